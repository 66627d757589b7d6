"""Day 04 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    Mistake("causal_mask", "off by one: masks the diagonal too (triu with k=0)", """
def causal_mask(t_q, t_k=None):
    t_k = t_q if t_k is None else t_k
    if t_k < t_q:
        raise ValueError("t_k must be >= t_q")
    return np.triu(np.full((t_q, t_k), -np.inf), k=t_k - t_q)
"""),
    Mistake("causal_mask", "top-left alignment: ignores the offset t_k - t_q", """
def causal_mask(t_q, t_k=None):
    t_k = t_q if t_k is None else t_k
    if t_k < t_q:
        raise ValueError("t_k must be >= t_q")
    return np.triu(np.full((t_q, t_k), -np.inf), k=1)
"""),
    Mistake("causal_mask", "masks the past instead of the future (tril)", """
def causal_mask(t_q, t_k=None):
    t_k = t_q if t_k is None else t_k
    if t_k < t_q:
        raise ValueError("t_k must be >= t_q")
    return np.tril(np.full((t_q, t_k), -np.inf), k=t_k - t_q - 1)
"""),
    Mistake("causal_mask", "accepts t_k < t_q silently", """
def causal_mask(t_q, t_k=None):
    t_k = t_q if t_k is None else t_k
    return np.triu(np.full((t_q, t_k), -np.inf), k=t_k - t_q + 1)
"""),
    Mistake("causal_mask", "treats t_k = 0 as not given (t_k = t_k or t_q)", """
def causal_mask(t_q, t_k=None):
    t_k = t_k or t_q
    if t_k < t_q:
        raise ValueError(f"t_k ({t_k}) must be >= t_q ({t_q})")
    return np.triu(np.full((t_q, t_k), -np.inf), k=t_k - t_q + 1)
""", says="t_k is None"),
    Mistake("attention_numpy", "forgets the 1/sqrt(d) scale", """
def attention_numpy(q, k, v, mask=None):
    scores = q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        scores = scores + mask
    return softmax(scores) @ v
"""),
    Mistake("attention_numpy", "softmax over the queries (axis -2) instead of the keys", """
def attention_numpy(q, k, v, mask=None):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return np.swapaxes(softmax(np.swapaxes(scores, -1, -2)), -1, -2) @ v
"""),
    Mistake("attention_numpy", "scales by sqrt(d_v) (the values' size) instead of sqrt(d)", """
def attention_numpy(q, k, v, mask=None):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(v.shape[-1])
    if mask is not None:
        scores = scores + mask
    return softmax(scores) @ v
"""),
    Mistake("attention_numpy", "applies the mask after the softmax (zeroes weights, no renormalisation)", """
def attention_numpy(q, k, v, mask=None):
    weights = softmax(q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]))
    if mask is not None:
        weights = weights * (mask == 0)
    return weights @ v
"""),
    Mistake("attention_numpy", "scales q in place (q /= np.sqrt(d)): changes the caller's array", """
def attention_numpy(q, k, v, mask=None):
    d = q.shape[-1]
    q /= np.sqrt(d)
    scores = q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        scores = scores + mask
    return softmax(scores) @ v
""", says="in place"),
    Mistake("attention_torch", "softmax written out without the max shift: exp overflows", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    e = torch.exp(scores)
    return e / e.sum(dim=-1, keepdim=True)

def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
""", says="exp overflowed"),
    Mistake("attention_torch", "scales q in place (q /= math.sqrt(d)): changes the caller's tensor", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    q /= math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1)
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)

def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
""", says="in place"),
    Mistake("attention_torch", "softmax over the queries (dim=-2)", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-2)


def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
"""),
    Mistake("attention_torch", "mask off by one: the diagonal is masked (row 0 becomes NaN)", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q - 1)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
"""),
    Mistake("attention_torch", "top-left aligned mask (tril() without the offset)", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
"""),
    Mistake("attention_torch", "divides by d instead of sqrt(d)", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / q.shape[-1]
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
"""),
    Mistake("attention_torch", "ignores causal=False (always masks)", """
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
"""),
    Mistake("heads", "split_heads with a direct view(B, H, T, d): heads cut the sequence", """
def split_heads(x, n_heads):
    B, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"D ({D}) must be divisible by n_heads ({n_heads})")
    return x.reshape(B, n_heads, T, D // n_heads)


def merge_heads(x):
    B, H, T, d = x.shape
    return x.reshape(B, T, H * d)
"""),
    Mistake("heads", "merge_heads reshapes without transposing back", """
def split_heads(x, n_heads):
    B, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"D ({D}) must be divisible by n_heads ({n_heads})")
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def merge_heads(x):
    B, H, T, d = x.shape
    return x.reshape(B, T, H * d)
