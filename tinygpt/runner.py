"""Day 17: the model runner. One forward pass over every scheduled sequence, on the paged cache.

The scheduler (tinygpt.scheduler) hands over a list of (sequence, start, n): feed each
sequence its tokens start .. start + n - 1. Some are decodes (n = 1), some prefill chunks,
lengths all different. The runner packs every token of the step into ONE row, so each weight
matrix is read once for all of them (the point of batching), and only attention, the one part
that mixes positions, looks at each sequence separately:

    ids        (1, T)  every scheduled token, sequence after sequence (T = the step's tokens)
    positions  (1, T)  each token's position in its own sequence (RoPE)
    per layer  q, k, v for all T tokens; k and v written into the pool at each token's slot;
               attention as a padded batch: sequence i's queries against its own blocks,
               gathered whole in block-table order, masked so query j sees positions
               <= start_i + j only
    logits     (N, V)  at each sequence's last scheduled token only (the rest are not needed)

Attention over padded keys gives the same numbers as each sequence alone up to float rounding,
so at temperature 0 every sequence picks the tokens its batch-1 `generate` picks
(tests/test_engine.py checks it under random arrivals, budgets and preemptions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinygpt.attention import merge_heads
from tinygpt.model import TinyGPT
from tinygpt.paged import PagedKVCache


class ModelRunner:
    """Runs a TinyGPT over a PagedKVCache shaped for it (PagedKVCache.for_model)."""

    def __init__(self, model: TinyGPT, cache: PagedKVCache) -> None:
        if not isinstance(model, TinyGPT):
            raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
        if cache.n_layers != model.cfg.n_layers:
            raise ValueError(f"the cache has {cache.n_layers} layers, the model "
                             f"n_layers={model.cfg.n_layers}")
        self.model, self.cache = model, cache
        self.device = cache.k.device

    @torch.inference_mode()
    def forward(self, work: Sequence[tuple[object, list[int], int]],
                every_position: Sequence[bool] | None = None):
        """work: (seq_id, token ids, start) per sequence, its tokens going to positions
        start .. start + len(ids) - 1 (reserved in the cache beforehand). Writes their keys
        and values and returns the logits at each sequence's last token: (N, V) float32.
        The cache's lengths are left to the caller (the scheduler's complete()).

        every_position: one flag per sequence; when given, returns (the (N, V) logits, a list
        with the (n_i, V) float32 logits at EVERY fed position of each flagged sequence and
        None for the others): prompt log-probabilities need them."""
        if not work:
            raise ValueError("work is empty: schedule at least one sequence")
        model, cache, device = self.model, self.cache, self.device
        size = cache.block_size
        counts = [len(ids) for _, ids, _ in work]
        if min(counts) < 1:
            raise ValueError("every scheduled sequence needs at least one token")
        starts = [start for _, _, start in work]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        n_seq, t_q = len(work), max(counts)
        tables = [cache.tables[seq_id] for seq_id, _, _ in work]
        for (seq_id, _, _), table, end in zip(work, tables, ends, strict=True):
            if len(table) * size < end:
                raise ValueError(f"positions up to {end - 1} of {seq_id!r} are not reserved")
        width = max(-(-end // size) for end in ends)       # blocks of the longest sequence

        # every token: its id, its position (RoPE), and the slot its key and value go to
        ids = [t for _, tokens, _ in work for t in tokens]
        positions = [p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]
        slot_block = [table[p // size] for table, s, e in zip(tables, starts, ends, strict=True)
                      for p in range(s, e)]
        slot_offset = [p % size for p in positions]
        as_long = dict(dtype=torch.long, device=device)
        ids_t = torch.tensor([ids], **as_long)
        pos_t = torch.tensor(positions, **as_long)
        w_blocks, w_offsets = torch.tensor(slot_block, **as_long), torch.tensor(slot_offset,
                                                                                 **as_long)
        # each sequence reads whole blocks, in table order (padding blocks are masked out)
        r_tables = torch.tensor([table[:width] + [0] * (width - min(len(table), width))
                                 for table in tables], **as_long)                  # (N, W)
        # padded queries: row i, column j is packed token first_i + j (j < n_i)
        first = torch.tensor([0, *counts[:-1]], **as_long).cumsum(0)
        col = torch.arange(t_q, device=device)
        real_q = col[None, :] < torch.tensor(counts, **as_long)[:, None]          # (N, T_q)
        q_index = torch.where(real_q, first[:, None] + col[None, :], 0)
        # query j of row i sits at position start_i + j and sees keys 0 .. start_i + j;
        # a padding query sees key 0 only (its output is thrown away; it must stay finite)
        q_pos = torch.tensor(starts, **as_long)[:, None] + col[None, :]
        keys = torch.arange(width * size, device=device)
        mask = torch.where(real_q[:, :, None], keys[None, None, :] <= q_pos[:, :, None],
                           keys[None, None, :] == 0)[:, None]                     # (N,1,Tq,Tk)
        n_kv = cache.n_kv_heads
        group = model.layers[0].attention.n_heads // n_kv    # a parallel shard's own heads
        # grouped-query attention without copying keys: the `group` query heads that share a
        # kv head become `group` times as many query rows of that head
        mask = mask.repeat(1, 1, group, 1)                                  # (N, 1, g*Tq, Tk)
        bias = torch.zeros(mask.shape, device=device, dtype=cache.k.dtype)
        bias = bias.masked_fill(~mask, float("-inf"))      # added to the scores: -inf hides
        scale = model.cfg.head_dim ** -0.5

        cos, sin = model.rope_cos[pos_t][None], model.rope_sin[pos_t][None]
        x = model.tok_embeddings(ids_t)                                            # (1, T, D)
        for layer_index, layer in enumerate(model.layers):
            attn = layer.attention
            q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)    # (1, H or H_kv, T, hd)
            k_pool, v_pool = cache.k[layer_index], cache.v[layer_index]  # (blocks, Hkv, bs, hd)
            k_pool[w_blocks, :, w_offsets] = k[0].transpose(0, 1)
            v_pool[w_blocks, :, w_offsets] = v[0].transpose(0, 1)
            head_dim = k.shape[-1]
            keys_i = gather_blocks(k_pool, r_tables)                       # (N, Hkv, Tk, d)
            values_i = gather_blocks(v_pool, r_tables)
            if t_q == 1:                             # decodes only: one query per sequence
                queries = q[0].transpose(0, 1)[:, :, None]                          # (N,H,1,d)
            else:
                queries = q[0][:, q_index].transpose(0, 1)                          # (N,H,Tq,d)
            queries = queries.reshape(n_seq, n_kv, group * t_q, head_dim)
            scores = queries @ keys_i.transpose(-1, -2) * scale + bias
            y = torch.softmax(scores, dim=-1) @ values_i                       # (N,Hkv,gTq,d)
            y = y.reshape(n_seq, n_kv * group, t_q, head_dim).transpose(1, 2)  # (N,Tq,H,d)
            y = y[:, 0] if t_q == 1 else y[real_q]                                 # (T, H, d)
            x = x + attn.wo(merge_heads(y.transpose(0, 1)[None]))
            x = x + layer.feed_forward(layer.ffn_norm(x))
        last = first + torch.tensor(counts, **as_long) - 1
        logits = model.output(model.norm(x[:, last]))[0].float()
        if every_position is None:
            return logits
        if len(every_position) != n_seq:
            raise ValueError(f"every_position needs one flag per sequence: "
                             f"{len(every_position)} for {n_seq}")
        rows = [model.output(model.norm(x[0, int(f):int(f) + n])).float() if flag
                else None for flag, f, n in zip(every_position, first, counts, strict=True)]
        return logits, rows


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """One layer's pool (num_blocks, H_kv, block_size, d) and block tables (N, W) -> each
    sequence's keys (or values) in position order: (N, H_kv, W * block_size, d)."""
    n_seq, width = tables.shape
    blocks = pool.index_select(0, tables.reshape(-1))            # (N * W, H_kv, bs, d)
    blocks = blocks.view(n_seq, width, *pool.shape[1:]).transpose(1, 2)
    return blocks.reshape(n_seq, pool.shape[1], width * pool.shape[2], pool.shape[3])
