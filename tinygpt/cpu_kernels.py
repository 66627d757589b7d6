"""Decode products at the CPU's memory bandwidth: tiled weights and a row split over the cores.

At batch 1 every product of a decode step multiplies a weight matrix by one vector: each weight
is read once for two flops, so the step should take (bytes of weights) / (memory bandwidth).
torch's products reach about half of that on a small model's 1-4 MB matrices (`make bench`
prints the figures): F.linear streams rows that need a horizontal sum each, and a batch-1
product is not split across the cores, so one core's share of the bandwidth is all it gets.

The kernels here (C, in tinygpt/csrc/cpu_gemv.c, compiled on first use) fix both:

    tiled layout   W (N, K) is stored as (N / 16, K, 16): tile t holds rows 16t .. 16t+15
                   column by column, so a tile is one sequential stream and every step is one
                   16-wide multiply-add into 16 running sums (no horizontal sums)
    row split      each product's tiles are shared by every core: helper threads started once
                   take chunks of tiles from an atomic counter and spin between products; the
                   calling thread takes chunks too and never waits for a helper that took none
    weights        float32 (exact products up to summation order) or bfloat16 (half the
                   bytes; each weight rounded once to 8 significant bits, the sums in float32;
                   on a CPU with avx512_bf16 x is rounded to bfloat16 too and the products run
                   on VDPBF16PS: bf16_path() says which) or llama.cpp's Q8_0 / Q4_1 blocks
                   (8.5 / 5 bits per weight), whose kernels round x to 8 bits per block of
                   32 (quantize_activation) and sum in integers with AVX-512 VNNI or AVX2
                   (a portable C loop elsewhere: int_path()): the only error beyond the
                   weights' own is x's rounding,
                   at most half a step per value

    TiledLinear        the products of one or more weights that share their input (q, k, v;
                       gate and up), stacked and tiled: x (M, K) -> a tuple of (M, N_i)
    available()        None when the kernels can run here, else the reason they cannot
    bf16_path()        how this machine's build multiplies bfloat16 weights (BF16_PATHS)
    int_path()         how it sums the Q8_0 / Q4_1 products' integers (INT_PATHS)
    load()             the compiled library (compiles it once per machine and source)
    build(*flags)      another build of the kernels, with extra compiler flags
    kernel_input()     x as the kernel for a format multiplies it (the oracle's input)
    DecodeLayers       a decode step's layers in one C call (the small operations between
                       the products in C, on the calling thread)
    MoEDecodeLayers    the same for a mixture-of-experts model: per layer the attention half
                       in C, the router in torch, the chosen experts in one C call (day 20)

tinygpt.native compiles the source on first use (cached under $TINYGPT_CACHE, default
~/.cache/tinygpt, named by a hash of the source, the compiler and its flags). The plain
products (F.linear on the dequantized weights and kernel_input(x)) stay the oracle:
tinygpt.kv_cache.DecodeStep checks the kernels against them when it builds a step.
"""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import torch

from tinygpt.native import NativeLibrary, in_huge_pages

SOURCE = Path(__file__).with_name("csrc") / "cpu_gemv.c"
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-shared",
         "-fPIC", "-pthread", "-lm")
TILE = 16
Q_BLOCK = 32            # Q8_0: one scale per row and block of 32 columns
MAX_ROWS = 4            # x rows (sequences) per product; larger batches are compute-bound
FORMATS = {"fp32": 0, "bf16": 1, "q8_0": 2, "q4_1": 3}    # the kernels' weight formats
WEIGHT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# how a build multiplies bfloat16 weights, by tg_bf16_path()'s code: the CPU's flags decide,
# since the library is compiled on first use with -march=native on the machine that runs it
BF16_PATHS = {0: "widened to float32", 1: "avx512_bf16 dot products"}
# how a build sums the integer products, by tg_int_path()'s code
INT_PATHS = {0: "portable C loops", 1: "AVX2 byte multiply-adds", 2: "AVX-512 VNNI"}

def _declare(lib: ctypes.CDLL) -> None:
    lib.tg_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    lib.tg_gemv.restype = ctypes.c_int
    lib.tg_use_portable.argtypes = [ctypes.c_int]
    lib.tg_use_portable.restype = ctypes.c_int
    lib.tg_int_path.restype = ctypes.c_int
    lib.tg_bf16_path.restype = ctypes.c_int
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.tg_layer.argtypes = [ctypes.c_int, P, L, L, P, P, F, P, L, P, L, P, L, P, L, P, P,
                             ctypes.c_int, P, P, L, L, P, P, L, L, L, L]
    lib.tg_layer.restype = ctypes.c_int
    lib.tg_layers.argtypes = [L, ctypes.c_int, P, L, L, P, P, F, P, L, P, L, P, L, P, L, P, P,
                              ctypes.c_int, P, P, L, L, P, P, L, L, L, L, P, P, L, P]
    lib.tg_layers.restype = ctypes.c_int
    lib.tg_attention.argtypes = [ctypes.c_int, P, P, L, L, P, P, F, P, L, P, L, P, P,
                                 ctypes.c_int, P, P, L, L, P, P, L, L, L]
    lib.tg_attention.restype = ctypes.c_int
    lib.tg_experts.argtypes = [ctypes.c_int, P, P, L, L, L] + [P] * 8 + [L]
    lib.tg_experts.restype = ctypes.c_int


def build(*extra_flags: str) -> NativeLibrary:
    """The kernels built with `extra_flags` after FLAGS (a shared object and a pool of their
    own; load() compiles it). The package uses build(); the tests also build the kernels with
    -mno-avx512bf16, to check the widened bfloat16 path on a CPU that has the instruction."""
    return NativeLibrary(SOURCE, "the CPU kernels", _declare, start="tg_start", stop="tg_stop",
                         after_fork="tg_after_fork", flags=FLAGS + extra_flags)


