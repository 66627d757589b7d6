"""Day 01: from logits to probabilities, in NumPy.

A language model ends in a vector of logits, one real number per token of the vocabulary. This
module turns logits into probabilities and scores predictions:

    softmax                  logits (..., V) -> probabilities (..., V), numerically stable
    logsumexp, log_softmax   the same in log space, finite where softmax underflows
    softmax_with_temperature divide by the temperature first; temperature 0 means greedy
    cross_entropy            mean negative log-likelihood of target ids, in nats
    perplexity               exp(-mean log-prob): the "effective number of choices"
"""

from __future__ import annotations

import numpy as np


def _as_logits(logits, axis: int = -1, name: str = "logits") -> np.ndarray:
    """`logits` as a float64 array, checked along `axis` (the vocabulary's)."""
    array = np.asarray(logits)
    if array.dtype == object or not np.issubdtype(array.dtype, np.number):
        raise TypeError(f"{name} must be a numeric array, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.complexfloating):
        raise TypeError(f"{name} must be real numbers, got dtype {array.dtype}")
    if array.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension (the vocabulary), got a scalar")
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"axis must be an integer, got {type(axis).__name__}")
    if not -array.ndim <= axis < array.ndim:
        raise ValueError(f"axis must be in [{-array.ndim}, {array.ndim}) for {name} of shape "
                         f"{array.shape}, got {axis}")
    if array.shape[axis] == 0:
        raise ValueError(f"{name} must have at least one entry along axis {axis}")
    array = array.astype(np.float64, copy=False)
    if np.isnan(array).any() or np.isposinf(array).any():
        raise ValueError(f"{name} must not contain NaN or +inf (-inf is allowed: a removed token)")
    if np.isneginf(array).all(axis=axis).any():
        raise ValueError(f"{name}: every entry of a row (along axis {axis}) is -inf, so no "
                         f"token is possible")
    return array


def logsumexp(logits, axis: int = -1) -> np.ndarray:
    """log(sum(exp(logits))) along `axis`, computed as m + log(sum(exp(logits - m))), m = max.

    Shape: (..., V) -> (...,). Finite for any finite input, however large.
    """
    x = _as_logits(logits, axis)
    m = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def softmax(logits, axis: int = -1) -> np.ndarray:
    """exp(x_i) / sum_j exp(x_j) along `axis`, with the max subtracted first.

    Subtracting the max changes nothing mathematically (the factor exp(-m) cancels) but keeps
    every exponent <= 0, so exp never overflows. Shape: (..., V) -> (..., V), rows sum to 1.
    """
    x = _as_logits(logits, axis)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(logits, axis: int = -1) -> np.ndarray:
    """log(softmax(logits)) computed as logits - logsumexp(logits): finite where softmax is 0.

    Shape: (..., V) -> (..., V).
    """
    x = _as_logits(logits, axis)
    return x - np.expand_dims(logsumexp(x, axis=axis), axis)


def softmax_with_temperature(logits, temperature: float, axis: int = -1) -> np.ndarray:
    """softmax(logits / temperature). temperature < 1 sharpens, > 1 flattens.

    temperature == 0 is greedy by design: a one-hot vector on the argmax (the first one on ties),
    the limit the distribution approaches as the temperature falls. A negative temperature
    (it would reverse the ranking) or a non-finite one raises ValueError. The logits are
    divided as (logits - max) / temperature (softmax does not change when a row is shifted), so
    a tiny temperature (1e-310, say) cannot overflow them to +inf: the largest stay 0 and the
    others fall to -inf, probability 0, the limit they tend to.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.floating
                                                       | np.integer):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), "
                         f"got {temperature}")
    x = _as_logits(logits, axis)
    if temperature == 0:
        winner = np.argmax(x, axis=axis)
        one_hot = np.zeros_like(x)
        np.put_along_axis(one_hot, np.expand_dims(winner, axis), 1.0, axis=axis)
        return one_hot
    shifted = x - np.max(x, axis=axis, keepdims=True)           # <= 0, the maxima exactly 0
    with np.errstate(over="ignore"):      # past float64's range: -inf, probability 0
        return softmax(shifted / temperature, axis=axis)


def cross_entropy(logits, targets) -> float:
    """Mean negative log-probability of `targets` under softmax(logits), in nats.

    logits: (N, V) floats with N >= 1 (the mean of nothing is no loss); targets: (N,) integer
    ids in [0, V). Returns a Python float.
    """
    x = _as_logits(logits)
    t = np.asarray(targets)
    if x.ndim != 2:
        raise ValueError(f"logits must have shape (N, V), got {x.shape}")
    if x.shape[0] == 0:
        raise ValueError(f"logits must have at least one row (N >= 1) to average over, got "
                         f"shape {x.shape}")
    if not np.issubdtype(t.dtype, np.integer) or t.shape != (x.shape[0],):
        raise ValueError(f"targets must be {x.shape[0]} integer ids, one per row of logits; "
                         f"got dtype {t.dtype}, shape {t.shape}")
    if t.size and (t.min() < 0 or t.max() >= x.shape[1]):
        raise ValueError(f"targets must lie in [0, {x.shape[1]}), got min {t.min()}, "
                         f"max {t.max()}")
    logp = log_softmax(x)
    return float(-np.mean(logp[np.arange(x.shape[0]), t]))


def perplexity(token_logprobs) -> float:
    """exp(-mean(token_logprobs)) = exp(cross-entropy): 1 for a perfect model, V for a uniform one.

    token_logprobs: (N,) natural-log probabilities the model gave to each actual next token
    (all <= 0). Passing negative log-likelihoods (positive numbers) raises ValueError.
    """
    lp = np.asarray(token_logprobs, dtype=np.float64)
    if lp.ndim != 1 or lp.size == 0:
        raise ValueError(f"token_logprobs must be a non-empty 1-D array, got shape {lp.shape}")
    if np.isnan(lp).any() or (lp > 0).any():
        raise ValueError("token_logprobs must be log-probabilities (<= 0, not NaN); positive "
                         "values look like negative log-likelihoods: negate them first")
    return float(np.exp(-np.mean(lp)))
