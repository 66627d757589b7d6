"""The engine's products on the CPU: many sequences' rows against tiled float32 weights.

A decode step of the engine (tinygpt.runner) multiplies every weight matrix by one row per
scheduled token: 16 rows when 16 sequences decode. torch's F.linear reaches about half of a
core's multiply-add rate (AMD EPYC with AVX-512, 2026-11-25) on these shapes (16 x 576
against 576 x 1536 and the like) and less on two; the kernel in tinygpt/csrc/cpu_gemm.c
(compiled on first use, like tinygpt.cpu_kernels') keeps a block of running sums in
registers, 6 rows x 32 outputs with AVX-512 (6 x 8 with AVX2, 6 x 4 without: gemm_tiles.h's
BLOCK_ROWS x BLOCK_VECS vectors), so each weight it loads feeds 6 multiply-adds, and splits
every product over the cores. It reads the tiled layout of tinygpt.cpu_kernels (W (N, K) as
(N / 16, K, 16)), and each output is summed in the order cpu_kernels' batch-1 kernel uses: a
row's products come out the same bits whether it was multiplied alone by `generate()` or with
fifteen others by the engine.

    GemmLinear        y_i = x @ W_i^T for weights that share their input (q, k, v; gate and
                      up), stacked and tiled once: x (M, K) float32, any M -> (M, N_i) each
    model_products    a TinyGPT's products as GemmLinears, per layer (qkv, wo, gate_up, w2)
                      and the head; cached per model, rebuilt when a weight changes
    refusal           why a model cannot use them (None when it can)
    available, load   the compiled library, or the reason there is none

The plain products (F.linear through the model's modules) stay the oracle: model_products
checks a probe against them when it builds, and tests/test_cpu_gemm.py compares every shape.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from tinygpt.cpu_kernels import TILE, tile
from tinygpt.native import FLAGS, NativeLibrary

SOURCE = Path(__file__).with_name("csrc") / "cpu_gemm.c"

def _declare(lib: ctypes.CDLL) -> None:
    lib.tg_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    lib.tg_gemm.restype = None
    lib.tg_paged_attention.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 5 \
        + [ctypes.c_long] * 6 + [ctypes.c_float]
    lib.tg_paged_attention.restype = ctypes.c_int
    lib.tg_chunk_attention.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 3 \
        + [ctypes.c_long] + [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_void_p] \
        + [ctypes.c_long] * 4 + [ctypes.c_float]
    lib.tg_chunk_attention.restype = None
    lib.tg_rope_store.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_void_p] * 2 \
        + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 3
    lib.tg_rope_store.restype = None
    lib.tg_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float]
    lib.tg_rms_norm.restype = None


def build(*extra_flags: str) -> NativeLibrary:
    """The library built with `extra_flags` after FLAGS (a shared object and a pool of its
    own). The package uses build(); the tests also build it for narrower vectors
    (-mno-avx512f, -mno-avx) and check that it gives the same bits."""
    return NativeLibrary(SOURCE, "the batched CPU products", _declare, start="tg_gemm_start",
                         stop="tg_gemm_stop", after_fork="tg_gemm_after_fork",
                         flags=FLAGS + extra_flags)


_library = build()
load = _library.load                # the compiled library, built and started on first use
available = _library.available      # None when the batched products can run here, else why
set_threads = _library.set_threads  # split every product over n threads from now on


class GemmLinear:
    """y_i = x @ W_i^T for float32 CPU weights W_i (N_i, K) that share their input.

    The weights are stacked, padded to a multiple of 16 rows and tiled (a copy: later changes
    to them do not reach it). Call with x (..., K) float32: returns one (..., N_i) float32
    output per weight.
    """

    def __init__(self, *weights: torch.Tensor) -> None:
        if not weights:
            raise ValueError("GemmLinear needs at least one weight")
        k = weights[0].shape[-1]
        for w in weights:
            if w.ndim != 2 or w.shape[1] != k or w.dtype != torch.float32 \
                    or w.device.type != "cpu":
                raise ValueError(f"GemmLinear needs 2-D float32 CPU weights sharing "
                                 f"in_features; got {w.dtype} {tuple(w.shape)} on {w.device}")
        lib = load()
        if lib is None:
            raise RuntimeError(available())
        self.lib = lib
        self.sizes = [w.shape[0] for w in weights]
        self.n, self.k = sum(self.sizes), k
        self.n_pad = self.n + -self.n % TILE
        with torch.inference_mode(False), torch.no_grad():
            stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 \
                else weights[0].detach()
            self.tiled = tile(stacked, torch.float32)

    @property
    def nbytes(self) -> int:
        return self.tiled.nbytes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.dtype != torch.float32 or x.shape[-1] != self.k:
            raise ValueError(f"GemmLinear takes float32 x (..., {self.k}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k).contiguous()
        y = torch.empty(rows.shape[0], self.n_pad)
        if rows.shape[0]:
            with _library.lock:
                self.lib.tg_gemm(self.tiled.data_ptr(), rows.data_ptr(), y.data_ptr(),
                                 rows.shape[0], self.n_pad, self.k)
        if self.n_pad != self.n:
            y = y[:, :self.n]
        return y.view(*lead, self.n).split(self.sizes, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (D,), weight, eps) for float32 x (..., D) in one call on this thread
    (torch's CPU rms_norm is seven operations; at 16 rows each costs more than the arithmetic).
    Equal to F.rms_norm up to float rounding (the sum of squares runs in another order).
    D must be at least 1 and eps a finite number >= 0."""
    dim = x.shape[-1] if x.ndim else 0
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != (dim,) \
            or dim < 1:
        raise ValueError(f"rms_norm takes float32 x (..., D) and weight (D,), D >= 1, got "
                         f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    lib = load()
    if lib is None:
        raise RuntimeError(available())
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    lib.tg_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps)
    return y


