"""Day 07: sampling. Turning one row of logits into the next token id.

A model's last layer gives logits (B, V): one score per vocabulary token for each of B rows.
Sampling picks one token per row. Each knob below is one small function that takes logits and
returns NEW logits (the input is never modified) with the tokens it removes set to -inf, so the
steps compose by plain function application and end in one softmax:

    apply_repetition_penalty          Hugging Face style: divide positive / multiply negative
                                      logits of every distinct token seen (prompt included)
    apply_frequency_presence_penalty  OpenAI style: subtract count * f + (count > 0) * p over the
                                      generated tokens
    apply_temperature                 logits / T; T -> 0 approaches greedy, T > 1 flattens (a T
                                      so small that logits / T overflows: (logits - max) / T)
    top_k_filter                      keep the k largest (ties with the k-th are kept)
    top_p_filter                      keep the smallest prefix (by probability) whose mass
                                      reaches p, including the token that crosses p
    min_p_filter                      keep tokens with prob >= min_p * (largest prob)
    typical_filter                    keep the tokens whose surprisal is closest to the entropy,
                                      up to mass typical_p
    sample_next_token                 penalties, then the filters in a chosen `order`, then
                                      one draw from the softmax (or argmax when T = 0)
    explain_sampling                  every stage's probability vector, as plain data, for the
                                      course's sampling explorer widget

Order matters: the filters do not commute in general (min-p before or after top-k can keep
different sets, and temperature before or after min-p changes what min-p sees). Engines differ:
Hugging Face transformers 5.23 (`GenerationMixin._get_logits_processor`) applies the
repetition penalty, then temperature, top-k, top-p, min-p, typical (HF_ORDER). vLLM's V1
sampler (vllm/v1/sample/sampler.py) applies penalties, then temperature, then min-p (one of its
"argmax-invariant" logits processors), then top-k and top-p together (VLLM_ORDER; vLLM has no
typical sampling, so that position is our choice).

Checked against transformers 5.23's processors (tests/test_sampling.py): the repetition penalty,
top-k, top-p, min-p and typical filters agree exactly except on exact probability ties at the
cut-off. There, transformers' top-p sorts ascending and keeps the HIGHER ids of a tied group,
and its typical filter keeps every token tied with the boundary one; ours keep the smallest
set, lower ids first.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

FILTER_STAGES = ("temperature", "top_k", "top_p", "min_p", "typical")
HF_ORDER: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p", "typical")
VLLM_ORDER: tuple[str, ...] = ("temperature", "min_p", "top_k", "top_p", "typical")
DEFAULT_ORDER = HF_ORDER
MAX_GENERATOR_SEED = 2**64 - 1     # torch.Generator.manual_seed takes seeds 0 .. 2**64 - 1
# the penalties act on float32 logits: a factor below float32's smallest normal number (or a
# term beyond its largest) turns every seen token's logit into +-inf or NaN
FLOAT32_TINY = torch.finfo(torch.float32).tiny      # 1.1754944e-38
FLOAT32_MAX = torch.finfo(torch.float32).max        # 3.4028235e+38


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------

def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (not bool), got {type(value).__name__} {value!r}")
    return int(value)


def check_token_id(name: str, value: object, vocab: int | None = None, *,
                   optional: bool = False) -> int | None:
    """An int token id (None too when optional), in [0, vocab) when vocab is given: the one
    check behind every pad_id, eos_id and eos_ids the loops and the engine take."""
    if value is None and optional:
        return None
    what = "None or an int" if optional else "an int"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {what} token id, got {type(value).__name__} {value!r}")
    if value < 0 or (vocab is not None and value >= vocab):
        top = "..." if vocab is None else vocab
        raise ValueError(f"{name} must be a token id in [0, {top}), got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Validated on construction.

    temperature         >= 0. 0 means greedy (argmax, first index on ties; filters skipped).
    top_k               >= 0. 0 means off; otherwise keep the k most likely tokens (and ties).
    top_p               in (0, 1]. 1 means off.
    min_p               in [0, 1]. 0 means off.
    typical_p           in (0, 1]. 1 means off.
    repetition_penalty  > 0. 1 means off; > 1 discourages tokens already seen (prompt included).
                        At most what float32 holds: in [FLOAT32_TINY, FLOAT32_MAX].
    frequency_penalty   real. 0 means off; subtracted once per occurrence in the generated text.
    presence_penalty    real. 0 means off; subtracted once if the token was generated at all.
                        Both in [-FLOAT32_MAX, FLOAT32_MAX] (what float32 holds).
    max_new_tokens      >= 1: the most tokens to generate (0 is rejected: asking for nothing is
                        almost always a bug, and every loop in the course produces >= 1 token).
    stop                stop strings, matched on decoded text; a single str means (str,).
    seed                None (use torch's global generator) or an int in
                        [0, MAX_GENERATOR_SEED = 2**64 - 1], the seeds a torch.Generator takes.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        def store(name: str, value) -> None:
            object.__setattr__(self, name, value)

        for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            store(name, _real(name, getattr(self, name)))
        for name in ("top_k", "max_new_tokens"):
            store(name, _integer(name, getattr(self, name)))

        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1] (1 = off), got {self.typical_p}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off) and in [{FLOAT32_TINY:.8g}, "
                f"{FLOAT32_MAX:.8g}] (float32's normal range: the logits are float32), got "
                f"{self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -FLOAT32_MAX <= getattr(self, name) <= FLOAT32_MAX:
                raise ValueError(f"{name} must be in [-{FLOAT32_MAX:.8g}, {FLOAT32_MAX:.8g}] "
                                 f"(what float32 holds: the logits are float32), got "
                                 f"{getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence):
            raise TypeError(f"stop must be a str or a sequence of str, got {type(stop).__name__}")
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must contain only str, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty, got ''")
        store("stop", stop)

        if self.seed is not None:
            store("seed", _integer("seed", self.seed))
            if not 0 <= self.seed <= MAX_GENERATOR_SEED:
                raise ValueError(f"seed must be None or an int in [0, 2**64 - 1] (what a "
                                 f"torch.Generator takes), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: the next token is the argmax."""
        return self.temperature == 0


