"""The rows of days 11 and 12: the KV cache, Hugging Face generate, decode bandwidth and the
roofline's prediction. run.py calls each group once (see run_bench); decode_bandwidth_rows
measures the bandwidths and the decode step in interleaved rounds and reports each row's median
round.

    kv_cache_speedup       cached vs uncached generate, 512-token prompt, 128 new tokens
    hf_generate_speedup    tinygpt cached greedy vs transformers LlamaForCausalLM.generate
    decode_bandwidth       bytes a batch-1 decode step must read / step time / bandwidth
    roofline_prediction    tinygpt.roofline's predicted decode step time vs the measured one
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from tinygpt import flops as F
from tinygpt import roofline as R
from tinygpt.bench.harness import (
    Comparison,
    _median_run,
    bandwidth_verdict,
    measure_read_bandwidth,
    median_round,
    random_prompt,
    synchronize,
)
from tinygpt.bench.models import model_info
from tinygpt.bench.registry import BenchContext, register
from tinygpt.generate import generate, model_device
from tinygpt.kv_cache import DTYPE_NAMES, DecodeStep, KVCache, prefill
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams


def compare_cache(model: TinyGPT, prompt_len: int = 512, new_tokens: int = 128, *,
                  repeats: int = 3, uncached_repeats: int = 1, seed: int = 0,
                  target: float = 5.0) -> Comparison:
    """Cached vs uncached greedy generate on the same prompt: speedup in tokens/s.

    tokens/s = new_tokens / end-to-end seconds (prefill included), after one short warm-up of
    each loop: the cached loop's median over `repeats` runs, the uncached loop's over
    `uncached_repeats` (one by default, in both plans: it is the slow loop, one run costs
    the time of many cached ones). Met when the speedup reaches `target` and both loops
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
         "uncached_repeats": uncached_repeats, "model": model_info(model)})


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
         "model": model_info(model)})


