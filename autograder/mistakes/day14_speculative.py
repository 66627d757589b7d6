"""Day 14 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

_ACCEPT_CHECK = """
def acceptance_probability(p_token, q_token):
    if q_token <= 0:
        raise ValueError(f"q_token must be > 0, got {q_token}")
"""

_VERIFY_HEAD = """
def verify_step(p, q, drafts, generator=None):
    new = []
"""

_LOOKUP_HEAD = """
def lookup_drafts(context, gamma, max_ngram=3):
"""

MISTAKES = [
    # ---------------------------------------------------------------- acceptance probability
    Mistake("acceptance_probability", "p / q not capped at 1", _ACCEPT_CHECK + """
    return p_token / q_token
"""),
    Mistake("acceptance_probability", "q / p (the ratio upside down)", _ACCEPT_CHECK + """
    if p_token <= 0:
        return 0.0
    return min(1.0, q_token / p_token)
"""),
    Mistake("acceptance_probability", "min(p, q) instead of min(1, p / q)", _ACCEPT_CHECK + """
    return min(p_token, q_token)
"""),
    Mistake("acceptance_probability", "no check: q_token = 0 divides by zero", """
def acceptance_probability(p_token, q_token):
    return min(1.0, p_token / q_token)
"""),
    Mistake("acceptance_probability", "q_token = 0 accepted as certain instead of refused", """
def acceptance_probability(p_token, q_token):
    if q_token <= 0:
        return 1.0
    return min(1.0, p_token / q_token)
"""),
    Mistake("acceptance_probability", "a ValueError whose message names no argument", """
def acceptance_probability(p_token, q_token):
    if q_token <= 0:
        raise ValueError("invalid request: the probability must be positive")
    return min(1.0, p_token / q_token)
""", says="must name the argument"),
    # ---------------------------------------------------------------- residual
    Mistake("residual", "not normalised", """
def residual(p, q):
    r = torch.clamp(p - q, min=0)
    if r.sum() <= 0:
        return p
    return r
"""),
    Mistake("residual", "no clamp: negative entries normalised along", """
def residual(p, q):
    r = p - q
    if r.abs().sum() <= 0:
        return p
    return r / r.abs().sum()
"""),
    Mistake("residual", "q - p (the draft's excess instead of the target's)", """
def residual(p, q):
    r = torch.clamp(q - p, min=0)
    if r.sum() <= 0:
        return p
    return r / r.sum()
"""),
    Mistake("residual", "p == q divides zero by zero (NaN)", """
def residual(p, q):
    r = torch.clamp(p - q, min=0)
    return r / r.sum()
"""),
    Mistake("residual", "returns p itself (resampling from the target)", """
def residual(p, q):
    return p
"""),
    Mistake("residual", "p == q gives zeros instead of p", """
def residual(p, q):
    r = torch.clamp(p - q, min=0)
    return r / r.sum().clamp(min=1e-12)