def _check_pools(what: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
                 ) -> tuple[int, int]:
    """What both pool attentions check first: float32 q (rows, H, d) and pools (num_blocks,
    H_kv, block_size, d) that fit it, H_kv and block_size at least 1. Returns (H_kv,
    block_size)."""
    if q.ndim != 3 or k_pool.ndim != 4 or k_pool.shape[1] < 1 or k_pool.shape[2] < 1:
        raise ValueError(f"{what} takes q (rows, H, d) and pools (num_blocks, H_kv >= 1, "
                         f"block_size >= 1, d), got q {tuple(q.shape)} and pools "
                         f"{tuple(k_pool.shape)}")
    _, kv_heads, block, _ = k_pool.shape
    if q.dtype != torch.float32 or k_pool.dtype != torch.float32 \
            or v_pool.dtype != torch.float32:
        raise ValueError(f"{what} takes float32 q and pools, got {q.dtype}, "
                         f"{k_pool.dtype}, {v_pool.dtype}")
    if k_pool.shape != v_pool.shape or k_pool.shape[-1] != q.shape[2] \
            or q.shape[1] % kv_heads:
        raise ValueError(f"{what}: q {tuple(q.shape)} does not fit pools "
                         f"{tuple(k_pool.shape)} / {tuple(v_pool.shape)}")
    return kv_heads, block


def _check_blocks(what: str, tables: torch.Tensor, k_pool: torch.Tensor) -> None:
    """A ValueError unless every entry of `tables` is a block of the pools, in [0, num_blocks):
    the kernels read the blocks the tables name without a bound."""
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= k_pool.shape[0]):
        raise ValueError(f"{what}: tables must name blocks of the pools, in [0, "
                         f"{k_pool.shape[0]}), got ids {int(tables.min())} .. "
                         f"{int(tables.max())}")


def _loaded(q: torch.Tensor) -> tuple:
    """The library (or why not), and q (rows, H, d) with each row's heads contiguous (rows
    may be apart: a view)."""
    lib = load()
    if lib is None:
        raise RuntimeError(available())
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return lib, q


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    tables: torch.Tensor, lengths: torch.Tensor, scale: float, *,
                    checked: bool = False) -> torch.Tensor:
    """One decode query per sequence against its keys in a paged pool (tinygpt.paged).

    q (N, H, d) float32; k_pool, v_pool (num_blocks, H_kv, block_size, d) float32, one layer's
    pool; tables (N, W) int64, sequence i's blocks in position order; lengths (N,) int64, the
    positions 0 .. lengths[i] - 1 that query i sees (at least 1, at most W * block_size).
    Query head h uses kv head h // (H / H_kv). Returns (N, H, d) float32: softmax(q k^T *
    scale) v per sequence and head, the same function as tinygpt.runner's padded batch (up to
    float rounding: the sums run in another order). checked=True skips the checks of the
    lengths' range and of the tables' block ids (the runner checks the lengths once per step,
    not once per layer, and its tables are its cache's own)."""
    kv_heads, block = _check_pools("paged_attention", q, k_pool, v_pool)
    n_seq, heads, dim = q.shape
    if tables.dtype != torch.int64 or tables.ndim != 2 or lengths.dtype != torch.int64 \
            or tables.shape[0] != n_seq or lengths.shape != (n_seq,):
        raise ValueError(f"paged_attention needs int64 tables (N, W) and lengths (N,) for "
                         f"N={n_seq}, got {tables.dtype} {tuple(tables.shape)} and "
                         f"{lengths.dtype} {tuple(lengths.shape)}")
    if n_seq and not checked and (int(lengths.min()) < 1
                                  or int(lengths.max()) > tables.shape[1] * block):
        raise ValueError(f"lengths must be in [1, {tables.shape[1] * block}], got "
                         f"{lengths.tolist()}")
    if not checked:
        _check_blocks("paged_attention", tables, k_pool)
    lib, q = _loaded(q)
    tables, lengths = tables.contiguous(), lengths.contiguous()
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    y = torch.empty(n_seq, heads, dim)
    if n_seq:
        with _library.lock:
            status = lib.tg_paged_attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(),
                                            v_pool.data_ptr(), tables.data_ptr(),
                                            lengths.data_ptr(), y.data_ptr(), n_seq, heads,
                                            kv_heads, dim, block, tables.shape[1], scale)
        if status:
            raise MemoryError("paged_attention could not allocate a sequence's scores")
    return y


