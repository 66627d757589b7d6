"""Measuring on a device: clocks, bandwidth, random prompts, streamed requests, and the
Comparison record every row of `python -m tinygpt bench` produces."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinygpt import flops as F
from tinygpt import roofline as R
from tinygpt.generate import model_device, stream
from tinygpt.metrics import RequestTrace
from tinygpt.model import TinyGPT
from tinygpt.sampling import SamplingParams


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (CUDA and MPS run asynchronously; CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def trace_request(model: torch.nn.Module, prompt_ids, params: SamplingParams, *,
                  clock: Callable[[], float] = time.perf_counter,
                  **stream_kwargs) -> tuple[RequestTrace, list[int]]:
    """Stream one request and timestamp every token: returns (trace, new token ids).

    The clock starts before stream() is called (argument checks and cache allocation count
    toward TTFT) and is read after each event, with the device synchronized first.
    stream_kwargs go to tinygpt.generate.stream (use_cache, eos_id, tokenizer, ...).
    """
    device = model_device(model)
    synchronize(device)
    start = clock()
    times, ids = [], []
    for event in stream(model, prompt_ids, params, **stream_kwargs):
        synchronize(device)
        times.append(clock())
        ids.append(event.token_id)
    prompt_len = len(prompt_ids) if not isinstance(prompt_ids, torch.Tensor) \
        else prompt_ids.shape[-1]
    return RequestTrace(start, tuple(times), prompt_len), ids


def measure_read_bandwidth(nbytes: int = 2**28, repeats: int = 5, warmup: int = 1, *,
                           device=None) -> float:
    """Read-only memory bandwidth in bytes/s: summing a float32 buffer of `nbytes` bytes.

    A sum reads every byte once and writes one number, like a decode step reading weights;
    tinygpt.roofline.measure_copy_bandwidth instead counts a copy's reads and writes. Use a
    buffer far larger than the last-level cache (default 256 MiB).
    """
    F._check_int("nbytes", nbytes, minimum=4)
    F._check_int("repeats", repeats)
    F._check_int("warmup", warmup, minimum=0)
    device = R._resolve_device(device)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    with torch.inference_mode():
        seconds = R._median_seconds(buffer.sum, repeats, warmup, device)
    return buffer.numel() * 4 / seconds


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """A seeded list of `length` uniformly random token ids in [0, vocab_size)."""
    F._check_int("length", length)
    F._check_int("vocab_size", vocab_size)
    F._check_int("seed", seed, minimum=0)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def _median_run(fn: Callable[[], object], repeats: int, device: torch.device
                ) -> tuple[float, object]:
    """(median wall seconds of `repeats` calls of fn, fn's last result); no warm-up."""
    seconds, result = [], None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


@dataclass
class Comparison:
    """One side-by-side measurement against a target.

    value: the measured figure (a ratio, or a fraction for utilization / error).
    target: the threshold, read with `direction`: ">=" (value must reach it) or "<=".
    met: whether every condition held; reason: why not (None when met).
    details: everything measured along the way, for the JSON report.
    targeted: False for an extra row shown for information (not a course target), and for
    every row of the quick plan (run_bench); the table prints such a row's figures with no
    verdict (report.verdict), though met still says whether the condition held.
    """

    name: str
    description: str
    value: float
    target: float
    direction: str
    unit: str
    met: bool
    reason: str | None
    details: dict = dataclasses.field(default_factory=dict)
    targeted: bool = True


def median_round(rounds: Sequence[Comparison]) -> Comparison:
    """The round whose value is the median (the upper median for an even count), judged as it
    stands, with every round's value in details["round_values"]. Taking one real round keeps
    the reported step time and bandwidths consistent with each other."""
    if not rounds:
        raise ValueError("rounds must hold at least one Comparison")
    chosen = sorted(rounds, key=lambda c: c.value)[len(rounds) // 2]
    chosen.details["round_values"] = [c.value for c in rounds]
    return chosen


ROOF_UNRELIABLE = "the measured bandwidth roof is below the achieved rate: roof unreliable"


def bandwidth_verdict(achieved: float, copy_bandwidth: float, read_bandwidth: float,
                      target: float) -> tuple[float, str, str | None]:
    """(share, judged_against, reason) of a decode's achieved bytes/s, judged against the
    HIGHER of the copy and read-only roofs. reason is None when target <= share <= 1; a share
    above 1 is a miss with ROOF_UNRELIABLE (a roof that the decode beats was measured too
    low, so the share says nothing); below target, the figures."""
    roof = max(copy_bandwidth, read_bandwidth)
    share = achieved / roof
    against = "read" if read_bandwidth >= copy_bandwidth else "copy"
    if share > 1:
        return share, against, (f"{ROOF_UNRELIABLE} ({achieved / 1e9:.2f} GB/s achieved, "
                                f"{roof / 1e9:.2f} GB/s {against} roof)")
    if share < target:
        return share, against, (f"{achieved / 1e9:.2f} GB/s achieved is {share:.0%} of the "
                                f"{roof / 1e9:.2f} GB/s measured ({against}), below "
                                f"{target:.0%}")
    return share, against, None


def median_round_share(nbytes: float, seconds: Sequence[float], copy_bandwidth: Sequence[float],
                       read_bandwidth: Sequence[float], target: float) -> dict:
    """Rounds of a decode reading `nbytes` per token in seconds[i], beside the copy and read
    roofs measured in that round: each round's share of its higher roof, and the median round
    (the upper median) judged by bandwidth_verdict. Returns {"share", "judged_against",
    "reason", "round" (its index), "round_shares"}; the share and the figures of "round" agree."""
    shares = [nbytes / s / max(c, r)
              for s, c, r in zip(seconds, copy_bandwidth, read_bandwidth, strict=True)]
    i = sorted(range(len(shares)), key=shares.__getitem__)[len(shares) // 2]
    share, against, reason = bandwidth_verdict(nbytes / seconds[i], copy_bandwidth[i],
                                               read_bandwidth[i], target)
    return {"share": share, "judged_against": against, "reason": reason, "round": i,
            "round_shares": shares}


def run_requests(model: TinyGPT, n_requests: int, new_tokens: int,
                 prompt_lengths: Sequence[int] = (16, 64, 128, 256), *, seed: int = 0,
                 warmup: int = 1) -> list[RequestTrace]:
    """Stream `n_requests` greedy requests one after another; prompts cycle through
    `prompt_lengths` (seeded random ids), each an int >= 1. The first `warmup` prompts (at most
    n_requests) are streamed once more beforehand, untimed. Returns the n_requests traces."""
    F._check_int("n_requests", n_requests)
    if isinstance(prompt_lengths, str | bytes) or not isinstance(prompt_lengths, Sequence) \
            or not prompt_lengths:
        raise ValueError(f"prompt_lengths must be a non-empty sequence of ints >= 1, got "
                         f"{prompt_lengths!r}")
    for i, length in enumerate(prompt_lengths):
        F._check_int(f"prompt_lengths[{i}]", length)
    F._check_int("warmup", warmup, minimum=0)
    if warmup > n_requests:
        raise ValueError(f"warmup must be at most n_requests={n_requests} (it reruns the first "
                         f"prompts), got {warmup}")
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompts = [random_prompt(prompt_lengths[i % len(prompt_lengths)], model.cfg.vocab_size,
                             seed + i) for i in range(n_requests)]
    for prompt in prompts[:warmup]:
        trace_request(model, prompt, params)
    return [trace_request(model, prompt, params)[0] for prompt in prompts]


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd",
             "sve")      # the instruction sets the CPU kernels' paths depend on


def cpu_model(cpuinfo: str | None = None) -> dict:
    """The CPU by name: {"name", "family", "model", "isa"} from /proc/cpuinfo's first processor
    (Linux; `cpuinfo` is that file's text, read here when None). isa lists the ISA_FLAGS the
    CPU reports. Elsewhere name is platform.processor() and the rest None / empty."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
                cpuinfo = handle.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break                   # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"name": fields.get("model name") or fields.get("Hardware") or platform.processor(),
            "family": fields.get("cpu family"), "model": fields.get("model"),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def machine_info(threads: int) -> dict:
    """Where the numbers come from: CPU (by name, family / model and ISA flags, cpu_model),
    cores, threads, load, versions."""
    try:
        load = os.getloadavg()
    except (OSError, AttributeError):
        load = None
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu": cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": threads,
            "load_average_1_5_15": load,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