"""),
    # ---------------------------------------------------------------- verify step
    Mistake("verify_step", "forgets the bonus token when every draft is accepted", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    if not drafts:
        new.append(draw(p[0], generator))
    return new
"""),
    Mistake("verify_step", "keeps going after the first rejection", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
        else:
            new.append(draw(residual(p[i], q[i]), generator))
    new.append(draw(p[len(drafts)], generator))
    return new
"""),
    Mistake("verify_step", "resamples from p instead of the residual", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
            continue
        new.append(draw(p[i], generator))
        return new
    new.append(draw(p[len(drafts)], generator))
    return new
"""),
    Mistake("verify_step", "rejection drops the position (no correction token)", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
            continue
        return new or [draw(residual(p[i], q[i]), generator)]
    new.append(draw(p[len(drafts)], generator))
    return new
"""),
    Mistake("verify_step", "accepts when the uniform draw is ABOVE the probability", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() > a):
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    new.append(draw(p[len(drafts)], generator))
    return new
"""),
    Mistake("verify_step", "bonus token from the last draft's row p[k-1]", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    new.append(draw(p[max(len(drafts) - 1, 0)], generator))
    return new
"""),
    Mistake("verify_step", "keeps every draft (no acceptance test)", _VERIFY_HEAD + """
    new = list(drafts)
    new.append(draw(p[len(drafts)], generator))
    return new
"""),
    Mistake("verify_step", "greedy check compares the draft with q's argmax", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        if generator is None:
            keep = int(q[i].argmax()) == token
        else:
            a = acceptance_probability(float(p[i, token]), float(q[i, token]))
            keep = torch.rand((), generator=generator).item() < a
        if keep:
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    new.append(draw(p[len(drafts)], generator))
    return new
""", says="not the draft's own"),
    Mistake("verify_step", "draws the bonus token without the generator (always p[k]'s argmax)",
            _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = acceptance_probability(float(p[i, token]), float(q[i, token]))
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    new.append(draw(p[len(drafts)]))
    return new
""", says="the bonus token is a sample of the last row"),
    Mistake("verify_step", "accepts a draft when a sample of p equals it (ignores q)", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        if draw(p[i], generator) == token:
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    new.append(draw(p[len(drafts)], generator))
    return new
""", says="a draft with p >= q must always be kept"),
    Mistake("verify_step", "accepts with probability p(d), not min(1, p(d) / q(d))", _VERIFY_HEAD + """
    for i, token in enumerate(drafts):
        a = float(p[i, token])
        if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            new.append(token)
            continue
        new.append(draw(residual(p[i], q[i]), generator))
        return new
    new.append(draw(p[len(drafts)], generator))
    return new
""", says="a draft with p >= q must always be kept"),
    # ---------------------------------------------------------------- tokens per pass
    Mistake("tokens_per_pass", "exponent gamma instead of gamma + 1 (forgets the bonus token)", """
def tokens_per_pass(a, gamma):
    if not 0 <= a <= 1:
        raise ValueError(f"a must be in [0, 1], got {a}")
    if a == 1:
        return float(gamma)
    return (1 - a ** gamma) / (1 - a)
"""),
    Mistake("tokens_per_pass", "divides by zero at a = 1", """
def tokens_per_pass(a, gamma):
    if not 0 <= a <= 1:
        raise ValueError(f"a must be in [0, 1], got {a}")
    return (1 - a ** (gamma + 1)) / (1 - a)
"""),
    Mistake("tokens_per_pass", "gamma * a + 1 (linear, as if acceptances did not stop a round)", """
def tokens_per_pass(a, gamma):
    if not 0 <= a <= 1:
        raise ValueError(f"a must be in [0, 1], got {a}")
    return 1 + gamma * a
"""),
    Mistake("tokens_per_pass", "no check of a", """
def tokens_per_pass(a, gamma):
    if a == 1:
        return float(gamma + 1)
    return (1 - a ** (gamma + 1)) / (1 - a)
"""),
    Mistake("tokens_per_pass", "returns the int gamma + 1 at a == 1 (the prompt asks for a float)", """
def tokens_per_pass(a, gamma):
    if not 0 <= a <= 1:
        raise ValueError(f"a must be in [0, 1], got {a}")
    if a == 1:
        return gamma + 1
    return (1 - a ** (gamma + 1)) / (1 - a)
""", says="as a float"),
    # ---------------------------------------------------------------- prompt lookup
    Mistake("lookup_drafts", "takes the oldest occurrence instead of the latest", _LOOKUP_HEAD + """
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(0, len(context) - n):
            if context[start:start + n] == tail:
                return context[start + n:start + n + gamma]
    return []
"""),
    Mistake("lookup_drafts", "counts the tail itself as an occurrence", _LOOKUP_HEAD + """
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + gamma]
    return []
""", says="position at the end is not an earlier occurrence"),
    Mistake("lookup_drafts", "tries the shortest n-gram first", _LOOKUP_HEAD + """
    for n in range(1, min(max_ngram, len(context) - 1) + 1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + gamma]
    return []
"""),
    Mistake("lookup_drafts", "returns gamma + 1 tokens", _LOOKUP_HEAD + """
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + gamma + 1]
    return []
"""),
    Mistake("lookup_drafts", "ignores max_ngram (only the last token)", _LOOKUP_HEAD + """
    if len(context) < 2:
        return []
    for start in range(len(context) - 2, -1, -1):
        if context[start] == context[-1]:
            return context[start + 1:start + 1 + gamma]
    return []
"""),
    # ---------------------------------------------------------------- self-check
    Mistake("q1", "thinks a poor draft changes the greedy output", 'answer_q1 = "B"'),
    Mistake("q2", "forgets the bonus token: 1 + a + a^2 + a^3", "answer_q2 = (1 - 0.8 ** 4) / (1 - 0.8)"),
    Mistake("q3", "forgets the draft cost", "answer_q3 = (1 - 0.8 ** 5) / (1 - 0.8)"),
    Mistake("q2", "one decimal where the question asks for two", "answer_q2 = 3.4",
            says="round your result to two decimals"),
    Mistake("q3", "truncates instead of rounding (1.6808 -> 1.67)", "answer_q3 = 1.67",
            says="round your result to two decimals"),
    Mistake("q4", "thinks the mask hides the rejected entries", 'answer_q4 = "A"'),
]

