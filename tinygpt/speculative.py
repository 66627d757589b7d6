"""Day 14: speculative decoding. Guess several tokens cheaply, let the big model check them in
one pass, keep the ones it agrees with.

A decode step of the target model costs about the same for 1 token as for gamma + 1 (it reads
every weight once either way). So a cheap drafter proposes gamma tokens d_1 .. d_gamma, and
the target scores all of them in ONE cached forward pass, giving its distributions p_1 ..
p_{gamma+1} at those positions. Going left to right, draft token d_i (drawn from the drafter's
q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i)). At the first rejection the
token is drawn instead from the residual norm(max(0, p_i - q_i)), and the rest is discarded;
if all gamma are accepted, a bonus token comes from p_{gamma+1}. Every pass yields between 1
and gamma + 1 tokens, and the tokens have exactly the target's distribution: the accepted
part and the residual part add up to p (the acceptance rule's whole point). At temperature 0
both distributions are one-hot, so the output is the target's greedy output token for token.

p and q are the distributions the sampler would draw from: softmax of the logits after
temperature, top-k, top-p and min-p (tinygpt.sampling's order). Penalties and typical
sampling are not supported here (they depend on history in ways the draft would have to
mirror), nor are stop strings (they are matched on decoded text, and there is no tokenizer
here); all are refused with a ValueError.

The rule is two small functions, `acceptance_probability` (min(1, p/q) for one token) and
`residual_distribution` (norm(max(0, p - q))), which the verify loop calls by name.

Drafters: `ModelDrafter` (a smaller model with its own KV cache) and `PromptLookupDrafter`
(copy what followed the last n tokens the last time they occurred: free to run, a one-hot q,
good on text that repeats). If the acceptances were independent with rate a, a pass would
yield (1 - a^(gamma+1)) / (1 - a) tokens on average; `SpeculativeStats` measures a
(acceptance_rate, and per draft position), `SpeculativeResult.tokens_per_pass` the yield.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tinygpt.generate import GenerationResult, model_device, model_limits, prepare_prompt
from tinygpt.kv_cache import DecodeStep, KVCache
from tinygpt.sampling import (
    SamplingParams,
    apply_temperature,
    check_token_id,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: (N, V) logits -> (N, V) float32 probabilities
    (one-hot on the argmax at temperature 0). Temperature as the sampler applies it
    (tinygpt.sampling.apply_temperature): a tiny one (1e-38) gives the argmax, not an overflow."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    x = apply_temperature(logits, params.temperature)
    x = min_p_filter(top_p_filter(top_k_filter(x, params.top_k), params.top_p), params.min_p)
    return torch.softmax(x, dim=-1)


def _gamma(gamma: object) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1 (draft tokens per pass), got {gamma!r}")
    return gamma


def expected_tokens_per_pass(a: float, gamma: int) -> float:
    """(1 - a^(gamma+1)) / (1 - a): tokens per target pass if each draft token is accepted
    independently with probability a (gamma + 1 when a = 1)."""
    if not 0 <= a <= 1:
        raise ValueError(f"a must be in [0, 1], got {a}")
    _gamma(gamma)
    return float(gamma + 1) if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)


def acceptance_probability(p_token: float, q_token: float) -> float:
    """min(1, p/q): the chance of keeping a draft token the drafter proposed with probability
    q_token > 0 and the target gives probability p_token >= 0 (both finite: NaN is refused,
    not read as a certain acceptance)."""
    if not 0 <= p_token < math.inf:
        raise ValueError(f"p_token must be a probability (a finite number >= 0), got {p_token}")
    if not 0 < q_token < math.inf:
        raise ValueError(f"q_token must be a finite number > 0 (the drafter proposed this "
                         f"token), got {q_token}")
    return min(1.0, p_token / q_token)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): (V,), (V,) -> (V,), where a rejected position draws from. Where
    p - q is nowhere positive (then p == q and nothing is ever rejected) p itself is returned."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    return r / total if total > 0 else p


def _draw(dist: torch.Tensor, params: SamplingParams, generator) -> int:
    """One id from a (V,) distribution: its argmax at temperature 0, else a seeded draw."""
    if params.greedy:
        return int(dist.argmax())
    return int(torch.multinomial(dist, 1, generator=generator))


@dataclass
class SpeculativeStats:
    gamma: int
    passes: int = 0                       # target forward passes after the prefill
    # per draft position: times a draft there was judged (proposed, and every draft before it
    # accepted: a round stops judging at its first rejection), and times it was accepted
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / max(1, sum(self.proposed))

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate of draft position i, given that positions before it were accepted."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed, strict=True)]


@dataclass(frozen=True)
class SpeculativeResult(GenerationResult):
    stats: SpeculativeStats | None = None

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / max(1, self.stats.passes)


class PromptLookupDrafter:
    """Propose the tokens that followed the most recent earlier occurrence of the context's
    last n tokens (n from `max_ngram` down to 1); q is one-hot on each proposal."""

    def __init__(self, max_ngram: int = 3) -> None:
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram

    def propose(self, context: list[int], gamma: int, vocab_size: int, params, generator
                ) -> tuple[list[int], torch.Tensor]:
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == tail:
                    found = context[start + n:start + n + gamma]
                    q = torch.nn.functional.one_hot(torch.tensor(found), vocab_size).float()
                    return found, q
        return [], torch.zeros(0, vocab_size)

    def rollback(self, length: int) -> None:
        """Nothing to undo: the drafter keeps no state."""


class ModelDrafter:
    """A smaller model with its own KV cache; proposes by sampling from its own processed
    distribution q (greedy at temperature 0). speculative_generate calls reset() at the start
    of every run, so one drafter serves many prompts."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (the draft model), got "
                            f"{type(model).__name__}")
        self.model = model
        self.cache: KVCache | None = None

    def reset(self) -> None:
        """Forget the cached context (the next propose() reads its whole context again)."""
        if self.cache is not None:
            self.cache.reset()

    def propose(self, context: list[int], gamma: int, vocab_size: int, params, generator
                ) -> tuple[list[int], torch.Tensor]:
        device = model_device(self.model)
        if self.cache is None:
            self.cache = KVCache.for_model(self.model, 1)
        missing = context[self.cache.length:]
        with torch.inference_mode():
            logits = self.model(torch.tensor([missing], device=device),
                                kv_cache=self.cache)[0, -1:]
            tokens, qs = [], []
            for i in range(gamma):
                q = target_probs(logits, params)[0]
                token = int(torch.multinomial(q, 1, generator=generator)) if not params.greedy \
                    else int(q.argmax())
                tokens.append(token)
                qs.append(q)
                if i + 1 < gamma:
                    logits = self.model(torch.tensor([[token]], device=device),
                                        kv_cache=self.cache)[0, -1:]
        return tokens, torch.stack(qs)

    def rollback(self, length: int) -> None:
        """Forget cached positions from `length` on (they held rejected drafts)."""
        if self.cache is not None and self.cache.length > length:
            self.cache.length = length


