"""Day 01 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    Mistake("softmax", "no max shift: overflows to nan for large logits", """
def softmax(logits):
    e = np.exp(np.asarray(logits, dtype=np.float64))
    return e / e.sum(axis=-1, keepdims=True)
"""),
    Mistake("softmax", "normalises over the whole array instead of each row", """
def softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()
"""),
    Mistake("softmax", "subtracts one max for the whole batch: other rows underflow", """
def softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum(axis=-1, keepdims=True)
"""),
    Mistake("softmax", "reduces along axis 0 (columns) instead of the last axis", """
def softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)
"""),
    Mistake("softmax", "shifts the input in place, modifying the caller's array", """
def softmax(logits):
    logits -= logits.max(axis=-1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=-1, keepdims=True)
"""),
    Mistake("softmax", "no np.asarray: a list input (the worked example) has no .max()", """
def softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
""", says="np.asarray"),
    Mistake("log_softmax", "log of softmax: -inf where a probability underflows", """
def log_softmax(logits):
    return np.log(softmax(logits))
"""),
    Mistake("log_softmax", "logsumexp without the max shift: overflows", """
def log_softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
"""),
    Mistake("log_softmax", "one max over the whole batch instead of per row", """
def log_softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))
"""),
    Mistake("temperature", "multiplies by the temperature instead of dividing", """
