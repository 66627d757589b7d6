"""Day 09: counting parameters, FLOPs and bytes of a Llama-style decoder.

Everything here is arithmetic on a `ModelConfig`; no tensors are created. The counts follow the
weights of `tinygpt.model.TinyGPT` (names in brackets):

    embedding   tok_embeddings (V, D)                              a lookup, not a matmul
    attention   per layer wq (D, H*hd), wk and wv (D, Hkv*hd), wo (H*hd, D)
    mlp         per layer w1 and w3 (D, d_ff), w2 (d_ff, D)        SwiGLU: three matrices
    norms       per layer attention_norm and ffn_norm (D,), one final norm (D,)
                [+ q_norm and k_norm (hd,) per layer with cfg.qk_norm]
    lm_head     output (D, V), absent when tie_embeddings reuses tok_embeddings

A mixture of experts (day 20, cfg.is_moe) has on each sparse layer, in place of one SwiGLU,
a router gate (D, E), E routed experts of three (D, d_expert) matrices and S shared experts
(one SwiGLU of width S * d_expert); "mlp" counts all of it. Memory holds every expert
(param_count, weight_bytes), but one token multiplies only its top_k routed experts (plus the
router and the shared ones): the FLOPs (matmul_params, weight_flops_per_token and all that
build on them) count those active weights, and the bytes a pass reads (weights_read_bytes,
decode_step_bytes, prefill_bytes) the experts its tokens chose: exactly top_k per sparse
layer for one token, the expected number under uniform routing for more
(tinygpt.moe.expected_distinct_experts, as tinygpt.moe.moe_decode_bytes counts them).

Conventions used throughout (each is a choice; the docstrings say where it matters):
- A multiply-add is 2 FLOPs. A matmul (m, k) @ (k, n) is 2*m*k*n FLOPs.
- Only matmuls are counted: norms, RoPE, softmax, SiLU and residual adds are a few FLOPs per
  activation, well under 1% of the total for real models, and torch's FlopCounterMode ignores
  them too, so our counts can be checked against it exactly.
- Weight FLOPs per token = 2 x every weight a token multiplies (LM head included, embedding
  lookup and norms excluded). Attention FLOPs (Q K^T and A V) grow with the context length.
- Bytes are for the weights and the KV cache; activations are assumed to stay on chip.
"""

from __future__ import annotations

import math

from tinygpt.model import ModelConfig
from tinygpt.moe import expected_distinct_experts

# Storage width of one number, in bits, for each dtype name the calculators accept.
DTYPE_BITS: dict[str, int] = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}


# --------------------------------------------------------------------------- input checks


def _check_cfg(cfg: object) -> ModelConfig:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a tinygpt.model.ModelConfig, got {type(cfg).__name__}")
    return cfg


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_dtype(name: str, dtype: object) -> str:
    if dtype not in DTYPE_BITS:
        raise ValueError(f"{name} must be one of {sorted(DTYPE_BITS)}, got {dtype!r}")
    return dtype  # type: ignore[return-value]


def bytes_per_element(dtype: str) -> float:
    """Bytes one number takes in `dtype`: fp32 4, bf16/fp16 2, int8 1, int4 0.5."""
    return DTYPE_BITS[_check_dtype("dtype", dtype)] / 8


# --------------------------------------------------------------------------- parameters


def _expert_params(cfg: ModelConfig) -> int:
    """Parameters of one routed expert: w1, w3 (d_expert, D) and w2 (D, d_expert)."""
    return 3 * cfg.d_model * cfg.d_expert


