"""Day 17: the model runner. One forward pass over every scheduled sequence, on the paged cache.

The scheduler (tinygpt.scheduler) hands over a list of (sequence, start, n): feed each
sequence its tokens start .. start + n - 1. Some are decodes (n = 1), some prefill chunks,
lengths all different. The runner packs every token of the step into ONE row, so each weight
matrix is read once for all of them (the point of batching), and only attention, the one part
that mixes positions, looks at each sequence separately:

    ids        (1, T)  every scheduled token, sequence after sequence (T = the step's tokens)
    positions  (1, T)  each token's position in its own sequence (RoPE)
    per layer  q, k, v for all T tokens; k and v written into the pool at each token's slot;
               attention as a padded batch (N, H, T_q, L): sequence i's queries against its
               own gathered blocks, masked so query j sees positions <= start_i + j only
    logits     (N, V)  at each sequence's last scheduled token only (the rest are not needed)

Attention over padded keys gives the same numbers as each sequence alone up to float rounding,
so at temperature 0 every sequence picks the tokens its batch-1 `generate` picks
(tests/test_engine.py checks it under random arrivals, budgets and preemptions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinygpt.attention import grouped_query_attention, merge_heads
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
    def forward(self, work: Sequence[tuple[object, list[int], int]]) -> torch.Tensor:
        """work: (seq_id, token ids, start) per sequence, its tokens going to positions
        start .. start + len(ids) - 1 (reserved in the cache beforehand). Writes their keys
        and values and returns the logits at each sequence's last token: (N, V) float32.
        The cache's lengths are left to the caller (the scheduler's complete())."""
        if not work:
            raise ValueError("work is empty: schedule at least one sequence")
        model, cache, device = self.model, self.cache, self.device
        counts = [len(ids) for _, ids, _ in work]
        if min(counts) < 1:
            raise ValueError("every scheduled sequence needs at least one token")
        starts = [start for _, _, start in work]
        n_seq, t_q = len(work), max(counts)
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        t_k = max(ends)

        ids = torch.tensor([t for _, tokens, _ in work for t in tokens], device=device)[None]
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        positions = positions.to(device)
        # where each new token's key and value go, and where each sequence's keys come from
        write = [cache.slots(seq_id, s, n)
                 for (seq_id, _, s), n in zip(work, counts, strict=True)]
        w_blocks = torch.cat([b for b, _ in write])
        w_offsets = torch.cat([o for _, o in write])
        r_blocks = torch.zeros(n_seq, t_k, dtype=torch.long, device=device)
        r_offsets = torch.zeros(n_seq, t_k, dtype=torch.long, device=device)
        for i, ((seq_id, _, _), end) in enumerate(zip(work, ends, strict=True)):
            blocks, offsets = cache.slots(seq_id, 0, end)
            r_blocks[i, :end], r_offsets[i, :end] = blocks, offsets
        # padded queries: row i, column j is packed token first_i + j (j < n_i)
        first = torch.tensor([0, *counts[:-1]], device=device).cumsum(0)
        col = torch.arange(t_q, device=device)
        real_q = col[None, :] < torch.tensor(counts, device=device)[:, None]      # (N, T_q)
        q_index = torch.where(real_q, first[:, None] + col[None, :], 0)
        # query j of row i sits at position start_i + j and sees keys 0 .. start_i + j;
        # a padding query sees key 0 only (its output is thrown away; it must stay finite)
        q_pos = torch.tensor(starts, device=device)[:, None] + col[None, :]
        keys = torch.arange(t_k, device=device)
        mask = torch.where(real_q[:, :, None], keys[None, None, :] <= q_pos[:, :, None],
                           keys[None, None, :] == 0)[:, None]                    # (N,1,Tq,Tk)

        cos, sin = model.rope_cos[positions][None], model.rope_sin[positions][None]
        x = model.tok_embeddings(ids)                                             # (1, T, D)
        for layer_index, layer in enumerate(model.layers):
            attn = layer.attention
            q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)    # (1, H or H_kv, T, hd)
            cache.k[layer_index, w_blocks, :, w_offsets] = k[0].transpose(0, 1)
            cache.v[layer_index, w_blocks, :, w_offsets] = v[0].transpose(0, 1)
            keys_i = cache.k[layer_index, r_blocks, :, r_offsets].transpose(1, 2)   # (N,Hkv,Tk,d)
            values_i = cache.v[layer_index, r_blocks, :, r_offsets].transpose(1, 2)
            queries = q[0][:, q_index].transpose(0, 1)                              # (N,H,Tq,d)
            y = grouped_query_attention(queries, keys_i, values_i, causal=False, mask=mask)
            y = y.transpose(1, 2)[real_q]                                            # (T, H, d)
            x = x + attn.wo(merge_heads(y.transpose(0, 1)[None]))
            x = x + layer.feed_forward(layer.ffn_norm(x))
        last = first + torch.tensor(counts, device=device) - 1
        return model.output(model.norm(x[:, last]))[0].float()
