"""Day 07 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ---- top-k -------------------------------------------------------------------------------
    Mistake("top_k", "keeps exactly k indices (torch.topk indices): drops tokens tied with the "
                     "k-th", """
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    idx = torch.topk(logits, k, dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("top_k", "one threshold for the whole batch instead of one per row", """
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits.flatten(), k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))
"""),
    Mistake("top_k", "modifies the caller's logits in place", """
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    logits[logits < kth] = float("-inf")
    return logits
"""),
    Mistake("top_k", "no guard for k >= V: torch.topk raises for k > V", """
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))
"""),
    Mistake("top_k", "the ValueError's message does not name k", """
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"cannot keep a negative number of tokens: {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))
""", says="name the argument in the message"),
    Mistake("top_k", "treats a negative k as off instead of raising", """
def top_k_filter(logits, k):
    if k <= 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))
"""),
    # ---- top-p -------------------------------------------------------------------------------
    Mistake("top_p", "cumulative <= p: drops the token that crosses p", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) <= p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("top_p", "drops the crossing token but always keeps the top one", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) <= p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("top_p", "applies the sorted mask to the unsorted logits (forgets to scatter back)", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p
    return logits.masked_fill(~keep_sorted, float("-inf"))
"""),
    Mistake("top_p", "no special case for p = 1: rounding drops tail tokens", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("top_p", "silently clamps p into (0, 1] instead of raising", """
def top_p_filter(logits, p):
    p = min(max(p, 1e-6), 1.0)
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    # ---- min-p -------------------------------------------------------------------------------
    Mistake("min_p", "absolute threshold: probs >= min_p, not min_p * the largest", """
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p, float("-inf"))
"""),
    Mistake("min_p", "compares logits instead of probabilities", """
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0:
        return logits.clone()
    threshold = min_p * logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < threshold, float("-inf"))
"""),
    Mistake("min_p", "strict > : min_p = 1 removes every token", """
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~(probs > threshold), float("-inf"))
"""),
    Mistake("min_p", "uses the largest probability of the whole batch, not of each row", """
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
"""),
    # ---- typical -----------------------------------------------------------------------------
    Mistake("typical", "sorts by probability (that is top-p), not by distance to the entropy", """
def typical_filter(logits, typical_p):
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1], got {typical_p}")
    if typical_p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < typical_p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("typical", "entropy as -(p * log p).sum(): nan when a token is already removed", """
def typical_filter(logits, typical_p):
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1], got {typical_p}")
    if typical_p == 1:
        return logits.clone()
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    _, order = torch.sort(distance, dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < typical_p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("typical", "cumulative <= typical_p: drops the crossing token", """
def typical_filter(logits, typical_p):
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1], got {typical_p}")
    if typical_p == 1:
        return logits.clone()
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    _, order = torch.sort(distance, dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) <= typical_p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    Mistake("typical", "signed distance (no abs): ranks the least surprising tokens first", """
def typical_filter(logits, typical_p):
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1], got {typical_p}")
    if typical_p == 1:
        return logits.clone()
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(dim=-1, keepdim=True)
    distance = -log_probs - entropy
    _, order = torch.sort(distance, dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < typical_p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""),
    # ---- sampling_probs ----------------------------------------------------------------------
    Mistake("sampling_probs", "applies the temperature after the filters, whatever the order", """
def sampling_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                   order=HF_ORDER):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits
    for stage in order:
        if stage == "top_k":
            x = top_k_filter(x, top_k)
        elif stage == "top_p":
            x = top_p_filter(x, top_p)
        elif stage == "min_p":
            x = min_p_filter(x, min_p)
        elif stage == "typical":
            x = typical_filter(x, typical_p)
    return torch.softmax(x / temperature, dim=-1)
"""),
    Mistake("sampling_probs", "ignores `order`: always Hugging Face's order", """
def sampling_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                   order=HF_ORDER):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits / temperature
    x = top_k_filter(x, top_k)
    x = top_p_filter(x, top_p)
    x = min_p_filter(x, min_p)
    x = typical_filter(x, typical_p)
    return torch.softmax(x, dim=-1)
"""),
    Mistake("sampling_probs", "does not renormalize: the raw probabilities with removed tokens "
                              "zeroed", """
def sampling_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                   order=HF_ORDER):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits
    for stage in order:
        if stage == "temperature":
            x = x / temperature
        elif stage == "top_k":
            x = top_k_filter(x, top_k)
        elif stage == "top_p":
            x = top_p_filter(x, top_p)
        elif stage == "min_p":
            x = min_p_filter(x, min_p)
        elif stage == "typical":
            x = typical_filter(x, typical_p)
    return torch.softmax(logits / temperature, dim=-1).masked_fill(torch.isneginf(x), 0.0)
"""),
    Mistake("sampling_probs", "multiplies by the temperature instead of dividing", """
def sampling_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                   order=HF_ORDER):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits
    for stage in order:
        if stage == "temperature":
            x = x * temperature
        elif stage == "top_k":
            x = top_k_filter(x, top_k)
        elif stage == "top_p":
            x = top_p_filter(x, top_p)
        elif stage == "min_p":
            x = min_p_filter(x, min_p)
        elif stage == "typical":
            x = typical_filter(x, typical_p)
    return torch.softmax(x, dim=-1)
"""),
    # ---- sample_next_token -------------------------------------------------------------------
    Mistake("sample_next_token", "ignores the generator: draws from torch's global RNG", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, typical_p, order)
    return torch.multinomial(probs, num_samples=1).squeeze(1)
"""),
    Mistake("sample_next_token", "returns multinomial's (B, 1) without squeezing", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1, keepdim=True)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, typical_p, order)
    return torch.multinomial(probs, num_samples=1, generator=generator)
"""),
    Mistake("sample_next_token", "draws from the raw softmax: the filters are ignored", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
"""),
    Mistake("sample_next_token", "greedy after the filters: typical sampling can change the "
                                 "argmax", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        x = typical_filter(min_p_filter(top_p_filter(top_k_filter(logits, top_k), top_p), min_p),
                           typical_p)
        return torch.argmax(x, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, typical_p, order)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
"""),
    Mistake("sample_next_token", "treats any temperature <= 0 as greedy (no error for -1)", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, typical_p, order)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
"""),
    # ---- the input's identity, large logits, knobs passed on (hidden checks added 2026-11)
    Mistake("top_k", "returns the caller's tensor itself when k is off (no copy)", """
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"k must be >= 0 (0 = off), got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))
""", says="not a copy"),
    Mistake("top_p", "returns the caller's tensor itself when p = 1 (no copy)", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1] (1 = off), got {p}")
    if p == 1:
        return logits
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
""", says="not a copy"),
    Mistake("top_p", "hand-written softmax without subtracting the max: exp overflows", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1] (1 = off), got {p}")
    if p == 1:
        return logits.clone()
    e = torch.exp(logits)
    probs = e / e.sum(dim=-1, keepdim=True)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
""", says="overflows"),
    Mistake("top_p", "the ValueError's message does not name p", """
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError("expected a value in (0, 1]")
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
""", says="should mention p"),
    Mistake("min_p", "returns the caller's tensor itself when min_p = 0 (no copy)", """
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if min_p == 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))
""", says="not a copy"),
    Mistake("min_p", "bare exp(logits) for the ratio (no max subtracted): overflows", """
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if min_p == 0:
        return logits.clone()
    weights = torch.exp(logits)
    threshold = min_p * weights.max(dim=-1, keepdim=True).values
    return logits.masked_fill(weights < threshold, float("-inf"))
