"""Day 05 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ---- rms_norm
    Mistake("rms_norm", "subtracts the mean first: that is LayerNorm", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 = x32 - x32.mean(dim=-1, keepdim=True)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
"""),
    Mistake("rms_norm", "adds eps outside the square root", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 = x32 / (x32.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)
    return weight * x32.to(x.dtype)
"""),
    Mistake("rms_norm", "forgets eps", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True))
    return weight * x32.to(x.dtype)
"""),
    Mistake("rms_norm", "normalizes over the first dimension instead of the last", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=0, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
"""),
    Mistake("rms_norm", "normalizes over the whole tensor, not each position", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean() + eps)
    return weight * x32.to(x.dtype)
"""),
    Mistake("rms_norm", "computes in the input dtype: float16 squares overflow", """
def rms_norm(x, weight, eps=1e-5):
    return weight * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))
"""),
    Mistake("rms_norm", "computes in float32 but never converts back to x.dtype", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps))
"""),
    Mistake("rms_norm", "forgets the learned weight", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
"""),
    Mistake("rms_norm", "divides by the standard deviation (torch.std) instead of the RMS", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    return weight * (x32 / torch.sqrt(x32.var(dim=-1, keepdim=True) + eps)).to(x.dtype)
"""),
    Mistake("rms_norm", "normalizes in place: x.float() is x itself for a float32 x", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 *= torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
""", says="in place"),
    Mistake("rms_norm", "ignores the eps argument (a hard-coded 1e-5)", """
def rms_norm(x, weight, eps=1e-5):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + 1e-5)
    return weight * x32.to(x.dtype)
""", says="not a fixed 1e-5"),
    # ---- swiglu
    Mistake("swiglu", "silu on the up projection instead of the gate", """
def swiglu(x, w1, w2, w3):
    return ((x @ w1.T) * F.silu(x @ w3.T)) @ w2.T
"""),
    Mistake("swiglu", "silu applied to the product of the two projections", """
def swiglu(x, w1, w2, w3):
    return F.silu((x @ w1.T) * (x @ w3.T)) @ w2.T
"""),
    Mistake("swiglu", "sigmoid instead of silu (plain GLU)", """
def swiglu(x, w1, w2, w3):
    return (torch.sigmoid(x @ w1.T) * (x @ w3.T)) @ w2.T
""", says="not sigmoid or GELU"),
    Mistake("swiglu", "GELU instead of silu", """
def swiglu(x, w1, w2, w3):
    return (F.gelu(x @ w1.T) * (x @ w3.T)) @ w2.T
""", says="not sigmoid or GELU"),
    Mistake("swiglu", "two-matrix MLP: drops the up projection", """
def swiglu(x, w1, w2, w3):
    return F.silu(x @ w1.T) @ w2.T
"""),
    # ---- block_forward
    Mistake("block_forward", "post-norm: normalizes after each residual addition", """
def block_forward(x, p, cfg, cos, sin):
    h = rms_norm(x + attention_forward(x, p, cfg, cos, sin), p["attention_norm.weight"],
                 cfg.norm_eps)
    out = h + swiglu(h, p["feed_forward.w1.weight"], p["feed_forward.w2.weight"],
                     p["feed_forward.w3.weight"])
    return rms_norm(out, p["ffn_norm.weight"], cfg.norm_eps)
"""),
    Mistake("block_forward", "adds the sublayer to the normalized x instead of x", """
def block_forward(x, p, cfg, cos, sin):
    xn = rms_norm(x, p["attention_norm.weight"], cfg.norm_eps)
    h = xn + attention_forward(xn, p, cfg, cos, sin)
    hn = rms_norm(h, p["ffn_norm.weight"], cfg.norm_eps)
    return hn + swiglu(hn, p["feed_forward.w1.weight"], p["feed_forward.w2.weight"],
                       p["feed_forward.w3.weight"])
"""),
    Mistake("block_forward", "parallel block: the MLP reads x instead of h", """
def block_forward(x, p, cfg, cos, sin):
    h = x + attention_forward(rms_norm(x, p["attention_norm.weight"], cfg.norm_eps), p, cfg,
                              cos, sin)
    xn = rms_norm(x, p["ffn_norm.weight"], cfg.norm_eps)
    return h + swiglu(xn, p["feed_forward.w1.weight"], p["feed_forward.w2.weight"],
                      p["feed_forward.w3.weight"])
"""),
    Mistake("block_forward", "swaps the two norm weights", """
def block_forward(x, p, cfg, cos, sin):
    h = x + attention_forward(rms_norm(x, p["ffn_norm.weight"], cfg.norm_eps), p, cfg, cos, sin)
    hn = rms_norm(h, p["attention_norm.weight"], cfg.norm_eps)
    return h + swiglu(hn, p["feed_forward.w1.weight"], p["feed_forward.w2.weight"],
                      p["feed_forward.w3.weight"])
""", says="norm1 uses attention_norm.weight"),
    Mistake("block_forward", "forgets the MLP's residual connection", """
def block_forward(x, p, cfg, cos, sin):
    h = x + attention_forward(rms_norm(x, p["attention_norm.weight"], cfg.norm_eps), p, cfg,
                              cos, sin)
    return swiglu(rms_norm(h, p["ffn_norm.weight"], cfg.norm_eps), p["feed_forward.w1.weight"],
                  p["feed_forward.w2.weight"], p["feed_forward.w3.weight"])
"""),
    Mistake("block_forward", "ignores cfg.norm_eps: both norms use rms_norm's default eps", """
def block_forward(x, p, cfg, cos, sin):
    h = x + attention_forward(rms_norm(x, p["attention_norm.weight"]), p, cfg, cos, sin)
    hn = rms_norm(h, p["ffn_norm.weight"])
    return h + swiglu(hn, p["feed_forward.w1.weight"], p["feed_forward.w2.weight"],
                      p["feed_forward.w3.weight"])
""", says="cfg.norm_eps"),
    # ---- model_forward
    Mistake("model_forward", "forgets the final norm", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    head = weights["tok_embeddings.weight"] if cfg.tie_embeddings else weights["output.weight"]
    return x @ head.T
"""),
    Mistake("model_forward", "ignores weight tying: always reads output.weight", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    return x @ weights["output.weight"].T
"""),
    Mistake("model_forward", "always uses the embedding matrix as the LM head", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    return x @ weights["tok_embeddings.weight"].T
"""),
    Mistake("model_forward", "scales the embeddings by sqrt(d_model) like the 2017 Transformer", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx] * cfg.d_model ** 0.5
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    head = weights["tok_embeddings.weight"] if cfg.tie_embeddings else weights["output.weight"]
    return x @ head.T
""", says="do not scale the embeddings"),
    Mistake("model_forward", "returns probabilities (softmax) instead of logits", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    head = weights["tok_embeddings.weight"] if cfg.tie_embeddings else weights["output.weight"]
    return torch.softmax(x @ head.T, dim=-1)
"""),
    Mistake("model_forward", "runs block 0 for every layer", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, 0), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    head = weights["tok_embeddings.weight"] if cfg.tie_embeddings else weights["output.weight"]
    return x @ head.T
"""),
    Mistake("model_forward", "RoPE tables with the default base instead of cfg.rope_base", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], cfg.norm_eps)
    head = weights["tok_embeddings.weight"] if cfg.tie_embeddings else weights["output.weight"]
    return x @ head.T
