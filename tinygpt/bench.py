"""Day 12: measuring inference.

A request's life, as a client watching the stream sees it:

    submit ──── prefill ────▶ token 1 ─▶ token 2 ─▶ ... ─▶ token n
    |<────────── TTFT ─────────>|<ITL>|                    |
    |<──────────────────── end-to-end latency ────────────>|

    TTFT       time to first token: queueing + prefill + the first sampling step
    ITL        inter-token latency: the gap before each later token (n - 1 of them)
    TPOT       time per output token after the first: (t_n - t_1) / (n - 1), the mean ITL
    e2e        end-to-end latency t_n - t_submit = TTFT + (n - 1) * TPOT
    tokens/s   n / e2e for one request (output tokens; the prompt is not counted)
    goodput    requests per second that meet BOTH a TTFT and a TPOT service-level objective

Latencies are reported as percentiles (p50 / p90 / p99) over repeated requests, because tails
matter to users and means hide them. Every timing here synchronizes the device before reading
the clock, runs under torch.inference_mode, and is preceded by warm-up runs.

`python -m tinygpt bench` also runs the comparisons of COURSE.md section 8 side by side in one
process and prints each ratio against its target (never hiding a miss):

    kv_cache_speedup       cached vs uncached generate, 512-token prompt, 128 new tokens
    hf_generate_speedup    tinygpt cached greedy vs transformers LlamaForCausalLM.generate
    decode_bandwidth       bytes a batch-1 decode step must read / step time / bandwidth
    roofline_prediction    tinygpt.roofline's predicted decode step time vs the measured one

On CPU the decode step runs with DecodeStep(pack_weights=True) (oneDNN-prepacked weights,
whose batch-1 products use every core); decode_bandwidth_unpacked shows torch's default
products for comparison. On CUDA the step is compiled (CUDA graphs).

Bandwidth: tinygpt.roofline.measure_copy_bandwidth counts a copy's read and write bytes;
measure_read_bandwidth here only reads (what a decode step does with the weights). Both are
reported, and the utilization target is judged against the HIGHER of the two, so a pass
cannot come from picking the smaller denominator.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tinygpt import flops as F
from tinygpt import roofline as R
from tinygpt.generate import generate, model_device, stream
from tinygpt.kv_cache import DTYPE_NAMES, DecodeStep, KVCache, prefill
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams

SCHEMA_VERSION = 1
PERCENTILES = (50, 90, 99)

# --------------------------------------------------------------------------------------------
# metrics of one request, from streamed timestamps


@dataclass(frozen=True)
class RequestTrace:
    """Timestamps of one streamed request, in seconds of one clock (e.g. time.perf_counter).

    start: when the request was submitted.   token_times: when each new token arrived, in
    order (at least one).   prompt_tokens: the prompt's length.
    """

    start: float
    token_times: tuple[float, ...]
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        times = tuple(float(t) for t in self.token_times)
        if not times:
            raise ValueError("token_times must hold at least one timestamp")
        if times[0] < self.start or any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("token_times must be non-decreasing and not before start")
        object.__setattr__(self, "token_times", times)

    @property
    def n_tokens(self) -> int:
        return len(self.token_times)


def ttft(trace: RequestTrace) -> float:
    """Time to first token: token_times[0] - start."""
    return trace.token_times[0] - trace.start


def inter_token_latencies(trace: RequestTrace) -> list[float]:
    """The n - 1 gaps between consecutive tokens (empty for a one-token request)."""
    times = trace.token_times
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def tpot(trace: RequestTrace) -> float | None:
    """Time per output token after the first: (t_n - t_1) / (n - 1); None when n == 1."""
    if trace.n_tokens < 2:
        return None
    return (trace.token_times[-1] - trace.token_times[0]) / (trace.n_tokens - 1)


def e2e_latency(trace: RequestTrace) -> float:
    """End-to-end latency: last token time - start."""
    return trace.token_times[-1] - trace.start


def tokens_per_second(trace: RequestTrace) -> float:
    """Output tokens per second of one request: n / e2e latency."""
    return trace.n_tokens / e2e_latency(trace)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between order statistics.

    Sorted values v_0 .. v_{n-1}: position p = q / 100 * (n - 1), answer v_floor(p) +
    (p - floor(p)) * (v_ceil(p) - v_floor(p)). Same as numpy.percentile's default.
    """
    if isinstance(q, bool) or not isinstance(q, int | float) or not 0 <= q <= 100:
        raise ValueError(f"q must be a number in [0, 100], got {q!r}")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("values must not be empty")
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def summarize(values: Sequence[float]) -> dict:
    """{"n", "mean", "min", "p50", "p90", "p99", "max"} of a non-empty list of numbers."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("values must not be empty")
    out = {"n": len(values), "mean": statistics.fmean(values), "min": min(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    out["max"] = max(values)
    return out


def meets_slo(trace: RequestTrace, ttft_slo: float, tpot_slo: float) -> bool:
    """TTFT <= ttft_slo and TPOT <= tpot_slo (a one-token request has no TPOT to miss)."""
    per_token = tpot(trace)
    return ttft(trace) <= ttft_slo and (per_token is None or per_token <= tpot_slo)


def goodput(traces: Sequence[RequestTrace], ttft_slo: float, tpot_slo: float,
            duration: float | None = None) -> float:
    """Requests per second that meet both SLOs (seconds): count meeting / duration.

    duration defaults to the span of the run: the last token of any request minus the
    earliest start.
    """
    for name, value in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    if not traces:
        raise ValueError("traces must not be empty")
    if duration is None:
        duration = (max(t.token_times[-1] for t in traces) - min(t.start for t in traces))
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    return sum(meets_slo(t, ttft_slo, tpot_slo) for t in traces) / duration


def request_metrics(traces: Sequence[RequestTrace], ttft_slo: float, tpot_slo: float) -> dict:
    """Percentile summaries of every metric over `traces`, and the goodput under the SLOs.

    Returns {"requests", "ttft_s", "tpot_s", "itl_s", "e2e_s", "tokens_per_s", "slo",
    "slo_met", "goodput_rps"}; each *_s / tokens_per_s entry is a `summarize` dict (tpot_s
    is None when every request produced one token).
    """
    if not traces:
        raise ValueError("traces must not be empty")
    tpots = [v for v in map(tpot, traces) if v is not None]
    itls = [gap for t in traces for gap in inter_token_latencies(t)]
    return {
        "requests": len(traces),
        "ttft_s": summarize([ttft(t) for t in traces]),
        "tpot_s": summarize(tpots) if tpots else None,
        "itl_s": summarize(itls) if itls else None,
        "e2e_s": summarize([e2e_latency(t) for t in traces]),
        "tokens_per_s": summarize([tokens_per_second(t) for t in traces]),
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "slo_met": sum(meets_slo(t, ttft_slo, tpot_slo) for t in traces),
        "goodput_rps": goodput(traces, ttft_slo, tpot_slo),
    }


# --------------------------------------------------------------------------------------------
# measuring


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


# --------------------------------------------------------------------------------------------
# the comparisons of COURSE.md section 8


@dataclass
class Comparison:
    """One side-by-side measurement against a target.

    value: the measured figure (a ratio, or a fraction for utilization / error).
    target: the threshold, read with `direction`: ">=" (value must reach it) or "<=".
    met: whether every condition held; reason: why not (None when met).
    details: everything measured along the way, for the JSON report.
    targeted: False for an extra row shown for information (not a COURSE.md target).
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


