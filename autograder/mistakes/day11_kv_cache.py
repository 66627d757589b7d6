"""Day 11 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

_CACHE_INIT = """
class LayerCache:
    def __init__(self, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.max_len = max_len
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype)
"""

_FORWARD_HEAD = """
@torch.no_grad()
def forward_with_cache(model, idx, caches, pos):
    T = idx.shape[1]
    x = model.tok_embeddings(idx)
"""

_GENERATE_HEAD = """
@torch.no_grad()
def generate_greedy_cached(model, prompt_ids, n_new):
    p = len(prompt_ids)
    if n_new < 1:
        raise ValueError("n_new must be >= 1")
    if p + n_new - 1 > model.cfg.max_seq_len:
        raise ValueError("too long for max_seq_len")
"""

MISTAKES = [
    # ---------------------------------------------------------------- token-layer units
    Mistake("token_layer_units", "uncached steps see p + 1 .. p + n tokens (off by one)", """
def token_layer_units(prompt_len, n_new, n_layers, cached):
    for name, value in (("prompt_len", prompt_len), ("n_new", n_new), ("n_layers", n_layers)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1")
    if cached:
        return n_layers * (prompt_len + n_new - 1)
    return n_layers * sum(prompt_len + i for i in range(1, n_new + 1))
"""),
    Mistake("token_layer_units", "cached loop also feeds the last new token back: p + n", """
def token_layer_units(prompt_len, n_new, n_layers, cached):
    for name, value in (("prompt_len", prompt_len), ("n_new", n_new), ("n_layers", n_layers)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1")
    if cached:
        return n_layers * (prompt_len + n_new)
    return n_layers * sum(prompt_len + i for i in range(n_new))
"""),
    Mistake("token_layer_units", "forgets the layers (counts tokens only)", """
def token_layer_units(prompt_len, n_new, n_layers, cached):
    for name, value in (("prompt_len", prompt_len), ("n_new", n_new), ("n_layers", n_layers)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1")
    if cached:
        return prompt_len + n_new - 1
    return sum(prompt_len + i for i in range(n_new))
"""),
    Mistake("token_layer_units", "uncached cost as n x p: forgets that the context grows", """
def token_layer_units(prompt_len, n_new, n_layers, cached):
    for name, value in (("prompt_len", prompt_len), ("n_new", n_new), ("n_layers", n_layers)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1")
    if cached:
        return n_layers * (prompt_len + n_new - 1)
    return n_layers * n_new * prompt_len
"""),
    # ---------------------------------------------------------------- the layer cache
    Mistake("layer_cache", "forgets the position offset: always writes at slot 0",
            _CACHE_INIT + """
    def update(self, k_new, v_new, pos):
        T = k_new.shape[2]
        end = pos + T
        if pos < 0 or end > self.max_len:
            raise ValueError(f"does not fit in max_len={self.max_len}")
        self.k[:, :, :T] = k_new
        self.v[:, :, :T] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]
"""),
    Mistake("layer_cache", "returns the whole buffer, unfilled zeros included", _CACHE_INIT + """
    def update(self, k_new, v_new, pos):
        end = pos + k_new.shape[2]
        if pos < 0 or end > self.max_len:
            raise ValueError(f"does not fit in max_len={self.max_len}")
        self.k[:, :, pos:end] = k_new
        self.v[:, :, pos:end] = v_new
        return self.k, self.v
"""),
    Mistake("layer_cache", "off by one: returns one position too few", _CACHE_INIT + """
    def update(self, k_new, v_new, pos):
        end = pos + k_new.shape[2]
        if pos < 0 or end > self.max_len:
            raise ValueError(f"does not fit in max_len={self.max_len}")
        self.k[:, :, pos:end] = k_new
        self.v[:, :, pos:end] = v_new
        return self.k[:, :, :end - 1], self.v[:, :, :end - 1]
"""),
    Mistake("layer_cache", "grows the cache with torch.cat instead of writing in place", """
class LayerCache:
    def __init__(self, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.max_len = max_len
        self.k = torch.zeros(batch, n_kv_heads, 0, head_dim, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, 0, head_dim, dtype=dtype)

    def update(self, k_new, v_new, pos):
        end = pos + k_new.shape[2]
        if pos < 0 or end > self.max_len:
            raise ValueError(f"does not fit in max_len={self.max_len}")
        self.k = torch.cat([self.k[:, :, :pos], k_new], dim=2)
        self.v = torch.cat([self.v[:, :, :pos], v_new], dim=2)
        return self.k, self.v
"""),
    Mistake("layer_cache", "no bounds check: a full cache is silently cut", _CACHE_INIT + """
    def update(self, k_new, v_new, pos):
        end = min(pos + k_new.shape[2], self.max_len)
        self.k[:, :, pos:end] = k_new[:, :, :end - pos]
        self.v[:, :, pos:end] = v_new[:, :, :end - pos]
        return self.k[:, :, :end], self.v[:, :, :end]
"""),
    Mistake("layer_cache", "returns the keys in place of the values", _CACHE_INIT + """
    def update(self, k_new, v_new, pos):
        end = pos + k_new.shape[2]
        if pos < 0 or end > self.max_len:
            raise ValueError(f"does not fit in max_len={self.max_len}")
        self.k[:, :, pos:end] = k_new
        self.v[:, :, pos:end] = v_new
        return self.k[:, :, :end], self.k[:, :, :end]
""", says="the second element comes from self.v"),
    Mistake("layer_cache", "rejects an exactly full cache (pos + T >= max_len)", _CACHE_INIT + """
    def update(self, k_new, v_new, pos):
        end = pos + k_new.shape[2]
        if pos < 0 or end >= self.max_len:
            raise ValueError(f"does not fit in max_len={self.max_len}")
        self.k[:, :, pos:end] = k_new
        self.v[:, :, pos:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]
""", says="may equal max_len exactly"),
    # ---------------------------------------------------------------- cached attention
    Mistake("cached_attention", "top-left aligned mask: F.scaled_dot_product_attention(is_causal=True)",
            """
def cached_attention(q, k, v):
    import torch.nn.functional as nnf
    n_rep = q.shape[1] // k.shape[1]
    return nnf.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                            is_causal=True)
"""),
    Mistake("cached_attention", "hand-written tril() mask without the S - T offset", """
def cached_attention(q, k, v):
    T, S, hd = q.shape[2], k.shape[2], q.shape[3]
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
    allowed = torch.ones(T, S, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
"""),
    Mistake("cached_attention", "no mask at all (right for one query, wrong for a chunk)", """
def cached_attention(q, k, v):
    hd = q.shape[3]
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
    return torch.softmax(scores, dim=-1) @ v
"""),
    Mistake("cached_attention", "GQA heads tiled with .repeat instead of repeated in place", """
def cached_attention(q, k, v):
    T, S, hd = q.shape[2], k.shape[2], q.shape[3]
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
    allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
"""),
    Mistake("cached_attention", "forgets the 1 / sqrt(head_dim) scale", """
def cached_attention(q, k, v):
    T, S = q.shape[2], k.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1)
    allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
"""),
    # ---------------------------------------------------------------- the cached forward
    Mistake("forward_with_cache", "RoPE positions restart at 0 for every call", _FORWARD_HEAD + """
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    for block, cache in zip(model.layers, caches):
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        k_all, v_all = cache.update(k, v, pos)
        x = x + block.attention.wo(merge_heads(cached_attention(q, k_all, v_all)))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))
"""),
    Mistake("forward_with_cache", "writes every call's keys at position 0", _FORWARD_HEAD + """
    cos, sin = model.rope_cos[pos:pos + T], model.rope_sin[pos:pos + T]
    for block, cache in zip(model.layers, caches):
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        k_all, v_all = cache.update(k, v, 0)
        x = x + block.attention.wo(merge_heads(cached_attention(q, k_all, v_all)))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))
