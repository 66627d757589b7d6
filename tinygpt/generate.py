"""Days 08 and 11: the generate loop, without and with a KV cache.

Autoregressive generation repeats one step: run the model on the whole context, take the logits
of the LAST position, pick a token (tinygpt.sampling), append it, and go again, until a stop
condition holds:

    "eos"          the model produced the end-of-sequence id (eos_id)
    "length"       max_new_tokens tokens were generated
    "stop_string"  the decoded text contains one of params.stop (it may span several tokens)

Without a cache (use_cache=False, day 08) the loop recomputes every position of the context at
every step, so each new token costs more than the last (time_per_token measures it). Day 11's
KV cache (use_cache=True, the default, same arguments and events) prefills the prompt once and
then feeds one token per step (tinygpt.kv_cache); at temperature 0 both loops pick the same
tokens. The pieces, in the order a step uses them:

    prepare_prompt      list[int] or tensor -> (1, T) long, with clear errors
    crop_context        keep the last max_seq_len ids when the text outgrows the window
    last_token_logits   model(context)[:, -1, :] under torch.inference_mode
    CachedLogits        the same logits from a KV cache: prefill, then one decode step per call
    find_stop           where the first stop string starts in a text
    held_back_length    how much of a text's end could still become a stop string
    stream              yields one TokenEvent per new token, with the text it releases
                        (the reply's text kept current by tinygpt.detokenize.ReplyText)
    token_events        the loop behind stream, fed logits by a callback (day 17's engine)
    generate            runs stream to the end and returns a GenerationResult
    time_per_token      the loop's seconds per token at several prompt lengths
    main                `python -m tinygpt generate --prompt ...`

Batch size 1 only: stop conditions are per sequence, and batching is day 13's topic.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tinygpt.detokenize import ReplyText
from tinygpt.kv_cache import CompileFallbackWarning, DecodeStep, KVCache, prefill, supports_kv_cache
from tinygpt.sampling import (
    DEFAULT_ORDER,
    SamplingParams,
    check_order,
    check_token_id,
    sample_next_token,
)

STOP_REASONS = ("eos", "length", "stop_string")


class ContextCroppedWarning(UserWarning):
    """The text outgrew the model's context window; only its last max_seq_len ids are fed."""


@dataclass(frozen=True)
class TokenEvent:
    """One new token, as stream() yields it.

    token_id       the id chosen
    index          its position among the new tokens (0, 1, ...)
    text           the text this token releases ("" while text is held back because it could be
                   the start of a stop string or of a multi-byte character); None without a
                   tokenizer. Joining every event's text gives GenerationResult.text.
    finish_reason  None, except on the last event: one of STOP_REASONS.
    """

    token_id: int
    index: int
    text: str | None
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    """What generate() returns.

    prompt_ids   the prompt, as a list of ids
    token_ids    every new id, in order, including a final EOS and the tokens that completed a
                 stop string
    stop_reason  one of STOP_REASONS
    text         the decoded new text (EOS excluded, cut before the stop string), or None
                 without a tokenizer
    """

    prompt_ids: list[int]
    token_ids: list[int]
    stop_reason: str
    text: str | None


# ----------------------------------------------------------------------------------------------
# One step of the loop
# ----------------------------------------------------------------------------------------------