def _mlp_params(cfg: ModelConfig, routed: float) -> float:
    """Feed-forward parameters of all layers when `routed` experts per sparse layer count:
    dense layers 3 D d_ff; sparse ones the router E D, the shared experts and `routed`
    routed experts."""
    n_moe = len(cfg.moe_layers)
    dense = (cfg.n_layers - n_moe) * 3 * cfg.d_model * cfg.d_ff
    if not n_moe:
        return dense
    router = cfg.n_experts * cfg.d_model
    shared = cfg.n_shared_experts * _expert_params(cfg)
    return dense + n_moe * (router + shared + routed * _expert_params(cfg))


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter count of TinyGPT(cfg) per group.

    Returns {"embedding", "attention", "mlp", "norms", "lm_head"}; "lm_head" is 0 when the
    embeddings are tied (the LM head then reuses the embedding matrix). Attention per layer is
    D*H*hd (wq) + 2*D*Hkv*hd (wk, wv) + H*hd*D (wo): grouped-query attention shrinks wk and wv.
    For a mixture of experts "mlp" holds every feed-forward weight: the dense layers' SwiGLUs
    and each sparse layer's router, all E routed experts and the shared ones (see
    active_param_breakdown for what one token uses). "norms" includes q/k norm weights.
    Multi-head latent attention (day 21): "attention" holds its projections
    (tinygpt.mla.mla_parameters less the latent norms, which "norms" holds).
    """
    _check_cfg(cfg)
    d, hd, layers = cfg.d_model, cfg.head_dim, cfg.n_layers
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    attention = d * q_width + 2 * d * kv_width + q_width * d
    latent_norms = 0
    if cfg.attention == "mla":
        from tinygpt.mla import mla_parameters

        latent_norms = cfg.q_lora_rank + cfg.kv_lora_rank
        attention = mla_parameters(cfg) - latent_norms
    return {
        "embedding": cfg.vocab_size * d,
        "attention": layers * attention,
        "mlp": int(_mlp_params(cfg, cfg.n_experts)),
        "norms": layers * (2 * d + latent_norms) + d + (layers * 2 * hd if cfg.qk_norm else 0),
        "lm_head": 0 if cfg.tie_embeddings else d * cfg.vocab_size,
    }


def active_param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """param_breakdown with "mlp" holding only what one token uses: on each sparse layer the
    router, the shared experts and top_k of the E routed experts (the dense layers whole).
    Equals param_breakdown for a dense model; its sum is
    tinygpt.model.count_active_parameters(cfg), the "active parameters" of model cards."""
    parts = param_breakdown(cfg)
    parts["mlp"] = int(_mlp_params(cfg, cfg.top_k))
    return parts


def param_count(cfg: ModelConfig) -> int:
    """Total parameters of TinyGPT(cfg): equals sum(p.numel() for p in model.parameters())
    and tinygpt.model.count_parameters(cfg); for a mixture of experts every expert counts."""
    return sum(param_breakdown(cfg).values())


def matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies in a forward pass: attention + MLP + the LM head.

    The LM head is the (D, V) matrix whether or not it is tied to the embeddings; the
    embedding lookup (a row gather) and the norms (elementwise) are not matmuls. For a
    mixture of experts the MLP is the active one (active_param_breakdown): the router, the
    shared experts and the token's top_k routed experts on each sparse layer.
    """
    parts = active_param_breakdown(cfg)
    return parts["attention"] + parts["mlp"] + cfg.d_model * cfg.vocab_size


def gpt2_param_count(vocab_size: int = 50257, d_model: int = 768, n_layers: int = 12,
                     n_positions: int = 1024) -> int:
    """Exact parameter count of an original GPT-2 (tied LM head), e.g. 124,439,808 for small.

    GPT-2 is not Llama-style: it has learned position embeddings (n_positions, D), biases on
    every linear layer, LayerNorm with weight and bias, and a 2-matrix GELU MLP of width 4D.
    Per layer: qkv (D, 3D) + 3D, proj (D, D) + D, fc (D, 4D) + 4D, proj (4D, D) + D, two
    LayerNorms 4D: 12 D^2 + 13 D. Plus V*D + n_positions*D + a final LayerNorm 2D.
    """
    for name, value in (("vocab_size", vocab_size), ("d_model", d_model),
                        ("n_layers", n_layers), ("n_positions", n_positions)):
        _check_int(name, value)
    d = d_model
    return vocab_size * d + n_positions * d + n_layers * (12 * d * d + 13 * d) + 2 * d


# --------------------------------------------------------------------------- FLOPs