"""),
    Mistake("heads", "merge_heads with the wrong transpose: (B, T, d, H) interleaves the heads", """
def split_heads(x, n_heads):
    B, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"D ({D}) must be divisible by n_heads ({n_heads})")
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def merge_heads(x):
    B, H, T, d = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, T, H * d)
"""),
    Mistake("heads", "no divisibility check: D // n_heads silently drops channels", """
def split_heads(x, n_heads):
    B, T, D = x.shape
    d = D // n_heads
    return x[..., : n_heads * d].reshape(B, T, n_heads, d).transpose(1, 2)


def merge_heads(x):
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)
"""),
    Mistake("repeat_kv", "tensor.repeat tiles the block: head h gets kv head h % H_kv", """
def repeat_kv(x, n_rep):
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1, got {n_rep}")
    return x.repeat(1, n_rep, 1, 1)
""", says="do not use repeat"),
    Mistake("repeat_kv", "repeats along the positions (dim 2) instead of the heads", """
def repeat_kv(x, n_rep):
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1, got {n_rep}")
    return torch.repeat_interleave(x, n_rep, dim=2)
""", says="along dim 1 (the heads)"),
    Mistake("repeat_kv", "n_rep = 0 silently returns zero heads", """
def repeat_kv(x, n_rep):
    return torch.repeat_interleave(x, n_rep, dim=1)
"""),
    Mistake("repeat_kv", "rejects only n_rep == 0: a negative n_rep reaches torch", """
def repeat_kv(x, n_rep):
    if n_rep == 0:
        raise ValueError(f"n_rep must be >= 1, got {n_rep}")
    return torch.repeat_interleave(x, n_rep, dim=1)
""", says="negative"),
    Mistake("gqa", "tiles the KV heads (repeat) instead of repeat_interleave", """
def grouped_query_attention(q, k, v, causal=True):
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError("n_kv_heads must divide n_heads")
    n_rep = n_heads // n_kv_heads
    return scaled_dot_product_attention(q, k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1), causal)
"""),
    Mistake("gqa", "n_rep = H_kv instead of H // H_kv", """
def grouped_query_attention(q, k, v, causal=True):
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError("n_kv_heads must divide n_heads")
    return scaled_dot_product_attention(q, repeat_kv(k, n_kv_heads), repeat_kv(v, n_kv_heads), causal)
""", says="n_rep = H // H_kv = 3"),
    Mistake("gqa", "no divisibility check: H=6, H_kv=4 fails with a shape error, not a ValueError", """
def grouped_query_attention(q, k, v, causal=True):
    n_rep = q.shape[1] // k.shape[1]
    return scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), causal)
"""),
    Mistake("gqa", "always causal: drops the causal argument", """
def grouped_query_attention(q, k, v, causal=True):
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError("n_kv_heads must divide n_heads")
    n_rep = n_heads // n_kv_heads
    return scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))
"""),
    Mistake("gqa", "calls F.sdpa(is_causal=causal, enable_gqa=True): top-left when T_q < T_k", """
def grouped_query_attention(q, k, v, causal=True):
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
""", says="bottom-right"),
    Mistake("gqa", "writes attention out with a square tril() mask: top-left when T_q < T_k", """