def model_limits(model: torch.nn.Module) -> tuple[int, int]:
    """(vocab_size, max_seq_len) from model.cfg, which every tinygpt model carries."""
    cfg = getattr(model, "cfg", None)
    try:
        vocab_size, max_seq_len = int(cfg.vocab_size), int(cfg.max_seq_len)
    except AttributeError as err:
        raise TypeError("model must have a .cfg with vocab_size and max_seq_len (like "
                        f"tinygpt.model.ModelConfig); got cfg={cfg!r}") from err
    return vocab_size, max_seq_len


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def prepare_prompt(prompt_ids, vocab_size: int, max_seq_len: int) -> torch.Tensor:
    """Validate a prompt and return it as a (1, T) long tensor (on the CPU).

    prompt_ids: a list of ints, or a 1-D (T,) or 2-D (1, T) integer tensor. Errors: an empty
    prompt, a batch of more than one row, ids outside [0, vocab_size), and T > max_seq_len (a
    prompt the model cannot read whole is refused rather than silently cut).
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.is_floating_point() or prompt_ids.is_complex() \
                or prompt_ids.dtype == torch.bool:
            raise TypeError(f"prompt_ids must hold integers, got dtype {prompt_ids.dtype}")
        if prompt_ids.ndim == 2:
            if prompt_ids.shape[0] != 1:
                raise ValueError(f"generate handles batch size 1 only: prompt_ids must have "
                                 f"shape (T,) or (1, T), got {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids[0]
        elif prompt_ids.ndim != 1:
            raise ValueError(f"prompt_ids must have shape (T,) or (1, T), got "
                             f"{tuple(prompt_ids.shape)}")
        ids = [int(i) for i in prompt_ids.tolist()]
    elif isinstance(prompt_ids, (list, tuple)):
        for i in prompt_ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"prompt_ids must be ints, got {type(i).__name__} {i!r}")
        ids = list(prompt_ids)
    else:
        raise TypeError(f"prompt_ids must be a list of ints or a 1-D / (1, T) tensor, got "
                        f"{type(prompt_ids).__name__}")
    if not ids:
        raise ValueError("prompt_ids is empty: the model needs at least one token to condition "
                         "on (encode some text, or start with a BOS id)")
    bad = [(pos, i) for pos, i in enumerate(ids) if not 0 <= i < vocab_size]
    if bad:
        pos, i = bad[0]
        raise ValueError(f"prompt_ids must be in [0, {vocab_size}) (the vocabulary): id {i} at "
                         f"position {pos} is not ({len(bad)} bad id(s) in all)")
    if len(ids) > max_seq_len:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context window "
                         f"(cfg.max_seq_len) is {max_seq_len}: shorten the prompt")
    return torch.tensor([ids], dtype=torch.long)


def crop_context(ids: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """The last max_seq_len ids of each row: (B, T) -> (B, min(T, max_seq_len)).

    Without a cache the model simply re-reads the cropped text from position 0, so the
    positions stay valid; what is lost is everything before the window.
    """
    return ids[:, -max_seq_len:]


@torch.inference_mode()
def last_token_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Run the model on a full context and keep the last position: (B, T) -> (B, V) float32."""
    logits = model(ids)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 \
            or logits.shape[:2] != ids.shape:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"model(ids) must return logits of shape (B, T, V) = "
                        f"({ids.shape[0]}, {ids.shape[1]}, V), got {got}")
    return logits[:, -1, :].float()