def chunk_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    tables: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                    scale: float, *, checked: bool = False) -> torch.Tensor:
    """Prefill chunks' queries against their sequences' keys in a paged pool, causally
    (tinygpt/csrc/chunk_attention.h: the scores in register blocks, a running softmax).

    q (T, H, d) float32, the chunks' rows one chunk after another: chunk c is counts[c]
    tokens at positions starts[c] .. starts[c] + counts[c] - 1 (their keys and values already
    in the pools), T = counts.sum(); k_pool, v_pool (num_blocks, H_kv, block_size, d) float32;
    tables (C, W) int64, chunk c's blocks in position order. Query j of chunk c sees positions
    0 .. starts[c] + j; query head h uses kv head h // (H / H_kv). Returns (T, H, d) float32,
    the function of runner.padded_attention up to float rounding. checked=True skips the checks
    that every chunk's last position is inside its table (the runner checks it once a step) and
    of the tables' block ids (the runner's are its cache's own)."""
    kv_heads, block = _check_pools("chunk_attention", q, k_pool, v_pool)
    n_tokens, heads, dim = q.shape
    n_chunks = tables.shape[0] if tables.ndim else 0
    if tables.dtype != torch.int64 or tables.ndim != 2 or starts.dtype != torch.int64 \
            or counts.dtype != torch.int64 or starts.shape != (n_chunks,) \
            or counts.shape != (n_chunks,):
        raise ValueError(f"chunk_attention needs int64 tables (C, W), starts (C,) and counts "
                         f"(C,), got {tables.dtype} {tuple(tables.shape)}, {starts.dtype} "
                         f"{tuple(starts.shape)}, {counts.dtype} {tuple(counts.shape)}")
    if not checked:      # (no chunks and rows of q: the rows would be returned unwritten)
        if int(counts.sum()) != n_tokens or n_chunks and (int(counts.min()) < 1
                                                           or int(starts.min()) < 0):
            raise ValueError(f"counts must be at least 1 and sum to q's {n_tokens} rows, "
                             f"starts at least 0: got counts {counts.tolist()}, starts "
                             f"{starts.tolist()}")
        if n_chunks and int((starts + counts).max()) > tables.shape[1] * block:
            raise ValueError(f"every chunk must end inside its table of {tables.shape[1]} "
                             f"blocks of {block}: ends {(starts + counts).tolist()}")
    if not checked:
        _check_blocks("chunk_attention", tables, k_pool)
    lib, q = _loaded(q)
    tables, starts, counts = tables.contiguous(), starts.contiguous(), counts.contiguous()
    first = torch.zeros(n_chunks, dtype=torch.int64)
    torch.cumsum(counts[:-1], 0, out=first[1:])
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    y = torch.empty(n_tokens, heads, dim)
    if n_chunks:
        with _library.lock:
            lib.tg_chunk_attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(),
                                   v_pool.data_ptr(), tables.data_ptr(), tables.shape[1],
                                   first.data_ptr(), starts.data_ptr(), counts.data_ptr(),
                                   n_chunks, y.data_ptr(), heads, kv_heads, dim, block, scale)
    return y


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin_signed: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor, *, checked: bool = False) -> None:
    """RoPE on q (T, H, d) and k (T, H_kv, d) in place, x * cos + roll(x, d / 2) *
    sin_signed with cos, sin_signed (T, d) (sin with its first half negated: the batch-1
    decode step's form, and the same bits as its three torch operations), then k and v
    (T, H_kv, d) written to rows slots (T * H_kv,) int64 of the pools viewed as (rows, d).
    q, k, v may be row-strided views of one product's output (their rows the same distance
    apart, each head's d values contiguous); everything float32 on the CPU. checked=True
    skips the check that every slot is a row of the pools (the runner's come from block
    tables)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    tensors = (q, k, v, cos, sin_signed, k_pool, v_pool)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("rope_store takes float32 CPU tensors")
    if k.shape != (tokens, kv_heads, dim) or v.shape != k.shape or dim % 2 \
            or cos.shape != (tokens, dim) or sin_signed.shape != cos.shape \
            or k_pool.shape[-1] != dim or v_pool.shape != k_pool.shape \
            or slots.shape != (tokens * kv_heads,) or slots.dtype != torch.int64:
        raise ValueError(f"rope_store: shapes do not fit: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}, "
                         f"pools {tuple(k_pool.shape)}, slots {tuple(slots.shape)}")
    ld = q.stride(0) if tokens > 1 else 0

    def fits(t: torch.Tensor) -> bool:      # a stride of a dimension of size 1 is arbitrary
        return all(size == 1 or stride == want
                   for size, stride, want in zip(t.shape, t.stride(), (ld, dim, 1), strict=True))

    if not all(fits(t) for t in (q, k, v)):
        raise ValueError("rope_store needs q, k, v rows the same distance apart, heads "
                         "contiguous (the views of one product's output)")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("rope_store writes into contiguous pools")
    rows = k_pool.numel() // dim
    if not checked and slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < rows:
        raise ValueError(f"slots must be rows of the pools, in [0, {rows})")
    lib = load()
    if lib is None:
        raise RuntimeError(available())
    cos, sin_signed, slots = cos.contiguous(), sin_signed.contiguous(), slots.contiguous()
    lib.tg_rope_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), ld, cos.data_ptr(),
                      sin_signed.data_ptr(), tokens, heads, kv_heads, dim, k_pool.data_ptr(),
                      v_pool.data_ptr(), slots.data_ptr())


def refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run its products through GemmLinear, or None when it can."""
    from tinygpt.model import TinyGPT

    if not isinstance(model, TinyGPT) or getattr(model, "quant_scheme", None) is not None:
        return "the batched CPU products need a full-precision TinyGPT"
    if not getattr(model, "fused_decode", True):
        return "the batched CPU products need a one-process model (not a tensor-parallel shard)"
    if model.cfg.fast_path_refusal() is not None:       # day 20: the runner's plain road
        return f"the batched CPU products are dense Llama layers; {model.cfg.fast_path_refusal()}"
    weight = model.output.weight
    if weight.device.type != "cpu":
        return f"the batched CPU products are for CPU weights; the model is on {weight.device}"
    if weight.dtype != torch.float32:
        return f"the batched CPU products take float32 models; this one is {weight.dtype}"
    odd = [type(p).__name__ for p in model.parameters()
           if type(p) not in (torch.Tensor, torch.nn.Parameter)]
    if odd:
        return f"the batched CPU products take plain tensors; this model holds {odd[0]} weights"
    return available()