def flag_message(message: str, **flags: str) -> str:
    """A SamplingParams error as a command line shows it: every field name in `message`
    written as its flag, --field-name (top_p -> --top-p), or as flags[field] where the
    command names it otherwise (chat: max_new_tokens="--max-tokens")."""
    names = {f.name: flags.get(f.name, "--" + f.name.replace("_", "-"))
             for f in fields(SamplingParams)}
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], message)


# ----------------------------------------------------------------------------------------------
# Input checks shared by every step
# ----------------------------------------------------------------------------------------------

def _check_logits(logits, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (B, V), got "
                        f"{type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {logits.dtype}")
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"{name} must have shape (B, V) with V >= 1, got {tuple(logits.shape)}")
    # one reduction for the common case: each row's max is finite exactly when the row has no
    # NaN (amax propagates it), no +inf, and at least one token that is not -inf
    rows = logits.shape[0]
    if rows == 1 and math.isfinite(logits.amax().item()):
        return logits
    if rows > 1 and all(map(math.isfinite, logits.amax(dim=-1).tolist())):
        return logits
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ValueError(f"{name} must not contain NaN or +inf (-inf marks a removed token)")
    if logits.shape[0] and torch.isneginf(logits).all(dim=-1).any():
        raise ValueError(f"{name}: a row is entirely -inf, so no token can be chosen")
    return logits