""", says="cache.update(k, v, pos)"),
    Mistake("forward_with_cache", "fills the cache but attends only over the new keys",
            _FORWARD_HEAD + """
    cos, sin = model.rope_cos[pos:pos + T], model.rope_sin[pos:pos + T]
    for block, cache in zip(model.layers, caches):
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        cache.update(k, v, pos)
        x = x + block.attention.wo(merge_heads(cached_attention(q, k, v)))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))
"""),
    Mistake("forward_with_cache", "uses the first layer's cache for every layer", _FORWARD_HEAD + """
    cos, sin = model.rope_cos[pos:pos + T], model.rope_sin[pos:pos + T]
    for block in model.layers:
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        k_all, v_all = caches[0].update(k, v, pos)
        x = x + block.attention.wo(merge_heads(cached_attention(q, k_all, v_all)))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))
"""),
    Mistake("forward_with_cache", "RoPE rows shifted by one (rows pos + 1 .. pos + T)",
            _FORWARD_HEAD + """
    cos, sin = model.rope_cos[pos + 1:pos + T + 1], model.rope_sin[pos + 1:pos + T + 1]
    for block, cache in zip(model.layers, caches):
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        k_all, v_all = cache.update(k, v, pos)
        x = x + block.attention.wo(merge_heads(cached_attention(q, k_all, v_all)))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))
