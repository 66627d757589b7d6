"""Rows on the first real model's shape: SmolLM2-135M at batch 1 on the CPU, through the
default `generate()`, in float32, bfloat16, 8-bit and 4-bit, and the engine at 16 requests.

    smollm2_fp32_bandwidth  float32 greedy decode through generate(): bytes a token reads
                            (weights + the KV cache) / seconds per token, over the higher
                            of the copy and read-only bandwidths measured in the same
                            rounds: >= 75%, and not above 100% (a roof the decode beats
                            was measured too low: NOT MET, the roof unreliable)
    smollm2_bf16_speedup    the model in bfloat16 (half the bytes) over float32, tokens/s:
                            >= 1.6x; the row names the bfloat16 products it measured
                            (tinygpt.cpu_kernels.bf16_path(): avx512_bf16 dot products where
                            the CPU has them, else the weights widened to float32)
    smollm2_q8_0_speedup    Q8_0 weights for every linear, the tied head too
                            (tinygpt.cpu_kernels.q8_0_model) over float32: >= 1.8x, and
                            teacher-forced greedy agreement with float32 >= 97% on the shipped
                            checkpoint; this row and the next name the integer sums they
                            measured (cpu_kernels.int_path(): AVX-512 VNNI, AVX2, or C loops)
    smollm2_q4_1_speedup    Q4_1 blocks for every linear and the head, run as they are
                            (tinygpt.cpu_kernels.q4_1_model) over float32: >= 1.75x, and
                            teacher-forced agreement >= 97% with the same blocks computed in
                            float32 (what llama.cpp's Q4_1 computes, up to its own 8-bit
                            rounding of the input; `make bench-llamacpp` compares with
                            llama.cpp itself). Agreement with float32 is printed beside it:
                            4 bits on every weight, the small checkpoint's head too, cost more
    smollm2_int4_speedup    (information) tinygpt.quant "int4-g32" (the head stays float32)
    smollm2_int8_speedup    (information) tinygpt.quant "int8" (per row; the head stays float32)

Error is measured on the course's own trained checkpoint (the random-weight model's tokens mean
nothing): teacher-forced greedy agreement with the float32 model through each variant's own
decode path (decode_agreement: the kernels generate() runs, prompts from held-out stories of
the course's corpus; the forward's agreement, tinygpt.quant.greedy_agreement, is kept beside
it) and held-out loss (the forward, which runs the same weight values in float32).
    smollm2_engine_16       the Engine with 16 concurrent greedy requests of 128 tokens over
                            llama.cpp F32 serving the same 16 with every sequence in each
                            decode, measured in turn in the same run: >= 1.0x, and every
                            output identical to its batch-1 generate(); without the optional
                            llama-cpp-python the row gives the engine's tokens/s over batch-1
                            generate()'s, as information (the identity still required), and
                            says so

Speed does not depend on what the weights say, so the model has SmolLM2's exact shapes
(30 layers, d_model 576, 9 query and 3 KV heads, d_ff 1536, 49,152 tokens, tied embeddings,
RoPE theta 1e5; 538 MB in float32) and seeded random weights. The quick plan runs the same
rows on a 2-layer model of the same widths with a 4,096-token vocabulary. Every variant runs in
turn within a round (float32, bfloat16, Q8_0, Q4_1, int4, int8, then the copy and read
bandwidths), and each speedup is the median over rounds of the per-round ratios, so a load
that comes and goes hits all alike; the tokens/s printed beside a ratio are each variant's
median. The bandwidth share is the median round's, printed with that round's own figures.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tinygpt import cpu_kernels
from tinygpt import quant as Q
from tinygpt.bench.harness import (
    Comparison,
    measure_read_bandwidth,
    median_round_share,
    random_prompt,
)
from tinygpt.bench.llamacpp import engine_vs_llama, write_gguf
from tinygpt.bench.llamacpp import unavailable as llama_unavailable
from tinygpt.bench.models import model_info, smollm2_config
from tinygpt.bench.registry import BenchContext, register
from tinygpt.engine import Engine
from tinygpt.generate import CachedLogits, generate, stream
from tinygpt.kv_cache import DecodeStep, KVCache
from tinygpt.model import TinyGPT
from tinygpt.roofline import measure_copy_bandwidth
from tinygpt.sampling import SamplingParams

BANDWIDTH_TARGET = 0.75
# None: a row for information
SPEEDUP_TARGETS = {"bf16": 1.6, "q8_0": 1.8, "q4_1": 1.75, "int4": None, "int8": None}
AGREEMENT_TARGET = 0.97
ENGINE_TARGET = 1.0      # the engine's tokens/s over llama.cpp F32 with every sequence batched
PROMPT_LEN = 8


def _variants(model: TinyGPT) -> dict:
    """The float32 model's lower-precision versions, by row name."""
    return {"bf16": copy.deepcopy(model).to(torch.bfloat16),
            "q8_0": cpu_kernels.q8_0_model(model),
            "q4_1": cpu_kernels.q4_1_model(model),
            "int4": Q.quantize_model(model, "int4-g32"),
            "int8": Q.quantize_model(model, "int8")}


