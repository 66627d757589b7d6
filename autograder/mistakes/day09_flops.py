"""Day 09 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ------------------------------------------------------------------ param_breakdown
    Mistake("param_breakdown", "ignores GQA: wk and wv sized with n_heads", """
def param_breakdown(cfg):
    D, L = cfg.d_model, cfg.n_layers
    return {
        "embedding": cfg.vocab_size * D,
        "attention": L * 4 * D * D,
        "mlp": L * 3 * D * cfg.d_ff,
        "norms": L * 2 * D + D,
        "lm_head": 0 if cfg.tie_embeddings else D * cfg.vocab_size,
    }
"""),
    Mistake("param_breakdown", "a 2-matrix MLP (GPT-2 style) instead of SwiGLU's 3", """
def param_breakdown(cfg):
    D, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return {
        "embedding": cfg.vocab_size * D,
        "attention": L * (D * q_width + 2 * D * kv_width + q_width * D),
        "mlp": L * 2 * D * cfg.d_ff,
        "norms": L * 2 * D + D,
        "lm_head": 0 if cfg.tie_embeddings else D * cfg.vocab_size,
    }
"""),
    Mistake("param_breakdown", "counts the LM head even when it is tied to the embeddings", """
def param_breakdown(cfg):
    D, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return {
        "embedding": cfg.vocab_size * D,
        "attention": L * (D * q_width + 2 * D * kv_width + q_width * D),
        "mlp": L * 3 * D * cfg.d_ff,
        "norms": L * 2 * D + D,
        "lm_head": D * cfg.vocab_size,
    }
"""),
    Mistake("param_breakdown", "forgets the final norm", """
def param_breakdown(cfg):
    D, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return {
        "embedding": cfg.vocab_size * D,
        "attention": L * (D * q_width + 2 * D * kv_width + q_width * D),
        "mlp": L * 3 * D * cfg.d_ff,
        "norms": L * 2 * D,
        "lm_head": 0 if cfg.tie_embeddings else D * cfg.vocab_size,
    }
"""),
    # ------------------------------------------------------------------ weight_flops
    Mistake("weight_flops", "1 FLOP per multiply-add instead of 2", """
def weight_flops_per_token(cfg):
    parts = param_breakdown(cfg)
    return parts["attention"] + parts["mlp"] + cfg.d_model * cfg.vocab_size
"""),
    Mistake("weight_flops", "forgets the LM head", """
def weight_flops_per_token(cfg):
    parts = param_breakdown(cfg)
    return 2 * (parts["attention"] + parts["mlp"])
"""),
    Mistake("weight_flops", "2 x all parameters: counts the embedding lookup and norms", """
def weight_flops_per_token(cfg):
    return 2 * sum(param_breakdown(cfg).values())
"""),
    Mistake("weight_flops", "takes the LM head from param_breakdown: 0 when tied", """
def weight_flops_per_token(cfg):
    parts = param_breakdown(cfg)
    return 2 * (parts["attention"] + parts["mlp"] + parts["lm_head"])
"""),
    # ------------------------------------------------------------------ attention_flops
    Mistake("attention_flops", "uses n_kv_heads: thinks GQA reduces attention FLOPs", """
def attention_flops_per_token(cfg, context_len):
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    return 4 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context_len
"""),
    Mistake("attention_flops", "counts only the scores q.k (or 1 FLOP per multiply-add)", """
def attention_flops_per_token(cfg, context_len):
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    return 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context_len
"""),
    Mistake("attention_flops", "one layer only: forgets n_layers", """
def attention_flops_per_token(cfg, context_len):
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    return 4 * cfg.n_heads * cfg.head_dim * context_len
"""),
    Mistake("attention_flops", "clamps a bad context_len to 1 instead of raising", """
def attention_flops_per_token(cfg, context_len):
    context_len = max(context_len, 1)
    return 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context_len