""", says="rows pos .. pos + T - 1"),
    # ---------------------------------------------------------------- the cached loop
    Mistake("generate_cached", "decode positions one too far: a zero slot is left in the cache",
            _GENERATE_HEAD + """
    caches = make_caches(model.cfg, 1, p + n_new)
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [int(logits[0, -1].argmax())]
    for pos in range(p + 1, p + n_new):
        logits = forward_with_cache(model, torch.tensor([[out[-1]]]), caches, pos)
        out.append(int(logits[0, -1].argmax()))
    return out
"""),
    Mistake("generate_cached", "recomputes the whole context every step (a fresh cache each time)",
            _GENERATE_HEAD + """
    ids = list(prompt_ids)
    out = []
    for _ in range(n_new):
        caches = make_caches(model.cfg, 1, len(ids))
        logits = forward_with_cache(model, torch.tensor([ids]), caches, 0)
        out.append(int(logits[0, -1].argmax()))
        ids.append(out[-1])
    return out
"""),
    Mistake("generate_cached", "takes the first token from the first position's logits",
            _GENERATE_HEAD + """
    caches = make_caches(model.cfg, 1, p + n_new - 1)
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [int(logits[0, 0].argmax())]
    for pos in range(p, p + n_new - 1):
        logits = forward_with_cache(model, torch.tensor([[out[-1]]]), caches, pos)
        out.append(int(logits[0, -1].argmax()))
    return out
"""),
    Mistake("generate_cached", "returns the prompt followed by the new tokens", _GENERATE_HEAD + """
    caches = make_caches(model.cfg, 1, p + n_new - 1)
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [int(logits[0, -1].argmax())]
    for pos in range(p, p + n_new - 1):
        logits = forward_with_cache(model, torch.tensor([[out[-1]]]), caches, pos)
        out.append(int(logits[0, -1].argmax()))
    return list(prompt_ids) + out
"""),
    Mistake("generate_cached", "returns 0-d tensors (argmax without int())", _GENERATE_HEAD + """
    caches = make_caches(model.cfg, 1, p + n_new - 1)
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [logits[0, -1].argmax()]
    for pos in range(p, p + n_new - 1):
        logits = forward_with_cache(model, torch.tensor([[out[-1]]]), caches, pos)
        out.append(logits[0, -1].argmax())
    return out
""", says="int("),
    # ---------------------------------------------------------------- memory
    Mistake("sequences_that_fit", "uses n_heads instead of n_kv_heads", """