_library = build()
load = _library.load                # the kernel library, compiled and started on first use
available = _library.available      # None when the kernels can run here, else the reason
set_threads = _library.set_threads  # split every product over n threads from now on


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 on the rows of W (N, K), K a multiple of 32: per row and block of 32
    columns d = max |w| / 127 and q = round(w * (1 / d)) in [-127, 127], in float32 and with
    halves rounded away from zero, as ggml's roundf and the gguf package's np_roundf (the same
    q, bit for bit); d is then stored as a float16 (as in a GGUF file). Returns (q int8 (N, K),
    d float32 (N, K / 32)), the float32 holding the float16 value exactly; W ~ q * d."""
    n, k = weight.shape
    if k % Q_BLOCK:
        raise ValueError(f"Q8_0 needs in_features a multiple of {Q_BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // Q_BLOCK, Q_BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    x = blocks * inverse[..., None]
    whole = x.abs().floor()                 # np_roundf: |x|'s whole part, + 1 from a half up
    q = x.sign() * (whole + (2 * (x.abs() - whole)).floor())
    return q.clamp(-127, 127).to(torch.int8).reshape(n, k), d.half().float()


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 (N, K), d (N, K / 32) -> float32 (N, K): every weight q * d of its block."""
    n, k = q.shape
    return (q.float().reshape(n, k // Q_BLOCK, Q_BLOCK) * d.float()[..., None]).reshape(n, k)


def tile_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks in the kernel's layout: per tile of 16 rows (the last padded with zero rows)
    and block b, 16 float16 scales, then the block's 32 columns in 8 groups of 4, each group
    the 16 rows' 4 weights side by side (row i, column 4g + c at byte 64g + 4i + c), stored
    as q + 128 (0..254: the integer product's unsigned operand); a uint8 tensor
    (tiles, K / 32, 32 + 512). d must hold float16 values (quantize_q8_0's do). q must be int8
    (else a TypeError) in [-127, 127], Q8_0's range (else a ValueError; quantize_q8_0's are):
    the AVX2 kernel negates q where x is negative, and int8 has no -(-128)."""
    if q.dtype != torch.int8:
        raise TypeError(f"q must be an int8 tensor of Q8_0 weights, got {q.dtype}")
    if q.numel() and int(q.min()) < -127:
        raise ValueError("q must hold Q8_0 weights in [-127, 127] (quantize_q8_0's range), "
                         "got -128")
    n, k = q.shape
    pad = -n % TILE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
    tiles, blocks = q.shape[0] // TILE, k // Q_BLOCK
    values = q.reshape(tiles, TILE, blocks, Q_BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    unsigned = (values.to(torch.int16) + 128).to(torch.uint8)             # (t, b, 8, 16, 4)
    scales = d.half().reshape(tiles, TILE, blocks).permute(0, 2, 1)        # (t, b, 16)
    return in_huge_pages(torch.cat([scales.contiguous().view(torch.uint8).reshape(
        tiles, blocks, -1), unsigned.contiguous().reshape(tiles, blocks, -1)], -1))


def quantize_q4_1(weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 on the rows of W (N, K), K a multiple of 32: per row and block of 32
    columns m = min, d = (max - min) / 15, q = min(15, trunc((w - m) / d + 0.5)); d and m are
    then stored as float16. Returns (q uint8 (N, K) in 0..15, d, m float32 (N, K / 32)) with
    W ~ d * q + m. Weights read from a GGUF file come as these blocks already: use them as
    they are (q4_1_model's `blocks`), never re-quantized."""
    n, k = weight.shape
    if k % Q_BLOCK:
        raise ValueError(f"Q4_1 needs in_features a multiple of {Q_BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // Q_BLOCK, Q_BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((blocks - low[..., None]) * inverse[..., None] + 0.5).trunc().clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), d.half().float(), low.half().float()


def q4_1_from_gguf(raw: torch.Tensor, shape: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF file's Q4_1 tensor as stored (uint8, 20 bytes per block of 32: float16 d,
    float16 m, then 16 bytes whose byte j holds column j in its low nibble and column j + 16
    in its high one) -> (q, d, m) as quantize_q4_1 returns them, for a weight of `shape`
    (N, K). No value is changed: the blocks run as they are."""
    n, k = shape
    if k % Q_BLOCK or raw.dtype != torch.uint8 or raw.numel() != n * k // Q_BLOCK * 20:
        raise ValueError(f"raw must be uint8 Q4_1 blocks for shape {shape} "
                         f"({n * k // Q_BLOCK * 20} bytes), got {raw.dtype} {raw.numel()}")
    blocks = raw.reshape(n, k // Q_BLOCK, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    packed = blocks[..., 4:]
    q = torch.cat([packed & 15, packed >> 4], -1)              # columns 0..15, then 16..31
    return q.reshape(n, k), d, m


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q uint8 (N, K) in 0..15, d and m (N, K / 32) -> float32 (N, K): d * q + m per block."""
    n, k = q.shape
    values = q.float().reshape(n, k // Q_BLOCK, Q_BLOCK) * d.float()[..., None] \
        + m.float()[..., None]
    return values.reshape(n, k)


def _check_q4_1_codes(name: str, q: torch.Tensor) -> None:
    """Q4_1 codes: a uint8 tensor in 0..15 (one full scan: for construction, not per step)."""
    if q.dtype != torch.uint8:
        raise TypeError(f"{name} must be a uint8 tensor of Q4_1 codes, got {q.dtype}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"{name} must hold Q4_1 codes in [0, 15] (quantize_q4_1's range), "
                         f"got {int(q.max())}")


def tile_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks in the kernel's layout: per tile of 16 rows (the last padded with zero rows)
    and block, 16 float16 scales, 16 float16 minimums, then 4 x 64 bytes: byte 64g + 4i + c
    holds row i's column 4g + c in its low nibble and column 16 + 4g + c in its high one;
    uint8 (tiles, K / 32, 320). d and m must hold float16 values (a GGUF file's and
    quantize_q4_1's do). q must be uint8 (else a TypeError) in 0..15 (else a ValueError: a
    larger code would spill into its neighbour's nibble)."""
    _check_q4_1_codes("q", q)
    n, k = q.shape
    pad = -n % TILE
    if pad:
        q, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, d, m))
    tiles, blocks = q.shape[0] // TILE, k // Q_BLOCK
    values = q.reshape(tiles, TILE, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # (t,b,2,4,16,4)
    packed = values[:, :, 0] | (values[:, :, 1] << 4)                       # (t, b, 4, 16, 4)

    def per_row(x: torch.Tensor) -> torch.Tensor:                          # (t, b, 16 * 2)
        return x.half().reshape(tiles, TILE, blocks).permute(0, 2, 1).contiguous() \
            .view(torch.uint8).reshape(tiles, blocks, -1)

    return in_huge_pages(torch.cat([per_row(d), per_row(m),
                                    packed.contiguous().reshape(tiles, blocks, -1)], -1))


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32, K a multiple of 32 -> (q int8 (M, K), d float32 (M, K / 32)): per row
    and block of 32 values d = max |x| / 127 and q = round(x * (1 / d)), half to even (0 where
    d is 0), as the Q8_0 and Q4_1 kernels quantize their input before the integer products.
    dequantize_activation(q, d) differs from x by at most d / 2 per value."""
    m, k = x.shape
    if k % Q_BLOCK:
        raise ValueError(f"x must have a multiple of {Q_BLOCK} columns, got {k}")
    blocks = x.detach().float().reshape(m, k // Q_BLOCK, Q_BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inverse[..., None]).to(torch.int8).reshape(m, k), d


def dequantize_activation(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 (M, K), d (M, K / 32) -> float32 (M, K): q * d of its block."""
    m, k = q.shape
    return (q.float().reshape(m, k // Q_BLOCK, Q_BLOCK) * d[..., None]).reshape(m, k)


def kernel_input(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernel for weights in `fmt` multiplies x (..., K) by: x itself for fp32, and
    for bf16 where the build widens the weights; x rounded to bfloat16 (to nearest, ties to
    even) for bf16 where it runs avx512_bf16 dot products (bf16_path()); x rounded to 8 bits
    per block of 32 (quantize_activation) for q8_0 and q4_1. The kernel's output equals
    F.linear(kernel_input(x, fmt), dequantized weights) up to float summation order; this is
    the oracle the tests and DecodeStep's probe use."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt == "bf16" and bf16_path() == BF16_PATHS[1]:
        return x.bfloat16().to(x.dtype)
    if fmt in ("fp32", "bf16"):
        return x
    rows = x.reshape(-1, x.shape[-1])
    return dequantize_activation(*quantize_activation(rows)).reshape(x.shape)


def use_portable(on: bool) -> bool:
    """Run the products on their plain C loops (True: float32 and widened bfloat16 one row
    after another, the integer formats without vector instructions) or on the fast ones
    (False, the default: every row's float sums side by side, the integer formats with
    AVX-512 VNNI or AVX2 where it was compiled in: int_path()); returns the previous setting.
    Both give the same float32 and bfloat16 bits and the same integer sums; the tests compare
    them."""
    if not isinstance(on, bool):
        raise TypeError(f"on must be True or False, got {on!r}")
    lib = load()
    if lib is None:
        raise RuntimeError(available())
    with _library.lock:
        return bool(lib.tg_use_portable(int(on)))


def int_path(lib: ctypes.CDLL | None = None) -> str:
    """How the kernels (or `lib`, another build of them) sum the Q8_0 and Q4_1 products'
    integers, by what the CPU they were compiled for has (INT_PATHS): AVX-512 VNNI's byte
    dot products, AVX2's byte and word multiply-adds, or the portable C loops; "unavailable"
    without the kernels. The sums are the same integers on every path."""
    lib = lib or load()
    return "unavailable" if lib is None else INT_PATHS[lib.tg_int_path()]


def bf16_path(lib: ctypes.CDLL | None = None) -> str:
    """How the kernels (or `lib`, another build of them) multiply bfloat16 weights:
    "avx512_bf16 dot products" where the build targets a CPU with avx512_bf16 (x rounded to
    bfloat16, VDPBF16PS), "widened to float32" elsewhere (the bfloat16 weights times float32
    x, each product exact inside its fused multiply-add), or "unavailable" without the
    kernels. Sums are float32 either way."""
    lib = lib or load()
    return "unavailable" if lib is None else BF16_PATHS[lib.tg_bf16_path()]


def tile(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W (N, K) -> the tiled layout in `dtype` (a copy, in huge pages where Linux gives them:
    tinygpt.native.in_huge_pages); a last partial tile is padded with zero rows. float32:
    (ceil(N / 16), K, 16), a tile column by column. bfloat16: by pairs of columns,
    (ceil(N / 16), ceil(K / 2), 16, 2), each row's weights of columns 2p and 2p + 1 side by
    side (one 32-bit lane: what VDPBF16PS multiplies; an odd K padded with a zero column)."""
    n, k = weight.shape
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {list(WEIGHT_DTYPES)}, got {dtype}")
    pad = -n % TILE
    w = torch.cat([weight.detach(), weight.new_zeros(pad, k)]) if pad else weight.detach()
    if dtype == torch.float32:
        return in_huge_pages(w.to(dtype).reshape(-1, TILE, k).transpose(1, 2))
    if k % 2:
        w = torch.cat([w, w.new_zeros(w.shape[0], 1)], 1)
    return in_huge_pages(w.to(dtype).reshape(-1, TILE, (k + 1) // 2, 2).transpose(1, 2))


class TiledLinear:
    """y_i = x @ W_i^T for weights W_i (N_i, K) that share their input, as one tiled product.

    TiledLinear(*weights, fmt="fp32", "bf16", "q8_0" or "q4_1") stacks the weights, converts
    them to the format (bf16: rounded to bfloat16; q8_0: quantize_q8_0; q4_1: the given
    `blocks`, one (q, d, m) per weight with q uint8 codes in 0..15 and d, m (N, K / 32), else
    quantize_q4_1; K >= 1, a multiple of 32 for both),
    tiles them and keeps the copy (later changes to the weights do not reach it). Call it
    with x (M, K) or (B, 1, K) float32, M <= MAX_ROWS: it returns one float32 output per
    weight, shapes (..., N_i), equal to F.linear(kernel_input(x, fmt), W_i dequantized) up to
    summation order (bf16: x as it is, or rounded to bfloat16 where bf16_path() is the
    avx512_bf16 dot products). The stacked rows are padded to a multiple of 16 with zeros, whose
    outputs are dropped.
    """

    def __init__(self, *weights: torch.Tensor, fmt: str = "fp32",
                 blocks: list[tuple] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}")
        reason = self.refusal(*weights, fmt=fmt)
        if reason is not None:
            raise ValueError(reason)
        lib = load()
        if lib is None:
            raise RuntimeError(available())
        self.lib, self.fmt, self.code = lib, fmt, FORMATS[fmt]
        self.sizes = [w.shape[0] for w in weights]
        self.n, self.k = sum(self.sizes), weights[0].shape[1]
        self.n_pad = self.n + -self.n % TILE
        with torch.inference_mode(False), torch.no_grad():
            stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 \
                else weights[0].detach()
            if fmt == "q4_1":
                if blocks is None:
                    blocks = [quantize_q4_1(w) for w in weights]
                if len(blocks) != len(weights) or any(
                        len(b) != 3 or b[0].shape != w.shape
                        or {tuple(b[1].shape), tuple(b[2].shape)}
                        != {(w.shape[0], w.shape[1] // Q_BLOCK)}
                        for b, w in zip(blocks, weights, strict=False)):
                    raise ValueError("blocks must hold one (q, d, m) per weight, q shaped like "
                                     "the weight and d, m (N, K / 32)")
                for i, b in enumerate(blocks):
                    _check_q4_1_codes(f"blocks[{i}][0]", b[0])
                self.tiled = tile_q4_1(*(torch.cat(parts) for parts in zip(*blocks,
                                                                          strict=True)))
            elif fmt == "q8_0":
                self.tiled = tile_q8_0(*quantize_q8_0(stacked))
            else:
                self.tiled = tile(stacked, torch.float32 if fmt == "fp32" else torch.bfloat16)

    @classmethod
    def sharing(cls, tiled: torch.Tensor, sizes: list[int]) -> TiledLinear:
        """A float32 TiledLinear over tiles that already exist (tile()'s float32 layout, e.g.
        tinygpt.cpu_gemm's, whose kernel reads the same tiles): no copy; `sizes` the stacked
        weights' rows. The tiles must stay unchanged while it is used."""
        n, n_pad = sum(sizes), -(-sum(sizes) // TILE) * TILE
        if tiled.dtype != torch.float32 or tiled.ndim != 3 or tiled.shape[0] * TILE != n_pad \
                or tiled.shape[2] != TILE or not tiled.shape[1] or not tiled.is_contiguous() \
                or tiled.device.type != "cpu":
            raise ValueError(f"tiled must be contiguous float32 CPU tiles ({n_pad // TILE}, K, "
                             f"{TILE}) for sizes {sizes}, got {tiled.dtype} {tuple(tiled.shape)}")
        lib = load()
        if lib is None:
            raise RuntimeError(available())
        self = cls.__new__(cls)
        self.lib, self.fmt, self.code = lib, "fp32", FORMATS["fp32"]
        self.sizes, self.n, self.k, self.n_pad = list(sizes), n, tiled.shape[1], n_pad
        self.tiled = tiled
        return self

    @staticmethod
    def refusal(*weights: torch.Tensor, fmt: str = "fp32") -> str | None:
        """Why these weights cannot be tiled together in `fmt`, or None when they can."""
        if not weights:
            return "TiledLinear needs at least one weight"
        k = weights[0].shape[-1] if weights[0].ndim else 0
        if k < 1:
            return f"TiledLinear needs in_features >= 1, got {tuple(weights[0].shape)}"
        if fmt in ("q8_0", "q4_1") and k % Q_BLOCK:
            return f"{fmt.upper()} needs in_features a multiple of {Q_BLOCK}, got {k}"
        for w in weights:
            if w.ndim != 2 or w.shape[1] != k or not w.dtype.is_floating_point:
                return (f"TiledLinear needs 2-D floating point weights sharing in_features; "
                        f"got {w.dtype} {tuple(w.shape)}")
            if w.device.type != "cpu":
                return f"TiledLinear is for CPU weights; got one on {w.device}"
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the tiled weights (what one product reads)."""
        return self.tiled.nbytes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A decode step makes ~120 of these calls per token, so the wrapper does as little
        # tensor bookkeeping as it can (each view or split costs about a microsecond).
        rows = x.numel() // self.k if x.ndim and x.shape[-1] == self.k else -1
        if x.dtype != torch.float32 or not 0 < rows <= MAX_ROWS:
            raise ValueError(f"TiledLinear takes float32 x (..., {self.k}) with at most "
                             f"{MAX_ROWS} rows, got {x.dtype} {tuple(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty((*x.shape[:-1], self.n_pad))
        with _library.lock:
            status = self.lib.tg_gemv(self.code, self.tiled.data_ptr(), x.data_ptr(),
                                      y.data_ptr(), rows, self.n_pad, self.k)
        if status:
            raise MemoryError("the kernel could not allocate the rounded activation")
        if self.n_pad != self.n:
            y = y[..., :self.n]                # the padding rows' outputs
        return (y,) if len(self.sizes) == 1 else y.split(self.sizes, -1)


class _CacheRows:
    """Where a decode step's rows go in the cache, for DecodeLayers and MoEDecodeLayers.

    A plain cache (block_size None): cache_layers' .k and .v are (cache_batch, kv_heads,
    max_len, head_dim); row b is sequence b at one position, or (consecutive) position pos + b
    of sequence 0. A paged pool (block_size given: the engine's tinygpt.paged.PagedKVCache,
    one layer's pool each): .k and .v are (num_blocks, kv_heads, block_size, head_dim) and each
    row brings its own position and block table (paged()). The C side sees one form: per row a
    position and a table of blocks, the plain cache being blocks of max_len positions.
    """

    def _bind(self, cache_layers: list, cos: torch.Tensor, sin_signed: torch.Tensor,
              block_size: int | None) -> None:
        k = cache_layers[0].k
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1
                                       or k.shape[2] != block_size):
            raise ValueError(f"block_size must be the pool's block size {k.shape[2]} (or None "
                             f"for a plain cache), got {block_size!r}")
        self.cos, self.sin_signed = cos.float().contiguous(), sin_signed.float().contiguous()
        self.cache_bf16 = int(k.dtype == torch.bfloat16)
        self.head_dim = cos.shape[-1]
        self.paged_pool = block_size is not None
        self.block = k.shape[2]          # max_len of a plain cache
        self.slots = k.shape[0]          # the plain cache's sequences, or the pool's blocks

    def _check_shapes(self, layers: list[tuple], cache_layers: list, heads: int,
                      kv_heads: int) -> None:
        """What the C side reads and writes without a bound, checked once: per layer
        (attention_norm, qkv, wo, ffn_norm, ...) against heads, kv_heads, the cache's
        (slots, kv_heads, block, head_dim) and the rotation tables (after _bind). Sets d_model,
        the width every call's x must have."""
        if not isinstance(heads, int) or not isinstance(kv_heads, int):
            raise TypeError(f"heads and kv_heads must be ints, got {heads!r}, {kv_heads!r}")
        if not 0 < kv_heads <= heads or heads % kv_heads:
            raise ValueError(f"heads must be a positive multiple of kv_heads, got heads={heads}, "
                             f"kv_heads={kv_heads}")
        d, hd, shape = layers[0][0].shape[0], self.head_dim, cache_layers[0].k.shape
        if self.cos.ndim != 2 or self.sin_signed.shape != self.cos.shape:
            raise ValueError(f"cos and sin_signed must be (max_seq_len, head_dim) of one shape, "
                             f"got {tuple(self.cos.shape)} and {tuple(self.sin_signed.shape)}")
        for i, c in enumerate(cache_layers):
            if len(shape) != 4 or shape[1] != kv_heads or shape[3] != hd \
                    or c.k.shape != shape or c.v.shape != shape:
                raise ValueError(f"cache_layers[{i}] must hold .k and .v (slots, kv_heads "
                                 f"{kv_heads}, block, head_dim {hd}) of every layer's shape, got "
                                 f"{tuple(c.k.shape)} and {tuple(c.v.shape)}")
        for i, (n1, qkv, wo, n2, *_) in enumerate(layers):
            if n1.shape != (d,) or n2.shape != (d,) or qkv.k != d:
                raise ValueError(f"layers[{i}]: the norm weights and qkv's in_features must be "
                                 f"the model width {d}, got {tuple(n1.shape)}, "
                                 f"{tuple(n2.shape)} and {qkv.k}")
            if list(qkv.sizes) != [heads * hd, kv_heads * hd, kv_heads * hd] \
                    or wo.k != heads * hd or wo.n != d:
                raise ValueError(f"layers[{i}]: qkv must stack ({heads}, {kv_heads}, {kv_heads}) "
                                 f"heads of {hd} and wo map {heads * hd} to {d}, got qkv "
                                 f"{qkv.sizes}, wo {wo.k} -> {wo.n}")
        self.d_model = d

    max_rows: int | None = MAX_ROWS      # rows of x per call (None: any number)

    def _check_x(self, x: torch.Tensor) -> int:
        rows, limit = x.shape[0], self.max_rows
        if x.dtype != torch.float32 or x.ndim != 2 or not x.is_contiguous() \
                or x.shape[1] != self.d_model \
                or not 0 < rows <= (rows if limit is None else limit):
            bound = "B >= 1" if limit is None else f"1 <= B <= {limit}"
            raise ValueError(f"x must be contiguous float32 (B, {self.d_model}), {bound}, got "
                             f"{x.dtype} {tuple(x.shape)}")
        return rows

    def _plain(self, x: torch.Tensor, pos: int, consecutive: bool) -> tuple:
        """(row positions, tables, width, block, cos, sin) for the plain cache's call."""
        if self.paged_pool:
            raise ValueError("these layers hold a paged pool: call paged(x, positions, tables)")
        rows = self._check_x(x)
        last = pos + rows - 1 if consecutive else pos
        limit = min(self.block, self.cos.shape[0])
        if not 0 <= pos <= last < limit:
            raise ValueError(f"positions must be in [0, {limit}), got {pos}..{last}")
        if not consecutive and rows > self.slots:
            raise ValueError(f"{rows} rows for a cache of {self.slots} sequences")
        row_pos = (ctypes.c_long * rows)(*(range(pos, pos + rows) if consecutive
                                          else [pos] * rows))
        tables = (ctypes.c_long * rows)(*([0] * rows if consecutive else range(rows)))
        return (ctypes.addressof(row_pos), ctypes.addressof(tables), 1, self.block,
                self.cos.data_ptr(), self.sin_signed.data_ptr()), (row_pos, tables)

    def _paged(self, x: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> tuple:
        """The same for a paged pool: positions (B,) and tables (B, W) int64 CPU tensors."""
        if not self.paged_pool:
            raise ValueError("these layers hold a plain cache: call them with (x, pos)")
        rows = self._check_x(x)
        for name, t, ndim in (("positions", positions, 1), ("tables", tables, 2)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.ndim != ndim \
                    or t.shape[0] != rows or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor with one row "
                                 f"per row of x ({rows}), got {t!r}")
        width = tables.shape[1]
        limit = min(width * self.block, self.cos.shape[0])
        if width < 1 or int(positions.min()) < 0 or int(positions.max()) >= limit:
            raise ValueError(f"positions must be in [0, {limit}) (the tables' {width} blocks "
                             f"of {self.block} and the rotation tables), got "
                             f"{positions.tolist()}")
        if int(tables.min()) < 0 or int(tables.max()) >= self.slots:
            raise ValueError(f"tables must name blocks in [0, {self.slots})")
        return (positions.data_ptr(), tables.data_ptr(), width, self.block,
                self.cos.data_ptr(), self.sin_signed.data_ptr()), (positions, tables)


class DecodeLayers(_CacheRows):
    """A decode step's layers in one C call (tg_layers: tg_layer in cpu_gemv.c per layer,
    layer after layer), per layer the four tiled products on the pool and everything between
    them (the RMS norms, RoPE, the cache write, attention over the cached positions,
    SiLU(gate) * up, the residual adds) on the calling thread, computed as the model's
    forward computes them, in float32 (bfloat16 weights are widened by the kernels, or
    multiplied with each product's input rounded to bfloat16 where bf16_path() is the
    avx512_bf16 dot products; a bfloat16 cache is read and written in bfloat16).

    layers: per layer (attention_norm weight (D,), qkv, wo, ffn_norm weight (D,), gate_up,
    w2), the products TiledLinear of one format (q, k, v stacked in that order; gate then up);
    cache_layers: objects with .k and .v (cache_batch, kv_heads, max_len, head_dim), float32
    or bfloat16; cos, sin_signed: (max_seq_len, head_dim) rotation tables. The norm weights
    and tables are copied to float32 (a float32 one is used as it is). Call it with x (B, D)
    float32 contiguous, B <= MAX_ROWS (any B with float32 products: max_rows), and the
    position: x becomes the last layer's output
    and every layer's cache holds the new keys and values at the position. With
    consecutive=True the B rows are instead positions pos .. pos + B - 1 of sequence 0, each
    attending causally to the positions up to its own (several tokens of one sequence).
    With final_norm (the model's last RMS norm weight) x ends normed by it: the head's input;
    with head too (the output product, a TiledLinear of the layers' format) the calls return
    the logits (B, V) float32 (otherwise None).
    With block_size, cache_layers hold the engine's paged pools instead (num_blocks, kv_heads,
    block_size, head_dim) and paged(x, positions, tables) runs the step: row b the token at
    positions[b] of the sequence whose blocks are tables[b] (_CacheRows). refusal(...) says
    why a model's step cannot run this way (None when it can).
    """

    def __init__(self, layers: list[tuple], cache_layers: list, cos: torch.Tensor,
                 sin_signed: torch.Tensor, heads: int, kv_heads: int, eps: float,
                 block_size: int | None = None, final_norm: torch.Tensor | None = None,
                 head: TiledLinear | None = None) -> None:
        reason = self.refusal(layers, cache_layers, cos, sin_signed)
        if reason is not None:
            raise ValueError(reason)
        self.lib = load()
        self._bind(cache_layers, cos, sin_signed, block_size)
        self._check_shapes(layers, cache_layers, heads, kv_heads)
        for i, (_, _, _, _, gate_up, w2) in enumerate(layers):
            if gate_up.k != self.d_model or w2.n != self.d_model:
                raise ValueError(f"layers[{i}]: gate_up must take and w2 give the model width "
                                 f"{self.d_model}, got {gate_up.k} and {w2.n}")
        layers = [(n1.float().contiguous(), qkv, wo, n2.float().contiguous(), gate_up, w2)
                  for n1, qkv, wo, n2, gate_up, w2 in layers]
        if final_norm is not None and (final_norm.shape != layers[0][0].shape
                                       or final_norm.device.type != "cpu"):
            raise ValueError(f"final_norm must be a CPU vector like the layers' norms "
                             f"{tuple(layers[0][0].shape)}, got {tuple(final_norm.shape)}")
        self.final_norm = None if final_norm is None else final_norm.float().contiguous()
        if head is not None and (final_norm is None or not isinstance(head, TiledLinear)
                                 or head.code != layers[0][1].code
                                 or head.k != layers[0][0].shape[0] or len(head.sizes) != 1):
            raise ValueError("head must be one TiledLinear of the layers' format on the normed "
                             "x, and needs final_norm")
        self.head = head
        self.heads, self.kv_heads, self.eps = heads, kv_heads, float(eps)
        self.d_ff = layers[0][4].sizes[0]
        self.keep = (layers, cache_layers)       # what the pointers below point into

        def pointers(tensors) -> ctypes.Array:
            return (ctypes.c_void_p * len(layers))(*(t.data_ptr() for t in tensors))

        first = layers[0]
        self._final_norm_ptr = None if self.final_norm is None else self.final_norm.data_ptr()
        self.code = first[1].code
        # float32 layers take any number of rows: beyond MAX_ROWS their products are the
        # register-blocked tiles of cpu_gemm.c (the same bits per row) and their attention
        # is split over the pool
        self.max_rows = None if first[1].fmt == "fp32" else MAX_ROWS
        self.sizes = (first[1].n_pad, first[2].n_pad, first[4].n_pad, first[5].n_pad)
        self.arrays = [pointers(t[i] for t in layers) for i in (0, 3)] + \
            [pointers(t[i].tiled for t in layers) for i in (1, 2, 4, 5)] + \
            [pointers(getattr(c, name) for c in cache_layers) for name in ("k", "v")]

    @staticmethod
    def refusal(layers: list[tuple], cache_layers: list, cos: torch.Tensor,
                sin_signed: torch.Tensor) -> str | None:
        """Why these layers cannot run as DecodeLayers, or None when they can."""
        if available() is not None:
            return available()
        if not layers or len(layers) != len(cache_layers):
            return "DecodeLayers needs one cache layer per layer"
        fmts = set()
        for norm1, qkv, wo, norm2, gate_up, w2 in layers:
            products = (qkv, wo, gate_up, w2)
            if not all(isinstance(p, TiledLinear) for p in products):
                return "every product must be a TiledLinear"
            fmts.update(p.fmt for p in products)
            if len(qkv.sizes) != 3 or len(gate_up.sizes) != 2 or \
                    gate_up.sizes[0] != gate_up.sizes[1] or w2.k != gate_up.sizes[0]:
                return "qkv must stack q, k, v and gate_up gate and up"
            if any(t.dtype not in WEIGHT_DTYPES or t.ndim != 1 for t in (norm1, norm2)):
                return "the norm weights must be float32 or bfloat16 vectors"
        if len(fmts) != 1:
            return f"the products must share one format, got {sorted(fmts)}"
        if len({tuple((p.n_pad, p.k) for p in layer[1:3] + layer[4:]) for layer in layers}) != 1:
            return "every layer's products must have the same shapes"
        tensors = [cos, sin_signed] + [t for c in cache_layers for t in (c.k, c.v)]
        if any(t.dtype not in WEIGHT_DTYPES or not t.is_contiguous() or t.device.type != "cpu"
               for t in tensors) or len({t.dtype for t in tensors[2:]}) != 1:
            return ("the cache (one dtype) and rotation tables must be contiguous float32 or "
                    "bfloat16 CPU tensors")
        return None

    def __call__(self, x: torch.Tensor, pos: int, consecutive: bool = False
                 ) -> torch.Tensor | None:
        return self._run(x, self._plain(x, pos, consecutive))

    def paged(self, x: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor
              ) -> torch.Tensor | None:
        """The step on a paged pool: x (B, D) as in __call__, positions (B,) and tables (B, W)
        int64: row b is position positions[b] of the sequence whose blocks are tables[b]."""
        return self._run(x, self._paged(x, positions, tables))

    def _run(self, x: torch.Tensor, where: tuple) -> torch.Tensor | None:
        rows, d = x.shape
        n1, n2, wqkv, wo, wgu, w2, kc, vc = self.arrays
        nqkv, no, ngu, ndown = self.sizes
        head, logits = self.head, None
        if head is not None:
            logits = torch.empty(rows, head.n_pad)
        with _library.lock:
            status = self.lib.tg_layers(len(n1), self.code, x.data_ptr(), rows, d, n1, n2,
                                        self.eps, wqkv, nqkv, wo, no, wgu, ngu, w2, ndown, kc,
                                        vc, self.cache_bf16, *where[0], self.heads,
                                        self.kv_heads, self.head_dim, self.d_ff,
                                        self._final_norm_ptr,
                                        None if head is None else head.tiled.data_ptr(),
                                        0 if head is None else head.n_pad,
                                        None if logits is None else logits.data_ptr())
        if status:
            raise MemoryError("the kernel could not allocate its buffers")
        if logits is not None and head.n_pad != head.n:
            logits = logits[:, :head.n]
        return logits


class MoEDecodeLayers(_CacheRows):
    """DecodeLayers for a mixture-of-experts model (day 20), per layer: the attention half in
    C (tg_attention, up to the feed-forward's norm), the router in torch (the MoE module's own
    `route`; its last_experts and last_ran are set), then the chosen experts in one C call
    (tg_experts: gate+up and down per expert over its rows, summed in tinygpt.moe.dispatch's
    order, a shared expert last with weight 1). A dense layer is one expert of weight 1.

    layers: per layer (attention_norm, qkv, wo, ffn_norm, ffn) as DecodeLayers' but ffn
    ("dense", gate_up, w2) or ("moe", moe, gate_ups, downs, shared): the MoE module, its E
    experts' products and None or the shared expert's (gate_up, down); TiledLinear products of
    one format, fp32 or bf16. The rest, block_size and the calls as in DecodeLayers.
    """

    def __init__(self, layers: list[tuple], cache_layers: list, cos: torch.Tensor,
                 sin_signed: torch.Tensor, heads: int, kv_heads: int, eps: float,
                 block_size: int | None = None) -> None:
        reason = self.refusal(layers, cache_layers, cos, sin_signed)
        if reason is not None:
            raise ValueError(reason)
        self.lib = load()
        self._bind(cache_layers, cos, sin_signed, block_size)
        self._check_shapes(layers, cache_layers, heads, kv_heads)
        self.heads, self.kv_heads, self.eps = heads, kv_heads, float(eps)
        self.code = layers[0][1].code
        self.layers, self.keep = [], []          # keep: what the pointers point into
        for (n1, qkv, wo, n2, ffn), cache in zip(layers, cache_layers, strict=True):
            n1, n2 = n1.float().contiguous(), n2.float().contiguous()
            if ffn[0] == "dense":
                moe, shared, products = None, None, [(ffn[1], ffn[2])]
            else:
                moe, gate_ups, downs, shared = ffn[1:]
                products = list(zip(gate_ups, downs, strict=True)) + ([shared] if shared else [])
            if any(g.k != self.d_model or down.n != self.d_model for g, down in products):
                raise ValueError(f"every expert's gate_up must take and down give the model "
                                 f"width {self.d_model}")
            tables = ((ctypes.c_void_p * len(products))(*(g.tiled.data_ptr() for g, _ in products)),
                      (ctypes.c_void_p * len(products))(*(d.tiled.data_ptr() for _, d in products)),
                      (ctypes.c_long * len(products))(*(g.n_pad for g, _ in products)),
                      (ctypes.c_long * len(products))(*(d.k for _, d in products)))
            self.keep.append((n1, n2, qkv, wo, products, cache))
            self.layers.append((n1.data_ptr(), n2.data_ptr(), qkv.tiled.data_ptr(), qkv.n_pad,
                                wo.tiled.data_ptr(), wo.n_pad, cache.k.data_ptr(),
                                cache.v.data_ptr(), moe, shared is not None, tables,
                                products[0][1].n_pad))

    @staticmethod
    def refusal(layers: list[tuple], cache_layers: list, cos: torch.Tensor,
                sin_signed: torch.Tensor) -> str | None:
        """Why these layers cannot run as MoEDecodeLayers, or None when they can."""
        if available() is not None:
            return available()
        if not layers or len(layers) != len(cache_layers):
            return "MoEDecodeLayers needs one cache layer per layer"
        fmts = set()
        for _, qkv, wo, _, ffn in layers:
            if ffn[0] == "dense":
                experts = [(ffn[1], ffn[2])]
            elif ffn[0] == "moe":
                experts = list(zip(ffn[2], ffn[3], strict=True)) + ([ffn[4]] if ffn[4] else [])
            else:
                return f"a layer's ffn must be ('dense', ...) or ('moe', ...), got {ffn[0]!r}"
            products = [qkv, wo, *(p for pair in experts for p in pair)]
            if not all(isinstance(p, TiledLinear) for p in products):
                return "every product must be a TiledLinear"
            fmts.update(p.fmt for p in products)
            if len(qkv.sizes) != 3 or any(len(g.sizes) != 2 or g.sizes[0] != g.sizes[1]
                                          or d.k != g.sizes[0] for g, d in experts):
                return "qkv must stack q, k, v and each expert's gate_up its gate and up"
        if not fmts <= {"fp32", "bf16"} or len(fmts) != 1:
            return f"the products must share one format, fp32 or bf16, got {sorted(fmts)}"
        tensors = [cos, sin_signed] + [t for c in cache_layers for t in (c.k, c.v)]
        if any(t.dtype not in WEIGHT_DTYPES or not t.is_contiguous() or t.device.type != "cpu"
               for t in tensors) or len({t.dtype for t in tensors[2:]}) != 1:
            return ("the cache (one dtype) and rotation tables must be contiguous float32 or "
                    "bfloat16 CPU tensors")
        return None

    def _route(self, moe, h: torch.Tensor, shared: bool) -> tuple:
        """(count, experts, m, rows_of, weights) of tg_experts for the router's choice."""
        rows = h.shape[0]
        weights, experts = moe.route(h.to(moe.gate.weight.dtype))
        moe.last_experts = experts
        by_expert: dict[int, list] = {}          # expert -> its (row, weight), rows in order
        for n, (row_e, row_w) in enumerate(zip(experts.tolist(), weights.tolist(), strict=True)):
            for e, w in zip(row_e, row_w, strict=True):
                by_expert.setdefault(e, []).append((n, w))
        groups = sorted(by_expert)
        m = [len(by_expert[e]) for e in groups]
        rows_of = [n for e in groups for n, _ in by_expert[e]]
        flat_w = [w for e in groups for _, w in by_expert[e]]
        moe.last_ran = tuple(groups)
        if shared:                                   # table entry E, every row, weight 1
            groups, m = [*groups, moe.n_experts], [*m, rows]
            rows_of, flat_w = [*rows_of, *range(rows)], [*flat_w, *([1.0] * rows)]
        count = len(groups)
        return (count, (ctypes.c_long * count)(*groups), (ctypes.c_long * count)(*m),
                (ctypes.c_long * len(rows_of))(*rows_of), (ctypes.c_float * len(flat_w))(*flat_w))

    def __call__(self, x: torch.Tensor, pos: int, consecutive: bool = False) -> None:
        self._run(x, self._plain(x, pos, consecutive))

    def paged(self, x: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> None:
        """DecodeLayers.paged for these layers."""
        self._run(x, self._paged(x, positions, tables))

    def _run(self, x: torch.Tensor, where: tuple) -> None:
        rows, d = x.shape
        cache_rows = where[0]
        h = torch.empty_like(x)
        xp, hp, lib, code = x.data_ptr(), h.data_ptr(), self.lib, self.code
        one = (1, (ctypes.c_long * 1)(0), (ctypes.c_long * 1)(rows),
               (ctypes.c_long * rows)(*range(rows)), (ctypes.c_float * rows)(*[1.0] * rows))
        for (n1, n2, wqkv, nqkv, wo, no, kc, vc, moe, shared, tables, n_down) in self.layers:
            with _library.lock:
                status = lib.tg_attention(code, xp, hp, rows, d, n1, n2, self.eps, wqkv, nqkv,
                                          wo, no, kc, vc, self.cache_bf16, *cache_rows,
                                          self.heads, self.kv_heads, self.head_dim)
            if status:
                raise MemoryError("the kernel could not allocate its buffers")
            plan = one if moe is None else self._route(moe, h, shared)
            with _library.lock:
                status = lib.tg_experts(code, xp, hp, rows, d, *plan, *tables, n_down)
            if status:
                raise MemoryError(f"the experts' kernel failed ({status})")


def _refuse_experts(model: torch.nn.Module, what: str) -> None:
    """A ValueError when `model` has mixture-of-experts layers (day 20): its experts are
    stacked (E, d_expert, D) parameters, not nn.Linear, so `what` would quantize only the
    routers, attention and head, leaving most of the weights in float32 and no expert to
    stream as blocks."""
    from tinygpt.moe import MoE  # imported here: tinygpt.moe uses these kernels

    layers = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    if layers:
        cfg = getattr(model, "cfg", None)
        why = cfg.fast_path_refusal() if hasattr(cfg, "fast_path_refusal") else \
            f"the model has mixture-of-experts layers ({layers[0]}, ...)"
        raise ValueError(f"{what} cannot quantize a mixture-of-experts model: {why}. Its "
                         f"experts are stacked (E, d_expert, D) tensors, not nn.Linear, so "
                         f"only the routers, attention and head would be quantized; run it in "
                         f"float32 or bfloat16")


def q8_0_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose every linear weight (the LM head too, and with it a tied
    embedding) holds its Q8_0 values, dequantize_q8_0(*quantize_q8_0(W)), and that is marked
    `decode_weights = "q8_0"`: tinygpt.kv_cache.DecodeStep then streams those weights as Q8_0
    blocks (8.5 bits per weight) instead of float32, each product's input rounded to 8 bits
    per block of 32 for the integer kernel. Everything else (prefill, the engine, the plain
    step) computes with the same weight values in float32 (re-quantizing a Q8_0 block's values
    gives back the same block), so the fast step differs from it only by the input rounding.
    Weights whose in_features is not a multiple of 32 stay as they are. A mixture-of-experts
    model is refused (ValueError): its experts are not nn.Linear layers."""
    _refuse_experts(model, "q8_0_model")
    out = copy.deepcopy(model)
    with torch.no_grad():
        for module in out.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % Q_BLOCK == 0:
                module.weight.copy_(dequantize_q8_0(*quantize_q8_0(module.weight)))
    out.decode_weights = "q8_0"
    return out.eval()


def q4_1_model(model: torch.nn.Module, blocks: dict[str, tuple] | None = None
               ) -> torch.nn.Module:
    """A copy of `model` whose linear weights (the LM head too, and with it a tied embedding)
    hold Q4_1 values, marked `decode_weights = "q4_1"`: DecodeStep streams the Q4_1 blocks
    (5 bits per weight with the scales and minimums) through the tiled integer kernel (the
    input rounded to 8 bits per block of 32), the rest computes with the same weight values in
    float32 (the oracle, which differs from the fast step only by that rounding).

    blocks: {name of a linear module's weight ("layers.0.attention.wq.weight"): (q, d, m)},
    e.g. a GGUF file's Q4_1 tensors, used as they are; weights without blocks are quantized
    here (quantize_q4_1). Weights whose in_features is not a multiple of 32 stay as they are.
    The blocks are kept in `decode_blocks` ({id(weight): (q, d, m)} of the copy's weights).
    A mixture-of-experts model is refused (ValueError): its experts are not nn.Linear layers.
    """
    _refuse_experts(model, "q4_1_model")
    blocks = dict(blocks or {})
    out = copy.deepcopy(model)
    out.decode_blocks = {}
    with torch.no_grad():
        for name, module in out.named_modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % Q_BLOCK == 0 \
                    and id(module.weight) not in out.decode_blocks:
                key = f"{name}.weight"
                parts = blocks.pop(key) if key in blocks else quantize_q4_1(module.weight)
                if parts[0].shape != module.weight.shape:
                    raise ValueError(f"blocks[{key!r}] has q of shape {tuple(parts[0].shape)}, "
                                     f"the weight {tuple(module.weight.shape)}")
                module.weight.copy_(dequantize_q4_1(*parts))
                out.decode_blocks[id(module.weight)] = parts
    if blocks:
        raise ValueError(f"blocks names weights the model has no linear for: {sorted(blocks)}")
    out.decode_weights = "q4_1"
    return out.eval()