"""),
    # ------------------------------------------------------------------ prefill_flops
    Mistake("prefill_flops", "counts only the causal triangle, not the square FlopCounterMode sees", """
def prefill_flops(cfg, batch, prompt_len):
    weights = batch * prompt_len * weight_flops_per_token(cfg)
    pairs = prompt_len * (prompt_len + 1) // 2
    return weights + batch * 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs
"""),
    Mistake("prefill_flops", "2NT only: forgets attention", """
def prefill_flops(cfg, batch, prompt_len):
    return batch * prompt_len * weight_flops_per_token(cfg)
"""),
    Mistake("prefill_flops", "attention linear in the prompt length (a decode step's cost)", """
def prefill_flops(cfg, batch, prompt_len):
    return batch * (prompt_len * weight_flops_per_token(cfg)
                    + attention_flops_per_token(cfg, prompt_len))
"""),
    Mistake("prefill_flops", "attention not multiplied by the batch", """
def prefill_flops(cfg, batch, prompt_len):
    weights = batch * prompt_len * weight_flops_per_token(cfg)
    return weights + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * prompt_len ** 2
"""),
    # ------------------------------------------------------------------ decode_flops
    Mistake("decode_flops", "forgets the batch", """
def decode_flops(cfg, batch, context_len):
    return weight_flops_per_token(cfg) + attention_flops_per_token(cfg, context_len)
"""),
    Mistake("decode_flops", "squares the context as in a prefill", """
def decode_flops(cfg, batch, context_len):
    return batch * (weight_flops_per_token(cfg)
                    + attention_flops_per_token(cfg, context_len) * context_len)
"""),
    Mistake("decode_flops", "weights only: forgets attention over the cache", """
def decode_flops(cfg, batch, context_len):
    return batch * weight_flops_per_token(cfg)
"""),
    # ------------------------------------------------------------------ weight_bytes
    Mistake("weight_bytes", "int4 stored as a whole byte", """
def weight_bytes(cfg, dtype):
    sizes = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 1}
    if dtype not in sizes:
        raise ValueError(f"dtype must be one of {sorted(sizes)}, got {dtype!r}")
    return sum(param_breakdown(cfg).values()) * sizes[dtype]
"""),
    Mistake("weight_bytes", "bits instead of bytes", """
def weight_bytes(cfg, dtype):
    bits = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}
    if dtype not in bits:
        raise ValueError(f"dtype must be one of {sorted(bits)}, got {dtype!r}")
    return sum(param_breakdown(cfg).values()) * bits[dtype]
"""),
    Mistake("weight_bytes", "unknown dtypes silently get 2 bytes", """
def weight_bytes(cfg, dtype):
    return math.ceil(sum(param_breakdown(cfg).values()) * BYTES_PER_ELEMENT.get(dtype, 2))
"""),
    Mistake("weight_bytes", "leaves out the embedding table", """