def decode_agreement(reference: TinyGPT, model: TinyGPT, prompts: torch.Tensor,
                     new_tokens: int) -> float:
    """Teacher-forced greedy agreement of `model`'s decode path with `reference`: the
    reference continues each prompt (P, T) greedily for `new_tokens` tokens (its forward);
    `model` then reads prompt + continuation the way generate() does (a prefill, then one
    decode step per token: DecodeStep's tiled products, whose Q8_0 / Q4_1 kernels also round
    each product's input to 8 bits, or QuantizedDecodeStep), and at each of the new_tokens
    positions its greedy token is compared with the reference's. Unlike
    tinygpt.quant.greedy_agreement (one forward over the whole text) this measures the
    kernels the decode step runs. Returns the fraction of positions that agree."""
    ids = prompts
    with torch.inference_mode():
        for _ in range(new_tokens - 1):
            ids = torch.cat([ids, reference(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        start = prompts.shape[1]
        want = reference(ids)[:, start - 1:].argmax(-1)                   # (P, new_tokens)
        same = 0
        for p in range(ids.shape[0]):
            logits = CachedLogits(model, start, new_tokens)
            for t in range(start, start + new_tokens):
                same += int(logits(ids[p:p + 1, :t]).argmax(-1) == want[p, t - start])
    return same / want.numel()


def shipped_errors(stories: int, prompts: int, new_tokens: int) -> dict[str, dict]:
    """Each variant of the course's trained checkpoint against its float32 self: teacher-forced
    greedy agreement on `prompts` prompts of 16 held-out tokens and `new_tokens` tokens each,
    and the held-out loss over `stories` stories of the course's corpus (seed 1: not the
    training stories)."""
    from tinygpt import corpus
    from tinygpt.train import encode_stories, evaluate, load_pretrained

    model, tokenizer = load_pretrained("cpu")
    data = encode_stories(corpus.generate_corpus(stories, 1).split("\n"), tokenizer)
    starts = torch.linspace(0, len(data) - 17, prompts).long()
    prompt_ids = torch.stack([data[i:i + 16] for i in starts.tolist()])
    fp32_loss = evaluate(model, data)
    out = {}
    for name, variant in _variants(model).items():
        forward = Q.greedy_agreement(model, variant, prompt_ids, new_tokens)
        loss = evaluate(variant, data)
        out[name] = {"token_agreement": decode_agreement(model, variant, prompt_ids,
                                                         new_tokens),
                     "forward_agreement": forward["token_agreement"], "loss": loss,
                     "loss_fp32": fp32_loss, "loss_increase": (loss - fp32_loss) / fp32_loss}
        if name == "q4_1":      # its target: the same blocks computed exactly, as llama.cpp does
            out[name]["blocks_agreement"] = decode_agreement(variant, variant, prompt_ids,
                                                             new_tokens)
    return out


def bytes_per_token(model: TinyGPT, context: int) -> int:
    """Bytes one batch-1 decode step reads: every weight a product reads (the embedding row
    is negligible; tied weights count once, as the head) plus `context` positions of cache."""
    cfg = model.cfg
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context
    weights = Q.weight_bytes(model)
    fmt = getattr(model, "decode_weights", None)      # float32 values, streamed in 8 or 4 bits
    if fmt in ("q8_0", "q4_1"):
        bits = 8.5 if fmt == "q8_0" else 5.0     # with the float16 scales (and minimums)
        linear = {id(m.weight): m.weight for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and m.in_features % cpu_kernels.Q_BLOCK == 0}
        weights -= sum(w.nbytes - int(w.numel() * bits / 8) for w in linear.values())
    return weights + kv * next(model.parameters()).element_size()


def seconds_per_token(model: TinyGPT, prompt: list[int], new_tokens: int) -> float:
    """Median gap between consecutive tokens of one greedy generate() (prefill excluded)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    stamps = [time.perf_counter() for _ in stream(model, prompt, params)]
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def _fast_path(model: TinyGPT) -> str:
    """Which decode step generate() runs for this model (for the report)."""
    if getattr(model, "quant_scheme", None) is not None:
        return f"QuantizedDecodeStep ({model.quant_scheme})"
    step = DecodeStep(model, KVCache.for_model(model, 1, 2))
    return "tiled CPU products (tinygpt.cpu_kernels)" if step.tiled else \
        f"plain products ({step.tiled_reason})"


@register("smollm2_cpu", day=12)
def smollm2_cpu(ctx: BenchContext) -> list[Comparison]:
    """SmolLM2-135M's shape on the CPU: fp32 at the bandwidth roof, bf16 / 8-bit / 4-bit."""
    if not ctx.on_cpu:
        return ctx.skip("smollm2_cpu", f"these rows are for the CPU, not {ctx.device}")
    cfg = smollm2_config()
    if ctx.quick:
        cfg = dataclasses.replace(cfg, n_layers=2, vocab_size=4096)
    new, rounds = (8, 1) if ctx.quick else (48, 5)
    ctx.log(f"smollm2_cpu: building the {cfg.n_layers}-layer model and its bf16 / q8_0 / "
            f"int4-g32 / int8 variants ...")
    fp32 = ctx.build(cfg)
    variants = {"fp32": fp32, **_variants(fp32)}
    prompt = random_prompt(PROMPT_LEN, cfg.vocab_size, ctx.seed)
    for model in variants.values():                  # warm-up: tiles, kernels, probes
        seconds_per_token(model, prompt, 3)
    ctx.log(f"smollm2_cpu: {rounds} round(s) of {new} tokens per variant, interleaved ...")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    copy_bw: list[float] = []
    read_bw: list[float] = []
    for _ in range(rounds):
        for name, model in variants.items():
            seconds[name].append(seconds_per_token(model, prompt, new))
        copy_bw.append(measure_copy_bandwidth(repeats=3))
        read_bw.append(measure_read_bandwidth(repeats=3))
    context = PROMPT_LEN + new // 2
    nbytes = {name: bytes_per_token(model, context) for name, model in variants.items()}
    paths = {name: _fast_path(model) for name, model in variants.items()}
    info = model_info(fp32)

    def summary(name: str) -> dict:
        s = statistics.median(seconds[name])
        return {"seconds_per_token": s, "tokens_per_s": 1 / s, "bytes_per_token": nbytes[name],
                "gb_per_s": nbytes[name] / s / 1e9, "decode_path": paths[name],
                "round_seconds": seconds[name]}

    rows = []
    judged = median_round_share(nbytes["fp32"], seconds["fp32"], copy_bw, read_bw,
                                BANDWIDTH_TARGET)
    value, pick = judged["share"], judged["round"]
    fp = summary("fp32")
    picked_s = seconds["fp32"][pick]
    roof = max(copy_bw[pick], read_bw[pick])
    figures = (f"round {pick + 1} of {rounds} (the median share): "
               f"{nbytes['fp32'] / picked_s / 1e9:.1f} GB/s ({1 / picked_s:.1f} tokens/s) of "
               f"{roof / 1e9:.1f} GB/s, the higher of copy {copy_bw[pick] / 1e9:.1f} and read "
               f"{read_bw[pick] / 1e9:.1f} GB/s")
    reason = judged["reason"]
    if reason is not None and value <= 1:
        reason = (f"{figures}; on a shared or loaded machine a product's share of the second "
                  f"core comes late")
    rows.append(Comparison(
        "smollm2_fp32_bandwidth",
        f"float32 batch-1 greedy decode through generate(), SmolLM2-135M shape "
        f"({cfg.n_layers} layers), bytes per token / s over the higher of the copy and "
        f"read-only bandwidths",
        value, BANDWIDTH_TARGET, ">=", "fraction", reason is None, reason,
        {**fp, "copy_bandwidth": copy_bw[pick], "read_bandwidth": read_bw[pick],
         "judged_against": judged["judged_against"], "round_copy_bandwidth": copy_bw,
         "round_read_bandwidth": read_bw, "round_utilization": judged["round_shares"],
         "new_tokens": new, "rounds": rounds, "model": info,
         "summary": f"{figures}; the medians over rounds: {fp['tokens_per_s']:.1f} tokens/s, "
                    f"{fp['gb_per_s']:.1f} GB/s; {fp['decode_path']}"}))
    bf16_path, int_path = cpu_kernels.bf16_path(), cpu_kernels.int_path()
    labels = {"bf16": f"the model in bfloat16 (products: {bf16_path})",
              "q8_0": f"Q8_0 weights, every linear and the head (integer sums: {int_path})",
              "q4_1": f"Q4_1 blocks as they are, every linear and the head (integer sums: "
                      f"{int_path})",
              "int8": "int8 per-row weights (quantize_model 'int8', float32 head)",
              "int4": "int4 groups of 32 (quantize_model 'int4-g32', float32 head)"}
    ctx.log("smollm2_cpu: agreement and held-out loss of each variant of the shipped "
            "checkpoint ...")
    errors = shipped_errors(*((30, 2, 4) if ctx.quick else (300, 16, 32)))
    for name, target in SPEEDUP_TARGETS.items():
        ratios = [f / o for f, o in zip(seconds["fp32"], seconds[name], strict=True)]
        ratio = statistics.median(ratios)
        other = summary(name)
        error = errors[name]
        agreement = error["token_agreement"]
        checked = error.get("blocks_agreement", agreement)
        against = "the same Q4_1 blocks in float32" if name == "q4_1" else "float32"
        medians = (f"the median of {rounds} rounds' ratios; the medians: "
                   f"{other['tokens_per_s']:.1f} vs {fp['tokens_per_s']:.1f} tokens/s float32")
        reasons = []
        if target is not None and ratio < target:
            reasons.append(f"{ratio:.2f}x ({medians}, {other['gb_per_s']:.1f} vs "
                           f"{fp['gb_per_s']:.1f} GB/s)")
            if name == "bf16":
                reasons[-1] += f"; bfloat16 products {bf16_path}"
            if name in ("int4", "int8"):
                reasons[-1] += (f"; the tied float32 head ({fp32.output.weight.nbytes / 1e6:.0f}"
                                f" MB) stays float32 and {other['decode_path']}'s kernels do "
                                f"not stream at the float32 rate")
        if name != "bf16" and checked < AGREEMENT_TARGET:
            reasons.append(f"teacher-forced agreement with {against} {checked:.1%} < "
                           f"{AGREEMENT_TARGET:.0%}")
        met = not reasons
        rows.append(Comparison(
            f"smollm2_{name}_speedup",
            f"{labels[name]} over float32, batch-1 greedy generate() tokens/s, SmolLM2 shape"
            + ("" if name == "bf16" else f"; shipped agreement with {against} >= "
                                          f"{AGREEMENT_TARGET:.0%}"),
            ratio, target or 1.0, ">=", "x", met, "; ".join(reasons) or None,
            {**other, **{f"shipped_{k}": v for k, v in error.items()},
             "tokens_per_s_fp32": fp["tokens_per_s"], "round_ratios": ratios,
             **({"bf16_path": bf16_path} if name == "bf16" else {}),
             **({"int_path": int_path} if name in ("q8_0", "q4_1") else {}),
             "summary": f"{medians} ({other['bytes_per_token'] / 1e6:.0f} vs "
                        f"{fp['bytes_per_token'] / 1e6:.0f} MB per token), "
                        f"{other['decode_path']}"
                        + (f", bfloat16 products {bf16_path}" if name == "bf16" else "")
                        + f"; shipped checkpoint: agreement "
                        f"with float32 {agreement:.1%}"
                        + (f", with the same blocks in float32 {checked:.1%}"
                           if name == "q4_1" else "")
                        + f", loss {error['loss_fp32']:.4f} -> "
                        f"{error['loss']:.4f} ({error['loss_increase']:+.2%})"},
            targeted=target is not None))
    rows.append(_engine_row(ctx, fp32, quick=ctx.quick))
    return rows


def _engine_row(ctx: BenchContext, model: TinyGPT, *, quick: bool) -> Comparison:
    """The Engine serving 16 greedy requests of 128 tokens at once against llama.cpp F32 doing
    the same with every sequence in each decode (tinygpt.bench.llamacpp.engine_vs_llama, when
    llama-cpp-python and gguf are installed), and each output against batch-1 generate()."""
    n_requests, new, rounds = (4, 8, 1) if quick else (16, 128, 2)
    params = SamplingParams(temperature=0.0, max_new_tokens=new)
    prompts = [random_prompt(PROMPT_LEN + i, model.cfg.vocab_size, ctx.seed + 10 + i)
               for i in range(n_requests)]
    ctx.log(f"smollm2_cpu: the engine and llama.cpp F32, {n_requests} concurrent requests of "
            f"{new} tokens, {rounds} round(s) in turn; then each request alone through "
            f"generate() ...")
    missing = llama_unavailable()
    if missing is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "smollm2-shape-F32.gguf"
            write_gguf(model, path, "F32")
            measured = engine_vs_llama(model, path, prompts, new, ctx.threads, rounds)
        outputs = measured["outputs"]
        ours, theirs = measured["engine_tokens_per_s"], measured["llama_tokens_per_s"]
        ratio = measured["ratio"]
    else:                  # the engine alone: its throughput, no reference to divide by
        engine = Engine(model, max_running=n_requests)
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))
        start = time.perf_counter()
        outputs = [r.token_ids for r in engine.generate(prompts, params)]
        ours, theirs = [n_requests * new / (time.perf_counter() - start)], []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    start = time.perf_counter()
    alone = [generate(model, p, params).token_ids for p in prompts]
    batch1 = sum(len(a) for a in alone) / (time.perf_counter() - start)
    same = sum(o == a for o, a in zip(outputs, alone, strict=True))
    engine_tps = statistics.median(ours)
    reasons = []
    if same < n_requests:
        reasons.append(f"{same} of {n_requests} outputs identical to batch-1 generate()")
    if missing is not None:      # the target cannot be judged here: a skip, not a pass
        ctx.skip("smollm2_engine_16_vs_llamacpp", f"llama.cpp not measured ({missing}: the "
                 f"optional llama-cpp-python extra, see the README); smollm2_engine_16 prints "
                 f"the engine over batch-1 generate(), as information, and `make "
                 f"bench-llamacpp` gives the ratio", targeted=True)
    elif ratio < ENGINE_TARGET:
        reasons.append(f"{ratio:.2f}x: the median of {rounds} rounds' ratios; the medians: "
                       f"engine {engine_tps:.1f} vs llama.cpp "
                       f"{statistics.median(theirs):.1f} tokens/s (load average {load:.2f}; "
                       f"the products are at the cores' multiply-add rate, the rest of a step "
                       f"is norms, RoPE, attention and Python)")
    met = not reasons
    against = f"llama.cpp F32 with {n_requests} sequences per decode"
    if missing is not None:      # no llama.cpp to divide by: the engine over batch-1 generate()
        ratio, against = engine_tps / batch1, "batch-1 generate() (llama.cpp not installed)"
    llama_text = f"llama.cpp not measured ({missing})" if not theirs else \
        f"llama.cpp F32 {statistics.median(theirs):.1f} tokens/s"
    return Comparison(
        "smollm2_engine_16",
        f"the engine, {n_requests} concurrent greedy requests of {new} tokens, over "
        f"{against} (tokens/s); every output identical to batch-1 generate()",
        ratio, ENGINE_TARGET, ">=", "x", met, "; ".join(reasons) or None,
        {"engine_tokens_per_s": engine_tps, "round_engine_tokens_per_s": ours,
         "llama_tokens_per_s": statistics.median(theirs) if theirs else None,
         "round_llama_tokens_per_s": theirs, "batch1_tokens_per_s": batch1,
         "identical": same, "requests": n_requests, "new_tokens": new, "rounds": rounds,
         "load_average": load, "threads": ctx.threads,
         "summary": ("" if missing is not None else
                     f"the median of {rounds} rounds' ratios; the medians: ")
                    + f"engine {engine_tps:.1f} tokens/s, {llama_text}, batch-1 generate() "
                    f"{batch1:.1f}; {same}/{n_requests} identical to batch-1; load average "
                    f"{load:.2f}"}, targeted=missing is None)