def _check_ids(ids, name: str, batch: int, vocab_size: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a LongTensor of shape (B, S), got {type(ids).__name__}")
    if ids.dtype != torch.long:
        raise TypeError(f"{name} must have dtype torch.long, got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] != batch:
        raise ValueError(f"{name} must have shape (B={batch}, S), got {tuple(ids.shape)}")
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must hold ids in [0, {vocab_size}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return ids


def _keep_only(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """New logits: `logits` where `keep` is True, -inf elsewhere."""
    return logits.masked_fill(~keep, float("-inf"))


# ----------------------------------------------------------------------------------------------
# Penalties (applied to the raw logits, before temperature)
# ----------------------------------------------------------------------------------------------

def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor,
                             penalty: float) -> torch.Tensor:
    """Penalize every distinct token in `seen_ids`, Hugging Face style.

    logits (B, V) float, seen_ids (B, S) long (prompt and generated ids; S may be 0).
    A seen token's logit x becomes x / penalty if x > 0 and x * penalty otherwise, once per
    distinct token however often it was seen. penalty > 1 makes seen tokens less likely,
    penalty in (0, 1) more likely, 1 changes nothing. Returns new (B, V) logits.
    """
    logits = _check_logits(logits)
    penalty = _real("penalty", penalty)
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0 (1 = off), got {penalty}")
    seen_ids = _check_ids(seen_ids, "seen_ids", logits.shape[0], logits.shape[1])
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen.scatter_(1, seen_ids.to(logits.device), True)  # a mask: many hits count once
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in each row: ids (B, S) long -> counts (B, vocab_size) long."""
    counts = torch.zeros(ids.shape[0], vocab_size, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids))


def apply_frequency_presence_penalty(logits: torch.Tensor, generated_ids: torch.Tensor,
                                     frequency: float, presence: float) -> torch.Tensor:
    """OpenAI-style penalties over the generated tokens only (the prompt does not count).

    logits (B, V) float, generated_ids (B, S) long. Each logit becomes
    x - count * frequency - (count > 0) * presence, where count is how often that token occurs in
    the row of generated_ids. Negative values reward repetition. Returns new (B, V) logits.
    """
    logits = _check_logits(logits)
    frequency = _real("frequency", frequency)
    presence = _real("presence", presence)
    generated_ids = _check_ids(generated_ids, "generated_ids", logits.shape[0], logits.shape[1])
    counts = token_counts(generated_ids.to(logits.device), logits.shape[1]).to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


# ----------------------------------------------------------------------------------------------
# Temperature and the filters
# ----------------------------------------------------------------------------------------------

def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, for temperature > 0. Shape (B, V) -> (B, V).

    Temperature 0 (greedy) is not a division: use argmax (sample_next_token does). A tiny
    temperature (1e-38, say) can overflow logits / T to +-inf in float32; such a row gets
    (logits - its max) / T instead (see sharpened), which softmax and every filter read the
    same way, and which tends to the argmax as T -> 0 (tied maxima share it).
    """
    logits = _check_logits(logits)
    temperature = _real("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here (for 0 = greedy, take the argmax), "
                         f"got {temperature}")
    scaled = logits / temperature
    if temperature >= 1:            # |x / T| <= |x|: nothing can overflow
        return scaled
    finite = torch.isfinite(scaled.amax(dim=-1, keepdim=True))     # (B, 1)
    if bool(finite.all()):
        return scaled
    return torch.where(finite, scaled, sharpened(logits, temperature))


def sharpened(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """(logits - row max) / temperature: logits (B, V) whose rows have a finite max, T > 0 (a
    number, or a (B, 1) tensor of them).

    Softmax does not change when a row is shifted, so this is the distribution of
    logits / T, but its largest entries are 0, never +inf. The others are negative; one that
    overflows becomes -inf, the probability 0 it tends to. The maxima stay 0 also when T is
    below the dtype's smallest number (5e-324 is 0 in float32, and 0 / 0 would be NaN)."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return torch.where(shifted == 0, shifted, shifted / temperature)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, and every logit tied with the k-th largest.

    logits (B, V). k = 0 means off (returns a copy); k >= V keeps everything.
    Returns new (B, V) logits with the others at -inf.
    """
    logits = _check_logits(logits)
    k = _integer("k", k)
    if k < 0:
        raise ValueError(f"k must be >= 0 (0 = off), got {k}")
    if k == 0 or k >= logits.shape[1]:
        return logits.clone()
    kth_largest = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return _keep_only(logits, logits >= kth_largest)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their total probability reaches p.

    Tokens are sorted by probability, descending (a stable sort: ties keep index order). A token
    is kept when the mass of the tokens BEFORE it is < p, so the token that crosses p is kept
    and at least one token always survives. logits (B, V), p in (0, 1]; p = 1 means off.
    Returns new (B, V) logits with the others at -inf.
    """
    logits = _check_logits(logits)
    p = _real("p", p)
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1] (1 = off), got {p}")
    if p == 1:
        return logits.clone()  # rounding in the cumulative sum must not drop tail tokens
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < p
    # the most likely token is always kept, also for a p below float32's smallest number,
    # which the comparison rounds to 0
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return _keep_only(logits, keep)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the largest probability.

    logits (B, V), min_p in [0, 1]; 0 means off. The most likely token always survives.
    Returns new (B, V) logits with the others at -inf.
    """
    logits = _check_logits(logits)
    min_p = _real("min_p", min_p)
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if min_p == 0:
        return logits.clone()
    probs = torch.softmax(logits.float(), dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return _keep_only(logits, probs >= threshold)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of softmax(logits) per row: (B, V) -> (B,). -inf entries add 0."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    return -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(dim=-1)


def typical_filter(logits: torch.Tensor, typical_p: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022): keep the tokens of typical surprisal.

    Each token's surprisal is -log p; the entropy H is its expected value. Tokens are ranked by
    |(-log p) - H| ascending (stable sort), and kept while the mass of the tokens BEFORE them is
    < typical_p: the smallest such set whose mass reaches typical_p, at least one token. Unlike
    top-p, this can drop the most likely token. logits (B, V), typical_p in (0, 1]; 1 = off.
    Returns new (B, V) logits with the others at -inf.
    """
    logits = _check_logits(logits)
    typical_p = _real("typical_p", typical_p)
    if not 0 < typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1] (1 = off), got {typical_p}")
    if typical_p == 1:
        return logits.clone()
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    distance = (-log_probs - entropy(logits)[:, None]).abs()  # +inf for removed tokens
    _, order = torch.sort(distance, dim=-1, stable=True)
    sorted_probs = log_probs.exp().gather(1, order)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < typical_p
    keep_sorted[:, 0] = True             # (as in top_p_filter, even for a tiny typical_p)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return _keep_only(logits, keep)


# ----------------------------------------------------------------------------------------------
# Composition
# ----------------------------------------------------------------------------------------------

def check_order(order: Sequence[str]) -> tuple[str, ...]:
    """Validate a stage order: a permutation of FILTER_STAGES. Returns it as a tuple."""
    if isinstance(order, str) or not isinstance(order, Sequence):
        raise TypeError(f"order must be a sequence of stage names, got {order!r}")
    order = tuple(order)
    if sorted(order) != sorted(FILTER_STAGES):
        raise ValueError(f"order must be a permutation of {FILTER_STAGES}, got {order}")
    return order


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: torch.Tensor | None = None,
                    generated_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition penalty over prompt + generated ids, then frequency / presence penalties over
    the generated ids. logits (B, V); ids (B, S) long or None. Returns new (B, V) logits.
    A penalty that overflows the logits' dtype (a tiny repetition_penalty dividing a large
    logit, a huge frequency_penalty times a count) is a ValueError naming the penalties."""
    logits = _check_logits(logits)
    batch, vocab_size = logits.shape
    empty = torch.zeros(batch, 0, dtype=torch.long, device=logits.device)
    if prompt_ids is None:
        prompt_ids = empty
    if generated_ids is None:
        generated_ids = empty
    prompt_ids = _check_ids(prompt_ids, "prompt_ids", batch, vocab_size).to(logits.device)
    generated_ids = _check_ids(generated_ids, "generated_ids", batch, vocab_size).to(logits.device)
    out = logits
    if params.repetition_penalty != 1:
        seen = torch.cat([prompt_ids, generated_ids], dim=1)
        out = apply_repetition_penalty(out, seen, params.repetition_penalty)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        out = apply_frequency_presence_penalty(out, generated_ids, params.frequency_penalty,
                                               params.presence_penalty)
    if out is logits:
        return logits.clone()
    if not bool(torch.isfinite(out.amax(dim=-1)).all()):    # +inf, NaN, or a row all -inf
        raise ValueError(f"the penalties (repetition_penalty={params.repetition_penalty}, "
                         f"frequency_penalty={params.frequency_penalty}, presence_penalty="
                         f"{params.presence_penalty}) overflow {logits.dtype} on these logits: "
                         f"use penalties closer to their off values (1, 0, 0)")
    return out


def apply_stage(logits: torch.Tensor, stage: str, params: SamplingParams) -> torch.Tensor:
    """Apply one named stage of FILTER_STAGES with its knob from `params` (off = a copy)."""
    if stage == "temperature":
        return apply_temperature(logits, params.temperature)
    if stage == "top_k":
        return top_k_filter(logits, params.top_k)
    if stage == "top_p":
        return top_p_filter(logits, params.top_p)
    if stage == "min_p":
        return min_p_filter(logits, params.min_p)
    if stage == "typical":
        return typical_filter(logits, params.typical_p)
    raise ValueError(f"stage must be one of {FILTER_STAGES}, got {stage!r}")


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      generator: torch.Generator | None = None,
                      prompt_ids: torch.Tensor | None = None,
                      generated_ids: torch.Tensor | None = None,
                      order: Sequence[str] = DEFAULT_ORDER) -> torch.Tensor:
    """Pick one next token per row: logits (B, V) float -> ids (B,) long.

    1. penalties: repetition (over prompt_ids + generated_ids), then frequency / presence (over
       generated_ids); both (B, S) long or None, read (and checked) only when a penalty is on.
    2. temperature 0: return the argmax (first index on ties). The filters are skipped: top-k,
       top-p and min-p always keep the argmax anyway; typical could drop it, and greedy means
       "the most likely token".
    3. otherwise the stages of `order` (default HF_ORDER: temperature, top-k, top-p, min-p,
       typical; VLLM_ORDER puts min-p before top-k), then one draw from softmax.

    Randomness comes from `generator`; if it is None and params.seed is set, a fresh generator
    seeded with params.seed is used (so two calls with the same inputs give the same ids; a loop
    should create ONE generator and pass it every step, as tinygpt.generate does); otherwise
    torch's global generator.
    """
    logits = _check_logits(logits)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    order = check_order(order)
    if params.repetition_penalty != 1 or params.frequency_penalty != 0 \
            or params.presence_penalty != 0:
        logits = apply_penalties(logits, params, prompt_ids, generated_ids)
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    for stage in order:
        logits = apply_stage(logits, stage, params)
    probs = torch.softmax(logits.float(), dim=-1)
    if generator is None and params.seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(params.seed)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


# ----------------------------------------------------------------------------------------------
# The sampling explorer's data
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingStage:
    """One bar chart of the sampling explorer.

    name    "raw", "penalties", a FILTER_STAGES name, or "renormalized" (always last)
    probs   V floats. raw / penalties / temperature: softmax of the logits after this stage.
            A filter: the distribution it was given (the latest softmax above) with the removed
            tokens set to 0, NOT renormalized, so sum(probs) is the mass kept so far.
            renormalized: the distribution the token is actually drawn from.
    kept    V bools: tokens still possible after this stage.
    active  False when the knob is off (or skipped because temperature is 0).
    """

    name: str
    probs: list[float]
    kept: list[bool]
    active: bool


def explain_sampling(logits_1d: torch.Tensor, params: SamplingParams,
                     order: Sequence[str] = DEFAULT_ORDER,
                     prompt_ids: Sequence[int] | None = None,
                     generated_ids: Sequence[int] | None = None) -> list[SamplingStage]:
    """Every stage sample_next_token goes through for one row of logits (V,), as plain data.

    Stages: "raw", then "penalties" (only when prompt_ids or generated_ids is given), then the
    five stages of `order`, then "renormalized". With temperature 0 the temperature stage is the
    one-hot argmax and the filters are inactive, matching sample_next_token.
    """
    if not isinstance(logits_1d, torch.Tensor):
        raise TypeError(f"logits_1d must be a 1-D torch.Tensor (V,), got "
                        f"{type(logits_1d).__name__}")
    if logits_1d.ndim != 1:
        raise ValueError(f"logits_1d must be a 1-D tensor (V,), got shape "
                         f"{tuple(logits_1d.shape)}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    order = check_order(order)
    logits = _check_logits(logits_1d[None, :], "logits_1d")
    stages: list[SamplingStage] = []

    def record(name: str, current: torch.Tensor, reference: torch.Tensor, active: bool) -> None:
        kept = ~torch.isneginf(current[0])
        probs = torch.where(kept, reference[0], torch.zeros_like(reference[0]))
        stages.append(SamplingStage(name, probs.tolist(), kept.tolist(), active))

    reference = torch.softmax(logits.float(), dim=-1)
    record("raw", logits, reference, True)
    if prompt_ids is not None or generated_ids is not None:
        def as_ids(ids):
            return None if ids is None else torch.tensor([list(ids)], dtype=torch.long)

        logits = apply_penalties(logits, params, as_ids(prompt_ids), as_ids(generated_ids))
        reference = torch.softmax(logits.float(), dim=-1)
        active = params.repetition_penalty != 1 or params.frequency_penalty != 0 \
            or params.presence_penalty != 0
        record("penalties", logits, reference, active)
    for stage in order:
        if params.greedy:
            if stage == "temperature":
                one_hot = torch.full_like(logits, float("-inf"))
                one_hot[0, torch.argmax(logits[0])] = 0.0
                logits = one_hot
                reference = torch.softmax(logits.float(), dim=-1)
            record(stage, logits, reference, stage == "temperature")
            continue
        logits = apply_stage(logits, stage, params)
        if stage == "temperature":
            reference = torch.softmax(logits.float(), dim=-1)
            record(stage, logits, reference, params.temperature != 1)
        else:
            knob_on = {"top_k": params.top_k != 0, "top_p": params.top_p != 1,
                       "min_p": params.min_p != 0, "typical": params.typical_p != 1}[stage]
            record(stage, logits, reference, knob_on)
    record("renormalized", logits, torch.softmax(logits.float(), dim=-1), True)
    return stages