# verify_step's tests swap in the reference acceptance_probability and residual.
MISTAKES = [replace(m, keeps=("verify_step",))
            if m.grade_id in ("acceptance_probability", "residual") else m for m in MISTAKES]

_MEASURE_ZERO = "torch.rand is continuous in [0, 1): it equals the acceptance probability with probability 0"
_GREEDY_ONE_HOT = "greedy p and q are one-hot, so a is 0 or 1: a >= 1 decides, and rand < 0 is never true"
_N_TOO_LONG = ("an n-gram of len(context) or more has no earlier start (its start range is empty), and "
               "n = 0 compares the whole context with []: neither ever matches")
_START_MINUS_ONE = "start = -1 slices context[-1:n - 1], which is empty for every n <= len(context) - 1"

EQUIVALENT_MUTANTS = {
    "verify_step: if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a): => "
    "if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() <= a):": _MEASURE_ZERO,
    "verify_step: if a >= 1 or (generator is not None and torch.rand((), generator=generator).item() < a): => "
    "if a >= 1 or ((torch.rand((), generator=generator).item() < a)):": _GREEDY_ONE_HOT,
    "lookup_drafts: for n in range(min(max_ngram, len(context) - 1), 0, -1): => "
    "for n in range(min(max_ngram, len(context) - 1), -1, -1):": _N_TOO_LONG,
    "lookup_drafts: for n in range(min(max_ngram, len(context) - 1), 0, -1): => "
    "for n in range(min(max_ngram, len(context) + 1), 0, -1):": _N_TOO_LONG,
    "lookup_drafts: for n in range(min(max_ngram, len(context) - 1), 0, -1): => "
    "for n in range(min(max_ngram, len(context) - 0), 0, -1):": _N_TOO_LONG,
    "lookup_drafts: for start in range(len(context) - n - 1, -1, -1): => "
    "for start in range(len(context) - n - 1, -2, -1):": _START_MINUS_ONE,
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('acceptance_probability', 'float min, message', """
def acceptance_probability(p_token, q_token):
    if not q_token > 0:
        raise ValueError(f"q_token must be positive, got {q_token}")
    return float(min(1, p_token / q_token))
"""),
    Alternative('acceptance_probability', 'another wording that names q_token, capitalised', """
def acceptance_probability(p_token, q_token):
    if q_token <= 0:
        raise ValueError(f"Q_TOKEN is {q_token}, but a proposed token needs q_token > 0")
    return min(1.0, p_token / q_token)
"""),
    Alternative('residual', 'where any positive float64', """
def residual(p, q):
    d = (p - q).double()
    if not (d > 0).any():
        return p
    r = torch.where(d > 0, d, torch.zeros_like(d))
    return (r / r.sum()).to(p.dtype)
"""),
    Alternative('verify_step', 'tensor probabilities, while loop', """
def verify_step(p, q, drafts, generator=None):
    tokens, i, k = [], 0, len(drafts)
    while i < k:
        a = acceptance_probability(p[i][drafts[i]], q[i][drafts[i]])
        if a == 1 or (generator is not None and torch.rand((), generator=generator).item() < a):
            tokens.append(drafts[i]); i += 1
        else:
            return tokens + [draw(residual(p[i], q[i]), generator)]
    return tokens + [draw(p[k], generator)]
"""),
    Alternative('tokens_per_pass', 'sum of powers', """
def tokens_per_pass(a, gamma):
    if a < 0 or a > 1:
        raise ValueError("a must be in [0, 1]")
    return float(sum(a ** i for i in range(gamma + 1)))
"""),
    Alternative('lookup_drafts', 'numpy windows', """
def lookup_drafts(context, gamma, max_ngram=3):
    arr = np.asarray(context)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        tail = arr[-n:]
        for s in reversed(range(len(arr) - n)):
            if np.array_equal(arr[s:s + n], tail):
                return [int(x) for x in arr[s + n:s + n + gamma]]
    return []
"""),
    Alternative('q2', 'two decimals, as asked', """
answer_q2 = 3.36
"""),
    Alternative('q3', 'two decimals, as asked', """
answer_q3 = 1.68
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy float64 from np.sum', '''
# Set answer_q2 to a number (tokens per target pass).
import numpy as np
answer_q2 = np.round(np.sum(0.8 ** np.arange(5)), 2)
'''),
    Alternative('q3', 'a NumPy float32', '''
# Set answer_q3 to a number (the estimated speedup).
import numpy as np
answer_q3 = np.float32(round((1 - 0.8 ** 5) / (1 - 0.8) / (1 + 0.25 * 4), 2))
'''),
]
