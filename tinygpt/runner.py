"""Day 17: the model runner. One forward pass over every scheduled sequence, on the paged cache.

The scheduler (tinygpt.scheduler) hands over a list of (sequence, start, n): feed each
sequence its tokens start .. start + n - 1. Some are decodes (n = 1), some prefill chunks,
lengths all different. The runner packs every token of the step into ONE row, so each weight
matrix is read once for all of them (the point of batching), and only attention, the one part
that mixes positions, looks at each sequence separately:

    ids        (1, T)  every scheduled token, sequence after sequence (T = the step's tokens)
    positions  (1, T)  each token's position in its own sequence (RoPE)
    per layer  q, k, v for all T tokens; k and v written into the pool at each token's slot;
               attention as padded batches: one of the decodes, one of each prefill chunk of
               ALONE_ROWS (64) tokens or more, and one of the shorter chunks (a decode or a
               short chunk padded to a long chunk's length would pay for its queries; latent
               attention keeps them all in one): sequence i's queries against its own blocks,
               gathered whole in block-table order, masked so query j sees positions
               <= start_i + j only
    logits     (N, V)  at each sequence's last scheduled token only (the rest are not needed)

Attention over padded keys gives the same numbers as each sequence alone up to float rounding,
so at temperature 0 every sequence picks the tokens its batch-1 `generate` picks
(tests/test_engine.py checks it under random arrivals, budgets and preemptions).

On the CPU with a float32 model the runner takes a faster road by default (batched=True):

    products   q, k, v as one product and gate, up as another, every token's row at once,
               through tinygpt.cpu_gemm's register-blocked kernel split over the cores (torch's
               F.linear at 16 rows reaches about half of one core's multiply-add rate, AMD
               EPYC with AVX-512, 2026-11-25)
    attention  the decodes (one token each) through cpu_gemm's paged attention, which reads
               each sequence's keys and values in place from its blocks (no gathered
               copies, no padding, no mask), and the prefill chunks through its chunk
               attention (their scores in register blocks, in place too). 16 decodes beside
               a 256-token chunk, 1,000 positions each, all in one padded batch took 3.2 s a
               step on SmolLM2 (the 2-core AMD EPYC with AVX-512, 2026-11-27), 0.5 s split
    the rest   RMSNorm in one call (cpu_gemm.rms_norm; torch's is seven operations), RoPE as
               roll(x) * signed sin, as the batch-1 decode step computes it
               (tinygpt.kv_cache.DecodeStep), all on one torch thread (Engine.step)
    decodes    a step that decodes at most decode_layers_rows (32) sequences and nothing else
               runs the layers generate() runs, cpu_kernels.DecodeLayers (one C call for the
               step, on the same tiles and on the pool in place): the engine then decodes one
               sequence as fast as generate(), and each row's logits have the bits
               generate()'s step gives for the same cache

Where one engine step of 16 decodes on SmolLM2-135M went on the 2-core AMD EPYC with AVX-512
(2 threads, shared, 2026-11-25; `python -m tinygpt bench --only smollm2_cpu` measures the
throughput): plain, about 56 ms of products, 19 ms of head, 27 ms of attention and small
operations, 2 ms of sampling (104 ms a step); batched, about 26, 7, 3 (attention) + 6 (small
operations) and 2 ms (44 ms a step). batched=False keeps the plain road: the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tinygpt import cpu_gemm
from tinygpt.cpu_kernels import DecodeLayers, TiledLinear
from tinygpt.model import TinyGPT
from tinygpt.paged import PagedKVCache


class ModelRunner:
    """Runs a TinyGPT over a PagedKVCache shaped for it (PagedKVCache.for_model).

    batched=True (the default) runs the weight products of a float32 CPU model through
    tinygpt.cpu_gemm (every scheduled token's row against tiled weights, split over the
    cores); `batched` tells whether they run and `batched_reason` why not. batched=False, other
    devices and dtypes run the model's own modules (F.linear): the oracle. So do mixture-of-
    experts and q/k-norm models (day 20, cpu_gemm.refusal says so): attn.qkv applies the q/k
    norms, and layer.feed_forward, a tinygpt.moe.MoE, routes the step's tokens and runs each
    chosen expert once over its rows.
    """

    decode_layers_rows = 32    # steps of at most this many decodes take the C layers

    def __init__(self, model: TinyGPT, cache: PagedKVCache, *, batched: bool = True) -> None:
        if not isinstance(model, TinyGPT):
            raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
        if cache.n_layers != model.cfg.n_layers:
            raise ValueError(f"the cache has {cache.n_layers} layers, the model "
                             f"n_layers={model.cfg.n_layers}")
        if not isinstance(batched, bool):
            raise TypeError(f"batched must be True or False, got {batched!r}")
        if model.cfg.rope_type == "dynamic":                 # day 21
            raise ValueError(f"the engine's runner reads the model's fixed RoPE tables; "
                             f"{model.cfg.positions_refusal()}. Generate with "
                             f"tinygpt.generate (TinyGPT.forward recomputes them)")
        self.model, self.cache = model, cache
        self.device = cache.k.device
        self.batched, self.batched_reason = False, "batched=False: the plain products run"
        self._products = None
        if batched:
            self.batched_reason = cpu_gemm.refusal(model)
            if self.batched_reason is None:
                try:
                    self._products = cpu_gemm.model_products(model)
                    self.batched = True
                    half = model.cfg.head_dim // 2
                    # rotate_half(x) * sin == roll(x, half) * sin_signed
                    self._sin_signed = torch.cat([-model.rope_sin[:, :half],
                                                  model.rope_sin[:, half:]], dim=-1)
                except ValueError as err:
                    self.batched_reason = str(err)
        self.decode_layers, self.decode_layers_reason = None, self.batched_reason
        if self.batched:
            self._decode_layers()

    def _decode_layers(self) -> None:
        """A step that decodes up to decode_layers_rows (32) sequences runs generate()'s
        layers: cpu_kernels.DecodeLayers, one C call for the layers, the final norm and the
        head, over the batched products' own tiles (no second copy) and the paged pool in
        place. decode_layers_reason says why not where they cannot.

        Measured (SmolLM2 in float32 on the 2-core AMD EPYC with AVX-512, greedy requests of
        64 tokens, tokens/s of the engine, prefill included): on 2026-11-27 the C layers 47.7
        against 41.5 for the batched road at one request, but 71.1 / 78.4 / 89.0 against
        80.6 / 111.7 / 132.5 at 2 / 3 / 4 (their float32 products ran one row after another),
        so only one sequence took them; since their products run every row side by side
        (2026-11-28), 108-116 / 142-143 / 170-180 against 92-93 / 130-131 / 166-169.
        Beyond 4 rows (MAX_ROWS) the C layers' float32 products are the batched road's own
        register-blocked tiles (cpu_gemm.c, the same bits per row) and their attention is
        split over the pool, so only the Python between the products is saved: on
        2026-11-29 (the AVX2 EPYC, 64 tokens, medians of 4-6 runs taking turns) 107.6 against
        87.3 tokens/s at 5 requests, 123.0 / 105.6 at 8, 163.1 / 147.5 at 16, 159.6 / 154.6
        at 32. Steps of up to decode_layers_rows decodes take them; more, and any step with a
        prefill chunk, take the batched road."""
        model, cache = self.model, self.cache
        # a guard: cpu_gemm.refusal keeps latent attention and sliding windows off the batched
        # road, the only one that gets here; only a latent pool built by hand for a dense
        # model would reach it
        if cache.latent or model.cfg.sliding_window:
            self.decode_layers_reason = ("the C layers read separate K and V pools and attend "
                                         "over every cached key: not a latent pool nor a "
                                         "sliding window")
            return
        layers, head = self._products
        tiled = [(block.attention_norm.weight,
                  *(TiledLinear.sharing(p.tiled, p.sizes) for p in products[:2]),
                  block.ffn_norm.weight,
                  *(TiledLinear.sharing(p.tiled, p.sizes) for p in products[2:]))
                 for block, products in zip(model.layers, layers, strict=True)]
        pools = [SimpleNamespace(k=cache.k[i], v=cache.v[i]) for i in range(cache.n_layers)]
        args = (tiled, pools, model.rope_cos, self._sin_signed)
        self.decode_layers_reason = DecodeLayers.refusal(*args)
        if self.decode_layers_reason is None:
            self.decode_layers = DecodeLayers(*args, model.layers[0].attention.n_heads,
                                              cache.n_kv_heads, model.cfg.norm_eps,
                                              block_size=cache.block_size,
                                              final_norm=model.norm.weight,
                                              head=TiledLinear.sharing(head.tiled, head.sizes))

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
        as_long = dict(dtype=torch.long, device=device)
        # each sequence reads whole blocks, in table order (padding blocks are masked out)
        r_tables = torch.tensor([table[:width] + [0] * (width - min(len(table), width))
                                 for table in tables], **as_long).clamp_(min=0)    # (N, W)
        # (a block dropped out of a sliding window, paged.DROPPED, reads as block 0: masked)
        if self.decode_layers is not None and n_seq <= self.decode_layers_rows and t_q == 1 \
                and every_position is None:
            return self._decode_rows([ids[0] for _, ids, _ in work], starts, r_tables)

        # every token: its id, its position (RoPE), and the slot its key and value go to
        ids = [t for _, tokens, _ in work for t in tokens]
        positions = [p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]
        slot_block = [table[p // size] for table, s, e in zip(tables, starts, ends, strict=True)
                      for p in range(s, e)]
        slot_offset = [p % size for p in positions]
        ids_t = torch.tensor([ids], **as_long)
        pos_t = torch.tensor(positions, **as_long)
        n_kv = cache.n_kv_heads
        # the pool's rows (num_blocks * H_kv * block_size, hd) each token's k and v go to
        slots = ((torch.tensor(slot_block, **as_long)[:, None] * n_kv
                  + torch.arange(n_kv, device=device)) * size
                 + torch.tensor(slot_offset, **as_long)[:, None]).reshape(-1)      # (T * H_kv)
        first = torch.tensor([0, *counts[:-1]], **as_long).cumsum(0)
        scale = model.cfg.head_dim ** -0.5
        # decodes and prefill chunks attend apart (a decode padded to a chunk's length would
        # pay for the chunk's queries); latent attention keeps one padded batch
        if not cache.latent:
            parts = self._attention_parts(counts, starts, ends, first, r_tables)
        else:
            padded = self._padded_batch(counts, starts, first, width)

        x = model.tok_embeddings(ids_t)                                            # (1, T, D)
        if self.batched:
            cos, sin = model.rope_cos[pos_t], self._sin_signed[pos_t]               # (T, hd)
        else:
            cos, sin = model.rope_cos[pos_t][None], model.rope_sin[pos_t][None]
        for layer_index, layer in enumerate(model.layers):
            attn = layer.attention
            k_pool, v_pool = cache.k[layer_index], cache.v[layer_index]  # (blocks, Hkv, bs, hd)
            if cache.latent:      # day 21: multi-head latent attention, absorbed (plain road)
                x = x + self._latent_attention(attn, layer.attention_norm(x), cos, sin, slots,
                                               k_pool, r_tables, padded)
                x = x + layer.feed_forward(layer.ffn_norm(x))
                continue
            if self.batched:          # q (T, H, hd), k and v already in the pool
                q = self._qkv_store(layer_index, x, cos, sin, slots)
            else:
                q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)   # (1, H or Hkv, T, hd)
                q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
                head_dim = k.shape[-1]
                k_pool.view(-1, head_dim).index_copy_(0, slots, k.reshape(-1, head_dim))
                v_pool.view(-1, head_dim).index_copy_(0, slots, v.reshape(-1, head_dim))
            y = split_attention(q, k_pool, v_pool, parts, scale,
                                bool(model.cfg.layer_window(layer_index)))
            y = y.reshape(1, y.shape[0], -1)                                     # (1, T, H*d)
            if self.batched:
                x = self._mlp(layer_index, x, y)
            else:
                x = x + attn.wo(y)
                x = x + layer.feed_forward(layer.ffn_norm(x))
        last = first + torch.tensor(counts, **as_long) - 1
        logits = self._head(self._norm(x[:, last]))[0].float()
        if every_position is None:
            return logits
        if len(every_position) != n_seq:
            raise ValueError(f"every_position needs one flag per sequence: "
                             f"{len(every_position)} for {n_seq}")
        rows = [self._head(self._norm(x[0, int(f):int(f) + n])).float() if flag
                else None for flag, f, n in zip(every_position, first, counts, strict=True)]
        return logits, rows

    @staticmethod
    def _latent_attention(attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          slots: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor,
                          padded: tuple) -> torch.Tensor:
        """A tinygpt.mla.MLAttention layer over a latent pool (PagedKVCache latent=r): h (1, T,
        D) normed -> its output (1, T, D). The absorbed decode is multi-query attention with
        one shared key [latent, RoPE key] per token, queries [q_nope W_uk, q_pe] per head and
        the latent as value: the latents and RoPE keys go into the pool at `slots`,
        padded_attention reads the blocks (values: the key's first r columns), and W_uv and wo
        take the weighted latents back out."""
        r = attn.kv_lora_rank
        q_nope, q_pe = attn.queries(h, cos, sin)                              # (1, H, T, .)
        q = torch.cat([attn.absorb_query(q_nope), q_pe], -1)[0].transpose(0, 1)  # (T,H,r+rope)
        key = torch.cat(attn.latent(h, cos, sin), -1)[0]                          # (T, r+rope)
        pool.view(-1, key.shape[-1]).index_copy_(0, slots, key)
        y = padded_attention(q, pool, pool, tables, padded, attn.scale)      # (T, H, r+rope)
        return attn.wo(attn.from_latent(y[..., :r].transpose(0, 1)[None]))

    def _attention_parts(self, counts: list[int], starts: list[int], ends: list[int],
                         first: torch.Tensor, tables: torch.Tensor) -> tuple:
        """A step's attention in parts: (the decodes' part, then the prefill chunks' parts),
        the decodes (one token each) None when the step has none, a part being (kind, rows,
        tables, a, b), rows its packed tokens' rows.

        The batched road (never a sliding window: cpu_gemm.refusal) reads the pool in place,
        in C: ("paged", rows, tables, lengths, None) for the decodes (cpu_gemm.paged_attention)
        and ("chunks", rows, tables, starts, counts) for every chunk at once
        (cpu_gemm.chunk_attention: register-blocked scores, no padding, no mask). 16 prompts
        of 1,000-1,015 tokens and 64 new tokens each, SmolLM2's shape, AVX2 EPYC, 2026-11-29,
        two runs each taking turns: the chunks' attention 13.4 and 12.4 s of the engine's 72.7
        and 66.8 s as padded batches sliced over two Python threads, 7.5 and 6.2 s of 67.0
        and 51.1 s in C (the machine's speed moved between the runs).

        The plain road: ("padded", rows, tables, padded, windowed) for padded_attention,
        windowed the same batch's mask with the sliding window (day 21) or None. Decodes
        never share a padded batch with a chunk: padded to a chunk of 256 tokens, a decode
        would cost 256 query rows against all its keys. Nor does a chunk of ALONE_ROWS tokens
        or more share one with other chunks: beside it, a shorter chunk's queries would be
        padded to its length and see its keys (a prompt's last 241 tokens beside the next
        prompt's first 15: twice the work); the smaller chunks share one."""
        as_long = dict(dtype=torch.long, device=self.device)
        window = self.model.cfg.sliding_window

        def rows_of(which: list[int]) -> torch.Tensor:
            return torch.cat([torch.arange(int(first[i]), int(first[i]) + counts[i], **as_long)
                              for i in which])

        def padded(which: list[int]) -> tuple:
            index = torch.tensor(which, **as_long)
            sizes, own_starts = [counts[i] for i in which], [starts[i] for i in which]
            width = max(-(-ends[i] // self.cache.block_size) for i in which)
            own_first = torch.tensor([0, *sizes[:-1]], **as_long).cumsum(0)
            return ("padded", rows_of(which), tables[index, :width],
                    self._padded_batch(sizes, own_starts, own_first, width),
                    self._padded_batch(sizes, own_starts, own_first, width, window)
                    if window else None)

        ones = [i for i, n in enumerate(counts) if n == 1]
        chunks = [i for i, n in enumerate(counts) if n > 1]
        if not self.batched:
            groups = [[i] for i in chunks if counts[i] >= ALONE_ROWS]
            if small := [i for i in chunks if counts[i] < ALONE_ROWS]:
                groups.append(small)
            return padded(ones) if ones else None, *(padded(group) for group in groups)
        decodes = None
        if ones:
            index = torch.tensor(ones, **as_long)
            decodes = ("paged", first[index], tables[index],
                       torch.tensor([ends[i] for i in ones], **as_long), None)
        if not chunks:
            return (decodes,)
        index = torch.tensor(chunks, **as_long)
        return decodes, ("chunks", rows_of(chunks), tables[index],
                         torch.tensor([starts[i] for i in chunks], **as_long),
                         torch.tensor([counts[i] for i in chunks], **as_long))

    def _padded_batch(self, counts: list[int], starts: list[int], first: torch.Tensor,
                      width: int, window: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_index, real_q, mask) of the padded batch: row i, column j of the padded queries
        is packed token first_i + j (j < n_i, real_q); mask (N, 1, Tq, W*bs) is True where a
        query may see a key (query j of row i sits at position start_i + j and sees keys 0 ..
        start_i + j, or with a sliding window (day 21) the last `window` of them; a padding
        query sees key 0 only: its output is thrown away, it must stay finite)."""
        device, size = self.device, self.cache.block_size
        as_long = dict(dtype=torch.long, device=device)
        col = torch.arange(max(counts), device=device)
        real_q = col[None, :] < torch.tensor(counts, **as_long)[:, None]          # (N, T_q)
        q_index = torch.where(real_q, first[:, None] + col[None, :], 0)
        q_pos = torch.tensor(starts, **as_long)[:, None] + col[None, :]
        keys = torch.arange(width * size, device=device)
        seen = keys[None, None, :] <= q_pos[:, :, None]
        if window:
            seen &= keys[None, None, :] > q_pos[:, :, None] - window
        return q_index, real_q, torch.where(real_q[:, :, None], seen,
                                            keys[None, None, :] == 0)[:, None]

    # -- decodes only: generate()'s C layers on the paged pool ------------------------------

    def _decode_rows(self, ids: list[int], starts: list[int], tables: torch.Tensor
                     ) -> torch.Tensor:
        """Sequence i's token ids[i] at position starts[i] through cpu_kernels.DecodeLayers on
        the pool (its blocks tables[i], forward's (N, W) block tables) -> logits (N, V): the
        computation generate()'s tiled step makes, so given the same cached keys and values a
        sequence's logits have the bits its batch-1 step gives it (tests/test_engine.py)."""
        x = self.model.tok_embeddings.weight[ids].float()                          # (N, D)
        return self.decode_layers.paged(x, torch.tensor(starts, dtype=torch.long),
                                        tables)                # the norm and head in C too

    # -- the batched road (tinygpt.cpu_gemm): fused q/k/v and gate/up, its rms_norm --------

    def _qkv_store(self, layer_index: int, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x (1, T, D) -> q (T, H, hd), rotated; k, rotated, and v written into the layer's
        pool at `slots` (RoPE as x * cos + roll(x, hd / 2) * sin_signed, the batch-1 decode
        step's form; cpu_gemm.rope_store)."""
        layer, cfg = self.model.layers[layer_index], self.model.cfg
        attn = layer.attention
        h = cpu_gemm.rms_norm(x[0], layer.attention_norm.weight, cfg.norm_eps)
        q, k, v = self._products[0][layer_index][0](h)
        q = q.view(-1, attn.n_heads, attn.head_dim)
        k = k.view(-1, attn.n_kv_heads, attn.head_dim)
        v = v.view(-1, attn.n_kv_heads, attn.head_dim)
        cpu_gemm.rope_store(q, k, v, cos, sin, self.cache.k[layer_index],
                            self.cache.v[layer_index], slots, checked=True)
        return q

    def _mlp(self, layer_index: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The rest of a layer: x + wo(y), then its feed-forward block. x (1, T, D), y the
        attention's merged heads (1, T, H * hd)."""
        layer, cfg = self.model.layers[layer_index], self.model.cfg
        _, wo, gate_up, w2 = self._products[0][layer_index]
        x = x + wo(y)[0]
        gate, up = gate_up(cpu_gemm.rms_norm(x, layer.ffn_norm.weight, cfg.norm_eps))
        return x + w2(F.silu(gate) * up)[0]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        if not self.batched:
            return model.norm(x)
        return cpu_gemm.rms_norm(x, model.norm.weight, model.cfg.norm_eps)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on x (..., D) -> (..., V)."""
        return self.model.output(x) if self._products is None else self._products[1](x)[0]


def split_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    parts: tuple, scale: float, windowed: bool = False) -> torch.Tensor:
    """A step's attention of the packed queries q (T, H, d) -> (T, H, d), the decodes and
    the chunks apart (parts: ModelRunner._attention_parts; the runner checked every table
    covers its end): cpu_gemm.paged_attention and cpu_gemm.chunk_attention on the batched
    road, padded_attention on the plain one (with the sliding window's mask in a windowed
    layer)."""
    def attend(part: tuple, queries: torch.Tensor) -> torch.Tensor:
        kind, _, tables, a, b = part
        if kind == "paged":
            return cpu_gemm.paged_attention(queries, k_pool, v_pool, tables, a, scale,
                                            checked=True)
        if kind == "chunks":
            return cpu_gemm.chunk_attention(queries, k_pool, v_pool, tables, a, b, scale,
                                            checked=True)
        return padded_attention(queries, k_pool, v_pool, tables, b if windowed else a, scale)

    present = [part for part in parts if part is not None]
    if len(present) == 1:                       # its rows are all of them, in order
        return attend(present[0], q)
    y = torch.empty_like(q)
    for part in present:
        y[part[1]] = attend(part, q[part[1]])
    return y


def padded_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     tables: torch.Tensor, padded: tuple, scale: float) -> torch.Tensor:
    """Attention of the packed queries q (T, H, d) over each sequence's blocks (tables (N, W)),
    as a padded batch (padded: ModelRunner._padded_batch's q_index, real_q, mask) -> (T, H, d).
    Query head h reads kv head h // (H / H_kv) (enable_gqa: no copies of the keys); torch's
    scaled_dot_product_attention runs it in tiles, never holding a (Tq, Tk) score matrix.
    The plain road's attention, and the oracle of cpu_gemm's two."""
    q_index, real_q, mask = padded
    t_q = real_q.shape[1]
    keys = gather_blocks(k_pool, tables)                                   # (N, Hkv, Tk, d)
    values = gather_blocks(v_pool, tables)
    if t_q == 1:                                     # decodes only: one query per sequence
        queries = q[:, :, None]                                                   # (N,H,1,d)
    else:
        queries = q[q_index].transpose(1, 2)                                     # (N,H,Tq,d)
    y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                       enable_gqa=True)                          # (N,H,Tq,d)
    y = y.transpose(1, 2)                                                        # (N,Tq,H,d)
    return y[:, 0] if t_q == 1 else y[real_q]                                     # (T, H, d)


ALONE_ROWS = 64          # on the plain road a chunk of this many tokens attends on its own


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """One layer's pool (num_blocks, H_kv, block_size, d) and block tables (N, W) -> each
    sequence's keys (or values) in position order: (N, H_kv, W * block_size, d)."""
    n_seq, width = tables.shape
    blocks = pool.index_select(0, tables.reshape(-1))            # (N * W, H_kv, bs, d)
    blocks = blocks.view(n_seq, width, *pool.shape[1:]).transpose(1, 2)
    return blocks.reshape(n_seq, pool.shape[1], width * pool.shape[2], pool.shape[3])