def grouped_query_attention(q, k, v, causal=True):
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
    n_rep = n_heads // n_kv_heads
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        t_q, t_k = scores.shape[-2], scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(t_q, t_k, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
""", says="bottom-right"),
    Mistake("q1", "thinks the mask aligns top-left (PyTorch's is_causal)", 'answer_q1 = "B"'),
    Mistake("q1", "thinks a token cannot see itself", 'answer_q1 = "D"'),
    Mistake("q2", "tiles instead of grouping: 13 % 8", "answer_q2 = 13 % 8"),
    Mistake("q2", "divides by the number of KV heads: 13 // 8", "answer_q2 = 13 // 8"),
    Mistake("q3", "thinks large scores flatten the softmax", 'answer_q3 = "B"'),
    Mistake("q3", "confuses multiplying with adding a constant", 'answer_q3 = "C"'),
    Mistake("q4", "counts the query heads instead of the KV heads", "answer_q4 = 2 * 32 * 32 * 128 * 2"),
    Mistake("q4", "forgets the factor 2 for keys and values", "answer_q4 = 32 * 8 * 128 * 2"),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'divides by d instead of sqrt(d)': ('gqa',),
    'tensor.repeat tiles the block': ('gqa',),
    "scales q in place (q /= np.sqrt(d))": ('attention_torch',),
    'softmax written out without the max shift': ('gqa',),
    "scales q in place (q /= math.sqrt(d))": ('gqa',),
    'rejects only n_rep == 0': ('gqa',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'attention_torch: allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q) => allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)':
        'differs only when q lives on a GPU; the graded kernel runs on the CPU',
    'q2: answer_q2 = 13 // (32 // 8) => answer_q2 = 14 // (32 // 8)':
        '14 // 4 is also 3',
    'q2: answer_q2 = 13 // (32 // 8) => answer_q2 = 12 // (32 // 8)':
        '12 // 4 is also 3',
    'q2: answer_q2 = 13 // (32 // 8) => answer_q2 = 13 // (32 / 8)':
        '13 // 4.0 is 3.0, equal to 3',
    'q2: answer_q2 = 13 // (32 // 8) => answer_q2 = 13 // (33 // 8)':
        '33 // 8 is also 4',
    'q2: answer_q2 = 13 // (32 // 8) => answer_q2 = 13 // (32 // 7)':
        '32 // 7 is also 4',
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('gqa', 'fallback: package sdpa, own repeat_kv', '''
import tinygpt.attention

def grouped_query_attention(q, k, v, causal=True):
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
    n_rep = n_heads // n_kv_heads
    return tinygpt.attention.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), causal)
'''),
    Alternative('attention_torch', 'float -inf mask added (not masked_fill)', '''
def attention_weights(q, k, causal=True):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.full((t_q, t_k), float("-inf"), dtype=q.dtype).triu(diagonal=t_k - t_q + 1)
        scores = scores + mask
    return torch.softmax(scores, dim=-1)

def scaled_dot_product_attention(q, k, v, causal=True):
    return attention_weights(q, k, causal) @ v
'''),
    Alternative('heads', 'reshape/permute, unflatten', '''
def split_heads(x, n_heads):
    B, T, D = x.shape
    if D % n_heads != 0:
        raise ValueError(f"D={D} is not divisible by n_heads={n_heads}")
    return x.unflatten(-1, (n_heads, D // n_heads)).permute(0, 2, 1, 3)

def merge_heads(x):
    return x.permute(0, 2, 1, 3).flatten(2)
'''),
    Alternative('repeat_kv', 'HF expand/reshape', '''
def repeat_kv(x, n_rep):
    if n_rep < 1:
        raise ValueError(f"n_rep must be at least 1, got {n_rep}")
    B, H, T, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(B, H, n_rep, T, d).reshape(B, H * n_rep, T, d)
'''),
    Alternative('gqa', 'via attention_weights', '''
def grouped_query_attention(q, k, v, causal=True):
    H, H_kv = q.size(1), k.size(1)
    if H % H_kv:
        raise ValueError("H_kv must divide H")
    k = repeat_kv(k, H // H_kv)
    v = repeat_kv(v, H // H_kv)
    return attention_weights(q, k, causal) @ v
'''),
    Alternative('causal_mask', 'np.where on index grids', '''
def causal_mask(t_q, t_k=None):
    if t_k is None:
        t_k = t_q
    if t_k < t_q:
        raise ValueError(f"t_k must be >= t_q, got t_k={t_k}, t_q={t_q}")
    i = np.arange(t_q)[:, None]
    j = np.arange(t_k)[None, :]
    return np.where(j <= i + (t_k - t_q), 0.0, -np.inf)
'''),
    Alternative('attention_numpy', 'a helper named sdpa_numpy with its own signature', '''
def sdpa_numpy(scores, v):
    """softmax(scores) @ v, the scores already scaled and masked."""
    return softmax(scores) @ v


def attention_numpy(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d) + mask) v."""
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    return sdpa_numpy(scores if mask is None else scores + mask, v)
'''),
    Alternative('q2', 'a 0-d torch tensor', '''
# Set answer_q2 to an integer.
answer_q2 = torch.tensor(13) // (32 // 8)
'''),
    Alternative('q4', 'a NumPy integer', '''
# Set answer_q4 to a number.
answer_q4 = np.int64(2) * 32 * 8 * 128 * 2
'''),
]
