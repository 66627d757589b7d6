"""Day 11's rows on a GPU: the decode loop captured in CUDA graphs (tinygpt.captured).

On the plan's GPU model in bf16 (the full plan's: ~1B parameters,
models.cuda_bandwidth_model_config), a 512-token prompt and 128 new tokens. The first four
rows are measured in rounds, each beside a fresh copy-bandwidth measurement, and each row keeps
its own median round (harness.median_round, chosen per row, so two rows may come from different
rounds); captured_new_lengths and captured_step_compiled are single runs:

    captured_step_bandwidth   batch 1: bytes a step must read (flops.decode_step_bytes) over
                              the replayed step's time, over the copy bandwidth (>= 70%)
    captured_greedy           end-to-end greedy (prefill, first token, 127 replays, one copy
                              back), the same bytes per generated token (>= 65%)
    captured_sampled          the same with temperature 0.8, top-p 0.9 on the device (>= 60%)
    captured_batch32          the batch-32 step's time over the batch-1 step's (<= 1.3x)
    captured_new_lengths      16 prompts of 16 lengths, one after another, every bucket's
                              graph captured first (as a server starts): the slowest of the
                              2nd to 16th per-token decode times over the median (<= 1.5x)
    captured_step_compiled    information: the batch-1 step with compile=True (torch.compile's
                              fused kernels inside the captured graph; one compilation)

CUDA only: on other devices the group says so and returns no rows. measure_steps and
measure_generate take a CapturedDecoder; one built with capture=False (the default off CUDA)
runs its steps eagerly, which is how tests/test_captured.py runs them on the CPU.
"""

from __future__ import annotations

import statistics
import time

import torch

from tinygpt import flops as F
from tinygpt import roofline as R
from tinygpt.bench.harness import Comparison, median_round, synchronize
from tinygpt.bench.models import model_info
from tinygpt.bench.registry import BenchContext, register
from tinygpt.captured import CapturedDecoder
from tinygpt.kv_cache import DTYPE_NAMES
from tinygpt.model import TinyGPT
from tinygpt.sampling import SamplingParams

STEP_TARGET, GREEDY_TARGET, SAMPLED_TARGET = 0.70, 0.65, 0.60
BATCH_TARGET, LENGTHS_TARGET = 1.3, 1.5
PROMPT, NEW_TOKENS, BIG_BATCH = 512, 128, 32
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)


def _prompt(model: TinyGPT, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=g)


def measure_steps(decoder: CapturedDecoder, prompt: torch.Tensor, steps: int,
                  warmup: int = 3) -> float:
    """Seconds per decode step: start(prompt), `warmup` steps (they capture), then `steps`
    steps with the device synchronized only before and after them."""
    device = decoder.device
    decoder.start(prompt, GREEDY, seed=0)
    for _ in range(warmup):
        decoder.step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def measure_generate(decoder: CapturedDecoder, prompt: torch.Tensor,
                     params: SamplingParams, new_tokens: int, seed: int = 0) -> float:
    """Seconds of one whole generate() (prefill, first token, the steps, the copy back)."""
    synchronize(decoder.device)
    start = time.perf_counter()
    decoder.generate(prompt, params, new_tokens, seed=seed)
    return time.perf_counter() - start


def _bandwidth_row(name: str, description: str, seconds_per_token: float, bytes_per_token: int,
                   copy: float, target: float, details: dict) -> Comparison:
    achieved = bytes_per_token / seconds_per_token
    share = achieved / copy
    met = share >= target
    reason = None if met else (f"{achieved / 1e9:.0f} GB/s is {share:.0%} of the {copy / 1e9:.0f}"
                               f" GB/s copy bandwidth, below {target:.0%}")
    return Comparison(name, description, share, target, ">=", "fraction", met, reason,
                      {"seconds_per_token": seconds_per_token, "bytes_per_token":
                       bytes_per_token, "achieved_bytes_per_s": achieved,
                       "copy_bandwidth": copy, **details})


def _ratio_row(name: str, description: str, value: float, target: float, details: dict
               ) -> Comparison:
    met = value <= target
    reason = None if met else f"{value:.2f}x is above {target:g}x"
    return Comparison(name, description, value, target, "<=", "x", met, reason, details)


@register("captured_decode", day=11)
def captured_decode_rows(ctx: BenchContext) -> list[Comparison]:
    """CUDA graphs: the captured decode loop against the GPU's copy bandwidth (CUDA only).

    Batch 1 and 32, greedy and sampled generation, and new prompt lengths; see the module's
    docstring for the rows."""
    if ctx.device.type != "cuda":
        return ctx.skip("captured_decode", f"CUDA graphs need a GPU, not {ctx.device}")
    return measured_rows(ctx)