def sequences_that_fit(cfg, free_bytes, context_len, bytes_per_element):
    if context_len < 1 or bytes_per_element <= 0:
        raise ValueError("context_len must be >= 1 and bytes_per_element > 0")
    per_sequence = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * bytes_per_element * context_len
    return max(0, int(free_bytes // per_sequence))
"""),
    Mistake("sequences_that_fit", "forgets the 2 (keys AND values)", """
def sequences_that_fit(cfg, free_bytes, context_len, bytes_per_element):
    if context_len < 1 or bytes_per_element <= 0:
        raise ValueError("context_len must be >= 1 and bytes_per_element > 0")
    per_sequence = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element * context_len
    return max(0, int(free_bytes // per_sequence))
"""),
    Mistake("sequences_that_fit", "rounds to the nearest integer instead of down", """
def sequences_that_fit(cfg, free_bytes, context_len, bytes_per_element):
    if context_len < 1 or bytes_per_element <= 0:
        raise ValueError("context_len must be >= 1 and bytes_per_element > 0")
    per_sequence = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element * context_len
    return max(0, round(free_bytes / per_sequence))
"""),
    Mistake("sequences_that_fit", "returns a negative count when nothing is free", """
def sequences_that_fit(cfg, free_bytes, context_len, bytes_per_element):
    if context_len < 1 or bytes_per_element <= 0:
        raise ValueError("context_len must be >= 1 and bytes_per_element > 0")
    per_sequence = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element * context_len
    return int(free_bytes // per_sequence)
"""),
    Mistake("sequences_that_fit", "a float count when bytes_per_element is fractional (no int())",
            """
def sequences_that_fit(cfg, free_bytes, context_len, bytes_per_element):
    if context_len < 1 or bytes_per_element <= 0:
        raise ValueError("context_len must be >= 1 and bytes_per_element > 0")
    per_sequence = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element * context_len
    return max(0, free_bytes // per_sequence)
""", says="float"),
    # ---------------------------------------------------------------- self-check
    Mistake("q1", "RoPE position restarts at 0 in every decode step", """
answer_q1 = "A"
"""),
    Mistake("q1", "position t + 1 (counting from 1)", """
answer_q1 = "D"
"""),
    Mistake("q2", "multi-head figure: 64 heads instead of 8 KV heads", """
answer_q2 = 2 * 80 * 64 * 128 * 2 * 4096 / 1e9
"""),
    Mistake("q2", "forgets the 2 for keys and values", """
answer_q2 = 80 * 8 * 128 * 2 * 4096 / 1e9
"""),
    Mistake("q3", "top-left mask: only key 0", """
answer_q3 = "C"
"""),
    # the markdown asks for both checks before any cache is built, each message naming its limit
    Mistake('generate_cached', 'caches built before the checks', """
@torch.no_grad()
def generate_greedy_cached(model, prompt_ids, n_new):
    p = len(prompt_ids)
    caches = make_caches(model.cfg, 1, max(p + n_new - 1, 1))
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    if p + n_new - 1 > model.cfg.max_seq_len:
        raise ValueError(f"exceeds max_seq_len ({model.cfg.max_seq_len})")
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [int(logits[0, -1].argmax())]
    while len(out) < n_new:
        logits = forward_with_cache(model, torch.tensor([[out[-1]]]), caches, p + len(out) - 1)
        out.append(int(logits[0, -1].argmax()))
    return out
""", says="before calling make_caches"),
    Mistake('generate_cached', 'ValueError messages that name neither n_new nor max_seq_len', """
@torch.no_grad()
def generate_greedy_cached(model, prompt_ids, n_new):
    p = len(prompt_ids)
    if n_new < 1:
        raise ValueError('need at least one new token')
    if p + n_new - 1 > model.cfg.max_seq_len:
        raise ValueError("the prompt plus the new tokens do not fit in the model's context window")
    caches = make_caches(model.cfg, 1, p + n_new - 1)
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [logits[0, -1].argmax().item()]
    for i in range(n_new - 1):
        logits = forward_with_cache(model, torch.tensor([out[-1]]).unsqueeze(0), caches, p + i)
        out.append(logits[0, -1].argmax().item())
    return out
""", says="the word n_new"),
]

# One mistake, one charge: forward_with_cache is tested with the package's attention and layer
# caches, generate_greedy_cached with the package's cache and cached forward, so a bug in the
# earlier pieces leaves them their full marks.
_KEEPS = {
    "off by one: returns one position too few": ("forward_with_cache", "generate_cached"),
    "hand-written tril() mask without the S - T offset": ("forward_with_cache", "generate_cached"),
    "RoPE positions restart at 0 for every call": ("generate_cached",),
    "RoPE rows shifted by one (rows pos + 1 .. pos + T)": ("generate_cached",),
    "rejects an exactly full cache (pos + T >= max_len)": ("forward_with_cache", "generate_cached"),
}
MISTAKES = [replace(m, keeps=_KEEPS.get(m.name, ())) for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
_CPU = "differs only when q lives on a GPU; the graded kernel runs on the CPU"
EQUIVALENT_MUTANTS = {
    "cached_attention: allowed = torch.ones(T, S, dtype=torch.bool, device=q.device)"
    ".tril(diagonal=S - T) => allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)":
        _CPU,
    "generate_cached: caches = make_caches(model.cfg, 1, p + n_new - 1) => "
    "caches = make_caches(model.cfg, 2, p + n_new - 1)":
        "a cache with a spare row gives the same tokens; it only wastes memory",
    "generate_cached: caches = make_caches(model.cfg, 1, p + n_new - 1) => "
    "caches = make_caches(model.cfg, 1, p + n_new + 1)":
        "a longer cache gives the same tokens; attention reads only the filled prefix",
    "generate_cached: caches = make_caches(model.cfg, 1, p + n_new - 1) => "
    "caches = make_caches(model.cfg, 1, p + n_new - 0)":
        "a longer cache gives the same tokens; attention reads only the filled prefix",
    "generate_cached: out = [int(logits[0, -1].argmax())] => "
    "out = [int(logits[-1, -1].argmax())]": "batch size 1: row 0 is row -1",
    "generate_cached: out.append(int(logits[0, -1].argmax())) => "
    "out.append(int(logits[-1, -1].argmax()))": "batch size 1: row 0 is row -1",
    "generate_cached: out.append(int(logits[0, -1].argmax())) => "
    "out.append(int(logits[0, 0].argmax()))": "a decode step feeds one token: position 0 is -1",
    "sequences_that_fit: return max(0, int(free_bytes // per_sequence)) => "
    "return max(0, int(free_bytes / per_sequence))":
        "int() truncates toward zero, which is the floor for the non-negative counts max keeps",
    "q2: answer_q2 = 2 * 80 * 8 * 128 * 2 * 4096 / 1e9 => "
    "answer_q2 = 2 * 80 * 8 * 128 * 2 * 4097 / 1e9": "within the question's tolerance",
    "q2: answer_q2 = 2 * 80 * 8 * 128 * 2 * 4096 / 1e9 => "
    "answer_q2 = 2 * 80 * 8 * 128 * 2 * 4095 / 1e9": "within the question's tolerance",
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('forward_with_cache', "calls update with the contract's keyword names", """
@torch.no_grad()
def forward_with_cache(model, idx, caches, pos):
    T = idx.shape[1]
    cos, sin = model.rope_cos[pos:pos + T], model.rope_sin[pos:pos + T]
    x = model.tok_embeddings(idx)
    for block, cache in zip(model.layers, caches):
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        k_all, v_all = cache.update(k_new=k, v_new=v, pos=pos)
        x = x + block.attention.wo(merge_heads(cached_attention(q, k_all, v_all)))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.output(model.norm(x))
"""),
    Alternative('forward_with_cache', 'update(k, v, pos=pos)', """
@torch.no_grad()
def forward_with_cache(model, idx, caches, pos):
    T = idx.shape[1]
    cos, sin = model.rope_cos[pos:pos + T], model.rope_sin[pos:pos + T]
    x = model.tok_embeddings(idx)
    for i, block in enumerate(model.layers):
        h = block.attention_norm(x)
        q, k, v = block.attention.qkv(h, cos, sin)
        keys, values = caches[i].update(k, v, pos=pos)
        y = cached_attention(q, keys, values)
        h = x + block.attention.wo(merge_heads(y))
        x = h + block.feed_forward(block.ffn_norm(h))
    return model.output(model.norm(x))
"""),
    Alternative('generate_cached', 'keyword caches= / pos=', """
@torch.no_grad()
def generate_greedy_cached(model, prompt_ids, n_new):
    p = len(prompt_ids)
    if n_new < 1:
        raise ValueError('n_new must be >= 1')
    if p + n_new - 1 > model.cfg.max_seq_len:
        raise ValueError('too long for max_seq_len')
    caches = make_caches(model.cfg, 1, p + n_new - 1)
    logits = forward_with_cache(model, torch.tensor(prompt_ids)[None], caches=caches, pos=0)
    out = [logits[0, -1].argmax().item()]
    for i in range(n_new - 1):
        logits = forward_with_cache(model, torch.tensor([out[-1]]).unsqueeze(0), caches, p + i)
        out.append(logits[0, -1].argmax().item())
    return out
"""),
    Alternative('token_layer_units', 'sum of range, validation via min', """
def token_layer_units(prompt_len, n_new, n_layers, cached):
    if min(prompt_len, n_new, n_layers) < 1:
        raise ValueError("prompt_len, n_new and n_layers must all be >= 1")
    if cached:
        return n_layers * (prompt_len + n_new - 1)
    return n_layers * sum(range(prompt_len, prompt_len + n_new))
print("scratch", token_layer_units(4, 3, 2, cached=False))
import matplotlib.pyplot as plt
plt.plot([1,2]); plt.show()
"""),
    Alternative('layer_cache', 'copy_ , list return, shape-derived max_len, extra kwarg device', """
class LayerCache:
    def __init__(self, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32, device="cpu"):
        self.max_len = max_len
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    def update(self, k_new, v_new, pos):
        T = k_new.size(2)
        if not 0 <= pos <= self.k.shape[2] - T:
            raise ValueError(f"pos={pos} with {T} new positions does not fit max_len={self.k.shape[2]}")
        self.k[:, :, pos:pos + T].copy_(k_new)
        self.v[:, :, pos:pos + T].copy_(v_new)
        return [self.k.narrow(2, 0, pos + T), self.v.narrow(2, 0, pos + T)]
"""),
    Alternative('cached_attention', 'repeat_interleave, scale q first, -1e9 additive mask, log-sum-exp', """
def cached_attention(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1); v = v.repeat_interleave(g, dim=1)
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(2, 3)
    i = torch.arange(T)[:, None] + (S - T); j = torch.arange(S)[None, :]
    scores = scores + torch.where(j <= i, 0.0, -1e9)
    p = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    return p @ v
"""),
    Alternative('forward_with_cache', 'positional, helper function', """
def _block_step(block, x, cache, pos, cos, sin):
    q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
    keys, values = cache.update(k, v, pos)
    x = x + block.attention.wo(merge_heads(cached_attention(q, keys, values)))
    return x + block.feed_forward(block.ffn_norm(x))

@torch.no_grad()
def forward_with_cache(model, idx, caches, pos):
    T = idx.size(1)
    cos = model.rope_cos[pos:pos + T]; sin = model.rope_sin[pos:pos + T]
    x = model.tok_embeddings(idx)
    for block, cache in zip(model.layers, caches):
        x = _block_step(block, x, cache, pos, cos, sin)
    return model.output(model.norm(x))
"""),
    Alternative('sequences_that_fit', 'math.floor of true division', """
def sequences_that_fit(cfg, free_bytes, context_len, bytes_per_element):
    if context_len < 1 or bytes_per_element <= 0:
        raise ValueError("context_len must be >= 1 and bytes_per_element > 0")
    if free_bytes <= 0:
        return 0
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element
    return math.floor(free_bytes / (per_token * context_len))
"""),
    Alternative('q2', 'numpy float', """
answer_q2 = np.float64(2 * 80 * 8 * 128 * 2 * 4096) / 1e9
"""),
    Alternative('q1', 'lowercase with space', """
answer_q1 = " c "
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy float32 (computed with numpy)', '''
# Set answer_q2 to a number (GB).
import numpy as np
answer_q2 = np.float32(2 * 80 * 8 * 128 * 2 * 4096) / np.float32(1e9)
'''),
    Alternative('layer_cache', 'messages that start with a capital (Max_len)', '''
class LayerCache:
    """One layer's keys and values, preallocated: k, v of shape (batch, n_kv_heads, max_len, head_dim)."""

    def __init__(self, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32):
        self.max_len = max_len
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype)

    def update(self, k_new, v_new, pos):
        """Write k_new, v_new (B, H_kv, T, hd) at slots pos .. pos+T-1; return the filled prefix."""
        end = pos + k_new.shape[2]
        if pos < 0 or end > self.max_len:
            raise ValueError(f"Max_len {self.max_len} exceeded: positions {pos} .. {end - 1}")
        self.k[:, :, pos:end] = k_new
        self.v[:, :, pos:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]
'''),
    Alternative('generate_cached', 'messages that start with a capital (N_new, Max_seq_len)', '''
@torch.no_grad()
def generate_greedy_cached(model, prompt_ids, n_new):
    """Greedy continuation of prompt_ids (list of ints) with a KV cache: a list of n_new ids."""
    p = len(prompt_ids)
    if n_new < 1:
        raise ValueError(f"N_new must be >= 1, got {n_new}")
    if p + n_new - 1 > model.cfg.max_seq_len:
        raise ValueError(f"Max_seq_len ({model.cfg.max_seq_len}) is too small for {p} prompt "
                         f"tokens and {n_new} new ones")
    caches = make_caches(model.cfg, 1, p + n_new - 1)
    logits = forward_with_cache(model, torch.tensor([prompt_ids]), caches, 0)
    out = [int(logits[0, -1].argmax())]
    for pos in range(p, p + n_new - 1):
        logits = forward_with_cache(model, torch.tensor([[out[-1]]]), caches, pos)
        out.append(int(logits[0, -1].argmax()))
    return out
'''),
]