def softmax_with_temperature(logits, temperature):
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        one_hot = np.zeros_like(x)
        np.put_along_axis(one_hot, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return one_hot
    return softmax(x * temperature)
"""),
    Mistake("temperature", "no greedy case: temperature 0 divides by zero", """
def softmax_with_temperature(logits, temperature):
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    with np.errstate(divide="ignore", invalid="ignore"):
        return softmax(np.asarray(logits, dtype=np.float64) / temperature)
""", says="one-hot on the argmax yourself"),
    Mistake("temperature", "exponentiates logits / temperature itself: exp overflows", """
def softmax_with_temperature(logits, temperature):
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        one_hot = np.zeros_like(x)
        np.put_along_axis(one_hot, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return one_hot
    e = np.exp(x / temperature)
    return e / e.sum(axis=-1, keepdims=True)
""", says="exp overflowed"),
    Mistake("temperature", "silently clamps a negative temperature instead of raising", """
def softmax_with_temperature(logits, temperature):
    temperature = max(temperature, 0.0)
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        one_hot = np.zeros_like(x)
        np.put_along_axis(one_hot, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return one_hot
    return softmax(x / temperature)
"""),
    Mistake("temperature", "greedy one-hot over the whole array, not per row", """
def softmax_with_temperature(logits, temperature):
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        one_hot = np.zeros(x.size)
        one_hot[x.argmax()] = 1.0
        return one_hot.reshape(x.shape)
    return softmax(x / temperature)
"""),
    Mistake("temperature", "divides in place (x /= temperature): changes the caller's logits", """
def softmax_with_temperature(logits, temperature):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        one_hot = np.zeros_like(x)
        np.put_along_axis(one_hot, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return one_hot
    x /= temperature
    return softmax(x)
""", says="in place"),
    Mistake("cross_entropy", "sums over positions instead of averaging", """
def cross_entropy(logits, targets):
    logp = log_softmax(logits)
    return float(-logp[np.arange(len(targets)), targets].sum())
""", says="not the sum"),
    Mistake("cross_entropy", "indexes logp[:, targets], averaging an N x N matrix", """
def cross_entropy(logits, targets):
    logp = log_softmax(logits)
    return float(-logp[:, targets].mean())
"""),
    Mistake("cross_entropy", "log base 2 (bits) instead of nats", """
def cross_entropy(logits, targets):
    p = softmax(logits)
    return float(-np.log2(p[np.arange(len(targets)), targets]).mean())
""", says="natural log"),
    Mistake("cross_entropy", "log of softmax: infinite loss when a probability underflows", """
def cross_entropy(logits, targets):
    p = softmax(logits)
    with np.errstate(divide="ignore"):
        return float(-np.log(p[np.arange(len(targets)), targets]).mean())
"""),
    Mistake("perplexity", "exp of the summed instead of the mean log-probability", """
def perplexity(token_logprobs):
    return float(np.exp(-np.sum(token_logprobs)))
"""),
    Mistake("perplexity", "base 2 with natural-log inputs", """
def perplexity(token_logprobs):
    return float(2 ** (-np.mean(token_logprobs)))
"""),
    Mistake("perplexity", "accepts negative log-likelihoods without complaint", """
def perplexity(token_logprobs):
    return float(np.exp(np.abs(np.mean(token_logprobs))))
"""),
    Mistake("perplexity", "rejects only a positive mean, not each positive entry", """
def perplexity(token_logprobs):
    lp = np.asarray(token_logprobs, dtype=np.float64)
    if lp.mean() > 0:
        raise ValueError("token_logprobs must be log-probabilities (<= 0)")
    return float(np.exp(-lp.mean()))
""", says="not the mean"),
    Mistake("q1", "thinks a shift raises every probability", 'answer_q1 = "A"'),
    Mistake("q1", "thinks a shift sharpens the distribution", 'answer_q1 = "C"'),
    Mistake("q2", "reports the cross-entropy itself", "answer_q2 = 2.0"),
    Mistake("q2", "uses base 2", "answer_q2 = 4.0"),
    Mistake("q3", "thinks a higher temperature sharpens", 'answer_q3 = "B"'),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'no max shift: overflows to nan for large logits': ('temperature', 'cross_entropy'),
    'normalises over the whole array instead of each row': ('temperature', 'cross_entropy'),
    'subtracts one max for the whole batch': ('temperature', 'cross_entropy'),
    'reduces along axis 0 (columns) instead of the last axis': ('temperature', 'cross_entropy'),
    'no np.asarray: a list input': ('temperature', 'cross_entropy'),
    'logsumexp without the max shift: overflows': ('cross_entropy',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'softmax: x = np.asarray(logits, dtype=np.float64) => x = np.asarray(logits)':
        "float64 only adds precision for float32 inputs; the results agree within the tests' tolerance",
    'log_softmax: x = np.asarray(logits, dtype=np.float64) => x = np.asarray(logits)':
        "float64 only adds precision for float32 inputs; the results agree within the tests' tolerance",
    'temperature: x = np.asarray(logits, dtype=np.float64) => x = np.asarray(logits)':
        "float64 only adds precision for float32 inputs; the results agree within the tests' tolerance",
    'perplexity: lp = np.asarray(token_logprobs, dtype=np.float64) => lp = np.asarray(token_logprobs)':
        "float64 only adds precision for float32 inputs; the results agree within the tests' tolerance",
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('softmax', 'float32 arithmetic (the exercise fixes no dtype)', '''
def softmax(logits):
    """Probabilities along the last axis of `logits` (shape (..., V)); each row sums to 1."""
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
'''),
    Alternative('temperature', 'a helper named greedy for temperature 0', '''
def greedy(x):
    """A one-hot on the argmax of each row."""
    out = np.zeros_like(x)
    np.put_along_axis(out, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
    return out


def softmax_with_temperature(logits, temperature):
    """softmax(logits / temperature) along the last axis; temperature 0 means greedy (one-hot)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    x = np.asarray(logits, dtype=np.float64)
    return greedy(x) if temperature == 0 else softmax(x / temperature)
'''),
    Alternative('q2', 'a NumPy float32 scalar', '''
# Set answer_q2 to a number.
answer_q2 = np.float32(np.exp(2.0))
'''),
    Alternative('log_softmax', 'logaddexp.reduce', '''
def log_softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
'''),
    Alternative('temperature', 'capitalised message', '''
def softmax_with_temperature(logits, temperature):
    if temperature < 0:
        raise ValueError(f"Temperature must be >= 0, got {temperature}")
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        out = np.zeros_like(x)
        np.put_along_axis(out, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    return softmax(x / temperature)
'''),
    Alternative('cross_entropy', 'loop over rows', '''
def cross_entropy(logits, targets):
    total = 0.0
    for row, t in zip(logits, targets):
        total -= log_softmax(row)[t]
    return total / len(targets)
'''),
    Alternative('perplexity', 'geometric mean of probabilities', '''
def perplexity(token_logprobs):
    lp = np.asarray(token_logprobs, dtype=float)
    if (lp > 0).any():
        raise ValueError("not log-probabilities")
    return float(1.0 / np.exp(lp.sum() / lp.size))
'''),
    Alternative('q1', 'letter with space', '''
answer_q1 = " B "'''),
]
