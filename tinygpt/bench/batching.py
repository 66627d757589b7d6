"""Day 13's row: batched decode. A decode step reads every weight once whatever the batch, so
B sequences per step should cost little more than one until the products stop being bound
by memory bandwidth (the roofline's critical batch).

    batched_decode   tokens/s at batch 16 over batch 1 on the 152M-parameter model (CPU, the
                     packed step), with every row's greedy tokens equal to its batch-1 run;
                     on CUDA: batch 32 over 1 on the ~1B bf16 model
"""

from __future__ import annotations

import statistics
import time

import torch

from tinygpt.bench.harness import Comparison, synchronize
from tinygpt.bench.models import bandwidth_model_config, model_info
from tinygpt.bench.registry import BenchContext, register
from tinygpt.kv_cache import DecodeStep, KVCache, prefill


def greedy_decode(model, prompts: torch.Tensor, steps: int, *, pack: bool,
                  warmup: int = 2) -> tuple[float, list[list[int]]]:
    """Prefill prompts (B, T), then `warmup` + `steps` greedy decode steps with
    DecodeStep; returns (median seconds of one timed step, each row's generated tokens)."""
    batch, length = prompts.shape
    device = prompts.device
    cache = KVCache.for_model(model, batch, max_len=length + warmup + steps + 1)
    with torch.inference_mode():
        token = torch.argmax(prefill(model, cache, prompts), dim=-1, keepdim=True)
        step = DecodeStep(model, cache, pack_weights=pack)
        tokens, seconds = [token], []
        for i in range(warmup + steps):
            synchronize(device)
            start = time.perf_counter()
            token = torch.argmax(step(token), dim=-1, keepdim=True)
            synchronize(device)
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
            tokens.append(token)
    ids = torch.cat(tokens, dim=1).tolist()
    return statistics.median(seconds), ids


@register("batched_decode", day=13)
def batched_decode(ctx: BenchContext) -> list[Comparison]:
    """Batched decode: tokens/s at batch 16 over batch 1 (CPU; 32 over 1 on CUDA)."""
    cpu = ctx.on_cpu
    cfg = bandwidth_model_config() if cpu else ctx.plan.cuda_bandwidth_model
    model = ctx.build(cfg) if cpu else ctx.build(cfg, torch.bfloat16)
    big, target = (16, 6.0) if cpu else (32, 20.0)
    steps, compared = (6, 2) if ctx.quick else (16, big)
    ctx.log(f"batched_decode: batch {big} against batch 1, {steps} steps ...")
    g = torch.Generator().manual_seed(ctx.seed)
    prompts = torch.randint(0, cfg.vocab_size, (big, 32), generator=g).to(ctx.device)
    one_s, _ = greedy_decode(model, prompts[:1], steps, pack=cpu)
    many_s, many_ids = greedy_decode(model, prompts, steps, pack=cpu)
    same = all(greedy_decode(model, prompts[i:i + 1], steps, pack=cpu)[1][0] == many_ids[i]
               for i in range(compared))
    ratio = (big / many_s) / (1 / one_s)
    met = same and ratio >= target
    reason = None if met else ("rows' tokens differ from their batch-1 runs" if not same else
                               f"{ratio:.2f}x is below the {target:g}x target")
    details = {"batch": big, "step_s_batch1": one_s, f"step_s_batch{big}": many_s,
               "tokens_per_s_batch1": 1 / one_s, f"tokens_per_s_batch{big}": big / many_s,
               "identical_tokens": same, "rows_compared": compared, "steps": steps,
               "packed": cpu, "model": model_info(model),
               "summary": f"batch 1 {1 / one_s:.1f} tokens/s, batch {big} {big / many_s:.1f} "
                          f"tokens/s (step {one_s * 1e3:.1f} -> {many_s * 1e3:.1f} ms); "
                          f"{compared} rows identical to batch 1: {same}"}
    return [Comparison("batched_decode", f"greedy decode tokens/s, batch {big} over batch 1, "
                       f"{model_info(model)['parameters'] / 1e6:.0f}M model, {ctx.device}",
                       ratio, target, ">=", "x", met, reason, details)]