def _check(target, draft, params, gamma, eos_id, generator) -> None:
    """Every argument of speculative_generate but the prompt, before any work."""
    if not isinstance(target, torch.nn.Module):
        raise TypeError(f"target must be a torch.nn.Module, got {type(target).__name__}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    unsupported = [name for name, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                          ("presence_penalty", 0.0), ("typical_p", 1.0))
                   if getattr(params, name) != off]
    if unsupported:
        raise ValueError(f"speculative decoding supports temperature, top_k, top_p and min_p; "
                         f"turn off {unsupported}")
    if params.stop:
        raise ValueError(f"speculative decoding matches no stop strings (there is no tokenizer "
                         f"to decode with): use params.stop=(), got {params.stop!r}")
    vocab_size, window = model_limits(target)
    _gamma(gamma)
    if gamma >= window:
        raise ValueError(f"gamma must be an int in [1, {window - 1}]: a pass feeds gamma + 1 "
                         f"tokens, which must fit the target's max_seq_len={window}; got {gamma}")
    check_token_id("eos_id", eos_id, vocab_size, optional=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got "
                        f"{type(generator).__name__}")
    if not (callable(getattr(draft, "propose", None)) and callable(getattr(draft, "rollback",
                                                                            None))):
        raise TypeError(f"draft must be a model (torch.nn.Module), a ModelDrafter, a "
                        f"PromptLookupDrafter or another object with propose() and rollback(); "
                        f"got {type(draft).__name__}")
    if isinstance(draft, ModelDrafter) and model_limits(draft.model)[0] != vocab_size:
        raise ValueError(f"the draft's vocabulary ({model_limits(draft.model)[0]}) differs from "
                         f"the target's ({vocab_size}): they must share a tokenizer")


