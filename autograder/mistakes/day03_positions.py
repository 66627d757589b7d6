"""Day 03 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    Mistake("one_hot", "np.eye lookup without a range check: -1 silently becomes the last class", """
def one_hot(ids, num_classes):
    return np.eye(num_classes)[np.asarray(ids)]
"""),
    Mistake("one_hot", "only handles 1-D ids (fancy indexing with arange(len(ids)))", """
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError("ids out of range")
    out = np.zeros((len(ids), num_classes))
    out[np.arange(len(ids)), ids] = 1.0
    return out
""", says="not only 1-D"),
    Mistake("one_hot", "classes on the first axis: returns (num_classes, ...) instead of (..., num_classes)", """
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError("ids out of range")
    return (np.arange(num_classes).reshape((-1,) + (1,) * ids.ndim) == ids).astype(np.float64)
"""),
    Mistake("one_hot", "off by one: accepts id == num_classes (checks > instead of >=)", """
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() > num_classes):
        raise ValueError("ids out of range")
    return (ids[..., None] == np.arange(num_classes)).astype(np.float64)
"""),
    Mistake("one_hot", "range check without an empty guard: ids.min() of no ids raises", """
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.min() < 0 or ids.max() >= num_classes:
        raise ValueError(f"ids must lie in [0, {num_classes})")
    return (ids[..., None] == np.arange(num_classes)).astype(np.float64)
""", says="check the range only when there are ids"),
    Mistake("one_hot", "returns ints (astype(int)) instead of a float array", """
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError(f"ids must lie in [0, {num_classes})")
    return (ids[..., None] == np.arange(num_classes)).astype(int)
""", says="float"),
    Mistake("one_hot", "returns the boolean comparison itself", """
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError(f"ids must lie in [0, {num_classes})")
    return ids[..., None] == np.arange(num_classes)
""", says="float"),
    Mistake("embedding", "lookup without validation: table[-1] silently reads the last row", """
def embedding_lookup(table, ids):
    return table[np.asarray(ids)]


def embedding_onehot_matmul(table, ids):
    return one_hot(ids, table.shape[0]) @ table
"""),
    Mistake("embedding", "range check without an empty guard: ids.min() of no ids raises", """
def embedding_lookup(table, ids):
    ids = np.asarray(ids)
    if ids.min() < 0 or ids.max() >= table.shape[0]:
        raise ValueError(f"ids must lie in [0, {table.shape[0]})")
    return table[ids]


def embedding_onehot_matmul(table, ids):
    return one_hot(ids, table.shape[0]) @ table
""", says="check the range only when there are ids"),
    Mistake("embedding", "one-hot over d (table.shape[1]) instead of V", """
def embedding_lookup(table, ids):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError("ids out of range")
    return table[ids]


def embedding_onehot_matmul(table, ids):
    return one_hot(ids, table.shape[1]) @ table.T
""", says="the vocabulary, not d"),
    Mistake("embedding", "flattens the ids and never reshapes: (B*T, d) instead of (B, T, d)", """
def embedding_lookup(table, ids):
    ids = np.asarray(ids).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError("ids out of range")
    return table[ids]


def embedding_onehot_matmul(table, ids):
    return one_hot(np.asarray(ids).ravel(), table.shape[0]) @ table
"""),
    Mistake("sinusoidal", "sin and cos swapped (cos in the even channels)", """
def sinusoidal_encoding(seq_len, d_model, base=10000.0):
    if d_model % 2:
        raise ValueError("d_model must be even")
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    omega = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    pe = np.zeros((seq_len, d_model))
    pe[:, 0::2] = np.cos(positions * omega)
    pe[:, 1::2] = np.sin(positions * omega)
    return pe
"""),
    Mistake("sinusoidal", "exponent i/d instead of 2i/d", """