def weight_bytes(cfg, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    parts = param_breakdown(cfg)
    return math.ceil((sum(parts.values()) - parts["embedding"]) * BYTES_PER_ELEMENT[dtype])
"""),
    # ------------------------------------------------------------------ kv_cache_bytes
    Mistake("kv_cache_bytes", "caches n_heads heads: ignores GQA", """
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    elements = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * tokens * batch
    return math.ceil(elements * BYTES_PER_ELEMENT[dtype])
"""),
    Mistake("kv_cache_bytes", "forgets the factor 2: keys only", """
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    elements = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * batch
    return math.ceil(elements * BYTES_PER_ELEMENT[dtype])
"""),
    Mistake("kv_cache_bytes", "forgets the batch", """
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    elements = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens
    return math.ceil(elements * BYTES_PER_ELEMENT[dtype])
"""),
    Mistake("kv_cache_bytes", "uses d_model instead of the KV width n_kv_heads x head_dim", """
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    elements = 2 * cfg.n_layers * cfg.d_model * tokens * batch
    return math.ceil(elements * BYTES_PER_ELEMENT[dtype])
"""),
    Mistake("param_breakdown", "wq and wo sized D x D: assumes n_heads * head_dim == d_model", """
def param_breakdown(cfg):
    D, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    kv_width = cfg.n_kv_heads * hd
    return {
        "embedding": cfg.vocab_size * D,
        "attention": L * (2 * D * D + 2 * D * kv_width),
        "mlp": L * 3 * D * cfg.d_ff,
        "norms": L * 2 * D + D,
        "lm_head": 0 if cfg.tie_embeddings else D * cfg.vocab_size,
    }
""", says="head_dim"),
    Mistake("param_breakdown", "head width computed as d_model / n_heads instead of cfg.head_dim", """
def param_breakdown(cfg):
    D, L = cfg.d_model, cfg.n_layers
    hd = D // cfg.n_heads
    q_width, kv_width = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return {
        "embedding": cfg.vocab_size * D,
        "attention": L * (D * q_width + 2 * D * kv_width + q_width * D),
        "mlp": L * 3 * D * cfg.d_ff,
        "norms": L * 2 * D + D,
        "lm_head": 0 if cfg.tie_embeddings else D * cfg.vocab_size,
    }
""", says="head_dim"),
    Mistake("weight_flops", "attention weights from d_model: wq and wo taken as D x D", """
def weight_flops_per_token(cfg):
    D, L = cfg.d_model, cfg.n_layers
    attention = L * (2 * D * D + 2 * D * cfg.n_kv_heads * cfg.head_dim)
    return 2 * (attention + L * 3 * D * cfg.d_ff + D * cfg.vocab_size)
""", says="head_dim"),
    Mistake("attention_flops", "4 L D context_len: d_model in place of n_heads * head_dim", """
def attention_flops_per_token(cfg, context_len):
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    return 4 * cfg.n_layers * cfg.d_model * context_len
""", says="head_dim"),
    Mistake("weight_bytes", "forgets math.ceil: a float number of bytes", """
def weight_bytes(cfg, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    return sum(param_breakdown(cfg).values()) * BYTES_PER_ELEMENT[dtype]
""", says="whole number"),
    Mistake("weight_bytes", "int() rounds half a byte down", """
def weight_bytes(cfg, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    return int(sum(param_breakdown(cfg).values()) * BYTES_PER_ELEMENT[dtype])
""", says="round UP"),
    Mistake("weight_bytes", "round() to the nearest byte", """
def weight_bytes(cfg, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    return round(sum(param_breakdown(cfg).values()) * BYTES_PER_ELEMENT[dtype])
""", says="round UP"),
    Mistake("weight_bytes", "BYTES_PER_ELEMENT[dtype] unchecked: a KeyError for an unknown dtype", """
def weight_bytes(cfg, dtype):
    return math.ceil(sum(param_breakdown(cfg).values()) * BYTES_PER_ELEMENT[dtype])
""", says="KeyError"),
    Mistake("kv_cache_bytes", "head width as d_model // n_heads instead of cfg.head_dim", """
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    elements = 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * tokens * batch
    return math.ceil(elements * BYTES_PER_ELEMENT[dtype])
""", says="head_dim"),
    Mistake("kv_cache_bytes", "forgets math.ceil: a float number of bytes", """
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}, got {dtype!r}")
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * batch * BYTES_PER_ELEMENT[dtype]
""", says="whole number"),
    # ------------------------------------------------------------------ self-check
    Mistake("q1", "thinks attention arithmetic is slower", 'answer_q1 = "A"'),
    Mistake("q1", "thinks decode recomputes the prompt", 'answer_q1 = "B"'),
    Mistake("q2", "used the sparse 1,979 TFLOP/s", """
answer_q2 = prefill_flops(LLAMA2_7B, 1, 512) / 1979e12 * 1e3
"""),
    Mistake("q2", "answered in seconds", """
answer_q2 = prefill_flops(LLAMA2_7B, 1, 512) / 989.4e12
"""),
    Mistake("q2", "the nominal 7.0e9 parameters (2 x 7e9 x 512 FLOPs)", """
answer_q2 = 2 * 7.0e9 * 512 / 989.4e12 * 1e3
""", says="nominal"),
    Mistake("q3", "thinks GQA also cuts attention FLOPs", 'answer_q3 = "A"'),
    Mistake("q3", "swapped: FLOPs shrink, bytes stay", 'answer_q3 = "C"'),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'ignores GQA: wk and wv sized with n_heads': ('weight_flops', 'attention_flops', 'weight_bytes'),
    'a 2-matrix MLP (GPT-2 style) instead of SwiGLU': ('weight_flops', 'attention_flops'),
    'forgets the LM head': ('attention_flops', 'prefill_flops', 'decode_flops'),
    '1 FLOP per multiply-add instead of 2': ('attention_flops',),
    '2 x all parameters: counts the embedding lookup and norms': ('attention_flops',),
    'takes the LM head from param_breakdown: 0 when tied': ('attention_flops',),
    'one layer only: forgets n_layers': ('decode_flops',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'q2: answer_q2 = prefill_flops(LLAMA2_7B, 1, 512) / 989.4e12 * 1e3 => answer_q2 = prefill_flops(LLAMA2_7B, 1, 513) / 989.4e12 * 1e3':
        "within the question's stated tolerance",
    'q2: answer_q2 = prefill_flops(LLAMA2_7B, 1, 512) / 989.4e12 * 1e3 => answer_q2 = prefill_flops(LLAMA2_7B, 1, 511) / 989.4e12 * 1e3':
        "within the question's stated tolerance",
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('param_breakdown', 'numpy ints', '''
def param_breakdown(cfg):
    D = np.int64(cfg.d_model)
    return dict(embedding=cfg.vocab_size * D,
                attention=cfg.n_layers * D * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads),
                mlp=cfg.n_layers * 3 * D * cfg.d_ff,
                norms=(2 * cfg.n_layers + 1) * D,
                lm_head=0 if cfg.tie_embeddings else cfg.vocab_size * D)
'''),
    Alternative('weight_flops', 'direct formula', '''
def weight_flops_per_token(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attn = cfg.n_layers * (2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd)
    mlp = cfg.n_layers * 3 * D * cfg.d_ff
    return 2 * (attn + mlp + D * cfg.vocab_size)
'''),
    Alternative('prefill_flops', 'keyword call', '''
def prefill_flops(cfg, batch, prompt_len):
    tokens = batch * prompt_len
    return tokens * weight_flops_per_token(cfg=cfg) + tokens * attention_flops_per_token(cfg=cfg, context_len=prompt_len)
'''),
    Alternative('decode_flops', 'keywords', '''
def decode_flops(cfg, batch, context_len):
    return batch * weight_flops_per_token(cfg=cfg) + batch * attention_flops_per_token(cfg, context_len=context_len)
'''),
    Alternative('weight_bytes', 'int4 via integer ceil', '''
def weight_bytes(cfg, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(BYTES_PER_ELEMENT)}")
    n = sum(param_breakdown(cfg).values())
    if dtype == "int4":
        return (n + 1) // 2
    return n * int(BYTES_PER_ELEMENT[dtype])
'''),
    Alternative('kv_cache_bytes', 'per-token bytes times tokens', '''
def kv_cache_bytes(cfg, tokens, batch, dtype):
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype {dtype!r} not in {list(BYTES_PER_ELEMENT)}")
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * BYTES_PER_ELEMENT[dtype]
    return math.ceil(per_token * tokens * batch)
'''),
    Alternative('q2', 'via HARDWARE', '''
answer_q2 = prefill_flops(LLAMA2_7B, 1, 512) / 989.4e12 * 1000'''),
]