def measure_decode_step(model: TinyGPT, context_len: int = 64, steps: int = 20,
                        warmup: int = 3, *, compile: bool = False,
                        pack_weights: bool = False, tiled: bool = True) -> dict:
    """Median seconds of one batch-1 decode step (tinygpt.kv_cache.DecodeStep) after a prefill.

    The cache is prefilled with `context_len` seeded random tokens, then `warmup` untimed and
    `steps` timed steps run, each feeding one token (the device synchronized around each).
    compile / pack_weights / tiled: DecodeStep's options (CUDA graphs; oneDNN-prepacked CPU
    weights; the tiled CPU kernels, on by default).
    Returns {"step_s", "step_s_all" (list), "context_len" (mean keys attended per timed step),
    "bytes_per_step" (flops.decode_step_bytes at that context), "compiled", "compile_note",
    "packed", "pack_note", "tiled", "tiled_note"}.
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
    step = DecodeStep(model, cache, compile=compile, pack_weights=pack_weights, tiled=tiled)
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
            "packed": step.packed, "pack_note": step.pack_reason, "tiled": step.tiled,
            "tiled_note": step.tiled_reason}


def compare_bandwidth(step: dict, copy_bandwidth: float, read_bandwidth: float, *,
                      target: float = 0.5, device: str = "cpu") -> Comparison:
    """Decode memory-bandwidth utilization: bytes_per_step / step_s / bandwidth.

    Judged against max(copy, read) bandwidth, the better roof this machine showed; the
    utilization against each is in details. A share above 100% is NOT MET: the roof was
    measured too low (harness.bandwidth_verdict).
    """
    achieved = step["bytes_per_step"] / step["step_s"]
    utilization, against, reason = bandwidth_verdict(achieved, copy_bandwidth, read_bandwidth,
                                                     target)
    met = reason is None
    return Comparison(
        "decode_bandwidth", f"batch-1 decode step bytes / step time / measured bandwidth, "
        f"{device}", utilization, target, ">=", "fraction", met, reason,
        {"achieved_bytes_per_s": achieved, "copy_bandwidth": copy_bandwidth,
         "read_bandwidth": read_bandwidth, "utilization_vs_copy": achieved / copy_bandwidth,
         "utilization_vs_read": achieved / read_bandwidth, "judged_against": against,
         **step})


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



# --------------------------------------------------------------------------------------------
# the row groups


@register("kv_cache", day=11)
def kv_cache_rows(ctx: BenchContext) -> list[Comparison]:
    """KV cache vs no cache: cached and uncached generate on one prompt, tokens/s."""
    plan = ctx.plan
    ctx.log(f"kv_cache_speedup: cached vs uncached, {plan.cache_prompt_len} + "
            f"{plan.cache_new_tokens} tokens ...")
    return [compare_cache(ctx.build(plan.cache_model), plan.cache_prompt_len,
                          plan.cache_new_tokens, repeats=plan.cache_repeats, seed=ctx.seed)]


@register("hf_generate", day=11)
def hf_generate_rows(ctx: BenchContext) -> list[Comparison]:
    """tinygpt's cached greedy generate vs Hugging Face transformers' generate."""
    plan = ctx.plan
    ctx.log("hf_generate_speedup: tinygpt vs transformers generate ...")
    rows = [compare_hf(ctx.build(plan.hf_model), plan.hf_prompt_len, plan.hf_new_tokens,
                       repeats=plan.hf_repeats, seed=ctx.seed)]
    if plan.hf_info_model is not None:
        info = compare_hf(ctx.build(plan.hf_info_model), plan.hf_prompt_len, plan.hf_new_tokens,
                          repeats=plan.hf_repeats, seed=ctx.seed,
                          name=f"hf_generate_speedup_{F.param_count(plan.hf_info_model) // 10**6}m")
        info.description += " (for information: a larger, more bandwidth-bound model)"
        info.targeted = False
        rows.append(info)
    return rows


@register("decode_bandwidth", day=12)
def decode_bandwidth_rows(ctx: BenchContext) -> list[Comparison]:
    """Decode memory-bandwidth utilization and the roofline's predicted step time.

    Each round measures the copy and read bandwidths and then the decode step, so every ratio
    divides figures taken seconds apart; the median round is reported. On CPU the step runs on
    the default tiled products (tinygpt.cpu_kernels; for information also on torch's plain
    products); on CUDA compiled.
    """
    plan, dev = ctx.plan, ctx.device
    ctx.log("roofline_prediction: this machine's measured roofline ...")
    big = (ctx.build(plan.bandwidth_model) if ctx.on_cpu else
           ctx.build(plan.cuda_bandwidth_model, torch.bfloat16))
    dtype = DTYPE_NAMES[next(big.parameters()).dtype]
    hw = R.measure_local_roofline(plan.roofline_seconds, device=dev, dtypes=(dtype,))

    ctx.log(f"decode_bandwidth: {plan.decode_rounds} rounds of bandwidth + decode step ...")
    bw_target = 0.5 if ctx.on_cpu else 0.6
    packed, unpacked, predicted = [], [], []
    for _ in range(plan.decode_rounds):
        copy_bw = R.measure_copy_bandwidth(plan.bandwidth_bytes,
                                           repeats=plan.bandwidth_repeats, device=dev)
        read_bw = measure_read_bandwidth(plan.bandwidth_bytes, repeats=plan.bandwidth_repeats,
                                         device=dev)
        step = measure_decode_step(big, plan.decode_context, steps=plan.decode_steps,
                                   compile=not ctx.on_cpu)
        step["model"] = model_info(big)
        packed.append(compare_bandwidth(step, copy_bw, read_bw, target=bw_target,
                                        device=str(dev)))
        # the roofline's bandwidth term, re-measured (the same copy) beside this round's step
        round_hw = dataclasses.replace(hw, bandwidth=copy_bw, source={
            **hw.source, "bandwidth": f"measured: median of {plan.bandwidth_repeats} copies "
                                      f"of {plan.bandwidth_bytes / 2**20:g} MiB on {dev}, "
                                      f"read + write bytes counted, beside the decode steps"})
        predicted.append(compare_roofline(big.cfg, step, round_hw, dtype,
                                          read_bandwidth=read_bw))
        if ctx.on_cpu:      # for information: torch's plain products (tiled=False)
            plain = measure_decode_step(big, plan.decode_context, steps=plan.decode_steps,
                                        tiled=False)
            plain["model"] = model_info(big)
            unpacked.append(compare_bandwidth(plain, copy_bw, read_bw, target=bw_target,
                                              device=str(dev)))
    rows = [median_round(packed)]
    if ctx.on_cpu:
        info = median_round(unpacked)
        info.name, info.targeted = "decode_bandwidth_unpacked", False
        info.description += " (for information: torch's plain products, tiled=False)"
        rows.append(info)
    roofline = median_round(predicted)
    roofline.details["local_roofline_bandwidth"] = hw.bandwidth
    rows.append(roofline)
    return rows
