"""Day 20's rows: mixtures of experts on the CPU (tinygpt.moe), float32.

    moe_dispatch_<E>x<k>   grouped dispatch (tinygpt.moe.dispatch: one product per chosen expert
                           over all its rows) over the per-token loop (moe_loop: one expert MLP
                           per token and slot), a 256-token prefill through one MoE layer at
                           D = 1024, three shapes (E, k, d_expert): (8, 2, 1408), (16, 4, 768),
                           (32, 8, 512); >= 5x, and dispatch within 4 times the loop's distance
                           from the float64 result (plus float32's eps times the result's
                           largest magnitude)
    moe_expert_products    (information) one MoE layer of the decode model at batch 1 through
                           tinygpt.moe.MoEDecode on three kinds of products: torch's F.linear on
                           each expert's (d_expert, D) slices, a fused gate+up in torch (one
                           F.linear on a stacked copy), and cpu_kernels' tiled products (gate
                           and up stacked), in GB/s of the experts' bytes: why the decode step
                           runs the tiled ones (generate() runs them from C, with the attention
                           between: cpu_kernels.MoEDecodeLayers)
    moe_decode_bandwidth   batch-1 greedy decode through generate() of a 340M-parameter MoE
                           model (MOE_DECODE_CONFIG), counting only the bytes a token reads:
                           the dense parts (attention, norms, routers, head; the embedding row
                           aside), its k experts per layer and the KV cache, over the higher
                           of the copy and read-only bandwidths measured in the same rounds:
                           >= 60%, and above 100% NOT MET (the roof measured too low)
    moe_decode_bytes       bytes per decode step at batch 1, 4, 16, 64 measured from what the
                           step ran (the distinct experts each MoE layer read, MoE.last_ran,
                           times an expert's bytes, plus the dense bytes) against the uniform-
                           routing formula E (1 - (1 - k/E)^B) (tinygpt.moe.moe_decode_bytes);
                           within 10%. The model's router weights are random, so its routing is
                           near-uniform (the load imbalance is printed): a trained router's
                           is not, and touches fewer experts at a batch
    moe_expert_parallel    greedy decode over 2 expert-parallel gloo ranks
                           (tinygpt.parallel.experts.measure_ep_decode): tokens identical to
                           one process; the step, its all-to-alls and all-gathers printed
                           beside the all-to-all cost model's (a link fitted on this machine)
    moe_routing_widget     (information) DeepSeek-V3, Qwen3-30B-A3B and Mixtral-8x7B from
                           their published config.json: distinct experts and weight bytes per
                           decode step at batch 1, 4, 16, 64, and the batch at which the
                           experts' products reach an H100 SXM's ridge point in the
                           checkpoint's dtype (tinygpt.moe.critical_batch)

The quick plan (CI's smoke run) runs every row on small shapes and few steps (one dispatch
shape, the first, on 32 tokens), for information only (too few routed tokens for the bytes'
10%), except expert parallelism's identical tokens.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch

from tinygpt import moe as M
from tinygpt import roofline as R
from tinygpt.bench.harness import (
    Comparison,
    measure_read_bandwidth,
    median_round_share,
    random_prompt,
)
from tinygpt.bench.registry import BenchContext, register
from tinygpt.generate import stream
from tinygpt.kv_cache import DecodeStep, KVCache, prefill
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.native import torch_single_thread
from tinygpt.roofline import measure_copy_bandwidth
from tinygpt.sampling import SamplingParams

D_MODEL, PREFILL_TOKENS = 1024, 256
DISPATCH_SHAPES = ((8, 2, 1408), (16, 4, 768), (32, 8, 512))      # (E, k, d_expert)
DISPATCH_TARGET, BANDWIDTH_TARGET, BYTES_TOLERANCE = 5.0, 0.60, 0.10
BYTES_BATCHES = (1, 4, 16, 64)
EP_WORLD = 2

# The decode model: 8 layers of 16 experts (top 2) of width 768 at D = 1024, GQA 16 / 4 heads:
# 339.9M parameters (1.36 GB in float32), of which a token reads 63M (252 MB) plus the cache.
MOE_DECODE_CONFIG = ModelConfig(vocab_size=8192, d_model=1024, n_layers=8, n_heads=16,
                                n_kv_heads=4, d_ff=2816, max_seq_len=1024, n_experts=16,
                                top_k=2, d_expert=768)
MOE_QUICK_CONFIG = ModelConfig(vocab_size=2048, d_model=256, n_layers=2, n_heads=4,
                               n_kv_heads=2, d_ff=512, max_seq_len=256, n_experts=8, top_k=2,
                               d_expert=128)

# Published shapes, from each model's config.json on the Hugging Face Hub (deepseek-ai/
# DeepSeek-V3, Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1): field names as there, plus
# the released checkpoint's weight dtype (DeepSeek-V3: FP8 e4m3, its quantization_config; the
# others bfloat16, their torch_dtype). "attention" names the layout: Multi-head Latent
# Attention (DeepSeek-V3) or grouped-query attention.
PUBLISHED: dict[str, dict] = {
    "DeepSeek-V3": dict(
        attention="mla", hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, tie_word_embeddings=False,
        dtype="fp8"),
    "Qwen3-30B-A3B": dict(
        attention="gqa", hidden_size=2048, num_hidden_layers=48, first_k_dense_replace=0,
        moe_intermediate_size=768, n_routed_experts=128, num_experts_per_tok=8,
        n_shared_experts=0, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        qk_norm=True, vocab_size=151936, tie_word_embeddings=False, dtype="bf16"),
    "Mixtral-8x7B": dict(
        attention="gqa", hidden_size=4096, num_hidden_layers=32, first_k_dense_replace=0,
        moe_intermediate_size=14336, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=0, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        qk_norm=False, vocab_size=32000, tie_word_embeddings=False, dtype="bf16"),
}
WEIGHT_BYTES = {"fp8": 1, "bf16": 2}
# The totals each model card states (parameters, billions), checked against the counts below.
PUBLISHED_TOTALS = {"DeepSeek-V3": 671, "Qwen3-30B-A3B": 30.5, "Mixtral-8x7B": 46.7}


# --------------------------------------------------------------------------------------------
# bytes


def published_parameters(c: dict) -> dict:
    """Parameter counts of a PUBLISHED entry: "expert" (one routed expert), "dense" (what every
    token reads: attention, norms, routers, shared experts, dense layers' MLPs, the head; not
    the embedding table, of which a token reads one row), "total" and "moe_layers"."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    if c["attention"] == "mla":
        q_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        attention = (d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * h * q_head
                     + d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
                     + c["kv_lora_rank"] * h * (c["qk_nope_head_dim"] + c["v_head_dim"])
                     + h * c["v_head_dim"] * d)
    else:
        hd, kv = c["head_dim"], c["num_key_value_heads"]
        attention = 2 * d * h * hd + 2 * d * kv * hd + (2 * hd if c["qk_norm"] else 0)
    layers, dense_layers = c["num_hidden_layers"], c["first_k_dense_replace"]
    moe_layers = layers - dense_layers
    e, i = c["n_routed_experts"], c["moe_intermediate_size"]
    expert = 3 * d * i
    router = e * d + (e if c["attention"] == "mla" else 0)        # + e_score_correction_bias
    dense = (layers * (attention + 2 * d) + dense_layers * 3 * d * c.get("intermediate_size", 0)
             + moe_layers * (router + c["n_shared_experts"] * expert)
             + c["vocab_size"] * d + d)                                      # head, final norm
    embeddings = 0 if c["tie_word_embeddings"] else c["vocab_size"] * d
    return {"expert": expert, "dense": dense, "moe_layers": moe_layers,
            "total": dense + embeddings + moe_layers * e * expert}