def compare_cache(model: TinyGPT, prompt_len: int = 512, new_tokens: int = 128, *,
                  repeats: int = 3, uncached_repeats: int = 1, seed: int = 0,
                  target: float = 5.0) -> Comparison:
    """Cached vs uncached greedy generate on the same prompt: speedup in tokens/s.

    tokens/s = new_tokens / end-to-end seconds (prefill included), median over repeats after
    one short warm-up of each loop. Met when the speedup reaches `target` and both loops
    produced identical tokens.
    """
    device = model_device(model)
    prompt = random_prompt(prompt_len, model.cfg.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    warm = SamplingParams(temperature=0.0, max_new_tokens=2)
    generate(model, prompt, warm, use_cache=True)
    generate(model, prompt, warm, use_cache=False)
    cached_s, cached = _median_run(lambda: generate(model, prompt, params, use_cache=True),
                                   repeats, device)
    uncached_s, uncached = _median_run(
        lambda: generate(model, prompt, params, use_cache=False), uncached_repeats, device)
    speedup = uncached_s / cached_s
    same = cached.token_ids == uncached.token_ids
    met = same and speedup >= target
    reason = None
    if not same:
        reason = "the cached and uncached loops produced different tokens at temperature 0"
    elif not met:
        reason = f"speedup {speedup:.2f}x is below the {target:g}x target"
    return Comparison(
        "kv_cache_speedup", f"cached vs uncached generate, {prompt_len}-token prompt, "
        f"{new_tokens} new tokens, {device}", speedup, target, ">=", "x", met, reason,
        {"cached_tokens_per_s": new_tokens / cached_s,
         "uncached_tokens_per_s": new_tokens / uncached_s, "cached_s": cached_s,
         "uncached_s": uncached_s, "identical_tokens": same, "repeats": repeats,
         "uncached_repeats": uncached_repeats, "model": _model_info(model)})


def compare_hf(model: TinyGPT, prompt_len: int = 32, new_tokens: int = 128, *,
               repeats: int = 5, seed: int = 0, target: float = 1.5,
               name: str = "hf_generate_speedup") -> Comparison:
    """tinygpt cached greedy generate vs transformers LlamaForCausalLM.generate, same weights.

    The HF model comes from tinygpt.model.to_hf_llama (sdpa attention, its DynamicCache,
    greedy, exactly new_tokens tokens). Runs alternate between the two, median of `repeats`
    after a warm-up of each; tokens/s = new_tokens / end-to-end seconds. Met when the tokens
    are identical and tinygpt's tokens/s is at least `target` times HF's.
    """
    from tinygpt.model import to_hf_llama

    device = model_device(model)
    hf = to_hf_llama(model)
    prompt = random_prompt(prompt_len, model.cfg.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def theirs(n: int = new_tokens) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, prompt_len:].tolist()

    def ours() -> list[int]:
        return generate(model, prompt, params).token_ids

    theirs(4)
    generate(model, prompt, SamplingParams(temperature=0.0, max_new_tokens=4))
    ours_s, hf_s = [], []
    ours_ids = hf_ids = None
    for _ in range(repeats):
        seconds, ours_ids = _median_run(ours, 1, device)
        ours_s.append(seconds)
        seconds, hf_ids = _median_run(theirs, 1, device)
        hf_s.append(seconds)
    ours_t, hf_t = statistics.median(ours_s), statistics.median(hf_s)
    speedup = hf_t / ours_t
    same = ours_ids == hf_ids
    met = same and speedup >= target
    reason = None
    if not same:
        first = next(i for i, (a, b) in enumerate(zip(ours_ids, hf_ids, strict=True)) if a != b)
        reason = f"tokens differ from Hugging Face's from new token {first} on"
    elif not met:
        reason = f"speedup {speedup:.2f}x is below the {target:g}x target"
    return Comparison(
        name, f"tinygpt cached greedy vs HF LlamaForCausalLM.generate, batch 1, "
        f"{prompt_len}-token prompt, {new_tokens} new tokens, {device}", speedup, target, ">=",
        "x", met, reason,
        {"tinygpt_tokens_per_s": new_tokens / ours_t, "hf_tokens_per_s": new_tokens / hf_t,
         "tinygpt_s": ours_t, "hf_s": hf_t, "identical_tokens": same, "repeats": repeats,
         "model": _model_info(model)})


def measure_decode_step(model: TinyGPT, context_len: int = 64, steps: int = 20,
                        warmup: int = 3, *, compile: bool = False,
                        pack_weights: bool = False) -> dict:
    """Median seconds of one batch-1 decode step (tinygpt.kv_cache.DecodeStep) after a prefill.

    The cache is prefilled with `context_len` seeded random tokens, then `warmup` untimed and
    `steps` timed steps run, each feeding one token (the device synchronized around each).
    compile / pack_weights: DecodeStep's options (CUDA graphs; prepacked CPU weights).
    Returns {"step_s", "step_s_all" (list), "context_len" (mean keys attended per timed step),
    "bytes_per_step" (flops.decode_step_bytes at that context), "compiled", "compile_note",
    "packed", "pack_note"}.
    """
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"the model's dtype must be one of {list(DTYPE_NAMES)}, got {dtype}")
    total = context_len + warmup + steps
    cache = KVCache.for_model(model, 1, max_len=total,
                              static=compile and device.type == "cuda")
    prompt = torch.tensor([random_prompt(context_len, model.cfg.vocab_size, 1)], device=device)
    prefill(model, cache, prompt)
    step = DecodeStep(model, cache, compile=compile, pack_weights=pack_weights)
    token = prompt[:, -1:]
    for _ in range(warmup):
        step(token)
    seconds = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step(token)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    mean_context = context_len + warmup + (steps + 1) / 2       # keys the timed steps attend
    bytes_per_step = F.decode_step_bytes(model.cfg, 1, round(mean_context), DTYPE_NAMES[dtype])
    return {"step_s": statistics.median(seconds), "step_s_all": seconds,
            "context_len": round(mean_context), "bytes_per_step": bytes_per_step,
            "compiled": step.compiled, "compile_note": step.reason,
            "packed": step.packed, "pack_note": step.pack_reason}