class CachedLogits:
    """The next-token logits of a growing context, computed with a KV cache (day 11).

    Call it with the whole context ids (1, n) after each new token, as the uncached loop calls
    last_token_logits: the first call prefills the prompt into a fresh cache, later calls feed
    only the newest id ids[:, -1:] at offset n - 1 (after tokens a grammar forced, the new ids
    in one pass: DecodeStep.extend). A preallocated cache cannot slide (its keys carry RoPE
    angles of their positions), so once the context outgrows max_seq_len each call re-reads
    the cropped window without the cache, exactly as the uncached loop does.
    The cache holds min(max_seq_len, prompt_len + max_new_tokens - 1) positions: the last new
    token is never fed back.
    compile: opt-in CUDA-graph decode step (see tinygpt.kv_cache.DecodeStep); on another
    device a CompileFallbackWarning says why it is not used.
    A quantized model (tinygpt.quant.quantize_model) decodes with QuantizedDecodeStep, its
    own fused step on the quantized kernels, on a dynamic cache; compile=True then falls back
    with a CompileFallbackWarning (the quantized kernels are not captured in a CUDA graph).
    """

    def __init__(self, model: torch.nn.Module, prompt_len: int, max_new_tokens: int, *,
                 compile: bool = False) -> None:
        _, self.max_seq_len = model_limits(model)
        self.model = model
        length = min(self.max_seq_len, prompt_len + max_new_tokens - 1)
        if getattr(model, "quant_scheme", None) is not None:
            if compile:
                warnings.warn(f"compile=True is not supported for a quantized model "
                              f"({model.quant_scheme}); its eager fused step is used",
                              CompileFallbackWarning, stacklevel=3)
            # Day 15's step, imported here: days 8-11 do not load day 15 (a quantized model
            # comes from tinygpt.quant.quantize_model, so the module is loaded already).
            from tinygpt.quant import QuantizedDecodeStep

            self.cache = KVCache.for_model(model, batch_size=1, max_len=length)
            self.step = QuantizedDecodeStep(model, self.cache)
            return
        static = compile and model_device(model).type == "cuda"
        self.cache = KVCache.for_model(model, batch_size=1, max_len=length, static=static)
        self.step = DecodeStep(model, self.cache, compile=compile)

    def token_context(self):
        """A context for the next call and the sampling after it: the decode step's
        (DecodeStep.token_threads: torch on one thread around the tiled CPU products);
        nothing for the prefill, a quantized step or a context past max_seq_len."""
        token_threads = getattr(self.step, "token_threads", None)
        if token_threads is None or not 0 < self.cache.length < self.max_seq_len:
            return contextlib.nullcontext()
        return token_threads()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (1, n): the prompt and every token so far -> logits (1, V) float32."""
        if self.cache.length == 0:
            return prefill(self.model, self.cache, ids)
        if ids.shape[1] > self.max_seq_len:
            return last_token_logits(self.model, crop_context(ids, self.max_seq_len))
        if ids.shape[1] <= self.cache.length:
            raise ValueError(f"ids must extend the cached context by at least one token: the "
                             f"cache holds {self.cache.length} positions, ids has {ids.shape[1]}")
        if ids.shape[1] > self.cache.length + 1 and hasattr(self.step, "extend"):  # day 19
            return self.step.extend(ids[:, self.cache.length:])[-1:]
        for position in range(self.cache.length, ids.shape[1]):  # one token, or no step.extend
            logits = self.step(ids[:, position:position + 1])
        return logits


# ----------------------------------------------------------------------------------------------
# Stop strings on decoded text
# ----------------------------------------------------------------------------------------------

def find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None if none occurs."""
    starts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(starts) if starts else None