def weight_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of the weight matmuls for one token: 2 x matmul_params(cfg) (about 2N; for a
    mixture of experts about 2 x the active parameters, not the total)."""
    return 2 * matmul_params(cfg)


def _score_value_width(cfg: ModelConfig) -> int:
    """Per query head and key: the width of q . k plus that of the value summed, 2 head_dim;
    multi-head latent attention (day 21) over its decompressed keys and values:
    qk_nope_head_dim + qk_rope_head_dim + v_head_dim."""
    if cfg.attention == "mla":
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return 2 * cfg.head_dim


def attention_flops_per_token(cfg: ModelConfig, context_len: int) -> int:
    """FLOPs of Q K^T and A V for one query token that attends to `context_len` keys.

    Per layer and query head: the scores q . k cost 2*hd per key, the weighted sum of values
    another 2*hd per key, so 4 * n_layers * n_heads * head_dim * context_len in all. GQA does
    not reduce this (every query head still scores every key); it only shrinks the cache.
    Multi-head latent attention (day 21) is counted over decompressed keys and values, as
    its prefill computes it: 2 x (qk_nope + qk_rope + v) per key instead of 4 x head_dim;
    its absorbed decode scores latents instead (tinygpt.mla's docstring: more FLOPs, fewer
    bytes).
    """
    _check_cfg(cfg)
    _check_int("context_len", context_len)
    return 2 * cfg.n_layers * cfg.n_heads * _score_value_width(cfg) * context_len


def flops_per_token(cfg: ModelConfig, context_len: int) -> int:
    """Weight FLOPs plus attention FLOPs of one token attending to `context_len` keys."""
    return weight_flops_per_token(cfg) + attention_flops_per_token(cfg, context_len)


def attention_scores_count(prompt_len: int, attention: str = "full") -> int:
    """Query-key pairs a prefill of `prompt_len` tokens computes, per sequence, layer, head.

    "full": prompt_len**2, what a dense kernel computes before masking (and what
    torch's FlopCounterMode reports: it ignores the mask). "causal": prompt_len*(prompt_len+1)/2,
    only the pairs the causal mask keeps (the diagonal included), roughly what a kernel that
    skips fully masked tiles (FlashAttention) performs.
    """
    _check_int("prompt_len", prompt_len)
    if attention == "full":
        return prompt_len * prompt_len
    if attention == "causal":
        return prompt_len * (prompt_len + 1) // 2
    raise ValueError(f"attention must be one of ['causal', 'full'], got {attention!r}")


def prefill_flops(cfg: ModelConfig, batch: int, prompt_len: int, *, attention: str = "full",
                  all_logits: bool = True) -> int:
    """FLOPs of one forward pass over a (batch, prompt_len) block of prompt tokens.

    = batch * prompt_len * weight FLOPs per token
      + batch * 4 * n_layers * n_heads * head_dim * attention_scores_count(prompt_len, attention)

    Default `attention="full"` counts the whole T x T score square: a dense SDPA computes it
    and masks afterwards, and FlopCounterMode counts it that way, so the default is what can be
    checked; `attention="causal"` counts the T(T+1)/2 unmasked pairs, the useful work.
    `all_logits=True` applies the LM head at every position, as a training-style forward that
    returns (batch, prompt_len, V) logits does; generation only needs the last position's
    logits, so `all_logits=False` applies it once per sequence.

    Example: Llama-2-7B, batch 1, 512 tokens: 6.77e12 (weights) + 0.14e12 (attention) = 6.90e12.
    """
    _check_int("batch", batch)
    head = cfg.d_model * cfg.vocab_size
    body = weight_flops_per_token(cfg) - 2 * head
    head_positions = prompt_len if all_logits else 1
    scores = attention_scores_count(prompt_len, attention)
    per_sequence = (prompt_len * body + head_positions * 2 * head
                    + 2 * cfg.n_layers * cfg.n_heads * _score_value_width(cfg) * scores)
    return batch * per_sequence


def decode_flops(cfg: ModelConfig, batch: int, context_len: int) -> int:
    """FLOPs of one decode step: `batch` sequences each feed one new token.

    `context_len` is the number of keys the new token attends to, itself included (the cache
    held context_len - 1 tokens before the step). = batch * flops_per_token(cfg, context_len).
    """
    _check_int("batch", batch)
    return batch * flops_per_token(cfg, context_len)


# --------------------------------------------------------------------------- bytes


def weight_bytes(cfg: ModelConfig, dtype: str, *, group_size: int | None = None) -> int:
    """Bytes to store every parameter of TinyGPT(cfg) in `dtype` (rounded up to whole bytes).

    dtype: one of "fp32" (4 bytes), "bf16"/"fp16" (2), "int8" (1), "int4" (0.5 per weight).
    Quantization scales are ignored by default. With `group_size` (int8/int4 only), one fp16
    scale per `group_size` consecutive weights is added (symmetric quantization, no zero
    points): e.g. int4 with group 128 costs 0.5 + 2/128 = 0.516 bytes per weight (+3%).
    Simplification: every parameter, norms and embeddings included, is counted at `dtype`.
    This is what must fit in memory: a mixture of experts counts all of its experts
    (tinygpt.kv_cache.max_batch_that_fits leaves the rest to the KV cache).
    """
    bits = DTYPE_BITS[_check_dtype("dtype", dtype)]
    n = param_count(cfg)
    total = math.ceil(n * bits / 8)
    if group_size is not None:
        if dtype not in ("int8", "int4"):
            raise ValueError(f"group_size only applies to dtype 'int8' or 'int4', got {dtype!r}")
        total += math.ceil(n / _check_int("group_size", group_size)) * 2
    return total


def kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int, dtype: str) -> int:
    """Bytes of the KV cache: 2 (K and V) x layers x kv_heads x head_dim x bytes x tokens x batch.

    With GQA only the n_kv_heads heads are cached: Llama-2-70B (8 of 64 heads) needs 1.34 GB
    for 4,096 bf16 tokens instead of the 10.7 GB a 64-head cache would. Multi-head latent
    attention (day 21) caches layers x (kv_lora_rank + qk_rope_head_dim) per token instead
    (tinygpt.mla.kv_bytes_per_token_mla): DeepSeek-V3, 70,272 bf16 bytes per token.
    """
    _check_cfg(cfg)
    _check_int("tokens", tokens, minimum=0)
    _check_int("batch", batch)
    bits = DTYPE_BITS[_check_dtype("dtype", dtype)]
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim
    if cfg.attention == "mla":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    elements = cfg.n_layers * per_layer * tokens * batch
    return math.ceil(elements * bits / 8)


def routed_experts_read(cfg: ModelConfig, tokens: int) -> float:
    """Routed experts per sparse layer whose weights a pass over `tokens` tokens reads: top_k
    for one token (exactly); for more, E (1 - (1 - k/E)^tokens), the expected number of
    distinct experts under uniform routing (tinygpt.moe.expected_distinct_experts; a skewed
    router touches fewer). 0 for a dense model."""
    _check_cfg(cfg)
    _check_int("tokens", tokens)
    if not cfg.is_moe:
        return 0
    if tokens == 1:
        return cfg.top_k
    return expected_distinct_experts(cfg.n_experts, cfg.top_k, tokens)


def weights_read_bytes(cfg: ModelConfig, tokens: int, dtype: str) -> int:
    """Bytes of weights one forward pass over `tokens` tokens (all sequences) must read.

    Every matrix and norm is read once, however many tokens share it. The untied embedding
    table is the exception: the lookup gathers only `tokens` rows of it (tokens x D). When the
    embeddings are tied the table is read whole by the LM head, and the gather adds its rows.

    A mixture of experts reads, on each sparse layer, the router, the shared experts and only
    the routed experts its tokens chose (routed_experts_read): at tokens=1, a batch-1 decode
    step, its active weights (active_param_breakdown); for more tokens the expected distinct
    experts under uniform routing, which is tinygpt.moe.moe_decode_bytes's count (use that
    with measured bytes per expert, or expert_load of a real routing, for a real batch).
    """
    bpe = bytes_per_element(dtype)
    _check_int("tokens", tokens)
    parts = param_breakdown(cfg)
    whole = parts["attention"] + _mlp_params(cfg, routed_experts_read(cfg, tokens)) \
        + parts["norms"] + cfg.d_model * cfg.vocab_size
    return math.ceil((whole + tokens * cfg.d_model) * bpe)


def decode_step_bytes(cfg: ModelConfig, batch: int, context_len: int, dtype: str,
                      kv_dtype: str | None = None) -> int:
    """Bytes one decode step must read: the weights once plus the whole KV cache.

    = weights_read_bytes(cfg, batch, dtype) + kv_cache_bytes(cfg, context_len, batch, kv_dtype)
    with `context_len` >= 1 keys per sequence as in decode_flops (the new token's own key
    included); `kv_dtype` defaults to `dtype`.
    Activations (a few vectors of width D per sequence) are ignored. A mixture of experts at
    batch 1 reads its active weights (top_k routed experts per sparse layer), at batch > 1
    the experts its batch is expected to touch (see weights_read_bytes and
    tinygpt.moe.moe_decode_bytes): more than the active weights, at most all of them.
    """
    _check_int("batch", batch)
    _check_int("context_len", context_len)
    kv = dtype if kv_dtype is None else kv_dtype
    return weights_read_bytes(cfg, batch, dtype) + kv_cache_bytes(cfg, context_len, batch, kv)


def prefill_bytes(cfg: ModelConfig, batch: int, prompt_len: int, dtype: str,
                  kv_dtype: str | None = None) -> int:
    """Bytes a prefill moves: the weights once plus the KV cache it writes for every token.

    = weights_read_bytes(cfg, batch * prompt_len, dtype) + kv_cache_bytes(cfg, prompt_len,
    batch, kv_dtype). Activations are ignored (assumed to stay in caches / SRAM).
    """
    _check_int("batch", batch)
    _check_int("prompt_len", prompt_len)
    kv = dtype if kv_dtype is None else kv_dtype
    return (weights_read_bytes(cfg, batch * prompt_len, dtype)
            + kv_cache_bytes(cfg, prompt_len, batch, kv))


# --------------------------------------------------------------------------- latency


def estimate_latency(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    """Lower bound on the seconds an operation takes: max(flops / peak_flops, nbytes / bandwidth).

    flops: FLOPs (a count). peak_flops: FLOP/s (a rate). nbytes: bytes. bandwidth: bytes/s.
    The slower of computing and moving memory wins, assuming the two overlap perfectly.
    """
    for name, value in (("flops", flops), ("nbytes", nbytes)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    for name, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
                or math.isinf(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return max(flops / peak_flops, nbytes / bandwidth)


# --------------------------------------------------------------------------- presets

PRESETS: dict[str, ModelConfig] = {
    # Meta's published configs (params.json / Hugging Face config.json of each release).
    "llama-2-7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=32, d_ff=11008, max_seq_len=4096),
    "llama-2-13b": ModelConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40,
                               n_kv_heads=40, d_ff=13824, max_seq_len=4096),
    "llama-2-70b": ModelConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, d_ff=28672, max_seq_len=4096),
    "llama-3-8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_base=500000.0),
    "llama-3-70b": ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, d_ff=28672, max_seq_len=8192, rope_base=500000.0),
    # GPT-2 small as a Llama-style stand-in: same vocab, width, depth, heads, context and tied
    # head. d_ff = 2048 = (2/3) * 4D makes the 3-matrix SwiGLU MLP exactly as large (and as
    # many FLOPs) as GPT-2's 2-matrix GELU MLP of width 4D = 3072. What the stand-in lacks:
    # learned position embeddings (1024 x 768), biases and LayerNorm biases, so param_count
    # is 123,551,232, 888,576 short of GPT-2's 124,439,808 (see gpt2_param_count).
    "gpt2-small": ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12,
                              n_kv_heads=12, d_ff=2048, max_seq_len=1024, tie_embeddings=True),
    # The course's shipped checkpoint, tinygpt/data/config.json (842,880 parameters); flops
    # does not read the file at import, so tests/test_course_facts.py keeps the two equal.
    "tinygpt": ModelConfig(vocab_size=408, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                           d_ff=352, max_seq_len=1024),
}