def compare_bandwidth(step: dict, copy_bandwidth: float, read_bandwidth: float, *,
                      target: float = 0.5, device: str = "cpu") -> Comparison:
    """Decode memory-bandwidth utilization: bytes_per_step / step_s / bandwidth.

    Judged against max(copy, read) bandwidth, the better roof this machine showed; the
    utilization against each is in details.
    """
    achieved = step["bytes_per_step"] / step["step_s"]
    roof = max(copy_bandwidth, read_bandwidth)
    utilization = achieved / roof
    met = utilization >= target
    reason = None if met else (f"{achieved / 1e9:.2f} GB/s achieved is {utilization:.0%} of the "
                               f"{roof / 1e9:.2f} GB/s measured, below {target:.0%}")
    return Comparison(
        "decode_bandwidth", f"batch-1 decode step bytes / step time / measured bandwidth, "
        f"{device}", utilization, target, ">=", "fraction", met, reason,
        {"achieved_bytes_per_s": achieved, "copy_bandwidth": copy_bandwidth,
         "read_bandwidth": read_bandwidth, "utilization_vs_copy": achieved / copy_bandwidth,
         "utilization_vs_read": achieved / read_bandwidth, "judged_against": (
             "read" if read_bandwidth >= copy_bandwidth else "copy"), **step})