def sinusoidal_encoding(seq_len, d_model, base=10000.0):
    if d_model % 2:
        raise ValueError("d_model must be even")
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    omega = base ** (-np.arange(d_model // 2, dtype=np.float64) / d_model)
    pe = np.zeros((seq_len, d_model))
    pe[:, 0::2] = np.sin(positions * omega)
    pe[:, 1::2] = np.cos(positions * omega)
    return pe
"""),
    Mistake("sinusoidal", "all sines then all cosines (concatenated halves, not interleaved)", """
def sinusoidal_encoding(seq_len, d_model, base=10000.0):
    if d_model % 2:
        raise ValueError("d_model must be even")
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    omega = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    return np.concatenate([np.sin(positions * omega), np.cos(positions * omega)], axis=1)
"""),
    Mistake("sinusoidal", "positions start at 1", """
def sinusoidal_encoding(seq_len, d_model, base=10000.0):
    if d_model % 2:
        raise ValueError("d_model must be even")
    positions = np.arange(1, seq_len + 1, dtype=np.float64)[:, None]
    omega = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    pe = np.zeros((seq_len, d_model))
    pe[:, 0::2] = np.sin(positions * omega)
    pe[:, 1::2] = np.cos(positions * omega)
    return pe
"""),
    Mistake("sinusoidal", "ignores the base argument (hard-coded 10000)", """
def sinusoidal_encoding(seq_len, d_model, base=10000.0):
    if d_model % 2:
        raise ValueError("d_model must be even")
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    omega = 10000.0 ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    pe = np.zeros((seq_len, d_model))
    pe[:, 0::2] = np.sin(positions * omega)
    pe[:, 1::2] = np.cos(positions * omega)
    return pe
"""),
    Mistake("rope_tables", "interleaved tables (repeat_interleave: adjacent channels share an angle)", """
def rope_cos_sin(head_dim, seq_len, base=10000.0):
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.repeat_interleave(angles, 2, dim=-1)
    return emb.cos(), emb.sin()
""", says="repeat_interleave"),
    Mistake("rope_tables", "frequencies base^(-i/d) instead of base^(-2i/d)", """
def rope_cos_sin(head_dim, seq_len, base=10000.0):
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    inv_freq = 1.0 / (base ** (torch.arange(head_dim // 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()
""", says="arange(0, head_dim, 2)"),
    Mistake("rope_tables", "angles not doubled: tables of shape (T, head_dim / 2)", """
def rope_cos_sin(head_dim, seq_len, base=10000.0):
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()
""", says="written twice"),
    Mistake("rope", "pairs adjacent channels (interleaved rotate) with rotate-half tables", """
def rotate_half(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin
"""),
    Mistake("rope", "wrong sign: rotate_half returns (x2, -x1), rotating the other way", """
def rotate_half(x):
    d = x.shape[-1]
    return torch.cat((x[..., d // 2 :], -x[..., : d // 2]), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin
"""),
    Mistake("rope", "forgets rotate_half: x * cos + x * sin is a scaling, not a rotation", """
def rotate_half(x):
    d = x.shape[-1]
    return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + x * sin
"""),
    Mistake("q1", "thinks the neighbours of 'sat' matter without positions", 'answer_q1 = "B"'),
    Mistake("q1", "thinks moving words changes the output", 'answer_q1 = "C"'),
    Mistake("q2", "uses the fastest pair", "answer_q2 = 2 * np.pi"),
    Mistake("q2", "forgets the 2 pi: 1 / theta instead of 2 pi / theta", "answer_q2 = 10000 ** (126 / 128)"),
    Mistake("q3", "reverses the offset", 'answer_q3 = "B"'),
    Mistake("q3", "thinks the sum of positions matters", 'answer_q3 = "D"'),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'classes on the first axis': ('embedding',),
    'returns ints (astype(int))': ('embedding',),
    'returns the boolean comparison': ('embedding',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'sinusoidal: positions = np.arange(seq_len, dtype=np.float64)[:, None]               # (T, 1) => positions = np.arange(seq_len)[:, None]               # (T, 1)':
        'the integer positions become float64 in the product with the float64 frequencies',
    'sinusoidal: omega = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # (d/2,) => omega = base ** (-np.arange(0, d_model, 2) / d_model)  # (d/2,)':
        'true division of the integer range already gives float64',
    'rope_tables: angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq   # (T, head_dim/2) => angles = torch.arange(seq_len)[:, None] * inv_freq   # (T, head_dim/2)':
        'integer positions times float32 frequencies give the same float32 angles',
    'rope_tables: inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)) => inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2) / head_dim))':
        'true division of the integer range already gives float32',
    'q2: answer_q2 = 2 * np.pi * 10000 ** (126 / 128) => answer_q2 = 2 * np.pi * 10001 ** (126 / 128)':
        "within the question's stated tolerance",
    'q2: answer_q2 = 2 * np.pi * 10000 ** (126 / 128) => answer_q2 = 2 * np.pi * 9999 ** (126 / 128)':
        "within the question's stated tolerance",
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('one_hot', 'Ids capitalised message', '''
def one_hot(ids, num_classes):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError(f"Ids must lie in [0, {num_classes})")
    return (ids[..., None] == np.arange(num_classes)).astype(float)
'''),
    Alternative('embedding', 'einsum', '''
def embedding_lookup(table, ids):
    ids = np.asarray(ids)
    V = len(table)
    if ids.size and not (0 <= ids.min() and ids.max() < V):
        raise ValueError(f"ids must be in [0, {V})")
    return table[ids]

def embedding_onehot_matmul(table, ids):
    return np.einsum("...v,vd->...d", one_hot(ids, table.shape[0]), table)
'''),
    Alternative('sinusoidal', 'exp(-log base) div_term, float64', '''
def sinusoidal_encoding(seq_len, d_model, base=10000.0):
    if d_model % 2 != 0:
        raise ValueError(f"d_model must be even, got {d_model}")
    position = np.arange(seq_len)[:, None].astype(np.float64)
    div_term = np.exp(np.arange(0, d_model, 2) * (-np.log(base) / d_model))
    pe = np.empty((seq_len, d_model))
    pe[:, 0::2] = np.sin(position * div_term)
    pe[:, 1::2] = np.cos(position * div_term)
    return pe
'''),
    Alternative('rope_tables', 'numpy then torch.from_numpy float32', '''
def rope_cos_sin(head_dim, seq_len, base=10000.0):
    if head_dim % 2:
        raise ValueError(f"odd head_dim {head_dim}")
    inv = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(seq_len)[:, None] * inv
    emb = np.concatenate([ang, ang], axis=-1)
    return torch.from_numpy(np.cos(emb)).float(), torch.from_numpy(np.sin(emb)).float()
'''),
    Alternative('rope', 'stack/unbind rotate_half, apply with unsqueeze', '''
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

def apply_rope(x, cos, sin):
    cos, sin = cos[None, None], sin[None, None]
    return x * cos + rotate_half(x) * sin
'''),
    Alternative('q2', 'math computation', '''
import math
answer_q2 = 2 * math.pi / (10000 ** (-126 / 128))'''),
]