def model_bytes(model: TinyGPT) -> dict:
    """What a TinyGPT's decode step reads, from its parameters: "dense" (every weight but the
    routed experts' and the embedding table's, which a step reads one row of; a tied table
    counts once, as the head), "expert" (one routed expert's three matrices), "moe_layers",
    "n_experts", "top_k", "kv_per_position" (cache bytes one position adds, all layers)."""
    moe = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, M.MoE)]
    if not moe:
        raise ValueError("the model has no MoE layer")
    routed = {id(p) for ff in moe for p in (ff.w1, ff.w3, ff.w2)}
    embedding = model.tok_embeddings.weight
    if embedding is not model.output.weight:
        routed.add(id(embedding))
    cfg, size = model.cfg, embedding.element_size()
    return {"dense": sum(p.nbytes for p in model.parameters() if id(p) not in routed),
            "expert": 3 * moe[0].w1[0].nbytes, "moe_layers": len(moe),
            "n_experts": moe[0].n_experts, "top_k": moe[0].top_k,
            "kv_per_position": 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * size}


# --------------------------------------------------------------------------------------------
# the rows


def _median_seconds(fn, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def dispatch_row(e: int, k: int, d_expert: int, tokens: int, seed: int, *, rounds: int,
                 targeted: bool) -> Comparison:
    """Grouped dispatch over the per-token loop for one MoE layer (E, k, d_expert) at D=1024:
    in each round the median of 3 dispatches, then one loop; the median of the rounds'
    ratios (a load that comes and goes hits both alike)."""
    gen = torch.Generator().manual_seed(seed)
    layer = M.MoE(D_MODEL, e, k, d_expert).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    x = torch.randn(tokens, D_MODEL, generator=gen)
    with torch.inference_mode():
        weights, experts = layer.route(x)
        args = (x, weights, experts, layer.w1, layer.w3, layer.w2)
        fast = M.dispatch(*args)                                                # warm-up
        loop = M.moe_loop(*args)
        ratios, fast_all, loop_all = [], [], []
        for _ in range(rounds):
            fast_all.append(_median_seconds(lambda: M.dispatch(*args), 3))
            loop_all.append(_median_seconds(lambda: M.moe_loop(*args), 1))
            ratios.append(loop_all[-1] / fast_all[-1])
        fast_s, loop_s = statistics.median(fast_all), statistics.median(loop_all)
        truth = M.dispatch(*(t.double() if t.is_floating_point() else t for t in args))
    err = (fast.double() - truth).abs().max().item()
    loop_err = (loop.double() - truth).abs().max().item()
    floor = torch.finfo(torch.float32).eps * truth.abs().max().item()
    close = err <= 4 * loop_err + floor
    speedup = statistics.median(ratios)
    expert_bytes = 3 * layer.w1[0].nbytes
    distinct = int((M.expert_load(experts, e) > 0).sum())
    met = close and speedup >= DISPATCH_TARGET
    reason = None
    if not close:
        reason = (f"dispatch is {err:.3g} from the float64 result, the loop {loop_err:.3g}: "
                  f"not the same function")
    elif not met:
        reason = f"{speedup:.2f}x is below {DISPATCH_TARGET:g}x"
    return Comparison(
        f"moe_dispatch_{e}x{k}", f"grouped dispatch over the per-token loop, {tokens}-token "
        f"prefill, {e} experts top-{k}, D {D_MODEL}, d_expert {d_expert}, float32",
        speedup, DISPATCH_TARGET, ">=", "x", met, reason,
        {"dispatch_s": fast_s, "loop_s": loop_s, "round_ratios": ratios, "tokens": tokens,
         "n_experts": e, "top_k": k, "d_expert": d_expert, "error_vs_float64": err,
         "loop_error_vs_float64": loop_err,
         "dispatch_weight_bytes": distinct * expert_bytes,
         "loop_weight_bytes": tokens * k * expert_bytes,
         "load_imbalance": M.load_imbalance(experts, e),
         "summary": f"the median of {rounds} rounds' ratios; the medians: dispatch "
                    f"{fast_s * 1e3:.1f} ms reads {distinct} experts once "
                    f"({distinct * expert_bytes / 1e6:.0f} MB); the loop {loop_s * 1e3:.0f} ms "
                    f"reads an expert per pair ({tokens * k * expert_bytes / 1e9:.2f} GB)"},
        targeted=targeted)


class StackedProducts(M.PlainProducts):
    """A fused gate+up in torch: the weights stacked once (a copy) and one F.linear."""

    def __init__(self, *weights: torch.Tensor) -> None:
        super().__init__(*weights)
        self.sizes = [w.shape[0] for w in weights]
        self.stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 \
            else weights[0].detach()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.nn.functional.linear(x, self.stacked).split(self.sizes, -1)


def products_row(model: TinyGPT, tokens: int, rounds: int, seed: int) -> Comparison:
    """One MoE layer at batch 1 on plain, stacked (fused gate+up) and tiled products."""
    layer = next(b.feed_forward for b in model.layers if isinstance(b.feed_forward, M.MoE))
    kinds = {"torch F.linear per slice": M.PlainProducts,
             "torch fused gate+up": StackedProducts, "tiled (cpu_kernels)": M.tiled_products}
    decoders = {name: M.MoEDecode(layer, factory) for name, factory in kinds.items()}
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, layer.w1.shape[2], generator=gen) for _ in range(tokens)]
    nbytes = layer.top_k * 3 * layer.w1[0].nbytes + layer.gate.weight.nbytes
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    copy_bw = []
    with torch.inference_mode():
        for decode in decoders.values():
            decode(xs[0])
        for _ in range(rounds):
            for name, decode in decoders.items():
                context = torch_single_thread() if name.startswith("tiled") else nullcontext()
                with context:
                    start = time.perf_counter()
                    for x in xs:
                        decode(x)
                    seconds[name].append((time.perf_counter() - start) / tokens)
            copy_bw.append(measure_copy_bandwidth(repeats=3))
    bw = statistics.median(copy_bw)
    rates = {name: nbytes / statistics.median(s) for name, s in seconds.items()}
    best = max(rates, key=rates.get)
    ratio = rates["tiled (cpu_kernels)"] / rates["torch F.linear per slice"]
    text = ", ".join(f"{name} {rate / 1e9:.1f} GB/s ({rate / bw:.0%})"
                     for name, rate in rates.items())
    return Comparison(
        "moe_expert_products", f"one MoE layer at batch 1 (top-{layer.top_k} of "
        f"{layer.n_experts}, d_expert {layer.d_expert}): tiled products over F.linear on the "
        f"expert slices, GB/s of the chosen experts' bytes", ratio, 1.0, ">=", "x", ratio >= 1.0,
        None if ratio >= 1.0 else f"{ratio:.2f}x: the tiled products were slower than F.linear",
        {"gb_per_s": {n: r / 1e9 for n, r in rates.items()}, "copy_bandwidth": bw,
               "bytes_per_token": nbytes, "best": best, "tokens": tokens, "rounds": rounds,
               "summary": f"{text} of {bw / 1e9:.1f} GB/s copy; fastest: {best}"},
        targeted=False)