# model -> (its weights' versions and addresses when tiled, the products): an engine is built
# per server or benchmark, and tiling 500 MB of weights costs about a second
_PRODUCTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_products(model: torch.nn.Module) -> tuple[list[tuple], GemmLinear]:
    """(per layer (qkv, wo, gate_up, w2), head) as GemmLinears for a model that refusal()
    accepts; cached per model and rebuilt when a weight changed or moved. A probe through the
    first layer's qkv and the head is checked against F.linear (ValueError if it disagrees)."""
    reason = refusal(model)
    if reason is not None:
        raise ValueError(reason)
    key = tuple((p._version, p.data_ptr()) for p in model.parameters())
    entry = _PRODUCTS.get(model)
    if entry is not None and entry[0] == key:
        return entry[1], entry[2]
    layers = [(GemmLinear(b.attention.wq.weight, b.attention.wk.weight, b.attention.wv.weight),
               GemmLinear(b.attention.wo.weight),
               GemmLinear(b.feed_forward.w1.weight, b.feed_forward.w3.weight),
               GemmLinear(b.feed_forward.w2.weight)) for b in model.layers]
    head = GemmLinear(model.output.weight)
    probe = torch.randn(5, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    for product, weight in ((layers[0][0], model.layers[0].attention.wq.weight),
                            (head, model.output.weight)):
        with torch.inference_mode():
            want = F.linear(probe, weight)
            got = product(probe)[0]
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
            raise ValueError("the batched CPU product disagreed with F.linear on a probe")
    _PRODUCTS[model] = (key, layers, head)
    return layers, head