def held_back_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some stop string.

    That much text cannot be shown yet: the next tokens may complete the stop string, and the
    stop string itself must never appear. held_back_length("say ST", ["STOP"]) == 2.
    """
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def _check_args(model, params, eos_id, tokenizer, generator, order, constraint=None
                ) -> tuple[int, int]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    vocab_size, max_seq_len = model_limits(model)
    for i, one in enumerate(eos_id if isinstance(eos_id, tuple) else (eos_id,)):
        check_token_id("eos_id" if one is eos_id else f"eos_id[{i}]", one, vocab_size,
                       optional=one is eos_id)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError("tokenizer must have a decode(list[int]) -> str method")
    if params.stop and tokenizer is None:
        raise ValueError(f"params.stop={params.stop!r} needs a tokenizer: stop strings are "
                         "matched on decoded text")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    check_order(order)
    if constraint is not None and not all(callable(getattr(constraint, name, None))
                                          for name in ("mask", "advance")):
        raise TypeError(f"constraint must be None or have mask(logits) and advance(token_id) "
                        f"methods, got {type(constraint).__name__}")
    return vocab_size, max_seq_len


def stream(model: torch.nn.Module, prompt_ids, params: SamplingParams, *,
           eos_id: int | None = None, tokenizer=None, generator: torch.Generator | None = None,
           order: Sequence[str] = DEFAULT_ORDER, use_cache: bool = True,
           compile: bool = False, constraint=None) -> Iterator[TokenEvent]:
    """Generate token by token, yielding a TokenEvent as soon as each token is chosen.

    model: maps ids (1, T) long -> logits (1, T, V) and has .cfg.vocab_size / .cfg.max_seq_len
    (put it in eval mode first). prompt_ids: list[int], (T,) or (1, T) tensor; batch size 1.
    params: sampling knobs, max_new_tokens and stop strings. eos_id: stop when it is sampled
    (or any of a tuple of ids: a chat's end of turn and the tokenizer's end of text).
    tokenizer: anything with decode(list[int]) -> str; needed for text and stop strings.
    generator: the randomness; if None, one seeded with params.seed (or torch's global one).
    order: the sampling stage order (see tinygpt.sampling).
    use_cache: use a KV cache (CachedLogits) when the model supports one (its forward takes a
    `kv_cache` argument, as TinyGPT's does); other models, and use_cache=False, run the
    uncached loop. Both loops take the same arguments and yield the same kind of events.
    compile: opt-in compiled (CUDA graph) decode step; needs use_cache=True; off CUDA it falls
    back to the eager step with a CompileFallbackWarning saying why.
    constraint: None, or what may come next (day 19's structured outputs): an object with
    mask(logits (1, V)) -> (1, V) logits with the tokens it forbids at -inf, and
    advance(token_id), called with each chosen token; one request uses it, and only one.

    Text is released only when it is final: the end that could still grow into a stop string,
    and a trailing U+FFFD (half of a multi-byte character), are held back until resolved.
    Stop strings are matched on the generated text only, not the prompt. When prompt plus
    generated ids outgrow cfg.max_seq_len, the context is cropped to its last max_seq_len ids
    and a ContextCroppedWarning is issued once. Bad arguments raise here, before any event.
    """
    _, max_seq_len = _check_args(model, params, eos_id, tokenizer, generator, order, constraint)
    for name, value in (("use_cache", use_cache), ("compile", compile)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decode step: it needs use_cache=True")
    device = model_device(model)
    prompt = prepare_prompt(prompt_ids, *model_limits(model)).to(device)
    if generator is None and params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    if use_cache and supports_kv_cache(model):
        next_logits = CachedLogits(model, prompt.shape[1], params.max_new_tokens,
                                   compile=compile)
    else:
        if compile:
            warnings.warn(f"compile=True needs a model that supports a KV cache; "
                          f"{type(model).__name__}.forward takes no kv_cache, so the uncached "
                          f"loop runs", CompileFallbackWarning, stacklevel=2)

        def next_logits(ids: torch.Tensor) -> torch.Tensor:
            return last_token_logits(model, crop_context(ids, max_seq_len))

    return token_events(next_logits, prompt, params, eos_id, tokenizer, generator, tuple(order),
                        max_seq_len, constraint, fast_forward=True)


def token_events(next_logits, prompt, params, eos_id, tokenizer, generator, order,
                 max_seq_len, constraint=None, fast_forward=False) -> Iterator[TokenEvent]:
    """The loop behind stream(); arguments already validated, prompt (1, T) on the device.

    next_logits(ids (1, n)) -> (1, V) gives the next-token logits of the context so far. The
    loop owns everything per request (sampling with its generator, penalties over its own
    history, stop conditions, held-back text), so day 17's engine drives one of these per
    request with logits it computed for a whole batch, and gets batch-1 behaviour by design.
    fast_forward: append the constraint's forced() tokens unsampled, so next_logits gets them
    at once (stream's can; so does day 19's Engine, which asks forced() first: tinygpt.engine).
    The ids are a view of one buffer, sized for what a run inside the window can add (a huge
    max_new_tokens allocates nothing more) and doubled by a run that goes on past the window.
    """
    prompt_len, eos_ids = prompt.shape[1], eos_id if isinstance(eos_id, tuple) else (eos_id,)
    room = min(params.max_new_tokens, max(1, max_seq_len - prompt_len + 1))
    buffer = torch.cat([prompt, prompt.new_empty(1, room)], dim=1)
    ids = buffer[:, :prompt_len]     # (1, T + generated so far): a view of buffer
    generated: list[int] = []        # every new id
    reply = ReplyText(tokenizer) if tokenizer is not None else None  # (EOS excluded)
    released, warned = "", False     # text already yielded; whether the crop was warned of
    penalized = params.repetition_penalty != 1 or params.frequency_penalty != 0 \
        or params.presence_penalty != 0   # the history is read only when a penalty is on
    # what next_logits wants around a token's work (CachedLogits: torch's threads)
    token_context = getattr(next_logits, "token_context", contextlib.nullcontext)
    forced: collections.deque[int] = collections.deque()
    find_forced = getattr(constraint, "forced", None) if fast_forward else None
    while True:
        if ids.shape[1] > max_seq_len and not warned:
            warnings.warn(
                f"prompt + generated tokens ({ids.shape[1]}) exceed the model's context window "
                f"(cfg.max_seq_len = {max_seq_len}); from now on only the last {max_seq_len} "
                "tokens are fed to the model", ContextCroppedWarning, stacklevel=2)
            warned = True
        if forced:                   # the grammar allows this token and no other
            token = forced.popleft()
        else:
            with torch.inference_mode(), token_context():
                logits = next_logits(ids)
                if constraint is not None:
                    logits = constraint.mask(logits)
                generated_t = ids[:, prompt_len:] if penalized else None
                token = sample_next_token(logits, params, generator=generator,
                                          prompt_ids=prompt, generated_ids=generated_t,
                                          order=order).item()
        if constraint is not None:
            constraint.advance(token)
        generated.append(token)
        if ids.shape[1] == buffer.shape[1]:     # full: double it, up to the tokens still to come
            room = min(ids.shape[1], params.max_new_tokens - len(generated) + 1)
            buffer = torch.cat([ids, ids.new_empty(1, room)], dim=1)
        buffer[0, ids.shape[1]] = token
        ids = buffer[:, :ids.shape[1] + 1]

        finish = "eos" if token in eos_ids else None
        text = None
        if reply is not None:
            full = reply.append(token) if finish is None else reply.text
            settled = full.rstrip("\ufffd")  # an incomplete UTF-8 character is not text yet
            cut = find_stop(settled, params.stop) if finish is None else None
            if cut is not None:
                finish, visible = "stop_string", settled[:cut]
            elif finish is None and len(generated) == params.max_new_tokens:
                finish, visible = "length", full
            elif finish is None:
                visible = settled[:len(settled) - held_back_length(settled, params.stop)]
            else:
                visible = full
            if not visible.startswith(released):
                raise RuntimeError("tokenizer.decode is not prefix-stable: decoding more ids "
                                   f"changed text already released ({released!r} -> "
                                   f"{visible!r})")
            text, released = visible[len(released):], visible
        elif finish is None and len(generated) == params.max_new_tokens:
            finish = "length"
        yield TokenEvent(token_id=token, index=len(generated) - 1, text=text,
                         finish_reason=finish)
        if finish is not None:
            return
        if find_forced is not None and not forced:
            forced.extend(find_forced())


def generate(model: torch.nn.Module, prompt_ids, params: SamplingParams, *,
             eos_id: int | None = None, tokenizer=None, generator: torch.Generator | None = None,
             order: Sequence[str] = DEFAULT_ORDER, use_cache: bool = True,
             compile: bool = False, constraint=None) -> GenerationResult:
    """Run stream() to the end and collect its events; same arguments. Batch size 1.

    use_cache=True (the default) runs the KV-cache loop when the model supports it,
    use_cache=False the day-08 loop that re-reads the whole context every step.

    Returns a GenerationResult: the new ids (including a final EOS), the stop reason, and the
    new text when a tokenizer is given (EOS excluded, cut before the stop string).
    """
    events = list(stream(model, prompt_ids, params, eos_id=eos_id, tokenizer=tokenizer,
                         generator=generator, order=order, use_cache=use_cache,
                         compile=compile, constraint=constraint))     # at least one event
    prompt = prepare_prompt(prompt_ids, *model_limits(model))[0].tolist()
    text = "".join(event.text for event in events) if tokenizer is not None else None
    return GenerationResult(prompt_ids=prompt, token_ids=[event.token_id for event in events],
                            stop_reason=events[-1].finish_reason, text=text)


# ----------------------------------------------------------------------------------------------
# Cost of the uncached loop
# ----------------------------------------------------------------------------------------------

def time_per_token(model: torch.nn.Module, prompt_lengths: Sequence[int], new_tokens: int, *,
                   repeats: int = 3, seed: int = 0, use_cache: bool = False) -> dict:
    """Seconds per generated token of the greedy loop, at several prompt lengths.

    use_cache=False (the default) times day 08's uncached loop, use_cache=True day 11's.

    For each length L a seeded random prompt of L ids is generated from, new_tokens tokens with
    no EOS; the time of the fastest of `repeats` runs (after one warm-up run) is divided by
    new_tokens. L + new_tokens must fit in cfg.max_seq_len (cropping would hide the growth).
    Returns {"prompt_lengths": [...], "seconds_per_token": [...], "tokens_per_second": [...],
    "new_tokens": int, "repeats": int, "device": str, "use_cache": bool}.
    """
    vocab_size, max_seq_len = model_limits(model)
    if not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be True or False, got {use_cache!r}")
    for name, value in (("new_tokens", new_tokens), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    lengths = list(prompt_lengths)
    if not lengths:
        raise ValueError("prompt_lengths must not be empty")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"prompt_lengths must be ints >= 1, got {length!r}")
        if length + new_tokens > max_seq_len:
            raise ValueError(f"prompt length {length} + new_tokens {new_tokens} exceeds the "
                             f"context window {max_seq_len}")
    device = model_device(model)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    rng = torch.Generator().manual_seed(seed)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()

    seconds = []
    for length in lengths:
        prompt = torch.randint(0, vocab_size, (length,), generator=rng).tolist()
        generate(model, prompt, params, use_cache=use_cache)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            generate(model, prompt, params, use_cache=use_cache)
            sync()
            best = min(best, time.perf_counter() - start)
        seconds.append(best / new_tokens)
    return {"prompt_lengths": lengths, "seconds_per_token": seconds,
            "tokens_per_second": [1.0 / s for s in seconds], "new_tokens": new_tokens,
            "repeats": repeats, "device": str(device), "use_cache": use_cache}


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt generate",
        description="Generate text from the course's shipped checkpoint.")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--device", default=None, help="cpu, cuda or mps (default: best found)")
    parser.add_argument("--no-cache", action="store_true",
                        help="use the uncached loop that re-reads the whole context every step")
    parser.add_argument("--compile", action="store_true",
                        help="compile the cached decode step with CUDA graphs (CUDA only)")
    return parser


def eos_id_of(tokenizer) -> int | None:
    """The tokenizer's end-of-text id (BPETokenizer.eot_id, tiktoken's eot_token), or None."""
    for name in ("eot_id", "eot_token"):
        try:
            value = getattr(tokenizer, name)
        except (AttributeError, KeyError, ValueError):  # eot_id: ValueError, eot_token: KeyError
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt generate --prompt TEXT [options]`: stream a continuation to stdout.

    The prompt is encoded after the tokenizer's end-of-text id (when it has one), as training
    presents stories. Prints the prompt, then the new text as it is generated; the stop reason
    and token count go to stderr. Returns 0 on success, 2 for bad arguments, 1 when the
    checkpoint cannot be loaded.
    """
    import tinygpt
    from tinygpt.sampling import flag_message

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                                seed=args.seed)
        device = tinygpt.usable_device(args.device)
        if args.compile and device.type != "cuda":
            raise ValueError(f"--compile builds CUDA graphs: it needs --device cuda, got {device}")
    except (TypeError, ValueError) as err:
        print(f"error: {flag_message(str(err))}", file=sys.stderr)   # the fields' flags
        return 2
    try:
        model, tokenizer = tinygpt.load_pretrained(device=device)
    except (OSError, RuntimeError) as err:
        print(f"error: could not load the pretrained checkpoint: {err}", file=sys.stderr)
        return 1
    model, eos_id = model.to(device).eval(), eos_id_of(tokenizer)
    try:
        prompt_ids = ([] if eos_id is None else [eos_id]) + list(tokenizer.encode(args.prompt))
        events = stream(model, prompt_ids, params, eos_id=eos_id, tokenizer=tokenizer,
                        use_cache=not args.no_cache, compile=args.compile)
        print(args.prompt, end="", flush=True)
        count, reason = 0, None
        for event in events:
            print(event.text, end="", flush=True)
            count, reason = count + 1, event.finish_reason
    except (TypeError, ValueError) as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 2
    print()
    print(f"[{count} tokens, stopped on {reason}, device {device}]", file=sys.stderr)
    return 0