def compare_roofline(cfg: ModelConfig, step: dict, hw: R.Hardware, dtype: str, *,
                     target: float = 0.30, read_bandwidth: float | None = None) -> Comparison:
    """tinygpt.roofline.decode_estimate's step time vs the measured one: |pred / meas - 1|.

    hw: the machine's measured roofline (roofline.measure_local_roofline). Met when the
    relative error is at most `target`. With read_bandwidth, details also hold the prediction
    on a roofline whose bandwidth is the read-only one.
    """
    estimate = R.decode_estimate(cfg, hw, 1, step["context_len"], dtype)
    error = estimate.seconds / step["step_s"] - 1
    met = abs(error) <= target
    reason = None if met else (f"predicted {estimate.seconds * 1e3:.2f} ms vs measured "
                               f"{step['step_s'] * 1e3:.2f} ms ({error:+.0%})")
    details = {"predicted_s": estimate.seconds, "measured_s": step["step_s"],
               "bound": estimate.bound, "hardware_bandwidth": hw.bandwidth,
               "hardware_peak_flops": hw.peak(dtype), "hardware_source": hw.source}
    if read_bandwidth is not None:
        read_hw = dataclasses.replace(hw, bandwidth=read_bandwidth, source={
            **hw.source, "bandwidth": "measured: read-only sum (tinygpt.bench)"})
        details["predicted_s_read_bandwidth"] = R.decode_estimate(
            cfg, read_hw, 1, step["context_len"], dtype).seconds
    return Comparison(
        "roofline_prediction", f"roofline-predicted vs measured decode step time, {dtype}",
        abs(error), target, "<=", "relative error", met, reason, details)


def median_round(rounds: Sequence[Comparison]) -> Comparison:
    """The round whose value is the median (the upper median for an even count), judged as it
    stands, with every round's value in details["round_values"]. Taking one real round keeps
    the reported step time and bandwidths consistent with each other."""
    if not rounds:
        raise ValueError("rounds must hold at least one Comparison")
    chosen = sorted(rounds, key=lambda c: c.value)[len(rounds) // 2]
    chosen.details["round_values"] = [c.value for c in rounds]
    return chosen


# --------------------------------------------------------------------------------------------
# the benchmark run


def course_model_config() -> ModelConfig:
    """The shape of the course's shipped checkpoint (tinygpt.train.TrainConfig defaults)."""
    return ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       d_ff=352, max_seq_len=1024)


def medium_model_config() -> ModelConfig:
    """A ~31M-parameter Llama-style model (126 MB in fp32), GQA with 4 of 8 heads."""
    return ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                       d_ff=1376, max_seq_len=1024)


def bandwidth_model_config() -> ModelConfig:
    """A ~152M-parameter model (610 MB in fp32) whose weights dwarf its cache and the CPU's
    caches, with matrices large enough (1024 x 2816) that each product streams at close to
    memory bandwidth; smaller models lose a larger share of the step to fixed per-kernel costs.
    """
    return ModelConfig(vocab_size=8192, d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4,
                       d_ff=2816, max_seq_len=1024)