def _decode_path(model: TinyGPT) -> str:
    """Which decode step generate() runs for this model at batch 1 (for the report)."""
    step = DecodeStep(model, KVCache.for_model(model, 1, 2))
    if not step.tiled:
        return f"the plain products ({step.tiled_reason})"
    if step._layers is not None:
        return f"{type(step._layers).__name__} (tinygpt.cpu_kernels: layers in C)"
    return "tiled CPU products, experts through tinygpt.moe.MoEDecode"


def seconds_per_token(model: TinyGPT, prompt: list[int], new_tokens: int) -> float:
    """Median gap between consecutive tokens of one greedy generate() (prefill excluded)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    stamps = [time.perf_counter() for _ in stream(model, prompt, params)]
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def decode_bandwidth_row(ctx: BenchContext, model: TinyGPT, *, targeted: bool) -> Comparison:
    """Batch-1 greedy decode through generate(): active bytes per token over the higher of the
    copy and read-only bandwidths (the median round's share; above 100% is NOT MET, the roof
    unreliable)."""
    new, rounds, prompt_len = (8, 1, 8) if ctx.quick else (48, 5, 8)
    info = model_bytes(model)
    prompt = random_prompt(prompt_len, model.cfg.vocab_size, ctx.seed)
    seconds_per_token(model, prompt, 3)                                   # tiles, warm-up
    moe = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, M.MoE)]
    ran = [len(ff.last_ran) for ff in moe]
    seconds, copy_bw, read_bw = [], [], []
    for _ in range(rounds):
        seconds.append(seconds_per_token(model, prompt, new))
        copy_bw.append(measure_copy_bandwidth(repeats=3))
        read_bw.append(measure_read_bandwidth(repeats=3))
    context = prompt_len + new // 2
    nbytes = info["dense"] + info["moe_layers"] * info["top_k"] * info["expert"] \
        + context * info["kv_per_position"]
    judged = median_round_share(nbytes, seconds, copy_bw, read_bw, BANDWIDTH_TARGET)
    value, pick = judged["share"], judged["round"]
    s, c_bw, r_bw = seconds[pick], copy_bw[pick], read_bw[pick]
    path = _decode_path(model)
    one_token = all(r == info["top_k"] for r in ran)
    figures = (f"round {pick + 1} of {rounds} (the median share): {nbytes / s / 1e9:.1f} GB/s "
               f"({1 / s:.1f} tokens/s) of {max(c_bw, r_bw) / 1e9:.1f} GB/s, the higher of "
               f"copy {c_bw / 1e9:.1f} and read {r_bw / 1e9:.1f} GB/s")
    reason = judged["reason"]
    if not one_token:
        reason = f"a batch-1 step ran {ran} experts per layer, not top_k={info['top_k']}"
    elif reason is not None and value <= 1:
        reason = f"{figures} on {path}"
    total = sum(p.numel() for p in model.parameters())
    return Comparison(
        "moe_decode_bandwidth", f"batch-1 greedy decode through generate(), a "
        f"{total / 1e6:.0f}M-parameter MoE model (top-{info['top_k']} of "
        f"{info['n_experts']}), active bytes per token / s over the higher of the copy and "
        f"read-only bandwidths", value, BANDWIDTH_TARGET, ">=", "fraction", reason is None,
        reason,
        {"seconds_per_token": s, "tokens_per_s": 1 / s, "bytes_per_token": nbytes,
         "gb_per_s": nbytes / s / 1e9, "copy_bandwidth": c_bw, "read_bandwidth": r_bw,
         "judged_against": judged["judged_against"], "round_seconds": seconds,
         "round_copy_bandwidth": copy_bw, "round_read_bandwidth": read_bw,
         "round_utilization": judged["round_shares"],
         "experts_run_per_layer": ran, "parameters": total, "decode_path": path,
         **{f"{k}_bytes": v for k, v in info.items() if k in ("dense", "expert")},
         "summary": f"{figures}; {nbytes / 1e6:.0f} MB active per token "
                    f"({info['dense'] / 1e6:.0f} MB dense + {info['moe_layers']} x "
                    f"{info['top_k']} experts of {info['expert'] / 1e6:.1f} MB + cache); "
                    f"{path}"},
        targeted=targeted)


def decode_bytes_row(ctx: BenchContext, model: TinyGPT, *, steps: int,
                     targeted: bool = True) -> Comparison:
    """Bytes per decode step from the experts each step ran, against the formula."""
    info = model_bytes(model)
    moe = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, M.MoE)]
    e, k = info["n_experts"], info["top_k"]
    per_batch, prompt_len = {}, 8
    for batch in BYTES_BATCHES:
        ids = torch.tensor([random_prompt(prompt_len, model.cfg.vocab_size, ctx.seed + 100 + b)
                            for b in range(batch)])
        cache = KVCache.for_model(model, batch, max_len=prompt_len + steps + 1)
        distinct, imbalance, seconds = [], [], []
        with torch.inference_mode():
            token = prefill(model, cache, ids).argmax(-1, keepdim=True)
            step = DecodeStep(model, cache)
            for _ in range(steps):
                start = time.perf_counter()
                with step.token_threads(batch):
                    token = step(token).argmax(-1, keepdim=True)
                seconds.append(time.perf_counter() - start)
                distinct.append(sum(len(ff.last_ran) for ff in moe))
                imbalance.extend(M.load_imbalance(ff.last_experts, e) for ff in moe)
        measured = info["dense"] + statistics.mean(distinct) * info["expert"]
        formula = M.moe_decode_bytes(info["dense"], info["expert"], info["moe_layers"], e, k,
                                     batch)
        per_batch[batch] = {
            "measured_bytes": measured, "formula_bytes": formula,
            "relative_error": measured / formula - 1,
            "distinct_per_layer": statistics.mean(distinct) / info["moe_layers"],
            "formula_distinct": M.expected_distinct_experts(e, k, batch),
            "mean_load_imbalance": statistics.mean(imbalance),
            "step_s": statistics.median(seconds)}
    worst = max(abs(r["relative_error"]) for r in per_batch.values())
    met = worst <= BYTES_TOLERANCE
    table = "; ".join(f"B={b}: {r['distinct_per_layer']:.1f} of {e} experts per layer "
                      f"(formula {r['formula_distinct']:.1f}), {r['measured_bytes'] / 1e6:.0f} MB"
                      f" ({r['relative_error']:+.1%}), {r['step_s'] * 1e3:.0f} ms"
                      for b, r in per_batch.items())
    return Comparison(
        "moe_decode_bytes", f"weight bytes per decode step at batch "
        f"{', '.join(map(str, BYTES_BATCHES))} from the experts the step ran vs "
        f"E (1 - (1 - k/E)^B) (top-{k} of {e}; random router weights: near-uniform routing)",
        worst, BYTES_TOLERANCE, "<=", "relative error", met,
        None if met else f"the largest deviation {worst:.1%}: {table}",
        {"per_batch": {str(b): r for b, r in per_batch.items()}, "steps": steps,
         "dense_bytes": info["dense"], "expert_bytes": info["expert"],
         "summary": table}, targeted=targeted)


def expert_parallel_row(ctx: BenchContext, model: TinyGPT, new_tokens: int) -> Comparison:
    """EP over 2 gloo ranks against one process: identical tokens, cost vs the cost model."""
    from tinygpt.parallel.experts import measure_ep_decode

    m = measure_ep_decode((model.cfg, model.state_dict()), EP_WORLD, batch=1, prompt_len=16,
                          new_tokens=new_tokens)
    same = sum(a == b for a, b in zip(m.tokens, m.one_tokens, strict=True))
    share = same / len(m.one_tokens)
    off = m.alltoall_seconds / m.predicted_alltoall_seconds if m.predicted_alltoall_seconds \
        else float("nan")
    summary = (f"{m.ep_step_seconds * 1e3:.1f} ms per step over {EP_WORLD} ranks vs "
               f"{m.one_step_seconds * 1e3:.1f} ms in one process; all-to-alls "
               f"{m.alltoall_seconds * 1e3:.2f} ms per step ({m.alltoall_calls:.0f} calls, "
               f"{m.alltoall_bytes / 1e3:.1f} kB sent) vs the cost model's "
               f"{m.predicted_alltoall_seconds * 1e3:.2f} ms ({off:.2f}x; link fitted here: "
               f"{m.link.latency * 1e6:.0f} us + bytes / {m.link.bandwidth / 1e9:.2f} GB/s); "
               f"all-gathers {m.gather_seconds * 1e3:.2f} ms vs "
               f"{m.predicted_gather_seconds * 1e3:.2f} ms; the rest (attention, experts, "
               f"head) {m.other_seconds * 1e3:.1f} ms")
    met = m.tokens_identical
    return Comparison(
        "moe_expert_parallel", f"greedy decode over {EP_WORLD} expert-parallel gloo ranks: "
        f"tokens identical to one process (batch 1, {new_tokens} tokens)", share, 1.0, ">=",
        "fraction", met, None if met else f"{same} of {len(m.one_tokens)} steps' tokens "
        f"identical", {
            "ep_step_s": m.ep_step_seconds, "one_step_s": m.one_step_seconds,
            "alltoall_s": m.alltoall_seconds, "predicted_alltoall_s":
            m.predicted_alltoall_seconds, "gather_s": m.gather_seconds,
            "predicted_gather_s": m.predicted_gather_seconds,
            "alltoall_calls": m.alltoall_calls, "alltoall_bytes": m.alltoall_bytes,
            "alltoall_measured_over_predicted": off, "expert_rows": m.expert_rows,
            "link": {"latency_s": m.link.latency, "bandwidth": m.link.bandwidth},
            "summary": summary})


def routing_widget_row() -> Comparison:
    """Distinct experts and bytes per step vs batch for three published MoE models."""
    batches = BYTES_BATCHES
    h100 = R.get_hardware("h100-sxm")
    models, lines = {}, []
    for name, c in PUBLISHED.items():
        n = published_parameters(c)
        e, k = c["n_routed_experts"], c["num_experts_per_tok"]
        size = WEIGHT_BYTES[c["dtype"]]
        rows = {b: {"distinct": M.expected_distinct_experts(e, k, b),
                    "bytes": M.moe_decode_bytes(n["dense"] * size, n["expert"] * size,
                                                n["moe_layers"], e, k, b)} for b in batches}
        # an H100 SXM's ridge in the checkpoint's dtype, per weight (tinygpt.roofline)
        critical = M.critical_batch(R.ridge_point(h100, c["dtype"]) * size, e, k)
        models[name] = {"parameters": n, "per_batch": {str(b): r for b, r in rows.items()},
                        "critical_batch_h100": critical,
                        "published_total_billions": PUBLISHED_TOTALS[name]}
        lines.append(f"{name} ({n['total'] / 1e9:.1f}B, {c['dtype']}): " + ", ".join(
            f"B={b} {r['distinct']:.1f} experts {r['bytes'] / 1e9:.1f} GB"
            for b, r in rows.items()) + f"; H100 critical batch {critical}")
    ds = models["DeepSeek-V3"]["per_batch"]
    ratio = ds[str(batches[-1])]["bytes"] / ds[str(batches[0])]["bytes"]
    return Comparison(
        "moe_routing_widget", f"DeepSeek-V3 weight bytes per decode step at batch "
        f"{batches[-1]} over batch 1 (uniform routing; also Qwen3-30B-A3B, Mixtral-8x7B)",
        ratio, 1.0, ">=", "x", ratio >= 1.0,
        None if ratio >= 1.0 else f"{ratio:.2f}x: fewer bytes at batch {batches[-1]} than at 1",
        {"models": models, "summary": " | ".join(lines)},
        targeted=False)


# --------------------------------------------------------------------------------------------
# the row groups


@register("moe_dispatch", day=20)
def moe_dispatch_rows(ctx: BenchContext) -> list[Comparison]:
    """MoE prefill: grouped dispatch against the per-token loop, three layer shapes."""
    shapes = DISPATCH_SHAPES[:1] if ctx.quick else DISPATCH_SHAPES
    tokens = 32 if ctx.quick else PREFILL_TOKENS
    rows = []
    for e, k, d_expert in shapes:
        ctx.log(f"moe_dispatch: {e} experts top-{k}, d_expert {d_expert}, {tokens} tokens ...")
        rows.append(dispatch_row(e, k, d_expert, tokens, ctx.seed, rounds=1 if ctx.quick else 5,
                                 targeted=not ctx.quick))
    return rows


@register("moe_decode", day=20)
def moe_decode_rows(ctx: BenchContext) -> list[Comparison]:
    """MoE decode: expert products, batch-1 bandwidth, bytes per step, expert parallelism.

    The bytes per step are checked against the uniform-routing formula; expert parallelism
    runs over 2 gloo ranks."""
    if not ctx.on_cpu:
        return ctx.skip("moe_decode", f"these rows are for the CPU, not {ctx.device}")
    cfg = MOE_QUICK_CONFIG if ctx.quick else MOE_DECODE_CONFIG
    ctx.log(f"moe_decode: building the {cfg.n_layers}-layer MoE model ...")
    model = ctx.build(cfg)
    ctx.log("moe_decode: one layer's experts on three kinds of products ...")
    rows = [products_row(model, 8 if ctx.quick else 40, 1 if ctx.quick else 5, ctx.seed)]
    ctx.log("moe_decode: batch-1 decode bandwidth ...")
    rows.append(decode_bandwidth_row(ctx, model, targeted=not ctx.quick))
    ctx.log(f"moe_decode: bytes per step at batch {BYTES_BATCHES} ...")
    rows.append(decode_bytes_row(ctx, model, steps=2 if ctx.quick else 6,
                                 targeted=not ctx.quick))
    ctx.log(f"moe_decode: expert parallelism over {EP_WORLD} gloo ranks ...")
    rows.append(expert_parallel_row(ctx, model, 4 if ctx.quick else 16))
    return rows


@register("moe_routing", day=20)
def moe_routing_rows(ctx: BenchContext) -> list[Comparison]:
    """The routing widget's numbers: distinct experts and bytes per step, published models."""
    return [routing_widget_row()]
