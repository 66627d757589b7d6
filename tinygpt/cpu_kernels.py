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
                   bytes; each weight rounded once to 8 significant bits, the sums in float32)

    TiledLinear        the products of one or more weights that share their input (q, k, v;
                       gate and up), stacked and tiled: x (M, K) -> a tuple of (M, N_i)
    available()        None when the kernels can run here, else the reason they cannot
    load()             the compiled library (compiles it once per machine and source)

The compiled library is cached under $TINYGPT_CACHE (default ~/.cache/tinygpt), named by a
hash of the source, the compiler and its flags. The plain products (F.linear) stay the oracle:
tinygpt.kv_cache.DecodeStep checks the kernels against them when it builds a step.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_gemv.c"
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-shared",
         "-fPIC", "-pthread")
TILE = 16
MAX_ROWS = 4            # x rows (sequences) per product; larger batches are compute-bound
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()            # one product at a time: the pool runs one job
_state: dict = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("TINYGPT_CACHE", Path.home() / ".cache" / "tinygpt"))


def _build() -> ctypes.CDLL:
    """Compile the source (once per source, compiler and flags) and load it."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()
                         + platform.machine().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_gemv-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise OSError(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
            os.replace(out, target)       # atomic: a concurrent build never sees half a file
    lib = ctypes.CDLL(str(target))
    lib.tg_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    lib.tg_gemv.restype = None
    lib.tg_start.argtypes = [ctypes.c_int]
    lib.tg_start.restype = ctypes.c_int
    lib.tg_stop.restype = None
    lib.tg_start(max(1, torch.get_num_threads()))
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, compiled and started on first use; None when it cannot be (the
    reason is then available())."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["reason"] = None, None
            if platform.machine() not in ("x86_64", "AMD64"):
                _state["reason"] = (f"the CPU kernels are written for x86-64; this machine is "
                                    f"{platform.machine()}")
            else:
                try:
                    _state["lib"] = _build()
                except OSError as err:
                    _state["reason"] = f"the CPU kernels could not be built: {err}"
        return _state["lib"]


def set_threads(threads: int) -> int:
    """Split every product over `threads` threads from now on (the default is
    torch.get_num_threads() when the library loads); returns the count now running."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    lib = load()
    if lib is None:
        raise RuntimeError(available())
    with _lock:
        lib.tg_stop()
        return lib.tg_start(threads)


def available() -> str | None:
    """None when the tiled CPU kernels can run on this machine, else the reason they cannot."""
    load()
    return _state["reason"]


def tile(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W (N, K) -> the tiled layout (ceil(N / 16), K, 16) in `dtype` (a copy); a last partial
    tile is padded with zero rows."""
    n, k = weight.shape
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {list(WEIGHT_DTYPES)}, got {dtype}")
    pad = -n % TILE
    w = torch.cat([weight.detach(), weight.new_zeros(pad, k)]) if pad else weight.detach()
    return w.to(dtype).reshape(-1, TILE, k).transpose(1, 2).contiguous()


class TiledLinear:
    """y_i = x @ W_i^T for weights W_i (N_i, K) that share their input, as one tiled product.

    TiledLinear(*weights, dtype=torch.float32 or torch.bfloat16) stacks the weights, tiles them
    and keeps the copy (later changes to the weights do not reach it). Call it with x (M, K)
    or (B, 1, K) float32, M <= MAX_ROWS: it returns one float32 output per weight, shapes
    (..., N_i). The stacked rows are padded to a multiple of 16 with zeros, whose outputs are
    dropped.
    """

    def __init__(self, *weights: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        reason = self.refusal(*weights)
        if reason is not None:
            raise ValueError(reason)
        lib = load()
        if lib is None:
            raise RuntimeError(available())
        self.lib, self.dtype, self.code = lib, dtype, WEIGHT_DTYPES[dtype]
        self.sizes = [w.shape[0] for w in weights]
        self.n, self.k = sum(self.sizes), weights[0].shape[1]
        self.n_pad = self.n + -self.n % TILE
        with torch.inference_mode(False), torch.no_grad():
            stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 \
                else weights[0].detach()
            self.tiled = tile(stacked, dtype)

    @staticmethod
    def refusal(*weights: torch.Tensor) -> str | None:
        """Why these weights cannot be tiled together, or None when they can."""
        if not weights:
            return "TiledLinear needs at least one weight"
        k = weights[0].shape[-1]
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
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k)
        if rows.dtype != torch.float32 or rows.shape[0] > MAX_ROWS:
            raise ValueError(f"TiledLinear takes float32 x with at most {MAX_ROWS} rows, got "
                             f"{rows.dtype} {tuple(x.shape)}")
        rows = rows.contiguous()
        y = torch.empty(rows.shape[0], self.n_pad)
        with _lock:
            self.lib.tg_gemv(self.code, self.tiled.data_ptr(), rows.data_ptr(), y.data_ptr(),
                             rows.shape[0], self.n_pad, self.k)
        if self.n_pad != self.n:
            y = y[:, :self.n]
        return y.view(*lead, self.n).split(self.sizes, -1)
