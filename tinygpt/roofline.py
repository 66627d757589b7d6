"""Day 10: the roofline model, a sourced hardware table, and a measured roofline of this machine.

An operation that does F FLOPs and moves B bytes has arithmetic intensity I = F / B (FLOP/byte).
A chip with peak compute P (FLOP/s) and memory bandwidth W (bytes/s) runs it at most at
min(P, W * I) FLOP/s: below the ridge point I* = P / W it is memory-bound, above it
compute-bound. Decode reads every weight once per step for only `batch` tokens, so its weight
matmuls sit at I ~ batch FLOP/byte in 16-bit: far left of the ridge (~295 on an H100).

All peak figures below are DENSE tensor-core throughputs. Vendor datasheets print the 2:4
structured-sparsity figure in the headline (H100 SXM bf16: 1,979 TFLOP/s "with sparsity");
dense matmuls, which is what LLM inference runs, get half of it. Memory capacities are the
datasheet's "GB" taken as 10^9 bytes.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tinygpt import flops as F
from tinygpt.model import ModelConfig

# dtype names a Hardware row may list a peak for (int8/int4/fp8 are OP/s of tensor cores).
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4")

TERA, GIGA = 1e12, 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense peak FLOP/s per dtype, memory bandwidth and capacity, and sources.

    peak_flops: {dtype: FLOP/s}, dtype in PEAK_DTYPES.  bandwidth: bytes/s.  memory: bytes.
    source: {figure: citation}, with a key for every dtype in peak_flops, "bandwidth" and
    "memory"; a citation says when its figure is an estimate rather than a vendor number.
    """

    name: str
    peak_flops: dict[str, float]
    bandwidth: float
    memory: float
    source: dict[str, str] = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ValueError(f"{self.name}: peak_flops must be a non-empty dict, "
                             f"got {self.peak_flops!r}")
        for dtype, value in self.peak_flops.items():
            if dtype not in PEAK_DTYPES:
                raise ValueError(f"{self.name}: peak_flops key must be one of {PEAK_DTYPES}, "
                                 f"got {dtype!r}")
            _check_rate(f"{self.name}: peak_flops[{dtype!r}]", value)
        _check_rate(f"{self.name}: bandwidth", self.bandwidth)
        _check_rate(f"{self.name}: memory", self.memory)
        if not isinstance(self.source, dict):
            raise TypeError(f"{self.name}: source must be a dict of citations, "
                            f"got {type(self.source).__name__}")
        needed = [*self.peak_flops, "bandwidth", "memory"]
        missing = [key for key in needed if not str(self.source.get(key, "")).strip()]
        if missing:
            raise ValueError(f"{self.name}: source needs a citation for every figure; "
                             f"missing {missing}")
        # Own copies, so that editing the dicts passed in cannot change a frozen row.
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "source", dict(self.source))

    def __hash__(self) -> int:  # the dict fields are not hashable; rows are keyed by name
        return hash((self.name, self.bandwidth, self.memory))

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype`; ValueError naming the dtypes this row has."""
        if dtype not in self.peak_flops:
            raise ValueError(f"dtype must be one of {sorted(self.peak_flops)} for hardware "
                             f"{self.name!r}, got {dtype!r}")
        return self.peak_flops[dtype]


def _check_rate(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _datasheet_row(name: str, sheet: str, tflops: dict[str, float], tb_s: float, gb: float,
                   notes: dict[str, str] | None = None) -> Hardware:
    """A vendor row: dense TFLOP/s per dtype, TB/s and GB, converted to FLOP/s, bytes/s, bytes."""
    notes = notes or {}
    source = {}
    for dtype in tflops:
        default = ("non-tensor FP32" if dtype == "fp32"
                   else "dense: half the figure the sheet gives 'with sparsity'")
        source[dtype] = f"{sheet}; {notes.get(dtype, default)}"
    source["bandwidth"] = f"{sheet}; GPU memory bandwidth {tb_s:g} TB/s"
    source["memory"] = f"{sheet}; GPU memory {gb:g} GB"
    peaks = {dtype: value * TERA for dtype, value in tflops.items()}
    return Hardware(name, peaks, tb_s * TERA, gb * GIGA, source)


_A100 = "NVIDIA A100 Tensor Core GPU datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet"
_ADA = "NVIDIA Ada Lovelace GPU architecture whitepaper"
_ACCUMULATE = "with FP32 accumulate, as PyTorch matmuls use"

# Dense TFLOP/s (TOP/s for int8/int4) per dtype.
_A100_TFLOPS = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0}
_H100_SXM_TFLOPS = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4,
                    "fp8": 1978.9, "int8": 1978.9}
_H100_PCIE_TFLOPS = {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0,
                     "fp8": 1513.0, "int8": 1513.0}
_L4_TFLOPS = {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5,
              "int8": 242.5}
_RTX4090_TFLOPS = {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3,
                   "int8": 660.6, "int4": 1321.2}
_H100_NOTE = {"bf16": "1,979 with sparsity, 989.4 dense (H100 architecture whitepaper)",
              "fp16": "1,979 with sparsity, 989.4 dense (H100 architecture whitepaper)"}

HARDWARE: dict[str, Hardware] = {
    "a100-40gb-sxm": _datasheet_row("a100-40gb-sxm", f"{_A100} (A100 40GB SXM column)",
                                    _A100_TFLOPS, 1.555, 40),
    "a100-80gb-sxm": _datasheet_row("a100-80gb-sxm", f"{_A100} (A100 80GB SXM column)",
                                    _A100_TFLOPS, 2.039, 80),
    "h100-sxm": _datasheet_row("h100-sxm", f"{_H100} (H100 SXM column)", _H100_SXM_TFLOPS,
                               3.35, 80, _H100_NOTE),
    "h100-pcie": _datasheet_row("h100-pcie", f"{_H100} (H100 PCIe column of the 2022 "
                                "editions; later editions list the H100 NVL instead)",
                                _H100_PCIE_TFLOPS, 2.0, 80),
    "h200": _datasheet_row("h200", f"{_H200} (H200 SXM column; compute as H100 SXM)",
                           _H100_SXM_TFLOPS, 4.8, 141, _H100_NOTE),
    "l4": _datasheet_row("l4", _L4, _L4_TFLOPS, 0.3, 24),
    "rtx-4090": _datasheet_row(
        "rtx-4090", f"{_ADA} (GeForce RTX 4090 column)", _RTX4090_TFLOPS, 1.008, 24,
        {"tf32": "dense; 165.2 with sparsity",
         "bf16": f"dense, {_ACCUMULATE}; 330.4 with sparsity",
         "fp16": f"dense, {_ACCUMULATE}; 330.3 dense with FP16 accumulate, 2x with sparsity",
         "fp8": f"dense, {_ACCUMULATE}; 2x with sparsity",
         "int8": "dense; 1,321.2 with sparsity", "int4": "dense; 2,642.4 with sparsity"}),
    "apple-m1-max": Hardware(
        "apple-m1-max",
        {"fp32": 10.4 * TERA, "fp16": 10.4 * TERA, "bf16": 10.4 * TERA},
        400 * GIGA, 64 * GIGA,
        {"fp32": "Apple M1 Max announcement (October 2021 event and newsroom release): "
                 "32-core GPU, 10.4 TFLOPS (FP32)",
         "fp16": "ESTIMATE: Apple publishes no FP16 figure; assumed equal to the FP32 10.4 "
                 "TFLOPS of the 32-core GPU (the Neural Engine is not usable from PyTorch)",
         "bf16": "ESTIMATE: the M1 GPU has no native bf16 arithmetic; assumed equal to FP32 "
                 "as an upper bound",
         "bandwidth": "Apple newsroom, 'Introducing M1 Pro and M1 Max' (Oct 2021): 400 GB/s",
         "memory": "Apple newsroom, 'Introducing M1 Pro and M1 Max' (Oct 2021): up to 64 GB "
                   "unified memory (largest configuration; shared with the CPU)"}),
}


def get_hardware(name: str) -> Hardware:
    """HARDWARE[name], or a ValueError listing the known names."""
    if name not in HARDWARE:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {name!r}")
    return HARDWARE[name]


def _check_hw(hw: object) -> Hardware:
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a tinygpt.roofline.Hardware (see HARDWARE), "
                        f"got {type(hw).__name__}")
    return hw


# --------------------------------------------------------------------------- the roofline


def ridge_point(hw: Hardware, dtype: str = "bf16") -> float:
    """Intensity (FLOP/byte) where the roofs meet: peak FLOP/s / bandwidth. H100 SXM bf16: ~295."""
    return _check_hw(hw).peak(dtype) / hw.bandwidth


def attainable_flops(hw: Hardware, intensity: float, dtype: str = "bf16") -> float:
    """Roofline: the most FLOP/s an op of `intensity` FLOP/byte can reach: min(peak, W * I)."""
    _check_hw(hw)
    if isinstance(intensity, bool) or not isinstance(intensity, int | float) \
            or not intensity >= 0:
        raise ValueError(f"intensity must be a number >= 0 (FLOP/byte), got {intensity!r}")
    return min(hw.peak(dtype), hw.bandwidth * intensity)


def op_time(flops: float, nbytes: float, hw: Hardware, dtype: str = "bf16") -> tuple[float, str]:
    """(seconds, bound) of an op on the roofline: max(flops / peak, nbytes / bandwidth).

    bound is "compute" when the compute time is the larger (ties count as compute), else
    "memory". This is a lower bound: real kernels reach 50-90% of either roof.
    """
    seconds = F.estimate_latency(flops, nbytes, _check_hw(hw).peak(dtype), hw.bandwidth)
    bound = "compute" if flops / hw.peak(dtype) >= nbytes / hw.bandwidth else "memory"
    return seconds, bound


@dataclass(frozen=True)
class Estimate:
    """Roofline estimate of one phase: FLOPs, bytes, intensity (FLOP/byte), bound, seconds."""

    phase: str
    batch: int
    flops: float
    bytes: float
    intensity: float
    bound: str
    seconds: float

    @property
    def flops_per_second(self) -> float:
        """The FLOP/s this estimate attains (its height on a roofline plot)."""
        return self.flops / self.seconds


def _default_compute_dtype(dtype: str) -> str:
    """Weights in int8/int4 are dequantized and multiplied in bf16 (weight-only quantization);
    others are multiplied in their own dtype."""
    F._check_dtype("dtype", dtype)
    return "bf16" if dtype in ("int8", "int4") else dtype


def _compute_dtype(hw: Hardware, dtype: str, compute_dtype: str | None) -> str:
    """The dtype the matmuls run in: `compute_dtype` if given, else _default_compute_dtype(dtype).
    A ValueError naming the argument at fault when `hw` lists no peak for it."""
    _check_hw(hw)
    compute = _default_compute_dtype(dtype)
    peaks = sorted(hw.peak_flops)
    if compute_dtype is not None:
        if compute_dtype not in hw.peak_flops:
            raise ValueError(f"compute_dtype must be one of {peaks} for hardware {hw.name!r}, "
                             f"got {compute_dtype!r}")
        return compute_dtype
    if compute not in hw.peak_flops:
        raise ValueError(f"hardware {hw.name!r} has no peak for {compute!r}, the compute dtype "
                         f"of dtype {dtype!r}: pass compute_dtype, one of {peaks}")
    return compute


def _estimate(phase: str, batch: int, flops: float, nbytes: float, hw: Hardware,
              dtype: str) -> Estimate:
    seconds, bound = op_time(flops, nbytes, hw, dtype)
    return Estimate(phase, batch, flops, nbytes, flops / nbytes, bound, seconds)


def prefill_estimate(cfg: ModelConfig, hw: Hardware, batch: int, prompt_len: int,
                     dtype: str = "bf16", *, kv_dtype: str | None = None,
                     compute_dtype: str | None = None, attention: str = "full") -> Estimate:
    """Roofline estimate of prefilling `batch` prompts of `prompt_len` tokens (the TTFT).

    FLOPs: flops.prefill_flops with the LM head on the last position only (generation needs
    no other logits) and `attention` "full" (dense kernel) or "causal" (masked tiles skipped).
    Bytes: flops.prefill_bytes (weights once + the KV cache written).
    dtype: weight dtype; compute runs in `compute_dtype`, by default dtype itself, or bf16 for
    int8/int4 weights (weight-only quantization).
    """
    compute = _compute_dtype(hw, dtype, compute_dtype)
    flops = F.prefill_flops(cfg, batch, prompt_len, attention=attention, all_logits=False)
    nbytes = F.prefill_bytes(cfg, batch, prompt_len, dtype, kv_dtype)
    return _estimate("prefill", batch, flops, nbytes, hw, compute)


def decode_estimate(cfg: ModelConfig, hw: Hardware, batch: int, context_len: int,
                    dtype: str = "bf16", *, kv_dtype: str | None = None,
                    compute_dtype: str | None = None) -> Estimate:
    """Roofline estimate of one decode step (the time per output token at this context).

    `context_len`: keys each new token attends to, itself included (flops.decode_flops).
    Bytes: flops.decode_step_bytes (weights once + the whole KV cache read).
    """
    compute = _compute_dtype(hw, dtype, compute_dtype)
    flops = F.decode_flops(cfg, batch, context_len)
    nbytes = F.decode_step_bytes(cfg, batch, context_len, dtype, kv_dtype)
    return _estimate("decode", batch, flops, nbytes, hw, compute)


def generation_estimate(cfg: ModelConfig, hw: Hardware, batch: int, prompt_len: int,
                        new_tokens: int, dtype: str = "bf16", *, kv_dtype: str | None = None,
                        compute_dtype: str | None = None) -> tuple[Estimate, Estimate | None]:
    """(prefill, decode) estimates for generating `new_tokens` after a `prompt_len` prompt.

    The prefill yields the first new token, so its seconds are the TTFT. The other
    new_tokens - 1 tokens take one decode step each, at contexts prompt_len + 1, ...,
    prompt_len + new_tokens - 1; the decode Estimate is their per-step average (its seconds
    are the time per output token, TPOT), bound "mixed" if steps differ. None if new_tokens == 1.
    """
    F._check_int("new_tokens", new_tokens)
    prefill = prefill_estimate(cfg, hw, batch, prompt_len, dtype, kv_dtype=kv_dtype,
                               compute_dtype=compute_dtype)
    steps = [decode_estimate(cfg, hw, batch, prompt_len + i, dtype, kv_dtype=kv_dtype,
                             compute_dtype=compute_dtype) for i in range(1, new_tokens)]
    if not steps:
        return prefill, None
    n = len(steps)
    flops = sum(s.flops for s in steps) / n
    nbytes = sum(s.bytes for s in steps) / n
    bounds = {s.bound for s in steps}
    bound = bounds.pop() if len(bounds) == 1 else "mixed"
    seconds = sum(s.seconds for s in steps) / n
    return prefill, Estimate("decode", batch, flops, nbytes, flops / nbytes, bound, seconds)


def critical_batch_size(cfg: ModelConfig, hw: Hardware, dtype: str = "bf16",
                        context_len: int = 0, *, kv_dtype: str | None = None,
                        compute_dtype: str | None = None) -> float:
    """Smallest (real-valued) batch at which a decode step becomes compute-bound.

    A step at batch B does B * (2 N_matmul + attention) FLOPs and reads W + B * (D + KV) bytes
    (the weights once, plus per sequence an embedding row and its KV cache). Setting
    FLOPs / bytes = ridge point and solving for B gives the threshold. With context_len=0
    (weights only) it is ~ ridge * bytes_per_weight / 2: about the ridge point for 16-bit
    weights. Attention has intensity ~ the GQA group size whatever the batch, so with a long
    context the threshold grows, and is math.inf when no batch makes the step compute-bound.
    Round up for an integer batch.
    """
    F._check_int("context_len", context_len, minimum=0)
    ridge = ridge_point(hw, _compute_dtype(hw, dtype, compute_dtype))
    bytes_per_seq = cfg.d_model * F.bytes_per_element(dtype)              # its embedding row
    shared_bytes = F.weights_read_bytes(cfg, 1, dtype) - bytes_per_seq     # read once per step
    flops_per_seq = F.weight_flops_per_token(cfg)
    if context_len:
        flops_per_seq += F.attention_flops_per_token(cfg, context_len)
        kv = dtype if kv_dtype is None else kv_dtype
        bytes_per_seq += F.kv_cache_bytes(cfg, context_len, 1, kv)
    margin = flops_per_seq - ridge * bytes_per_seq
    return ridge * shared_bytes / margin if margin > 0 else math.inf


# --------------------------------------------------------------------------- measuring


_TORCH_DTYPES = ("fp32", "bf16", "fp16")


def _resolve_device(device: object):
    import torch

    if device is None:
        from tinygpt import pick_device

        return pick_device()
    return device if isinstance(device, torch.device) else torch.device(str(device))


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int, device) -> float:
    """Median wall time of fn() over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul_flops(sizes: Sequence[int] = (256, 512, 1024), repeats: int = 5,
                         warmup: int = 2, *, dtype: str = "fp32", device=None) -> float:
    """Best measured FLOP/s of square (n, n) @ (n, n) matmuls, over n in `sizes`.

    Each size: `warmup` untimed runs, then the median of `repeats` timed runs; FLOPs = 2 n^3.
    dtype in ("fp32", "bf16", "fp16"); device: None picks CUDA, MPS, then CPU.
    """
    import torch

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    if isinstance(sizes, int) or not sizes:
        raise ValueError(f"sizes must be a non-empty sequence of ints, got {sizes!r}")
    for n in sizes:
        F._check_int("sizes[i]", n)
    F._check_int("repeats", repeats)
    F._check_int("warmup", warmup, minimum=0)
    device = _resolve_device(device)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    generator = torch.Generator().manual_seed(0)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, generator=generator).to(device=device, dtype=torch_dtype)
        b = torch.randn(n, n, generator=generator).to(device=device, dtype=torch_dtype)
        seconds = _median_seconds(lambda a=a, b=b: a @ b, repeats, warmup, device)
        best = max(best, 2 * n**3 / seconds)
    return best


def measure_copy_bandwidth(nbytes: int = 2**27, repeats: int = 5, warmup: int = 1, *,
                           device=None) -> float:
    """Measured memory bandwidth in bytes/s from copying a buffer of `nbytes` bytes.

    A copy reads nbytes and writes nbytes, and both are counted: bandwidth = 2 * nbytes /
    median seconds (write-allocate traffic on CPUs is not counted). Use buffers far larger
    than the last-level cache (the default 128 MiB), or you measure the cache.
    """
    import torch

    F._check_int("nbytes", nbytes, minimum=8)
    F._check_int("repeats", repeats)
    F._check_int("warmup", warmup, minimum=0)
    device = _resolve_device(device)
    src = torch.ones(nbytes // 8, dtype=torch.float64, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), repeats, warmup, device)
    return 2 * src.numel() * 8 / seconds


def _device_memory_bytes(device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError) as exc:
        raise RuntimeError("cannot read this machine's memory size (os.sysconf)") from exc


def measure_local_roofline(seconds_budget: float = 2.0, *, device=None,
                           dtypes: Sequence[str] = ("fp32",)) -> Hardware:
    """Measure this machine's roofline: a Hardware row named "local".

    Half of `seconds_budget` goes to matmuls of growing size n = 128, 256, ... (peak FLOP/s =
    the best median), half to copies of growing size 1 MiB, 2 MiB, ... up to 1 GiB (bandwidth
    = the largest buffer's read + write bytes/s, the one least helped by caches). A size is
    measured only if the times seen so far predict it fits in the budget, so the call takes
    about seconds_budget (more on a heavily loaded machine, where even small ops are slow).
    dtypes: matmul dtypes to measure, from ("fp32", "bf16", "fp16").
    device: None picks CUDA, MPS, then CPU.
    """
    if isinstance(seconds_budget, bool) or not isinstance(seconds_budget, int | float) \
            or not 0 < seconds_budget < math.inf:
        raise ValueError(f"seconds_budget must be a finite number > 0, got {seconds_budget!r}")
    if isinstance(dtypes, str) or not dtypes or any(d not in _TORCH_DTYPES for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty sequence drawn from {_TORCH_DTYPES}, "
                         f"got {dtypes!r}")
    device = _resolve_device(device)
    runs = 4                                             # 1 warm-up + 3 timed per size
    measure_copy_bandwidth(2**16, repeats=1, warmup=1, device=device)    # start thread pools
    peaks, source = {}, {}
    for dtype in dtypes:
        share = seconds_budget / 2 / len(dtypes)
        start, n = time.perf_counter(), 128
        best = measure_matmul_flops((n,), repeats=3, warmup=1, dtype=dtype, device=device)
        largest = n
        while 2 * n <= 8192:
            # Each matmul of size 2n takes ~8x the median time seen at size n.
            seconds_next = runs * 8 * (2 * n**3 / best)
            if time.perf_counter() - start + seconds_next > share:
                break
            n *= 2
            best = max(best, measure_matmul_flops((n,), repeats=3, warmup=1, dtype=dtype,
                                                  device=device))
            largest = n
        peaks[dtype] = best
        source[dtype] = (f"measured: best median of 3 {dtype} matmuls, n = 128..{largest}, "
                         f"on {device}")
    share, start, nbytes = seconds_budget / 2, time.perf_counter(), 2**20
    bandwidth = measure_copy_bandwidth(nbytes, repeats=3, warmup=1, device=device)
    while nbytes < 2**30:
        # A copy of 2x the bytes takes ~2x as long; filling the two new buffers ~2 more copies.
        seconds_next = (runs + 2) * 2 * (2 * nbytes / bandwidth)
        if time.perf_counter() - start + seconds_next > share:
            break
        nbytes *= 2
        bandwidth = measure_copy_bandwidth(nbytes, repeats=3, warmup=1, device=device)
    note = "" if nbytes >= 2**26 else " (small buffer: may measure a cache, not DRAM)"
    source["bandwidth"] = (f"measured: median of 3 copies of {nbytes / 2**20:g} MiB on {device},"
                           f" read + write bytes counted{note}")
    source["memory"] = f"{device} memory size reported by the system"
    return Hardware("local", peaks, bandwidth, _device_memory_bytes(device), source)


# --------------------------------------------------------------------------- plotting


def plot_roofline(hw_list: Hardware | Sequence[Hardware], points: Sequence = (), ax=None, *,
                  dtype: str = "bf16"):
    """Log-log roofline plot: one roof per Hardware, its ridge point, and labelled points.

    points: Estimates (labelled "phase B=batch", placed at (intensity, flops_per_second)) or
    (label, intensity FLOP/byte, FLOP/s) tuples. ax: a matplotlib Axes to draw on, or None for
    a new Figure. Returns the matplotlib Figure (built without pyplot, so no GUI is needed).
    """
    import numpy as np
    from matplotlib.figure import Figure

    hws = [hw_list] if isinstance(hw_list, Hardware) else list(hw_list)
    if not hws:
        raise ValueError("hw_list must contain at least one Hardware")
    for hw in hws:
        _check_hw(hw)
    labelled = []
    for p in points:
        if isinstance(p, Estimate):
            labelled.append((f"{p.phase} B={p.batch}", p.intensity, p.flops_per_second))
        elif isinstance(p, tuple) and len(p) == 3:
            labelled.append((str(p[0]), float(p[1]), float(p[2])))
        else:
            raise TypeError(f"points must hold Estimate or (label, intensity, flop_per_s) "
                            f"tuples, got {p!r}")
    if ax is None:
        fig = Figure(figsize=(7, 4.5))
        ax = fig.subplots()
    else:
        fig = ax.figure
    ridges = [ridge_point(hw, dtype) for hw in hws]
    xs = [x for _, x, _ in labelled if x > 0] + ridges
    x = np.logspace(math.log10(min(xs) / 4), math.log10(max(xs) * 8), 200)
    for hw, ridge in zip(hws, ridges, strict=True):
        (line,) = ax.plot(x, np.minimum(hw.peak(dtype), hw.bandwidth * x),
                          label=f"{hw.name} ({dtype})")
        ax.plot([ridge], [hw.peak(dtype)], "o", color=line.get_color())
        ax.annotate(f"ridge {ridge:.0f}", (ridge, hw.peak(dtype)), textcoords="offset points",
                    xytext=(4, 6), fontsize=8, color=line.get_color())
    for label, xi, yi in labelled:
        marker = "s" if label.startswith("prefill") else "^"
        ax.plot([xi], [yi], marker, color="black", markersize=5)
        ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title("roofline")
    ax.set_ylim(top=3 * max(hw.peak(dtype) for hw in hws))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return fig


# --------------------------------------------------------------------------- command line


def _si(value: float, unit: str) -> str:
    """1.5e12, "FLOP" -> "1.5 TFLOP" (3 significant digits); seconds get ms / us / ns."""
    if unit == "s":
        for scale, name in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
            if value >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value * 1e9:.3g} ns"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def output_path(path: str, option: str, *, plot: bool = False) -> str:
    """Check a command line's output file before any slow work: `path` is not empty and not a
    folder, its folder exists (made here when missing: `make bench` writes into bench-results/)
    and takes a new file, and a plot's extension is one matplotlib's canvas writes (matplotlib
    would add .png to a name without one). Returns path; a ValueError naming `option`
    otherwise."""
    if not path:
        raise ValueError(f"{option} needs a file path, got an empty one")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file path")
    if plot:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        if target.suffix[1:].lower() not in formats:
            raise ValueError(f"{option} {path}: the file name must end in one of "
                             f"{', '.join('.' + name for name in formats)}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass                      # a file can be written there
    except OSError as err:
        raise ValueError(f"{option} {path}: cannot write into the folder {target.parent} "
                         f"({err.strerror or err})") from None
    return path


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m tinygpt roofline`."""
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt roofline",
        description="Roofline estimates of prefill (TTFT) and decode (time per token).")
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(F.PRESETS),
                        help="model preset (default llama-3-8b)")
    parser.add_argument("--hardware", default="h100-sxm", choices=[*sorted(HARDWARE), "local"],
                        help="hardware row; 'local' measures this machine (default h100-sxm)")
    parser.add_argument("--batch", type=_positive_int, nargs="+", default=[1],
                        help="one or more batch sizes (default 1)")
    parser.add_argument("--prompt", type=_positive_int, default=512,
                        help="prompt tokens (default 512)")
    parser.add_argument("--new", type=_positive_int, default=128,
                        help="new tokens generated (default 128)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(F.DTYPE_BITS),
                        help="weight dtype (default bf16); int8/int4 compute in bf16")
    parser.add_argument("--kv-dtype", default=None, choices=sorted(F.DTYPE_BITS),
                        help="KV-cache dtype (default: --dtype)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="save a roofline plot (.png, .pdf, .svg, ...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt roofline ...`: print the roofline table; see build_parser(). A bad
    --plot path is one `error: ...` line (exit 2), before --hardware local measures."""
    args = build_parser().parse_args(argv)
    if args.plot is not None:
        try:
            output_path(args.plot, "--plot", plot=True)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    cfg = F.PRESETS[args.model]
    compute = _default_compute_dtype(args.dtype)
    if args.hardware == "local":
        hw = measure_local_roofline(2.0, dtypes=(compute,))
    else:
        hw = HARDWARE[args.hardware]
    kv = args.kv_dtype or args.dtype
    ridge = ridge_point(hw, compute)
    print(f"{args.model} on {hw.name}: weights {args.dtype}, KV cache {kv}, compute {compute}")
    print(f"  model    {F.param_count(cfg):,} parameters, weights "
          f"{_si(F.weight_bytes(cfg, args.dtype), 'B')}")
    estimate = " (an estimate: see HARDWARE[...].source)" if "ESTIMATE" in hw.source.get(
        compute, "") else ""
    print(f"  hardware {_si(hw.peak(compute), 'FLOP/s')} dense {compute}{estimate}, "
          f"{_si(hw.bandwidth, 'B/s')}, {_si(hw.memory, 'B')}")
    critical = critical_batch_size(cfg, hw, args.dtype, kv_dtype=kv)
    print(f"  ridge point {ridge:.1f} FLOP/byte; decode weight matmuls turn compute-bound "
          f"from batch {math.ceil(critical)}")
    last = args.prompt + args.new - 1
    steps = (f"decode row = average of {args.new - 1} steps (context {args.prompt + 1}..{last})"
             if args.new > 1 else "no decode steps")
    print(f"  prompt {args.prompt} tokens, {args.new} new tokens: prefill time = TTFT; {steps}")
    if last + 1 > cfg.max_seq_len:
        print(f"  note: {last + 1} tokens exceed the model's max_seq_len {cfg.max_seq_len}")
    header = (f"{'batch':>5}  {'phase':<18} {'FLOPs':>11} {'bytes':>10} {'FLOP/byte':>9}  "
              f"{'bound':<7} {'time':>9} {'tokens/s':>9}  memory")
    print()
    print(header)
    print("-" * len(header))
    points: list[Estimate] = []
    for batch in args.batch:
        prefill, decode = generation_estimate(cfg, hw, batch, args.prompt, args.new, args.dtype,
                                              kv_dtype=kv)
        need = F.weight_bytes(cfg, args.dtype) + F.kv_cache_bytes(cfg, last + 1, batch, kv)
        fits = "fits" if need <= hw.memory else f"DOES NOT FIT in {_si(hw.memory, 'B')}"
        rows = [(prefill, "prefill (TTFT)", "", f"{_si(need, 'B')} {fits}")]
        if decode is not None:
            rows.append((decode, "decode (per token)", f"{batch / decode.seconds:,.0f}", ""))
        for est, phase, rate, memory in rows:
            print(f"{batch:>5}  {phase:<18} {_si(est.flops, 'FLOP'):>11} "
                  f"{_si(est.bytes, 'B'):>10} {est.intensity:>9.1f}  {est.bound:<7} "
                  f"{_si(est.seconds, 's'):>9} {rate:>9}  {memory}".rstrip())
            points.append(est)
    if args.plot is not None:
        fig = plot_roofline([hw], points, dtype=compute)
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"\nwrote {args.plot}")
    return 0