def cuda_bandwidth_model_config() -> ModelConfig:
    """The GPU's bandwidth model: ~1.1B parameters (2.2 GB in bf16), shaped like Llama 3.2 1B
    (d_model 2048, 16 layers, 32 query and 8 KV heads, d_ff 8192) with a 32k vocabulary."""
    return ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                       d_ff=8192, max_seq_len=2048)


def _model_info(model: TinyGPT) -> dict:
    dtype = next(model.parameters()).dtype
    return {"config": dataclasses.asdict(model.cfg), "parameters": F.param_count(model.cfg),
            "weight_bytes": F.weight_bytes(model.cfg, DTYPE_NAMES.get(dtype, "fp32")),
            "dtype": str(dtype), "device": str(model_device(model))}


def _build(cfg: ModelConfig, device: torch.device, seed: int = 0,
           dtype: torch.dtype = torch.float32) -> TinyGPT:
    return TinyGPT(cfg, seed=seed).to(device=device, dtype=dtype).eval()


def run_requests(model: TinyGPT, n_requests: int, new_tokens: int,
                 prompt_lengths: Sequence[int] = (16, 64, 128, 256), *, seed: int = 0,
                 warmup: int = 1) -> list[RequestTrace]:
    """Stream `n_requests` greedy requests one after another; prompts cycle through
    `prompt_lengths` (seeded random ids). Returns their traces (warm-up requests excluded)."""
    F._check_int("n_requests", n_requests)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompts = [random_prompt(prompt_lengths[i % len(prompt_lengths)], model.cfg.vocab_size,
                             seed + i) for i in range(n_requests)]
    for prompt in prompts[:warmup]:
        trace_request(model, prompt, params)
    return [trace_request(model, prompt, params)[0] for prompt in prompts]