"""),
    Mistake("model_forward", "the final norm ignores cfg.norm_eps (rms_norm's default eps)", """
def model_forward(idx, weights, cfg):
    T = idx.shape[1]
    cos, sin = rope_cos_sin(cfg.head_dim, T, cfg.rope_base)
    x = weights["tok_embeddings.weight"][idx]
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"])
    head = weights["tok_embeddings.weight"] if cfg.tie_embeddings else weights["output.weight"]
    return x @ head.T
""", says="cfg.norm_eps"),
    # ---- count_params
    Mistake("count_params", "counts wk and wv with n_heads instead of n_kv_heads", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attention = 4 * D * cfg.n_heads * hd
    per_layer = attention + 3 * D * cfg.d_ff + 2 * D
    return 2 * cfg.vocab_size * D + cfg.n_layers * per_layer + D - (
        cfg.vocab_size * D if cfg.tie_embeddings else 0)
"""),
    Mistake("count_params", "double-counts a tied embedding", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attention = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd
    per_layer = attention + 3 * D * cfg.d_ff + 2 * D
    return 2 * cfg.vocab_size * D + cfg.n_layers * per_layer + D
"""),
    Mistake("count_params", "forgets the norm weights", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attention = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd
    per_layer = attention + 3 * D * cfg.d_ff
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + cfg.n_layers * per_layer + head
"""),
    Mistake("count_params", "forgets the final norm", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attention = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd
    per_layer = attention + 3 * D * cfg.d_ff + 2 * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + cfg.n_layers * per_layer + head
"""),
    Mistake("count_params", "a two-matrix MLP (GPT-2 style) instead of SwiGLU's three", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attention = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd
    per_layer = attention + 2 * D * cfg.d_ff + 2 * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + cfg.n_layers * per_layer + D + head
"""),
    Mistake("count_params", "counts kv projections with n_kv_heads * d_model (not head_dim)", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.head_dim
    attention = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * D
    per_layer = attention + 3 * D * cfg.d_ff + 2 * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + cfg.n_layers * per_layer + D + head
"""),
    Mistake("count_params", "returns a float (uses / for the head dimension)", """
def count_params(cfg):
    D, hd = cfg.d_model, cfg.d_model / cfg.n_heads
    attention = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd
    per_layer = attention + 3 * D * cfg.d_ff + 2 * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + cfg.n_layers * per_layer + D + head
"""),
    # ---- self-check
    Mistake("q1", "thinks unit variance makes the two norms agree", 'answer_q1 = "A"'),
    Mistake("q1", "thinks both divide by the same statistic", 'answer_q1 = "C"'),
    Mistake("q2", "counts only one of wk and wv", "answer_q2 = 402.653184"),
    Mistake("q2", "gives the total parameter count of the MHA model", "answer_q2 = 8835.567616"),
    Mistake("q2", "answers in parameters, not millions", "answer_q2 = 805306368"),
    Mistake("q3", "thinks the block's output is normalized", 'answer_q3 = "B"'),
    Mistake("q3", "forgets the residual connection", 'answer_q3 = "C"'),
]

# One mistake, one charge: block_forward and model_forward are tested with the package's RMSNorm,
# SwiGLU and Block swapped in, so a bug in those exercises leaves them their full marks.
_KEEPS = {
    "forgets the learned weight": ("block_forward", "model_forward"),
    "sigmoid instead of silu (plain GLU)": ("block_forward", "model_forward"),
    "swaps the two norm weights": ("model_forward",),
    "normalizes in place: x.float() is x itself for a float32 x": ("block_forward", "model_forward"),
    "ignores the eps argument (a hard-coded 1e-5)": ("block_forward", "model_forward"),
    "ignores cfg.norm_eps: both norms use rms_norm's default eps": ("model_forward",),
}
MISTAKES = [replace(m, keeps=_KEEPS.get(m.name, ())) for m in MISTAKES]

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('block_forward', 'correct + scratch loop over parameters (rebinds p)', '''
def block_forward(x, p, cfg, cos, sin):
    h = x + attention_forward(rms_norm(x, p["attention_norm.weight"], cfg.norm_eps), p, cfg, cos, sin)
    return h + swiglu(rms_norm(h, p["ffn_norm.weight"], cfg.norm_eps), p["feed_forward.w1.weight"],
                      p["feed_forward.w2.weight"], p["feed_forward.w3.weight"])

for p in block.parameters():
    pass
'''),
    Alternative('block_forward', 'correct + scratch check with shorter rope tables', '''
def block_forward(x, p, cfg, cos, sin):
    h = x + attention_forward(rms_norm(x, p["attention_norm.weight"], cfg.norm_eps), p, cfg, cos, sin)
    return h + swiglu(rms_norm(h, p["ffn_norm.weight"], cfg.norm_eps), p["feed_forward.w1.weight"],
                      p["feed_forward.w2.weight"], p["feed_forward.w3.weight"])

cos, sin = rope_cos_sin(BLOCK_CFG.head_dim, 4, BLOCK_CFG.rope_base)
print(block_forward(torch.randn(1, 4, 32), dict(block.state_dict()), BLOCK_CFG, cos, sin).shape)
'''),
    Alternative('rms_norm', 'float64 internally', '''
def rms_norm(x, weight, eps=1e-5):
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
'''),
    Alternative('swiglu', 'F.linear', '''
def swiglu(x, w1, w2, w3):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
'''),
    Alternative('model_forward', 'F.embedding, max_seq_len tables sliced, get head', '''
def model_forward(idx, weights, cfg):
    B, T = idx.shape
    cos, sin = rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
    cos, sin = cos[:T], sin[:T]
    x = F.embedding(idx, weights["tok_embeddings.weight"])
    for i in range(cfg.n_layers):
        x = block_forward(x, layer_weights(weights, i), cfg, cos, sin)
    x = rms_norm(x, weights["norm.weight"], eps=cfg.norm_eps)
    head = weights.get("output.weight", weights["tok_embeddings.weight"])
    return F.linear(x, head)
'''),
    Alternative('count_params', 'np.int64 arithmetic', '''
def count_params(cfg):
    D, hd = np.int64(cfg.d_model), cfg.head_dim
    per_layer = D * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * D * cfg.d_ff + 2 * D
    total = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * per_layer + D
    return total
'''),
    Alternative('q2', 'via count_params', '''
answer_q2 = (count_params(dataclasses.replace(LLAMA3_8B, n_kv_heads=32)) - count_params(LLAMA3_8B)) / 1e6'''),
]
