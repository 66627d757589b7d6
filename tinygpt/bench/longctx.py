"""Day 21's rows: long contexts on the CPU (tinygpt.mla, sliding windows), float32.

    mla_decode_4096   a batch-1 decode step of a DeepSeek-shaped multi-head latent attention
                      model (MLA_DECODE_CONFIG: 32 heads over a 512-wide latent, RoPE key 64,
                      2 layers, dense feed-forward) at a 4,096-token context: the absorbed
                      decode over the latent cache (MLAttention.decode = "absorbed") against
                      the naive decode tinygpt.mla offers (MLAttention.decode = "naive":
                      every step decompresses every cached latent into K and V through wkv_b);
                      >= 2x, with the largest logit difference between the two (float32
                      rounding: within LOGIT_TOLERANCE of the logits' scale, same greedy
                      token). mla.py has no cache of decompressed K and V; the row also times,
                      for information, one layer's attention over K and V decompressed once
                      beforehand (what an ordinary cache of the same heads would read), beside
                      the absorbed and naive attention of that layer
    mla_kv_bytes      the KV bytes per token the latent cache (KVCache.for_model) and the
                      engine's paged pool (PagedKVCache.for_model) hold, against
                      (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes: equal
    window_kv_flat    a sliding-window model (every layer windowed: W = 256, block size 16)
                      generating one long sequence through the engine (8,192 tokens in the
                      full plan): the blocks the sequence holds after each decode step; flat
                      after the window (the largest over the second half equals the largest
                      at the window's end: up to W + block positions, the first span that
                      straddles a block boundary), and its first tokens identical to the windowed
                      generate()'s (the reference, over a shorter prefix)
    sinks_ppl         SmolLM2-135M-Instruct (the real weights) teacher-forced over 32,768
                      tokens of the course's synthetic stories (tinygpt.long_context.
                      long_text) under StreamingLLM's cache: 4 sinks + a 1,020-token window;
                      its perplexity over positions 8,192 to 32,767 against its perplexity
                      inside the window (positions 512 to 1,023: the cache still holds every
                      token, and the text's first tokens, predicted from almost no context,
                      are left out): within 10%
    window_only_ppl   the same text with the window only (1,024 tokens, the same memory):
                      perplexity over positions 8,192 to 32,767 against inside the window:
                      at least 2x worse (StreamingLLM's finding on Llama-2 and others)

The quick plan (CI's smoke run) runs every row on small shapes, for information only, except
mla_kv_bytes and the whole window_kv_flat row (its flat blocks and its tokens both judged).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from tinygpt import mla as MLA
from tinygpt.bench.harness import Comparison, random_prompt
from tinygpt.bench.registry import BenchContext, register
from tinygpt.generate import generate
from tinygpt.kv_cache import KVCache
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.paged import DROPPED, PagedKVCache
from tinygpt.sampling import SamplingParams

MLA_CONTEXT, MLA_TARGET = 4096, 2.0
LOGIT_TOLERANCE = 1e-4          # largest |absorbed - naive| over the largest |logit|
PREFILL_CHUNK = 512

# 32 heads over a 512-wide latent (DeepSeek-V3's kv_lora_rank and RoPE key; nope and v 128),
# 2 layers with a dense feed-forward at D = 1024: 64.6M parameters.
MLA_DECODE_CONFIG = ModelConfig(vocab_size=8192, d_model=1024, n_layers=2, n_heads=32,
                                n_kv_heads=32, d_ff=2816, max_seq_len=MLA_CONTEXT + 16,
                                attention="mla", kv_lora_rank=512, qk_rope_head_dim=64,
                                qk_nope_head_dim=128, v_head_dim=128)
MLA_QUICK_CONFIG = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=8,
                               n_kv_heads=8, d_ff=256, max_seq_len=272, attention="mla",
                               kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                               v_head_dim=32)
MLA_QUICK_CONTEXT = 256

WINDOW, WINDOW_BLOCK = 256, 16
# 8,192 tokens (32 windows): 16,384 took 325 s through the engine on a 2-core AMD EPYC with
# AVX-512 at a load average of 6 (2026-11-27), past the couple of minutes a row should take
WINDOW_TOKENS, WINDOW_REFERENCE = 8192, 512
WINDOW_CONFIG = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=128, max_seq_len=WINDOW_TOKENS + 64, sliding_window=WINDOW)
WINDOW_QUICK = dict(window=16, block=4, tokens=160, reference=48)
WINDOW_PROMPT = 8

SINKS, SINK_WINDOW = 4, 1020          # StreamingLLM's 4 sinks; 1,024 cached tokens in all
SINK_TOKENS, SINK_FROM = 32768, 8192  # perplexity over positions 8,192 .. 32,767
SINK_QUICK = dict(window=252, tokens=1024, start=512)
SINK_TARGET, WINDOW_ONLY_TARGET = 1.10, 2.0


# --------------------------------------------------------------------------------------------
# multi-head latent attention


def _set_decode(model: TinyGPT, decode: str) -> None:
    for layer in model.layers:
        layer.attention.decode = decode


def fill_latent_cache(model: TinyGPT, context: int, seed: int) -> tuple[KVCache, list[int]]:
    """A batch-1 latent cache holding `context` random tokens (prefilled in chunks); returns
    it and the prompt, whose last token the decode steps feed again at position `context`."""
    prompt = random_prompt(context + 1, model.cfg.vocab_size, seed)
    cache = KVCache.for_model(model, 1, context + 1)
    with torch.inference_mode():
        for start in range(0, context, PREFILL_CHUNK):
            ids = torch.tensor([prompt[start:min(start + PREFILL_CHUNK, context)]])
            model(ids, kv_cache=cache)
    return cache, prompt


def decode_once(model: TinyGPT, cache: KVCache, token: int, decode: str) -> torch.Tensor:
    """One decode step at position cache.length (restored after): logits (V,)."""
    _set_decode(model, decode)
    length = cache.length
    try:
        with torch.inference_mode():
            return model(torch.tensor([[token]]), kv_cache=cache)[0, -1].float()
    finally:
        cache.length = length
        _set_decode(model, "absorbed")


def attention_seconds(model: TinyGPT, cache: KVCache, token: int, repeats: int
                      ) -> dict[str, float]:
    """Layer 0's attention for one query over the cached latents (median seconds): absorbed,
    naive (decompressing) and over K and V decompressed once beforehand."""
    attn, layer = model.layers[0].attention, cache.layers[0]
    n = cache.length
    c, k_pe = layer.c[:, :n], layer.k_pe[:, :n]
    with torch.inference_mode():
        x = model.tok_embeddings(torch.tensor([[token]]))
        cos, sin = model.rope_cos[n:n + 1], model.rope_sin[n:n + 1]
        q_nope, q_pe = attn.queries(x, cos, sin)
        k, v = attn.expand(c, k_pe)
        q = torch.cat([q_nope, q_pe], dim=-1)
        fns = {"absorbed": lambda: attn.attend_absorbed(q_nope, q_pe, c, k_pe, None),
               "naive": lambda: attn.attend_naive(q_nope, q_pe, c, k_pe, None),
               "decompressed_cache": lambda: torch.nn.functional.scaled_dot_product_attention(
                   q, k, v, scale=attn.scale)}
        out = {}
        for name, fn in fns.items():
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times)
    return out


def mla_decode_row(ctx: BenchContext, model: TinyGPT, context: int, *, rounds: int,
                   targeted: bool) -> Comparison:
    """Absorbed over naive decode at `context` tokens: the median of per-round ratios."""
    cache, prompt = fill_latent_cache(model, context, ctx.seed)
    token = prompt[context]
    absorbed = decode_once(model, cache, token, "absorbed")                # warm-up, logits
    naive = decode_once(model, cache, token, "naive")
    ratios, fast, slow = [], [], []
    for _ in range(rounds):
        for decode, seconds in (("absorbed", fast), ("naive", slow)):
            start = time.perf_counter()
            decode_once(model, cache, token, decode)
            seconds.append(time.perf_counter() - start)
        ratios.append(slow[-1] / fast[-1])
    speedup = statistics.median(ratios)
    diff = (absorbed - naive).abs().max().item()
    scale = naive.abs().max().item()
    same_token = int(absorbed.argmax()) == int(naive.argmax())
    close = diff <= LOGIT_TOLERANCE * max(scale, 1.0) and same_token
    layer_s = attention_seconds(model, cache, token, 3 if rounds > 1 else 1)
    met = close and speedup >= MLA_TARGET
    reason = None
    if not close:
        reason = (f"absorbed and naive logits differ by {diff:.3g} (largest logit {scale:.3g}"
                  f", same greedy token: {same_token}): not float32 rounding")
    elif not met:
        reason = f"{speedup:.2f}x is below {MLA_TARGET:g}x"
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    a_s, n_s = statistics.median(fast), statistics.median(slow)
    return Comparison(
        "mla_decode_4096", f"batch-1 decode step at a {context}-token context, absorbed over "
        f"naive (decompressing every cached latent each step), a {total / 1e6:.1f}M-parameter "
        f"MLA model ({cfg.n_heads} heads, latent {cfg.kv_lora_rank}, RoPE key "
        f"{cfg.qk_rope_head_dim}, {cfg.n_layers} layers), float32", speedup, MLA_TARGET, ">=",
        "x", met, reason,
        {"absorbed_s": a_s, "naive_s": n_s, "round_ratios": ratios, "context": context,
         "parameters": total, "max_logit_difference": diff, "max_abs_logit": scale,
         "same_greedy_token": same_token, "baseline": "MLAttention.decode='naive'",
         "layer0_attention_s": layer_s,
         "summary": f"the median of {rounds} rounds' ratios; the medians: absorbed "
                    f"{a_s * 1e3:.1f} ms, naive {n_s * 1e3:.1f} ms per step; logits "
                    f"differ by at most {diff:.2e} (largest |logit| {scale:.2f}), same token: "
                    f"{same_token}; layer 0's attention: absorbed "
                    f"{layer_s['absorbed'] * 1e3:.2f} ms, naive {layer_s['naive'] * 1e3:.1f} "
                    f"ms, over K and V decompressed beforehand "
                    f"{layer_s['decompressed_cache'] * 1e3:.2f} ms"},
        targeted=targeted)


def mla_bytes_row(model: TinyGPT, context: int) -> Comparison:
    """KV bytes per token of the latent cache and the engine's pool against the formula."""
    cfg = model.cfg
    size = model.tok_embeddings.weight.element_size()
    formula = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.n_layers * size
    cache = KVCache.for_model(model, 1, context)
    block_size, blocks = 16, -(-context // 16)
    pool = PagedKVCache.for_model(model, blocks, block_size)
    pool_bytes = pool.k.nbytes + (0 if pool.v is pool.k else pool.v.nbytes)
    measured = {"kv_cache": cache.nbytes / context,
                "paged_pool": pool_bytes / (blocks * block_size)}
    library = MLA.kv_bytes_per_token_mla(cfg, size)
    expanded = MLA.kv_bytes_per_token_expanded(cfg, size)
    worst = max(abs(v / formula - 1) for v in (*measured.values(), library))
    met = worst == 0
    return Comparison(
        "mla_kv_bytes", f"KV bytes per token of the latent cache and the engine's paged pool "
        f"vs (kv_lora_rank + qk_rope_head_dim) x layers x {size} B = {formula}", worst, 0.0,
        "<=", "relative error", met,
        None if met else f"measured {measured}, kv_bytes_per_token_mla {library}, formula "
        f"{formula}",
        {**{f"{k}_bytes_per_token": v for k, v in measured.items()}, "formula": formula,
         "kv_bytes_per_token_mla": library, "expanded_bytes_per_token": expanded,
         "summary": f"KVCache {measured['kv_cache']:.0f} B, paged pool "
                    f"{measured['paged_pool']:.0f} B per token = ({cfg.kv_lora_rank} + "
                    f"{cfg.qk_rope_head_dim}) x {cfg.n_layers} x {size}; decompressed K and V "
                    f"would take {expanded} B ({expanded / formula:.1f}x)"})


# --------------------------------------------------------------------------------------------
# sliding windows


def window_blocks(model: TinyGPT, prompt: list[int], new_tokens: int, block_size: int
                  ) -> tuple[list[int], list[int], float]:
    """Generate greedily through the engine; returns the tokens, the blocks the sequence
    holds after each step (index: tokens generated so far) and the seconds taken."""
    from tinygpt.engine import Engine

    total = len(prompt) + new_tokens
    engine = Engine(model, None, block_size=block_size, max_running=1,
                    num_blocks=-(-total // block_size) + 2, token_budget=256)
    pool = engine.runner.cache
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    rid = engine.add_request(prompt, params)
    held: list[int] = []
    tokens: list[int] = []
    start = time.perf_counter()
    while engine.has_work:
        for _, event in engine.step():
            tokens.append(event.token_id)
        table = pool.tables.get(rid)
        if table is not None and len(tokens) > len(held):
            held.append(sum(b != DROPPED for b in table))
    return tokens, held, time.perf_counter() - start


def window_row(ctx: BenchContext, model: TinyGPT, *, window: int, block: int, tokens: int,
               reference: int, targeted: bool) -> Comparison:
    """Blocks held per step of one long windowed generation: flat after the window."""
    prompt = random_prompt(WINDOW_PROMPT, model.cfg.vocab_size, ctx.seed)
    new = tokens - len(prompt)
    out, held, seconds = window_blocks(model, prompt, new, block)
    want = generate(model, prompt, SamplingParams(temperature=0.0,
                                                  max_new_tokens=reference - len(prompt)))
    same = out[:len(want.token_ids)] == want.token_ids
    # held[i]: after the (i + 1)-th generated token (len(prompt) + i positions cached). The
    # window's end: up to window + block positions, one block past the first full window,
    # where the window's span first straddles a block boundary (W / block blocks, then
    # (W - 1) // block + 2 once it straddles: the steady state's largest)
    at_window = max(held[:max(1, window + block - len(prompt))])
    second_half = max(held[len(held) // 2:])
    flat = second_half == at_window
    bound = (window - 1) // block + 2
    met = flat and same and at_window <= bound
    reason = None
    if not same:
        first = next(i for i, (a, b) in enumerate(zip(out, want.token_ids, strict=False))
                     if a != b)
        reason = f"the engine's tokens differ from generate()'s from token {first}"
    elif not met:
        reason = (f"the second half holds up to {second_half} blocks, the window's end "
                  f"{at_window} (bound {bound})")
    full_blocks = -(-tokens // block)
    return Comparison(
        "window_kv_flat", f"blocks a sliding-window sequence (W {window}, block size {block}, "
        f"{model.cfg.n_layers} layers) holds per engine step over {tokens} tokens: the largest "
        f"over the second half over the largest at the window's end", second_half / at_window,
        1.0, "<=", "x", met, reason,
        {"blocks_at_window_end": at_window, "blocks_second_half_max": second_half,
         "bound": bound, "blocks_without_window": full_blocks, "tokens": tokens,
         "reference_tokens": len(want.token_ids), "tokens_identical": same,
         "seconds": seconds, "tokens_per_s": new / seconds,
         "summary": f"{at_window} blocks held at the window's end, at most {second_half} over "
                    f"the second half (bound (W-1)/block + 2 = {bound}; {full_blocks} without a "
                    f"window); the first {len(want.token_ids)} tokens identical to generate(): "
                    f"{same}; {new} tokens in {seconds:.1f} s"},
        targeted=targeted)


# --------------------------------------------------------------------------------------------
# attention sinks


def sink_rows(ctx: BenchContext, model: TinyGPT, tokenizer, *, window: int, tokens: int,
              start: int, targeted: bool) -> list[Comparison]:
    """Perplexity past the window with sinks + window and with the window only, each against
    the perplexity inside the window (the same for both: the cache holds every token there)."""
    from tinygpt import long_context as LC

    ids = LC.long_text(tokenizer, tokens, seed=ctx.seed)
    chunk = min(256, model.cfg.max_seq_len - window - SINKS + 1)    # RoPE rows a chunk uses
    runs = {}
    for name, (w, s) in {"sinks": (window, SINKS), "window_only": (window + SINKS, 0)}.items():
        began = time.perf_counter()
        nll = LC.streaming_nll(model, ids, window=w, sinks=s, chunk=chunk)
        runs[name] = (nll, time.perf_counter() - began)
    # inside the window: its second half (the cache holds every token, and the text's first
    # tokens, predicted from almost no context, do not weigh on it)
    cache = window + SINKS
    inside = LC.perplexity(runs["sinks"][0], cache // 2 - 1, cache - 1)
    past = {name: LC.perplexity(nll, start - 1) for name, (nll, _) in runs.items()}
    common = {"tokens": tokens, "from_position": start, "window": window, "sinks": SINKS,
              "ppl_inside_window": inside, "ppl_sinks": past["sinks"],
              "ppl_window_only": past["window_only"],
              "seconds": {name: sec for name, (_, sec) in runs.items()}}
    where = f"positions {start:,} to {tokens - 1:,}"
    ratio = past["sinks"] / inside
    met = ratio <= SINK_TARGET
    sinks = Comparison(
        "sinks_ppl", f"SmolLM2 perplexity over {where} with {SINKS} sinks + a {window}-token "
        f"window, over its perplexity inside the window (positions {cache // 2:,} to "
        f"{cache - 1:,})", ratio, SINK_TARGET, "<=", "x", met,
        None if met else f"{past['sinks']:.3f} past the window against {inside:.3f} inside",
        {**common, "summary": f"perplexity {past['sinks']:.3f} over {where} with sinks, "
                              f"{inside:.3f} inside the window"}, targeted=targeted)
    ratio = past["window_only"] / inside
    met = ratio >= WINDOW_ONLY_TARGET
    alone = Comparison(
        "window_only_ppl", f"SmolLM2 perplexity over {where} with the window only "
        f"({window + SINKS} tokens, the same memory), over its perplexity inside the window",
        ratio, WINDOW_ONLY_TARGET, ">=", "x", met,
        None if met else (f"this model loses less without its first tokens than the target "
                          f"assumes: {past['window_only']:.3f} past the window against "
                          f"{inside:.3f} inside, {past['sinks']:.3f} with the sinks kept"),
        {**common, "summary": f"perplexity {past['window_only']:.3f} over {where} with the "
                              f"window only, {past['sinks']:.3f} with sinks, {inside:.3f} "
                              f"inside the window"}, targeted=targeted)
    return [sinks, alone]


# --------------------------------------------------------------------------------------------
# the row groups


@register("mla_decode", day=21)
def mla_decode_rows(ctx: BenchContext) -> list[Comparison]:
    """MLA decode at a 4,096-token context: absorbed against naive, KV bytes per token."""
    if not ctx.on_cpu:
        return ctx.skip("mla_decode", f"these rows are for the CPU, not {ctx.device}")
    cfg, context = (MLA_QUICK_CONFIG, MLA_QUICK_CONTEXT) if ctx.quick else \
        (MLA_DECODE_CONFIG, MLA_CONTEXT)
    model = ctx.build(cfg)
    ctx.log(f"mla_decode: prefilling {context} tokens, then absorbed and naive decode ...")
    rows = [mla_decode_row(ctx, model, context, rounds=1 if ctx.quick else 5,
                           targeted=not ctx.quick)]
    rows.append(mla_bytes_row(model, context))
    return rows


@register("window_kv", day=21)
def window_kv_rows(ctx: BenchContext) -> list[Comparison]:
    """A sliding-window model's blocks held per engine step: flat after the window."""
    if not ctx.on_cpu:
        return ctx.skip("window_kv", f"these rows are for the CPU, not {ctx.device}")
    if ctx.quick:
        q = WINDOW_QUICK
        cfg = dataclasses.replace(WINDOW_CONFIG, sliding_window=q["window"],
                                  max_seq_len=q["tokens"] + 64)
    else:
        q = dict(window=WINDOW, block=WINDOW_BLOCK, tokens=WINDOW_TOKENS,
                 reference=WINDOW_REFERENCE)
        cfg = WINDOW_CONFIG
    model = ctx.build(cfg)
    ctx.log(f"window_kv: {q['tokens']} tokens through the engine (W {q['window']}) ...")
    return [window_row(ctx, model, window=q["window"], block=q["block"], tokens=q["tokens"],
                       reference=q["reference"], targeted=True)]


@register("sinks", day=21)
def sinks_rows(ctx: BenchContext) -> list[Comparison]:
    """SmolLM2 past its window: perplexity with 4 sinks + the window and with the window only."""
    if not ctx.on_cpu:
        return ctx.skip("sinks", f"these rows are for the CPU, not {ctx.device}")
    from tinygpt.gguf import smollm2_path
    from tinygpt.loading import load_model

    try:
        smollm2_path()
    except FileNotFoundError as err:
        return ctx.skip("sinks", str(err), targeted=not ctx.quick)
    model, tokenizer, _ = load_model("smollm2")
    if ctx.quick:
        q = SINK_QUICK
    else:
        q = dict(window=SINK_WINDOW, tokens=SINK_TOKENS, start=SINK_FROM)
    ctx.log(f"sinks: SmolLM2 over {q['tokens']} tokens, {SINKS} sinks + window {q['window']}"
            f" and the window only ...")
    return sink_rows(ctx, model, tokenizer, window=q["window"], tokens=q["tokens"],
                     start=q["start"], targeted=not ctx.quick)
