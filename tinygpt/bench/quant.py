"""Day 15's rows: decode steps on quantized weights against the float32 step, side by side with
torchao's implementation of the same schemes.

    quant_int8_decode     int8 per-channel weights through fbgemm's dynamically quantized
                          linear (tinygpt.quant.QuantizedDecodeStep, kernel="dynamic": the
                          activations are rounded to int8 too, one scale per call) over this
                          group's float32 step, DecodeStep(pack_weights=True) with oneDNN
                          prepacked weights (the decode_bandwidth row times the default tiled
                          step instead), on the 152M model, CPU: >= 1.8x, AND the
                          held-out loss of the shipped checkpoint quantized the same way (same
                          kernel) within 1% of float32's
    quant_int8_weight_only_decode
                          (information) the same int8 weights through torch's weight-only
                          aten._weight_int8pack_mm (bfloat16 activations), with its loss
    quant_int4_g128_decode
                          (information) int4, groups of 128 (aten._weight_int4pack_mm_for_cpu)
    quant_torchao_<s>     for each scheme torchao runs on the device: our relative logit error
                          on the 152M model against its bound, 1.25x torchao's + 0.005 absolute
                          (the tolerance tests/test_quant.py states; the row prints the two
                          errors, the ratio and both steps' tokens/s beside it)
    quant_cuda_<s>        on CUDA only: int8 and int4-g128 decode tokens/s over bf16 on the ~1B
                          model (>= 1.4x and >= 1.8x); skipped with the reason elsewhere

Why fbgemm's dynamic kernel for the targeted row. At batch 1 every product reads its whole
weight once, so a kernel that reads int8 instead of float32 can be up to 4x faster if it keeps
up with memory. Three candidates on x86 CPUs: torch's weight-only _weight_int8pack_mm (int8
weights, bfloat16 activations; its float32-activation path is several times slower than
F.linear), fbgemm's dynamic int8 linear (also rounds the activations to 7-bit integers, one
scale per call, and multiplies integers), and dequantize-then-matmul (rebuilds a float32 weight
every call: slower than float32). Both int8 kernels reached the target on a fast day (2.4x and
2.6x); on 2026-11-24, with the machine's memory bandwidth at 21-25 GB/s instead of 34-47, the
weight-only kernel measured 1.65-1.69x and fbgemm's 2.1-2.6x in the same runs (all of these:
the 2-core development machine on or before 2026-11-24, most likely the AVX-512 EPYC): the
weight-only kernel converts activations and accumulates in bfloat16 and is bound by that
arithmetic on 2 cores, not by the int8 bytes. The targeted row therefore uses fbgemm's kernel;
its extra activation rounding costs +0.016% held-out loss on the shipped checkpoint (the
weight-only kernel +0.003%), far inside the 1% budget, and the row beside it keeps the
weight-only kernel in view.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from tinygpt import quant as Q
from tinygpt.bench.harness import Comparison, synchronize
from tinygpt.bench.models import bandwidth_model_config, cuda_bandwidth_model_config, model_info
from tinygpt.bench.registry import BenchContext, register
from tinygpt.kv_cache import DecodeStep, KVCache, prefill
from tinygpt.model import TinyGPT

INT8_SPEEDUP_TARGET = 1.8
LOSS_INCREASE_TARGET = 0.01        # int8 per-channel on the shipped checkpoint
TORCHAO_ERROR_RATIO = 1.25         # our logit error <= 1.25 x torchao's + TORCHAO_ERROR_SLACK
TORCHAO_ERROR_SLACK = 0.005
CUDA_TARGETS = {"int8": 1.4, "int4-g128": 1.8}
PROMPT_LEN = 32


def held_out_losses(variants: dict[str, Callable[[TinyGPT], TinyGPT]], stories: int
                    ) -> tuple[float, dict[str, float]]:
    """Held-out loss of the shipped checkpoint in float32 and after each variant (a function
    of the float32 model returning the quantized one), on `stories` held-out stories."""
    from tinygpt import corpus
    from tinygpt.train import encode_stories, evaluate, load_pretrained

    model, tokenizer = load_pretrained("cpu")
    data = encode_stories(corpus.generate_corpus(stories, 1).split("\n"), tokenizer)
    return evaluate(model, data), {name: evaluate(make(model), data)
                                   for name, make in variants.items()}


class _Timed:
    """A decode step on its own cache: `run(steps)` prefills a seeded prompt, takes two warm-up
    steps, then returns the median seconds of `steps` greedy steps."""

    def __init__(self, model: TinyGPT, make_step: Callable, steps: int, seed: int) -> None:
        self.model = model
        self.cache = KVCache.for_model(model, 1, PROMPT_LEN + steps + 3)
        self.step = make_step(model, self.cache)
        device = next(model.parameters()).device
        self.prompt = torch.randint(0, model.cfg.vocab_size, (1, PROMPT_LEN),
                                    generator=torch.Generator().manual_seed(seed)).to(device)

    def run(self, steps: int) -> float:
        self.cache.reset()
        device = self.prompt.device
        with torch.inference_mode():
            token = prefill(self.model, self.cache, self.prompt).argmax(-1, keepdim=True)
            seconds = []
            for i in range(steps + 2):
                synchronize(device)
                start = time.perf_counter()
                token = self.step(token).argmax(-1, keepdim=True)
                synchronize(device)
                if i >= 2:
                    seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)


def interleaved_steps(timers: dict[str, _Timed], steps: int, rounds: int
                      ) -> dict[str, list[float]]:
    """Each timer's step seconds in `rounds` rounds, the timers taking turns within a round
    (the machine's load changes from minute to minute; taking turns exposes all alike)."""
    out: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            out[name].append(timer.run(steps))
    return out


def _median_ratio(base: list[float], other: list[float]) -> float:
    return statistics.median(b / o for b, o in zip(base, other, strict=True))


def _logit_error(reference: TinyGPT, model: TinyGPT, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return Q.relative_error(model(ids).float(), reference(ids).float())


def _cpu_rows(ctx: BenchContext) -> list[Comparison]:
    steps, rounds = (4, 1) if ctx.quick else (16, 5)
    stories = 100 if ctx.quick else 300
    cfg = bandwidth_model_config()
    ctx.log(f"quant_decode: quantizing the {cfg.n_layers}-layer 152M model (int8, int4-g128, "
            f"fbgemm int8, torchao) ...")
    model = ctx.build(cfg)
    variants = {
        "int8": Q.quantize_model(model, "int8"),
        "int8_dynamic": Q.quantize_model(model, "int8", kernel="dynamic"),
        "int4-g128": Q.quantize_model(model, "int4-g128"),
    }
    torchao, torchao_reasons = {}, {}
    for scheme in ("int8", "int4-g128"):
        reference, reason = Q.torchao_quantize(model, scheme)
        if reference is None:
            torchao_reasons[scheme] = reason
        else:
            torchao[scheme] = reference
    timers = {"fp32": _Timed(model, lambda m, c: DecodeStep(m, c, pack_weights=True), steps,
                             ctx.seed)}
    for name, qm in variants.items():
        timers[name] = _Timed(qm, Q.QuantizedDecodeStep, steps, ctx.seed)
    for scheme, reference in torchao.items():
        timers[f"torchao_{scheme}"] = _Timed(reference, DecodeStep, steps, ctx.seed)
    ctx.log(f"quant_decode: {rounds} round(s) of {steps} decode steps per variant ...")
    seconds = interleaved_steps(timers, steps, rounds)
    kernels = {name: timers[name].step.kernels for name in variants}
    tps = {name: 1 / statistics.median(s) for name, s in seconds.items()}
    ctx.log(f"quant_decode: held-out loss of the shipped checkpoint ({stories} stories) ...")
    fp32_loss, losses = held_out_losses({
        "int8": lambda m: Q.quantize_model(m, "int8"),
        "int8_dynamic": lambda m: Q.quantize_model(m, "int8", kernel="dynamic"),
        "int4-g128": lambda m: Q.quantize_model(m, "int4-g128")}, stories)
    increase = {name: (loss - fp32_loss) / fp32_loss for name, loss in losses.items()}
    fp32_bytes = Q.weight_bytes(model)

    def details(name: str) -> dict:
        return {"step_s_fp32": statistics.median(seconds["fp32"]),
                f"step_s_{name}": statistics.median(seconds[name]),
                "tokens_per_s_fp32": tps["fp32"], f"tokens_per_s_{name}": tps[name],
                "round_ratios": [b / o for b, o in zip(seconds["fp32"], seconds[name],
                                                        strict=True)],
                "kernels": kernels.get(name), "weight_bytes_fp32": fp32_bytes,
                "weight_bytes": Q.weight_bytes(variants[name]),
                "shipped_loss_fp32": fp32_loss, "shipped_loss": losses[name],
                "shipped_loss_increase": increase[name], "held_out_stories": stories,
                "steps": steps, "rounds": rounds, "model": model_info(model),
                "summary": f"{tps['fp32']:.1f} -> {tps[name]:.1f} tokens/s (median steps; "
                           f"the ratio is the median of the per-round ratios), weights "
                           f"{fp32_bytes / 1e6:.0f} -> {Q.weight_bytes(variants[name]) / 1e6:.0f}"
                           f" MB, kernels {kernels.get(name)}; shipped checkpoint loss "
                           f"{fp32_loss:.4f} -> {losses[name]:.4f} ({increase[name]:+.3%})"}

    rows = []
    ratio = _median_ratio(seconds["fp32"], seconds["int8_dynamic"])
    reasons = []
    if ratio < INT8_SPEEDUP_TARGET:
        reasons.append(f"{ratio:.2f}x is below the {INT8_SPEEDUP_TARGET}x target (the int8 "
                       f"products did not keep up with memory: a loaded machine)")
    if increase["int8_dynamic"] > LOSS_INCREASE_TARGET:
        reasons.append(f"the shipped checkpoint's loss rose {increase['int8_dynamic']:.2%} "
                       f"(target <= {LOSS_INCREASE_TARGET:.0%})")
    rows.append(Comparison(
        "quant_int8_decode", "int8 per-channel decode step (fbgemm dynamic) over float32 "
        f"(packed), tokens/s, {model_info(model)['parameters'] / 1e6:.0f}M model, CPU; shipped "
        f"loss within {LOSS_INCREASE_TARGET:.0%}", ratio, INT8_SPEEDUP_TARGET, ">=", "x",
        not reasons, "; ".join(reasons) or None, details("int8_dynamic")))
    for name, label, row_name in (
            ("int8", "int8 weight-only (_weight_int8pack_mm, bfloat16 activations)",
             "quant_int8_weight_only_decode"),
            ("int4-g128", "int4 weight-only, groups of 128", "quant_int4_g128_decode")):
        r = _median_ratio(seconds["fp32"], seconds[name])
        rows.append(Comparison(row_name,
                               f"{label} decode step over float32 (packed), tokens/s, CPU", r,
                               1.0, ">=", "x", r >= 1.0, None if r >= 1.0 else
                               f"{r:.2f}x: slower than float32", details(name), targeted=False))
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator()
                        .manual_seed(ctx.seed + 1))
    for scheme in ("int8", "int4-g128"):
        name = f"quant_torchao_{scheme.replace('-', '_')}"
        if scheme not in torchao:
            ctx.skip(name, torchao_reasons[scheme], targeted=not ctx.quick)
            continue
        ours_err = _logit_error(model, variants[scheme], ids)
        theirs_err = _logit_error(model, torchao[scheme], ids)
        ratio = ours_err / theirs_err if theirs_err > 0 else float("inf")
        bound = TORCHAO_ERROR_RATIO * theirs_err + TORCHAO_ERROR_SLACK
        met = ours_err <= bound
        theirs_tps = tps[f"torchao_{scheme}"]
        rows.append(Comparison(
            name, f"{scheme}: our relative logit error against its bound, "
            f"{TORCHAO_ERROR_RATIO}x torchao's (same model) + {TORCHAO_ERROR_SLACK} (an absolute "
            f"slack), CPU",
            ours_err, bound, "<=", "logit error", met,
            None if met else f"error {ours_err:.4f} vs torchao's {theirs_err:.4f}",
            {"our_logit_error": ours_err, "torchao_logit_error": theirs_err,
             "error_ratio": ratio,
             "slack": TORCHAO_ERROR_SLACK, "tokens_per_s_ours": tps[scheme],
             "tokens_per_s_torchao": theirs_tps, "tokens_per_s_fp32": tps["fp32"],
             "torchao_step": "tinygpt DecodeStep over torchao's quantized weights (its "
                             "F.linear dispatch)",
             "summary": f"logit error ours {ours_err:.4f}, torchao {theirs_err:.4f} "
                        f"({ratio:.2f}x); "
                        f"tokens/s ours {tps[scheme]:.1f}, torchao {theirs_tps:.1f}, "
                        f"float32 {tps['fp32']:.1f}"}))
    return rows


def _cuda_rows(ctx: BenchContext) -> list[Comparison]:
    steps, rounds = (4, 1) if ctx.quick else (32, 3)
    cfg = cuda_bandwidth_model_config()
    model = ctx.build(cfg, torch.bfloat16)
    timers = {"bf16": _Timed(model, DecodeStep, steps, ctx.seed)}
    for scheme in CUDA_TARGETS:
        timers[scheme] = _Timed(Q.quantize_model(model, scheme), Q.QuantizedDecodeStep, steps,
                                ctx.seed)
    seconds = interleaved_steps(timers, steps, rounds)
    rows = []
    bf16_tps = 1 / statistics.median(seconds["bf16"])
    for scheme, target in CUDA_TARGETS.items():
        r = _median_ratio(seconds["bf16"], seconds[scheme])
        tps = 1 / statistics.median(seconds[scheme])
        stat = (f"median of {rounds} rounds' ratios; the tokens/s (1 / median step): bf16 "
                f"{bf16_tps:.1f}, {scheme} {tps:.1f}")
        rows.append(Comparison(
            f"quant_cuda_{scheme.replace('-', '_')}",
            f"{scheme} decode step over bf16, tokens/s, ~1B model, {ctx.device}", r, target,
            ">=", "x", r >= target, None if r >= target else
            f"{r:.2f}x is below {target}x ({stat}; eager steps; gpt-fast's figures use "
            f"torch.compile)",
            {"tokens_per_s_bf16": bf16_tps, f"tokens_per_s_{scheme}": tps,
             "round_ratios": [b / o for b, o in zip(seconds["bf16"], seconds[scheme],
                                                     strict=True)],
             "summary": stat, "kernels": timers[scheme].step.kernels,
             "model": model_info(model)}))
    return rows


@register("quant_decode", day=15)
def quant_decode(ctx: BenchContext) -> list[Comparison]:
    """Quantized decode steps (int8, int4) over float32, and against torchao's."""
    if ctx.device.type == "cuda":
        return _cuda_rows(ctx)
    if not ctx.on_cpu:
        return ctx.skip("quant_decode", f"no quantized kernels on {ctx.device}")
    ctx.skip("quant_cuda", "the GPU rows (int8 / int4-g128 vs bf16 on the ~1B model) need "
             "CUDA (run with --device cuda on a GPU)")
    return _cpu_rows(ctx)