""", says="overflows"),
    Mistake("typical", "returns the caller's tensor itself when typical_p = 1 (no copy)", """
def typical_filter(logits, typical_p):
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1] (1 = off), got {typical_p}")
    if typical_p == 1:
        return logits
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    _, order = torch.sort(distance, dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < typical_p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
""", says="not a copy"),
    Mistake("sampling_probs", "divides the caller's logits by the temperature in place", """
def sampling_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                   order=HF_ORDER):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here (0 = greedy), got {temperature}")
    x = logits
    for stage in order:
        if stage == "temperature":
            x /= temperature
        elif stage == "top_k":
            x = top_k_filter(x, top_k)
        elif stage == "top_p":
            x = top_p_filter(x, top_p)
        elif stage == "min_p":
            x = min_p_filter(x, min_p)
        elif stage == "typical":
            x = typical_filter(x, typical_p)
        else:
            raise ValueError(f"unknown stage {stage!r} in order")
    return torch.softmax(x, dim=-1)
""", says="in-place"),
    Mistake("sample_next_token", "does not pass `order` on to sampling_probs", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, typical_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
""", says="order"),
    Mistake("sample_next_token", "passes only temperature, top_k and top_p on (min_p, typical_p "
            "dropped)", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, order=order)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
""", says="min_p"),
    Mistake("sample_next_token", "forgets to pass typical_p on to sampling_probs", """
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, order=order)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
""", says="typical_p"),
    # ---- self-check ----------------------------------------------------------------------------
    Mistake("q1", "drops the crossing token", 'answer_q1 = "B"'),
    Mistake("q1", "counts every token below the cumulative 0.95", 'answer_q1 = "D"'),
    Mistake("q2", "thinks top-k is slower", 'answer_q2 = "A"'),
    Mistake("q2", "confuses top-k with typical sampling", 'answer_q2 = "C"'),
    Mistake("q3", "filters before the temperature (min-p on the raw distribution)", "answer_q3 = 2"),
    Mistake("q3", "counts every token", "answer_q3 = 5"),
]

# One mistake, one charge: sampling_probs is tested with the package's filters swapped in, and
# sample_next_token's hidden tests with a reference pipeline, so these keep their full marks.
_KEEPS = {
    "cumulative <= p: drops the token that crosses p": ("sampling_probs", "sample_next_token"),
    "cumulative <= typical_p: drops the crossing token": ("sampling_probs", "sample_next_token"),
    "signed distance (no abs): ranks the least surprising tokens first": ("sampling_probs",),
    "applies the temperature after the filters, whatever the order": ("sample_next_token",),
}
MISTAKES = [replace(m, keeps=_KEEPS.get(m.name, ())) for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    "top_k: if k == 0 or k >= logits.shape[-1]: => if k == 0 or k > logits.shape[-1]:":
        "k == V: the k-th largest is the row minimum, so the threshold keeps every token anyway",
    "top_k: kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:] => "
    "kth_largest = torch.topk(logits, k).values[:, -1:]": "torch.topk's default dim is -1",
    "top_p: sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True) => "
    "sorted_probs, order = torch.sort(probs, descending=True, stable=True)":
        "torch.sort's default dim is -1",
    "typical: _, order = torch.sort(distance, dim=-1, stable=True) => "
    "_, order = torch.sort(distance, stable=True)": "torch.sort's default dim is -1",
    "min_p: if min_p == 0: => if False:":
        "min_p = 0 gives threshold 0 and no probability is < 0: the filter keeps every token",
    "min_p: if min_p == 0: => if min_p == (-1):":
        "min_p = -1 is rejected above; min_p = 0 then keeps every token through threshold 0",
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('sample_next_token', 'helper named draw', '''
def draw(probs, generator=None):
    "One token id per row of probs (B, V) -> (B,)."
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, typical_p, order)
    return draw(probs, generator)
'''),
    Alternative('top_p', 'helper named masked', '''
def masked(logits, keep):
    "logits with the tokens not in keep set to -inf (a new tensor)."
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = torch.zeros_like(mass_before, dtype=torch.bool).scatter(1, order, mass_before < p)
    return masked(logits, keep)
'''),
    Alternative('q3', 'the 0-d tensor count, without int()', '''
# Set answer_q3 to a number.
answer_q3 = (sampling_probs(LOGITS, temperature=2.0, min_p=0.1) > 0).sum()
'''),
    Alternative('q3', 'numpy count', '''
answer_q3 = np.sum(sampling_probs(LOGITS, temperature=2.0, min_p=0.1).numpy() > 0)'''),
    Alternative('top_k', 'kthvalue threshold + torch.where', '''
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    V = logits.shape[-1]
    if k == 0 or k >= V:
        return logits.clone()
    kth = torch.kthvalue(logits, V - k + 1, dim=-1, keepdim=True).values
    return torch.where(logits >= kth, logits, torch.full_like(logits, float("-inf")))
'''),
    Alternative('top_p', 'exclusive cumsum by shifting cumulative', '''
def top_p_filter(logits, p):
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if p == 1:
        return logits.clone()
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep_sorted = mass_before < p
    keep = keep_sorted.gather(1, order.argsort(dim=-1))
    return logits.masked_fill(~keep, float("-inf"))
'''),
    Alternative('min_p', 'log-space comparison', '''
import math
def min_p_filter(logits, min_p):
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_p == 0:
        return logits.clone()
    logp = torch.log_softmax(logits, dim=-1)
    keep = logp >= logp.max(dim=-1, keepdim=True).values + math.log(min_p)
    return logits.masked_fill(~keep, float("-inf"))
'''),
    Alternative('typical', 'float64', '''
def typical_filter(logits, typical_p):
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1], got {typical_p}")
    if typical_p == 1:
        return logits.clone()
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    probs = log_probs.exp()
    H = -torch.where(probs > 0, probs * log_probs, 0.0).sum(-1, keepdim=True)
    distance = (-log_probs - H).abs()
    _, order = torch.sort(distance, dim=-1, stable=True)
    sp = probs.gather(1, order)
    keep_sorted = torch.cumsum(sp, -1) - sp < typical_p
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
'''),
    Alternative('sample_next_token', 'keywords, view(-1), max().indices', '''
def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                      order=HF_ORDER, generator=None):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p, typical_p=typical_p, order=order)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
'''),
    Alternative('sampling_probs', 'messages that start with a capital (Temperature, Unknown stage)', '''
def sampling_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                   order=HF_ORDER):
    """The distribution the next token is drawn from: the stages of `order`, then softmax."""
    if temperature <= 0:
        raise ValueError(f"Temperature must be positive (use greedy for 0), got {temperature}")
    stages = {"temperature": lambda x: x / temperature,
              "top_k": lambda x: top_k_filter(x, top_k),
              "top_p": lambda x: top_p_filter(x, top_p),
              "min_p": lambda x: min_p_filter(x, min_p),
              "typical": lambda x: typical_filter(x, typical_p)}
    x = logits
    for stage in order:
        if stage not in stages:
            raise ValueError(f"Unknown stage {stage!r} in order; known: {sorted(stages)}")
        x = stages[stage](x)
    return torch.softmax(x, dim=-1)
'''),
    Alternative('top_k', 'message names top_k, torch.where on a threshold', '''
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"top_k must be non-negative (0 = off), got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    threshold = logits.topk(k, dim=-1).values[..., -1:]
    return torch.where(logits >= threshold, logits, torch.full_like(logits, float("-inf")))
'''),
    Alternative('top_k', 'message with a capital K', '''
def top_k_filter(logits, k):
    if k < 0:
        raise ValueError(f"K = {k} is negative; K must be >= 0")
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))
'''),
]