def measured_rows(ctx: BenchContext, compiled: bool = True) -> list[Comparison]:
    """The group's rows on ctx's device (off CUDA the steps run eagerly: the tests' check of
    this code); compiled=False leaves out the compiled step's row."""
    plan, dev = ctx.plan, ctx.device
    model = ctx.build(plan.cuda_bandwidth_model, torch.bfloat16)
    dtype = DTYPE_NAMES[torch.bfloat16]
    prompt_len, new_tokens = sizes(model)
    max_len = prompt_len + new_tokens
    rounds = 1 if ctx.quick else 3
    one = CapturedDecoder(model, 1, max_len)
    big = CapturedDecoder(model, BIG_BATCH, max_len)
    prompt = _prompt(model, 1, prompt_len, ctx.seed)
    prompts = _prompt(model, BIG_BATCH, prompt_len, ctx.seed)
    context = prompt_len + new_tokens // 2                  # keys a mean step attends
    per_token = F.decode_step_bytes(model.cfg, 1, context, dtype)
    info = {"model": model_info(model), "prompt": prompt_len, "new_tokens": new_tokens,
            "buckets": one.buckets}
    ctx.log(f"captured_decode: {rounds} round(s) of copy bandwidth, steps at batch 1 and "
            f"{BIG_BATCH}, greedy and sampled generation ...")
    rows: dict[str, list[Comparison]] = {}
    for _ in range(rounds):
        copy = R.measure_copy_bandwidth(plan.bandwidth_bytes, repeats=plan.bandwidth_repeats,
                                        device=dev)
        step_1 = measure_steps(one, prompt, new_tokens - 4)
        step_32 = measure_steps(big, prompts, new_tokens - 4)
        greedy = measure_generate(one, prompt, GREEDY, new_tokens) / new_tokens
        sampled = measure_generate(one, prompt, SAMPLED, new_tokens, ctx.seed) / new_tokens
        for row in (
            _bandwidth_row("captured_step_bandwidth", "captured decode step, batch 1, bytes "
                           "read / step time / copy bandwidth", step_1, per_token, copy,
                           STEP_TARGET, {**info, "captures": one.captures}),
            _bandwidth_row("captured_greedy", f"captured greedy generate, batch 1, "
                           f"{prompt_len} + {new_tokens} tokens, step bytes x tokens / time / "
                           f"copy bandwidth", greedy, per_token, copy, GREEDY_TARGET, info),
            _bandwidth_row("captured_sampled", "captured sampled generate (T 0.8, top-p 0.9 on "
                           "the device), the same", sampled, per_token, copy, SAMPLED_TARGET,
                           info),
            _ratio_row("captured_batch32", f"captured step at batch {BIG_BATCH} over batch 1",
                       step_32 / step_1, BATCH_TARGET, {**info, "step_1_s": step_1,
                                                        "step_32_s": step_32}),
        ):
            rows.setdefault(row.name, []).append(row)
    out = [median_round(r) for r in rows.values()]
    out.append(_new_lengths_row(ctx, model, max_len, prompt_len, new_tokens))
    if compiled:
        out.append(_compiled_row(ctx, model, prompt, max_len, new_tokens, per_token))
    return out


def sizes(model: TinyGPT) -> tuple[int, int]:
    """(prompt, new tokens): 512 and 128, or for a model with a shorter window (the tests'
    tiny ones) half and a quarter of it."""
    window = model.cfg.max_seq_len
    if window >= PROMPT + NEW_TOKENS:
        return PROMPT, NEW_TOKENS
    return window // 2, window // 4


def _new_lengths_row(ctx: BenchContext, model: TinyGPT, max_len: int, prompt_len: int,
                     new_tokens: int) -> Comparison:
    """16 prompts of 16 lengths through one decoder: per-token decode time of each."""
    decoder = CapturedDecoder(model, 1, max_len)
    lengths = sorted({max(1, prompt_len * (i + 4) // 20) for i in range(16)})  # 102 .. 486
    ctx.log(f"captured_decode: {len(lengths)} prompts of as many lengths ...")
    start = time.perf_counter()
    decoder.capture_all()                   # at start-up, as a server would
    capture_s = time.perf_counter() - start
    steps = min(32, new_tokens // 2)
    times = [measure_steps(decoder, _prompt(model, 1, n, ctx.seed + n), steps, warmup=0)
             for n in lengths]
    steady = statistics.median(times)
    worst = max(times[1:]) / steady
    return _ratio_row("captured_new_lengths", "captured decode, 16 prompts of 16 lengths: "
                      "slowest per-token time of the 2nd to 16th over the median", worst,
                      LENGTHS_TARGET, {"lengths": lengths, "seconds_per_token": times,
                                       "captures": decoder.captures, "capture_all_s":
                                       capture_s, "buckets": decoder.buckets})


def _compiled_row(ctx: BenchContext, model: TinyGPT, prompt: torch.Tensor, max_len: int,
                  new_tokens: int, per_token: int) -> Comparison:
    """Information: the batch-1 step with compile=True, positions in one bucket."""
    ctx.log("captured_decode: compiling the step (torch.compile, one bucket) ...")
    decoder = CapturedDecoder(model, 1, max_len, bucket=max_len, compile=True)
    start = time.perf_counter()
    step = measure_steps(decoder, prompt, new_tokens - 4)
    copy = R.measure_copy_bandwidth(ctx.plan.bandwidth_bytes,
                                    repeats=ctx.plan.bandwidth_repeats, device=ctx.device)
    row = _bandwidth_row("captured_step_compiled", "information: the captured step compiled "
                         "first (torch.compile), batch 1", step, per_token, copy, STEP_TARGET,
                         {"model": model_info(model), "compile_and_run_s":
                          time.perf_counter() - start})
    row.targeted = False
    return row