@torch.inference_mode()
def speculative_generate(target: torch.nn.Module, draft, prompt_ids, params: SamplingParams, *,
                         gamma: int = 4, eos_id: int | None = None,
                         generator: torch.Generator | None = None) -> SpeculativeResult:
    """Generate with `target`, drafting with `draft` (a model, a ModelDrafter, a
    PromptLookupDrafter, or any object with their propose() and rollback()); see the module
    docstring. Returns the GenerationResult fields (stop_reason "eos" or "length") plus
    `stats` and `tokens_per_pass`.

    The context is not cropped (the caches cannot slide): prompt + max_new_tokens - 1 positions
    must fit the target's max_seq_len (and the draft model's), as in day 17's Engine; the last
    new token is never fed back. gamma is in [1, max_seq_len - 1]. A drafter's reset(), when it
    has one (ModelDrafter), is called first. A quantized target (tinygpt.quant.quantize_model)
    verifies with tinygpt.quant.QuantizedDecodeStep, as generate() decodes it.
    Bad arguments raise ValueError / TypeError before any work."""
    if isinstance(draft, torch.nn.Module):
        draft = ModelDrafter(draft)
    _check(target, draft, params, gamma, eos_id, generator)
    device = model_device(target)
    vocab, window = model_limits(target)
    prompt = prepare_prompt(prompt_ids, vocab, window)[0].tolist()
    positions = len(prompt) + params.max_new_tokens - 1
    if positions > window:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens "
                         f"({params.max_new_tokens}) - 1 = {positions} positions exceed the "
                         f"target's max_seq_len={window} (speculative decoding cannot crop the "
                         f"context)")
    if isinstance(draft, ModelDrafter) and positions - 1 > model_limits(draft.model)[1]:
        raise ValueError(f"the draft model reads up to {positions - 1} positions of this run, "
                         f"more than its max_seq_len={model_limits(draft.model)[1]}: lower "
                         f"max_new_tokens or shorten the prompt")
    if generator is None and params.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    reset = getattr(draft, "reset", None)
    if callable(reset):
        reset()
    stats = SpeculativeStats(gamma, proposed=[0] * gamma, accepted=[0] * gamma)
    cache = KVCache.for_model(target, 1)
    logits = target(torch.tensor([prompt[:-1]], device=device), kv_cache=cache) \
        if len(prompt) > 1 else None
    if getattr(target, "quant_scheme", None) is not None:
        # day 15's step, imported here as tinygpt.generate.CachedLogits does: a quantized
        # model comes from tinygpt.quant.quantize_model, so the module is loaded already
        from tinygpt.quant import QuantizedDecodeStep

        verify = QuantizedDecodeStep(target, cache).extend     # the model's own forward
    else:
        verify = DecodeStep(target, cache).extend  # the model's forward, or the tiled CPU layers
    context, out, reason = list(prompt), [], None
    while reason is None:
        room = min(gamma, params.max_new_tokens - len(out) - 1)
        drafts, q = draft.propose(context, room, vocab, params, generator) if room > 0 \
            else ([], torch.zeros(0, vocab))
        start = cache.length                                   # = len(context) - 1
        feed = torch.tensor([[context[-1], *drafts]], device=device)
        logits = verify(feed)                                  # (1 + len(drafts), V)
        stats.passes += 1
        p = target_probs(logits, params).cpu()
        new: list[int] = []
        n_accepted = 0
        for i, token in enumerate(drafts):
            stats.proposed[i] += 1
            accept = acceptance_probability(float(p[i, token]), float(q[i, token]))
            if accept >= 1.0 or (accept > 0.0 and not params.greedy
                                 and float(torch.rand((), generator=generator)) < accept):
                stats.accepted[i] += 1
                n_accepted += 1
                new.append(token)
                continue
            new.append(_draw(residual_distribution(p[i], q[i]), params, generator))
            break
        else:                                                  # every draft accepted: bonus
            new.append(_draw(p[len(drafts)], params, generator))
        for token in new:
            out.append(token)
            context.append(token)
            if token == eos_id:
                reason = "eos"
                break
            if len(out) == params.max_new_tokens:
                reason = "length"
                break
        cache.length = start + 1 + n_accepted      # keep the last token and accepted drafts
        draft.rollback(len(context) - 1)
    return SpeculativeResult(prompt, out, reason, None, stats)