def machine_info(threads: int) -> dict:
    """Where the numbers come from: CPU, cores, threads, load, versions."""
    try:
        load = os.getloadavg()
    except (OSError, AttributeError):
        load = None
    return {"platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": threads,
            "load_average_1_5_15": load,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


@dataclass(frozen=True)
class BenchPlan:
    """What run_bench measures, and how hard. bench_plan(quick) gives the two standard plans.

    requests / request_new_tokens / request_prompt_lengths: the streamed-request metrics, on
    the course-sized model.   cache_*: the cached-vs-uncached comparison.   hf_*: the Hugging
    Face comparison (hf_info_model: an extra, untargeted run at another size, or None).
    bandwidth_*: the decode-bandwidth model (fp32 on CPU; on a GPU cuda_bandwidth_model in
    bf16, as COURSE.md section 8 asks), the bytes of the bandwidth-measuring buffers, the
    prefilled context, the timed decode steps per round and the rounds (each round measures
    the bandwidths and then the decode steps, so every ratio divides figures taken seconds
    apart; the median round is reported).   roofline_seconds: budget of
    roofline.measure_local_roofline.
    """

    name: str
    requests: int
    request_new_tokens: int
    request_prompt_lengths: tuple[int, ...]
    request_model: ModelConfig
    cache_model: ModelConfig
    cache_prompt_len: int
    cache_new_tokens: int
    cache_repeats: int
    hf_model: ModelConfig
    hf_prompt_len: int
    hf_new_tokens: int
    hf_repeats: int
    hf_info_model: ModelConfig | None
    bandwidth_model: ModelConfig
    cuda_bandwidth_model: ModelConfig
    bandwidth_bytes: int
    bandwidth_repeats: int
    decode_context: int
    decode_steps: int
    decode_rounds: int
    roofline_seconds: float


def bench_plan(quick: bool = False) -> BenchPlan:
    """The standard plans. Quick: the course-sized model wherever possible, few repeats (a CI
    smoke run, well under a minute on 2 quiet cores). Full: a ~31M model for the cache
    comparison, more repeats and rounds (a few minutes on 2 cores). Both measure bandwidth on
    the 610 MB model of bandwidth_model_config().
    Both keep the targets' workloads: 512 + 128 tokens for the cache, 128 new tokens for HF."""
    course = course_model_config()
    return BenchPlan(
        name="quick" if quick else "full",
        requests=8 if quick else 24, request_new_tokens=32 if quick else 64,
        request_prompt_lengths=(16, 64, 128, 256), request_model=course,
        cache_model=course if quick else medium_model_config(), cache_prompt_len=512,
        cache_new_tokens=128, cache_repeats=3,
        hf_model=course, hf_prompt_len=32, hf_new_tokens=128, hf_repeats=3 if quick else 5,
        hf_info_model=None if quick else medium_model_config(),
        bandwidth_model=bandwidth_model_config(),
        cuda_bandwidth_model=cuda_bandwidth_model_config(),
        bandwidth_bytes=2**28, bandwidth_repeats=3 if quick else 5,
        decode_context=64, decode_steps=10 if quick else 30, decode_rounds=3 if quick else 5,
        roofline_seconds=1.0 if quick else 4.0)


def run_bench(plan: BenchPlan | None = None, *, device: str = "cpu",
              threads: int | None = None, ttft_slo: float = 0.1, tpot_slo: float = 0.02,
              seed: int = 0, log: Callable[[str], None] = print) -> tuple[dict, RequestTrace]:
    """Run every measurement of `plan` (default: the full plan); returns (report dict, the
    trace of one request, for a timeline plot).

    device: where the models run ("cpu" for the course's CPU targets; on "cuda" the decode
    step is compiled and the bandwidth target is 60%). threads: torch threads (default: the
    number of usable cores).

    The report: {"schema_version", "tool", "created_utc", "plan", "machine", "settings",
    "requests" (request_metrics + "model"), "comparisons" (Comparison dicts),
    "all_targets_met" (over the targeted comparisons), "seconds"}.
    """
    plan = bench_plan(False) if plan is None else plan
    began = time.perf_counter()
    if threads is None:
        threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
    F._check_int("threads", threads)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    comparisons: list[Comparison] = []

    models: dict[ModelConfig, TinyGPT] = {}

    def model(cfg: ModelConfig) -> TinyGPT:
        if cfg not in models:
            models[cfg] = _build(cfg, dev, seed)
        return models[cfg]

    log("requests: streamed timings ...")
    traces = run_requests(model(plan.request_model), plan.requests, plan.request_new_tokens,
                          plan.request_prompt_lengths, seed=seed)
    requests = request_metrics(traces, ttft_slo, tpot_slo)
    requests["model"] = _model_info(model(plan.request_model))

    log(f"kv_cache_speedup: cached vs uncached, {plan.cache_prompt_len} + "
        f"{plan.cache_new_tokens} tokens ...")
    comparisons.append(compare_cache(model(plan.cache_model), plan.cache_prompt_len,
                                     plan.cache_new_tokens, repeats=plan.cache_repeats,
                                     seed=seed))

    log("hf_generate_speedup: tinygpt vs transformers generate ...")
    comparisons.append(compare_hf(model(plan.hf_model), plan.hf_prompt_len, plan.hf_new_tokens,
                                  repeats=plan.hf_repeats, seed=seed))
    if plan.hf_info_model is not None:
        info = compare_hf(model(plan.hf_info_model), plan.hf_prompt_len, plan.hf_new_tokens,
                          repeats=plan.hf_repeats, seed=seed,
                          name=f"hf_generate_speedup_{F.param_count(plan.hf_info_model) // 10**6}m")
        info.description += " (for information: a larger, more bandwidth-bound model)"
        info.targeted = False
        comparisons.append(info)
    models.clear()

    log("roofline_prediction: this machine's measured roofline ...")
    on_cpu = dev.type == "cpu"
    big = (_build(plan.bandwidth_model, dev, seed) if on_cpu else
           _build(plan.cuda_bandwidth_model, dev, seed, torch.bfloat16))
    dtype = DTYPE_NAMES[next(big.parameters()).dtype]
    hw = R.measure_local_roofline(plan.roofline_seconds, device=dev, dtypes=(dtype,))

    log(f"decode_bandwidth: {plan.decode_rounds} rounds of bandwidth + decode step ...")
    bw_target = 0.5 if on_cpu else 0.6
    packed, unpacked, predicted = [], [], []
    for _ in range(plan.decode_rounds):
        copy_bw = R.measure_copy_bandwidth(plan.bandwidth_bytes,
                                           repeats=plan.bandwidth_repeats, device=dev)
        read_bw = measure_read_bandwidth(plan.bandwidth_bytes, repeats=plan.bandwidth_repeats,
                                         device=dev)
        step = measure_decode_step(big, plan.decode_context, steps=plan.decode_steps,
                                   compile=not on_cpu, pack_weights=on_cpu)
        step["model"] = _model_info(big)
        packed.append(compare_bandwidth(step, copy_bw, read_bw, target=bw_target,
                                        device=str(dev)))
        # the roofline's bandwidth term, re-measured (the same copy) beside this round's step
        round_hw = dataclasses.replace(hw, bandwidth=copy_bw, source={
            **hw.source, "bandwidth": f"measured: median of {plan.bandwidth_repeats} copies "
                                      f"of {plan.bandwidth_bytes / 2**20:g} MiB on {dev}, "
                                      f"read + write bytes counted, beside the decode steps"})
        predicted.append(compare_roofline(big.cfg, step, round_hw, dtype,
                                          read_bandwidth=read_bw))
        if on_cpu:      # for information: torch's default products, without packing
            plain = measure_decode_step(big, plan.decode_context, steps=plan.decode_steps)
            plain["model"] = _model_info(big)
            unpacked.append(compare_bandwidth(plain, copy_bw, read_bw, target=bw_target,
                                              device=str(dev)))
    comparisons.append(median_round(packed))
    if on_cpu:
        info = median_round(unpacked)
        info.name, info.targeted = "decode_bandwidth_unpacked", False
        info.description += " (for information: torch's default products, unpacked weights)"
        comparisons.append(info)
    roofline = median_round(predicted)
    roofline.details["local_roofline_bandwidth"] = hw.bandwidth
    comparisons.append(roofline)

    report = {
        "schema_version": SCHEMA_VERSION,
        "tool": "python -m tinygpt bench",
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "plan": plan.name,
        "machine": machine_info(threads),
        "settings": {"device": str(dev), "threads": threads, "seed": seed,
                     "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo},
        "requests": requests,
        "comparisons": [dataclasses.asdict(c) for c in comparisons],
        "all_targets_met": all(c.met for c in comparisons if c.targeted),
        "seconds": time.perf_counter() - began,
    }
    return report, traces[0]


# --------------------------------------------------------------------------------------------
# output: table, JSON, timeline plot


def _format_value(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.1%}"


def format_table(report: dict) -> str:
    """The report as readable text: request percentiles, then one row per comparison."""
    lines = []
    machine = report["machine"]
    lines.append(f"tinygpt bench ({report['plan']}) on "
                 f"{report['settings']['device']}, {machine['torch_threads']} threads, "
                 f"{machine['cpu_count']} CPUs, load average {machine['load_average_1_5_15']}")
    load = machine["load_average_1_5_15"]
    if load and load[0] > (machine["cpu_count"] or 1):
        lines.append(f"WARNING: the machine was loaded (1-minute load average {load[0]:.1f} on "
                     f"{machine['cpu_count']} CPUs): timings are noisy and ratios unreliable")
    req = report["requests"]
    lines.append(f"\nrequests: {req['requests']} streamed greedy requests, "
                 f"{req['model']['parameters']:,}-parameter model")
    lines.append(f"  {'metric':<14}{'p50':>11}{'p90':>11}{'p99':>11}{'mean':>11}")
    for key, label, scale, unit in (("ttft_s", "TTFT", 1e3, "ms"), ("tpot_s", "TPOT", 1e3, "ms"),
                                    ("itl_s", "ITL", 1e3, "ms"), ("e2e_s", "e2e", 1e3, "ms"),
                                    ("tokens_per_s", "tokens/s", 1, "")):
        summary = req[key]
        if summary is None:
            continue
        cells = "".join(f"{summary[k] * scale:>9.2f}{unit:>2}" for k in ("p50", "p90", "p99",
                                                                          "mean"))
        lines.append(f"  {label:<14}{cells}")
    slo = req["slo"]
    lines.append(f"  goodput {req['goodput_rps']:.2f} requests/s meeting TTFT <= "
                 f"{slo['ttft_s'] * 1e3:g} ms and TPOT <= {slo['tpot_s'] * 1e3:g} ms "
                 f"({req['slo_met']}/{req['requests']} requests)")
    lines.append("")
    header = f"{'comparison':<30}{'measured':>12}{'target':>12}  result"
    lines.append(header)
    lines.append("-" * len(header))
    for c in report["comparisons"]:
        target = f"{c['direction']} {_format_value(c['target'], c['unit'])}"
        result = "met" if c["met"] else f"NOT MET: {c['reason']}"
        if not c["targeted"]:
            result = f"(information only) {result}"
        lines.append(f"{c['name']:<30}{_format_value(c['value'], c['unit']):>12}{target:>12}  "
                     f"{result}")
    for c in report["comparisons"]:
        d = c["details"]
        if c["name"].startswith("decode_bandwidth"):
            layout = " (prepacked weights)" if d.get("packed") else ""
            lines.append(f"\n{c['name']}{layout}: {d['bytes_per_step'] / 1e6:.1f} MB per step in "
                         f"{d['step_s'] * 1e3:.2f} ms = {d['achieved_bytes_per_s'] / 1e9:.2f} "
                         f"GB/s; {d['utilization_vs_copy']:.0%} of copy bandwidth "
                         f"{d['copy_bandwidth'] / 1e9:.2f} GB/s (read + write counted), "
                         f"{d['utilization_vs_read']:.0%} of read-only bandwidth "
                         f"{d['read_bandwidth'] / 1e9:.2f} GB/s; judged against the "
                         f"{d['judged_against']} figure, the higher one")
            for note in ("compile_note", "pack_note"):
                if d.get(note):
                    lines.append(f"  note: {d[note]}")
        if c["name"].startswith("hf_generate") or c["name"] == "kv_cache_speedup":
            rates = {k: v for k, v in d.items() if k.endswith("tokens_per_s")}
            text = ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:.1f} tokens/s"
                             for k, v in rates.items())
            lines.append(f"{c['name']}: {text}; {d['model']['parameters']:,} parameters; "
                         f"identical tokens: {d['identical_tokens']}")
    lines.append(f"\nall targets met: {report['all_targets_met']} "
                 f"({report['seconds']:.0f} s)")
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    """Write the report as indented JSON (no NaN: missing values are null)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, allow_nan=False)
        handle.write("\n")


def plot_timeline(trace: RequestTrace, ax=None, *, title: str | None = None):
    """Timeline of one request: TTFT span, then a tick per token, and each ITL as a bar.

    Returns the matplotlib Figure (two stacked Axes when ax is None; with an ax, only the
    timeline is drawn on it). Built without pyplot, so no GUI is needed.
    """
    from matplotlib.figure import Figure

    times_ms = [(t - trace.start) * 1e3 for t in trace.token_times]
    if ax is None:
        fig = Figure(figsize=(8, 4.5))
        ax, ax_itl = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1, 2]})
    else:
        fig, ax_itl = ax.figure, None
    ax.axvspan(0, times_ms[0], color="tab:orange", alpha=0.3,
               label=f"TTFT {times_ms[0]:.1f} ms (prefill)")
    ax.vlines(times_ms, 0, 1, color="tab:blue", linewidth=1, label="token streamed")
    ax.set_yticks([])
    ax.set_xlabel("ms since the request was submitted")
    ax.set_xlim(0, times_ms[-1] * 1.02)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or f"one request: {trace.prompt_tokens}-token prompt, "
                 f"{trace.n_tokens} new tokens, e2e {times_ms[-1]:.1f} ms")
    if ax_itl is not None:
        gaps = [g * 1e3 for g in inter_token_latencies(trace)]
        if gaps:
            ax_itl.bar(range(2, len(gaps) + 2), gaps, color="tab:blue", width=0.8)
            per_token = tpot(trace) * 1e3
            ax_itl.axhline(per_token, color="black", linestyle="--",
                           label=f"TPOT {per_token:.2f} ms")
            ax_itl.legend(fontsize=8)
        ax_itl.set_xlabel("token index")
        ax_itl.set_ylabel("ITL (ms)")
        fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m tinygpt bench`."""
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt bench",
        description="Measure TTFT, TPOT, tokens/s, goodput and the course's speed targets "
                    "(COURSE.md section 8) side by side; print a table, optionally write JSON.")
    parser.add_argument("--quick", action="store_true",
                        help="small models and few repeats: a CI smoke run under a minute")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the JSON report")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="save a timeline plot of one request (PNG)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (the course's targets), cuda or mps (default cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the number of usable cores)")
    parser.add_argument("--ttft-slo", type=float, default=0.1, help="TTFT SLO in s (0.1)")
    parser.add_argument("--tpot-slo", type=float, default=0.02, help="TPOT SLO in s (0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when a target is not met")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt bench [--quick] [--json PATH] ...`; see build_parser()."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import tinygpt

    try:
        device = tinygpt.pick_device(args.device)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        for name, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report, trace = run_bench(bench_plan(args.quick), device=str(device), threads=args.threads,
                              ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, seed=args.seed,
                              log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_timeline(trace).savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 1 if args.strict and not report["all_targets_met"] else 0
