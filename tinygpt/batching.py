"""Day 13: batching. Many sequences per forward pass, so each weight read serves many tokens.

Prompts have different lengths, and a batch is a rectangle. Left padding puts every prompt's
last token in the last column, so one decode step appends one column for all rows:

    row 0   .   .   The cat  sat        mask  0 0 1 1 1      positions  0 0 0 1 2
    row 1   A  big  dog  ran  off             1 1 1 1 1                 0 1 2 3 4

Three things keep each row's result equal to running it alone:
- a key-padding mask: no query attends to a pad (combined with the causal mask; each pad query
  still sees its own position, so its softmax has something to normalise and stays finite);
- position ids that count only real tokens, so RoPE turns row 0's "The" by position 0, as it
  would unpadded (with the pads masked, RoPE's scores depend only on relative offsets, so a
  constant shift would cancel; counting real tokens keeps every position inside the model's
  window, and it is what models with absolute positions need);
- per-row sampling: one seeded generator per request, so a row's draws do not depend on what
  it was batched with.

The module, top to bottom:

    left_pad, position_ids, attention_mask, forward_padded
                        the padded batch and one forward pass of the model's own layers over it
    BatchedKVCache      B rows in one day-11 KVCache, each with its own length: the columns are
                        shared (one write offset), a key mask says which columns hold a row's
                        real tokens. A step may carry a different number of real tokens per row
                        (a prefill chunk in one row, a decode token in the others); reorder()
                        permutes or copies rows (beam search), crop() rolls columns back.
    generate_batch      prefill + decode for a list of prompts, per-row stops and sampling;
                        at temperature 0 each row equals tinygpt.generate.generate on its own
    beam_search         the beams are the rows of one BatchedKVCache, reordered every step by
                        the surviving beams' indices; Hugging Face's scoring conventions
    chunked_prefill     a prompt's prefill in chunks; the logits equal the one-pass prefill
    Request, request_stream, roofline_step_time, admit, simulate
                        a discrete-event simulator of static and continuous batching (with
                        optional chunked prefill) driven by a step-time model; it reports the
                        day-12 metrics (tinygpt.metrics) and slot utilisation
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tinygpt import flops as F
from tinygpt.attention import grouped_query_attention, merge_heads
from tinygpt.generate import GenerationResult, find_stop, model_device
from tinygpt.kv_cache import KVCache
from tinygpt.metrics import RequestTrace, inter_token_latencies, summarize, tpot, ttft
from tinygpt.mla import LatentLayerCache
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.roofline import Hardware, op_time
from tinygpt.sampling import SamplingParams, check_token_id, sample_next_token

# --------------------------------------------------------------------------------------------
# padded batches


def _is_integer_tensor(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _token_ids(values: object, name: str) -> list[int]:
    """A list of ints or a 1-D integer tensor as plain ints (bools and floats are refused, as
    tinygpt.generate.prepare_prompt refuses them: int() would truncate 79.9 to 79)."""
    if isinstance(values, torch.Tensor):
        if not _is_integer_tensor(values):
            raise TypeError(f"{name} must hold integer token ids, got dtype {values.dtype}")
        if values.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape "
                             f"{tuple(values.shape)}")
        return values.tolist()
    for t in values:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"{name} must hold ints (token ids), got {type(t).__name__} {t!r}")
    return list(values)


def _check_prompts(prompts: object, name: str = "prompts") -> list[list[int]]:
    """A non-empty list of non-empty token-id lists (lists of ints or 1-D integer tensors),
    as plain ints."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"{name} must be a non-empty list of token-id lists, got {prompts!r}")
    return [_check_prompt(prompt, f"{name}[{i}]") for i, prompt in enumerate(prompts)]


def _check_prompt(prompt: object, name: str) -> list[int]:
    """One non-empty prompt (a list of ints or a 1-D integer tensor) as plain ints."""
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence | torch.Tensor):
        raise TypeError(f"{name} must be a list of token ids, got {type(prompt).__name__}")
    ids = _token_ids(prompt, name)
    if len(ids) == 0:
        raise ValueError(f"{name} is empty: every prompt needs at least one token")
    return ids


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ids (B, T) long and a mask (B, T) bool, True on real tokens.
    T is the longest prompt's length; pad_id is an int >= 0 (a token id: pads are fed to the
    model, masked)."""
    check_token_id("pad_id", pad_id)
    prompts = _check_prompts(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only: (B, T) bool -> (B, T) long, 0 at each row's first
    real token (pads get 0 too, before or after the real tokens; nothing attends to them)."""
    return torch.where(mask, mask.long().cumsum(dim=-1) - 1, 0)


def attention_mask(key_mask: torch.Tensor, n_queries: int) -> torch.Tensor:
    """(B, 1, T_q, T_k) bool: query i (the last T_q key positions) may see key j when j is a
    real token or j is its own position. The causal part is applied by the attention call."""
    batch, n_keys = key_mask.shape
    own = torch.zeros(n_queries, n_keys, dtype=torch.bool, device=key_mask.device)
    own[torch.arange(n_queries), torch.arange(n_keys - n_queries, n_keys)] = True
    return (key_mask[:, None, None, :] | own[None, None]).expand(batch, 1, n_queries, n_keys)


@torch.inference_mode()
def forward_padded(model: TinyGPT, ids: torch.Tensor, positions: torch.Tensor,
                   key_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The model's layers over a padded batch with a cache: ids, positions (B, T) long;
    key_mask (B, cache.length + T) bool over every cached and new position. Writes the new
    keys and values at cache.length and returns logits (B, T, V)."""
    if model.cfg.positions_refusal() is not None:           # day 21
        raise ValueError(f"forward_padded attends with its own padding mask and the model's "
                         f"fixed RoPE tables; {model.cfg.positions_refusal()}")
    start = cache.check_step(ids.shape[0], ids.shape[1], ids.device,
                             model.tok_embeddings.weight.dtype)
    if key_mask.shape != (ids.shape[0], start + ids.shape[1]):
        raise ValueError(f"key_mask must have shape (B, cache.length + T) = "
                         f"({ids.shape[0]}, {start + ids.shape[1]}), got "
                         f"{tuple(key_mask.shape)}")
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]       # (B, T, head_dim)
    mask = attention_mask(key_mask, ids.shape[1])
    x = model.tok_embeddings(ids)
    for layer, layer_cache in zip(model.layers, cache.layers, strict=True):
        attn = layer.attention
        if isinstance(layer_cache, LatentLayerCache):      # day 21: multi-head latent attention
            x = x + attn.forward_masked(layer.attention_norm(x), cos, sin, layer_cache, start,
                                        mask)
            x = x + layer.feed_forward(layer.ffn_norm(x))
            continue
        q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)
        k, v = layer_cache.update(k, v, start)
        y = grouped_query_attention(q, k, v, causal=True, mask=mask)
        x = x + attn.wo(merge_heads(y))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    cache.advance(ids.shape[1])
    return model.output(model.norm(x))


# --------------------------------------------------------------------------------------------
# the batched cache


class BatchedKVCache:
    """B sequences in one preallocated KVCache (tinygpt.kv_cache), each with its own length.

    Every forward writes one column per new token for all rows (the KVCache's single offset,
    `columns`); key_mask (B, max_len) bool marks the columns that hold a row's real tokens and
    lengths (B,) long counts them, which is also each row's next position. A row with fewer
    real tokens than the step is wide gets pads in that step (masked, never attended to), so
    rows can grow at different speeds: a prompt's prefill chunk in one row while the others
    decode one token each.
    """

    def __init__(self, model: TinyGPT, batch_size: int, max_len: int | None = None) -> None:
        self.model = model
        self.cache = KVCache.for_model(model, batch_size, max_len)
        self.key_mask = torch.zeros(batch_size, self.cache.max_len, dtype=torch.bool,
                                    device=self.cache.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.cache.device)

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def columns(self) -> int:
        """Columns written so far (the next write offset), shared by every row."""
        return self.cache.length

    def forward(self, ids: torch.Tensor, new_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append a step: ids (B, T) long, new_mask (B, T) bool, True where ids is a real token
        of that row (default: all real). Each row's real tokens are its next tokens, in order;
        pads may sit anywhere (they are written but masked). Returns logits (B, T, V)."""
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != self.batch_size:
            raise ValueError(f"ids must be a tensor of shape (batch_size={self.batch_size}, T), "
                             f"got {getattr(ids, 'shape', type(ids).__name__)}")
        if new_mask is None:
            new_mask = torch.ones_like(ids, dtype=torch.bool)
        if new_mask.shape != ids.shape or new_mask.dtype != torch.bool:
            raise ValueError(f"new_mask must be a bool tensor of ids' shape {tuple(ids.shape)}, "
                             f"got {new_mask.dtype} {tuple(new_mask.shape)}")
        start, width = self.columns, ids.shape[1]
        if start + width > self.cache.max_len:
            raise ValueError(f"the batched cache is full: {start} of max_len="
                             f"{self.cache.max_len} columns are used and {width} more were given")
        new_mask = new_mask.to(self.key_mask.device)
        positions = self.lengths[:, None] + new_mask.long().cumsum(dim=1) - 1
        positions = positions.clamp(min=0)
        if int(positions.max()) >= self.model.cfg.max_seq_len:
            raise ValueError(f"a row would reach position {int(positions.max())}, beyond the "
                             f"model's max_seq_len={self.model.cfg.max_seq_len}")
        self.key_mask[:, start:start + width] = new_mask
        logits = forward_padded(self.model, ids.to(self.key_mask.device), positions,
                                self.key_mask[:, :start + width], self.cache)
        self.lengths += new_mask.sum(dim=1)
        return logits

    def reorder(self, index: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `index` (K,) long, in that order (repeats copy a row): row i becomes old
        row index[i], keys, values, mask and length. The batch size becomes K."""
        if isinstance(index, torch.Tensor) and not _is_integer_tensor(index) or \
                not isinstance(index, torch.Tensor) and any(
                    isinstance(i, bool) or not isinstance(i, int) for i in index):
            raise TypeError(f"index must hold integer row numbers, got {index!r}")
        index = torch.as_tensor(index, dtype=torch.long, device=self.cache.device)
        if index.ndim != 1 or len(index) == 0:
            raise ValueError(f"index must be a non-empty 1-D list of row numbers, got shape "
                             f"{tuple(index.shape)}")
        if int(index.min()) < 0 or int(index.max()) >= self.batch_size:
            raise ValueError(f"index must hold row numbers in [0, {self.batch_size}), got "
                             f"{index.tolist()}")
        for layer in self.cache.layers:
            if isinstance(layer, LatentLayerCache):         # day 21: latents, RoPE keys
                layer.c, layer.k_pe = layer.c.index_select(0, index), \
                    layer.k_pe.index_select(0, index)
                continue
            layer.k = layer.k.index_select(0, index)
            layer.v = layer.v.index_select(0, index)
        self.cache.batch_size = len(index)
        self.key_mask = self.key_mask.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)

    def crop(self, columns: int) -> None:
        """Forget every column from `columns` on (for all rows): the next step writes there.
        Lengths are recounted from the mask (a draft's rejected tokens are rolled back so)."""
        if isinstance(columns, bool) or not isinstance(columns, int) or not (
                0 <= columns <= self.columns):
            raise ValueError(f"columns must be an int in [0, {self.columns}], got {columns!r}")
        self.key_mask[:, columns:] = False
        self.cache.length = columns
        self.lengths = self.key_mask.sum(dim=1)


# --------------------------------------------------------------------------------------------
# batched generation


def _params_per_row(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence) or len(params) != n or not all(
            isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"params must be one SamplingParams or a list of {n} (one per "
                         f"prompt), got {params!r}")
    return list(params)


@torch.inference_mode()
def generate_batch(model: TinyGPT, prompts: Sequence[Sequence[int]],
                   params: SamplingParams | Sequence[SamplingParams], *,
                   eos_id: int | None = None, tokenizer=None) -> list[GenerationResult]:
    """Generate for every prompt in one left-padded batch; returns a GenerationResult per
    prompt, in order. params: one SamplingParams for all or one per prompt (each row stops on
    its own max_new_tokens, eos_id and stop strings; stop strings need `tokenizer`). At
    temperature 0 each row's tokens equal tinygpt.generate.generate's for that prompt alone;
    a seeded row draws from its own generator, so its tokens do not depend on its batch-mates.
    A finished row feeds pads (its length stops growing) while the others go on.
    """
    prompt_lists = _check_prompts(prompts)
    rows = _params_per_row(params, len(prompt_lists))
    ids, mask = left_pad(prompt_lists)
    vocab, window = model.cfg.vocab_size, model.cfg.max_seq_len
    check_token_id("eos_id", eos_id, vocab, optional=True)
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ValueError(f"prompts: token ids must be in [0, {vocab})")
    steps = max(p.max_new_tokens for p in rows)
    if ids.shape[1] + steps - 1 > window:
        raise ValueError(f"the longest prompt ({ids.shape[1]}) plus max_new_tokens ({steps}) "
                         f"- 1 exceeds max_seq_len={window}")
    if any(p.stop for p in rows) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (decode) to be matched")
    device = model_device(model)
    generators = [torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None
                  else None for p in rows]
    batch = BatchedKVCache(model, len(rows), max_len=ids.shape[1] + steps - 1)
    logits = batch.forward(ids.to(device), mask.to(device))[:, -1]
    out: list[list[int]] = [[] for _ in rows]
    reasons: list[str | None] = [None] * len(rows)
    texts: list[str | None] = [None] * len(rows)
    for _ in range(steps):
        tokens = torch.zeros(len(rows), dtype=torch.long, device=device)
        for i, p in enumerate(rows):
            if reasons[i] is not None:
                continue
            generated = torch.tensor([out[i]], dtype=torch.long, device=device)
            prompt_t = torch.tensor([prompt_lists[i]], dtype=torch.long, device=device)
            tokens[i] = sample_next_token(logits[i:i + 1], p, generators[i], prompt_ids=prompt_t,
                                          generated_ids=generated)[0]
            out[i].append(int(tokens[i]))
            reasons[i] = _finished(out[i], p, eos_id, tokenizer, texts, i)
        if all(r is not None for r in reasons):
            break
        running = torch.tensor([r is None for r in reasons], device=device)
        logits = batch.forward(tokens[:, None], running[:, None])[:, -1]
    return [GenerationResult(prompt_lists[i], out[i], reasons[i] or "length",
                             texts[i] if tokenizer is not None else None)
            for i in range(len(rows))]


def _finished(tokens: list[int], params: SamplingParams, eos_id, tokenizer, texts, i
              ) -> str | None:
    """Why a row stops after its newest token (None: it goes on); keeps texts[i] current."""
    if tokenizer is not None:
        body = tokens[:-1] if tokens[-1] == eos_id else tokens
        text = tokenizer.decode(body)
        cut = find_stop(text, params.stop)
        texts[i] = text if cut is None else text[:cut]
        if cut is not None:
            return "stop_string"
    if tokens[-1] == eos_id:
        return "eos"
    if len(tokens) == params.max_new_tokens:
        return "length"
    return None


# --------------------------------------------------------------------------------------------
# beam search


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam: its new tokens (a final EOS included) and its score, the sum of the
    tokens' log-probabilities divided by len(token_ids) ** length_penalty."""

    token_ids: list[int]
    score: float
    log_prob: float


@dataclass(frozen=True)
class BeamSearchResult:
    """What beam_search returns: the best hypothesis's tokens and score, and every finished
    hypothesis kept (best first, at most num_beams)."""

    prompt_ids: list[int]
    token_ids: list[int]
    score: float
    hypotheses: list[BeamHypothesis]
    steps: int


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@torch.inference_mode()
def beam_search(model: TinyGPT, prompt_ids: Sequence[int], num_beams: int,
                max_new_tokens: int, *, length_penalty: float = 1.0,
                eos_id: int | None = None) -> BeamSearchResult:
    """Deterministic beam search with Hugging Face's conventions (transformers' generate with
    num_beams=num_beams, do_sample=False and its default early_stopping=False).

    The num_beams running beams are the rows of one BatchedKVCache. Each step scores every
    (beam, token) pair by the beam's summed log-probability plus log_softmax of its logits,
    keeps the best 2 * num_beams candidates, and
    - moves each candidate among the best num_beams that ends in eos_id, or reaches
      max_new_tokens, to the finished hypotheses with score sum / n_new ** length_penalty
      (n_new counts its new tokens, EOS included); at most num_beams are kept, the best;
    - continues the best num_beams candidates that did not finish: the cache's rows are
      reordered by their beam indices (a beam that won twice is copied into two rows) and
      their tokens are fed in one batched step.
    It stops after max_new_tokens, or once num_beams hypotheses are finished and the best
    running beam, scored at its current length, cannot beat the worst of them (HF's heuristic
    for length_penalty > 0 and early_stopping=False: a longer continuation could in principle
    still win, exactly as in transformers).
    """
    prompt = _check_prompt(prompt_ids, "prompt_ids")
    _check_int("num_beams", num_beams, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float) or \
            not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    vocab, window = model.cfg.vocab_size, model.cfg.max_seq_len
    check_token_id("eos_id", eos_id, vocab, optional=True)
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab})")
    if len(prompt) + max_new_tokens - 1 > window:
        raise ValueError(f"the prompt ({len(prompt)}) plus max_new_tokens ({max_new_tokens}) "
                         f"- 1 exceeds max_seq_len={window}")
    device = model_device(model)
    keep = 2 * num_beams                                 # candidates examined per step
    cache = BatchedKVCache(model, 1, max_len=len(prompt) + max_new_tokens - 1)
    logits = cache.forward(torch.tensor([prompt], device=device))[:, -1].float()
    cache.reorder([0] * num_beams)                       # every beam starts from the prompt
    logits = logits.expand(num_beams, -1)
    running_scores = torch.full((num_beams,), -1e9, device=device)
    running_scores[0] = 0.0                              # only beam 0 is live at first
    running_tokens: list[list[int]] = [[] for _ in range(num_beams)]
    finished: list[BeamHypothesis] = []
    improvable = True
    steps = 0
    for step in range(max_new_tokens):
        steps += 1
        scores = running_scores[:, None] + torch.log_softmax(logits, dim=-1)   # (K, V)
        top_scores, top_index = torch.topk(scores.flatten(), k=min(keep, scores.numel()))
        beams, tokens = top_index // vocab, top_index % vocab
        n_new = step + 1
        ends = (tokens == eos_id) if eos_id is not None else torch.zeros_like(tokens, dtype=bool)
        if n_new == max_new_tokens:
            ends = torch.ones_like(ends)
        if improvable:
            for rank in range(min(num_beams, len(tokens))):
                if ends[rank]:
                    seq = running_tokens[int(beams[rank])] + [int(tokens[rank])]
                    total = float(top_scores[rank])
                    finished.append(BeamHypothesis(seq, total / n_new ** length_penalty, total))
            finished = sorted(finished, key=lambda h: -h.score)[:num_beams]
        if bool(ends.all()):
            break
        alive = torch.where(ends, top_scores - 1e9, top_scores)
        chosen = torch.topk(alive, k=num_beams).indices                  # best first
        running_scores = alive[chosen]
        parent, token = beams[chosen], tokens[chosen]
        running_tokens = [running_tokens[int(b)] + [int(t)] for b, t in
                          zip(parent.tolist(), token.tolist(), strict=True)]
        if improvable and len(finished) == num_beams:
            best_running = float(running_scores[0]) / n_new ** length_penalty
            improvable = best_running > finished[-1].score
        if not improvable:
            break
        cache.reorder(parent)                            # row i now holds beam parent[i]'s past
        logits = cache.forward(token[:, None])[:, -1].float()
    best = finished[0]
    return BeamSearchResult(prompt, list(best.token_ids), best.score, finished, steps)


# --------------------------------------------------------------------------------------------
# chunked prefill


@torch.inference_mode()
def chunked_prefill(model: TinyGPT, prompt_ids: Sequence[int], chunk_size: int,
                    cache: BatchedKVCache | None = None) -> torch.Tensor:
    """Prefill one prompt in chunks of at most chunk_size tokens: logits (T, V) of every
    position, equal to the one-pass prefill model(ids)[0] up to float rounding (the products
    have other shapes; tests bound the difference). Fills `cache` (one row; a fresh one if
    None), so decoding can go on from it."""
    prompt = _check_prompt(prompt_ids, "prompt_ids")
    _check_int("chunk_size", chunk_size, 1)
    if cache is None:
        cache = BatchedKVCache(model, 1, max_len=len(prompt))
    ids = torch.tensor([prompt], device=model_device(model))
    return torch.cat([cache.forward(ids[:, i:i + chunk_size])[0]
                      for i in range(0, len(prompt), chunk_size)])


# --------------------------------------------------------------------------------------------
# static vs continuous batching: a discrete-event simulator


@dataclass(frozen=True)
class Request:
    """One request of a stream: it arrives at `arrival` seconds with a prompt of prompt_len
    tokens and will generate output_len tokens (known to the simulator, not to the policy)."""

    arrival: float
    prompt_len: int
    output_len: int


def request_stream(n_requests: int, rate: float, *, seed: int = 0, prompt_median: int = 256,
                   output_median: int = 128, sigma: float = 0.8, max_len: int = 2048
                   ) -> list[Request]:
    """A seeded stream: Poisson arrivals at `rate` requests/s (exponential gaps), prompt and
    output lengths log-normal around their medians (a few long requests among many short
    ones, as in chat traffic), clipped to [1, max_len]. The medians and max_len are ints >= 1,
    sigma a finite number >= 0."""
    _check_int("n_requests", n_requests, 1)
    for name, value in (("prompt_median", prompt_median), ("output_median", output_median),
                        ("max_len", max_len)):
        _check_int(name, value, 1)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise ValueError(f"rate must be a number of requests per second > 0, got {rate!r}")
    if isinstance(sigma, bool) or not isinstance(sigma, int | float) or not (
            math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n_requests):
        t += rng.expovariate(rate)
        lengths = [min(max_len, max(1, round(m * math.exp(rng.gauss(0.0, sigma)))))
                   for m in (prompt_median, output_median)]
        out.append(Request(t, lengths[0], lengths[1]))
    return out


StepTime = Callable[[int, int], float]
"""A step-time model: (tokens the step pushes through the model, cached tokens its attention
reads) -> seconds."""


def roofline_step_time(cfg: ModelConfig, hw: Hardware, dtype: str = "bf16", *,
                       overhead_s: float = 0.0) -> StepTime:
    """A step-time model from day 10's roofline: a step over n tokens reading c cached tokens
    does n * 2 * matmul params FLOPs (plus 4 * L * H * hd per cached key for attention) and
    reads the weights once plus the c cached tokens' keys and values; it takes the larger of
    compute time and memory time (tinygpt.roofline.op_time), plus a fixed overhead."""
    weight = F.weights_read_bytes(cfg, 1, dtype)
    per_key_bytes = F.kv_cache_bytes(cfg, 1, 1, dtype)
    per_token_flops = F.weight_flops_per_token(cfg)
    per_key_flops = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim

    def step_time(tokens: int, kv_tokens: int) -> float:
        flops = tokens * per_token_flops + kv_tokens * per_key_flops
        return op_time(flops, weight + kv_tokens * per_key_bytes, hw, dtype)[0] + overhead_s

    return step_time


POLICIES = ("static", "continuous")


def admit(policy: str, n_waiting: int, n_running: int, max_batch: int, more_coming: bool
          ) -> int:
    """How many waiting requests join the batch at this step boundary.

    static: only when the batch is empty, and only a full batch (max_batch requests), unless
    no more requests will arrive (then whatever waits); continuous: fill every free slot."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "static":
        if n_running > 0 or (n_waiting < max_batch and more_coming):
            return 0
        return min(n_waiting, max_batch)
    return min(n_waiting, max_batch - n_running)


@dataclass(frozen=True)
class Step:
    """One simulated step: its time span, the decode rows that produced a token, the rows and
    prompt tokens it prefilled, and the slots held (a static batch holds finished rows'
    slots)."""

    start: float
    end: float
    decode_rows: int
    prefill_rows: int
    prefill_tokens: int
    busy_slots: int


@dataclass
class SimulationResult:
    """A simulated run: per request a day-12 RequestTrace (in request order), and the steps."""

    policy: str
    max_batch: int
    chunk_size: int | None
    requests: list[Request]
    traces: list[RequestTrace]
    steps: list[Step] = field(repr=False)

    @property
    def makespan(self) -> float:
        """Seconds from the first arrival to the last token."""
        return max(t.token_times[-1] for t in self.traces) - min(r.arrival for r in
                                                                 self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the makespan (math.inf for a makespan of 0: every
        step took 0 s and every request arrived at once, as tokens_per_second says)."""
        tokens = sum(t.n_tokens for t in self.traces)
        return tokens / self.makespan if self.makespan > 0 else math.inf

    @property
    def slot_utilisation(self) -> float:
        """Share of slot-seconds (max_batch slots over the makespan) spent producing tokens:
        a slot counts while its request prefills or decodes, not while a finished request
        waits for its static batch, nor while the server is idle. 0.0 for a makespan of 0
        (no slot-seconds at all)."""
        if self.makespan <= 0:
            return 0.0
        useful = sum((s.end - s.start) * (s.decode_rows + s.prefill_rows) for s in self.steps)
        return useful / (self.max_batch * self.makespan)

    def summary(self) -> dict:
        """Throughput, slot utilisation, and p50/p90/p99 (tinygpt.metrics.summarize) of TTFT,
        TPOT and inter-token latency, in seconds."""
        tpots = [v for v in map(tpot, self.traces) if v is not None]
        itls = [gap for t in self.traces for gap in inter_token_latencies(t)]
        return {"policy": self.policy, "max_batch": self.max_batch,
                "chunk_size": self.chunk_size, "requests": len(self.traces),
                "makespan_s": self.makespan, "throughput_tok_s": self.throughput,
                "slot_utilisation": self.slot_utilisation,
                "ttft_s": summarize([ttft(t) for t in self.traces]),
                "tpot_s": summarize(tpots) if tpots else None,
                "itl_s": summarize(itls) if itls else None}


@dataclass
class _Slot:
    index: int
    request: Request
    prefilled: int = 0
    times: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.times) >= self.request.output_len


def simulate(requests: Sequence[Request], policy: str, max_batch: int, step_time: StepTime,
             *, chunk_size: int | None = None,
             admit_fn: Callable[[str, int, int, int, bool], int] = admit) -> SimulationResult:
    """Run `requests` through a batching server whose steps take step_time(tokens, kv_tokens).

    At each step boundary `admit` decides how many waiting requests (first come, first
    served) take a slot. A step then decodes one token for every slot whose prefill is done
    and prefills the others: whole prompts, or with chunk_size at most chunk_size prompt
    tokens per step in total (first come first), sharing the step with the decodes. A
    prompt's last prefill step yields its first token. Static batching pads: its prefill step
    pushes batch x longest prompt tokens, and its decode steps run every row until the
    longest output is done (a finished row still costs its slot and its token).
    Continuous batching frees a slot as soon as its request is done. admit_fn replaces
    `admit` (same arguments); a policy that admits too many, or none while requests wait and
    nothing else can happen, raises a ValueError instead of running forever.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    _check_int("max_batch", max_batch, 1)
    if chunk_size is not None:
        _check_int("chunk_size", chunk_size, 1)
    if not isinstance(requests, Sequence) or not requests or not all(
            isinstance(r, Request) for r in requests):
        raise ValueError("requests must be a non-empty list of Request")
    for name, bad in (("prompt_len", [r for r in requests if r.prompt_len < 1]),
                      ("output_len", [r for r in requests if r.output_len < 1])):
        if bad:
            raise ValueError(f"requests: every {name} must be >= 1, got {bad[0]!r}")
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    arrivals = deque(order)
    waiting: deque[int] = deque()
    running: list[_Slot] = []
    done: dict[int, list[float]] = {}
    steps: list[Step] = []
    now = requests[order[0]].arrival
    while len(done) < len(requests):
        while arrivals and requests[arrivals[0]].arrival <= now:
            waiting.append(arrivals.popleft())
        n_in = admit_fn(policy, len(waiting), len(running), max_batch, bool(arrivals))
        if isinstance(n_in, bool) or not isinstance(n_in, int) or not (
                0 <= n_in <= min(len(waiting), max_batch - len(running))):
            raise ValueError(f"admit_fn returned {n_in!r}; it must be an int in [0, "
                             f"{min(len(waiting), max_batch - len(running))}] ({len(waiting)} "
                             f"waiting, {max_batch - len(running)} free slots)")
        if n_in == 0 and not running and not arrivals:
            raise ValueError(f"admit_fn admitted nothing with {len(waiting)} requests waiting, "
                             f"an empty batch and no arrivals to come: the run would never end")
        for _ in range(n_in):
            i = waiting.popleft()
            running.append(_Slot(i, requests[i]))
        if not running:
            now = requests[arrivals[0]].arrival          # idle until the next arrival
            continue
        active = [s for s in running if not s.done]
        decoding = [s for s in active if s.prefilled == s.request.prompt_len]
        prefilling = [s for s in active if s.prefilled < s.request.prompt_len]
        budget = math.inf if chunk_size is None else chunk_size
        chunks = []
        for s in prefilling:
            n = int(min(budget, s.request.prompt_len - s.prefilled))
            budget -= n
            chunks.append((s, n))
        if policy == "static" and prefilling and chunk_size is None:
            width = max(s.request.prompt_len for s in prefilling)
            tokens = width * len(running)
        elif policy == "static":
            tokens = len(running) - len(prefilling) + sum(n for _, n in chunks)
        else:
            tokens = len(decoding) + sum(n for _, n in chunks)
        kv = sum(s.request.prompt_len + len(s.times) for s in decoding) + sum(
            s.prefilled + n for s, n in chunks)
        dt = step_time(tokens, kv)
        steps.append(Step(now, now + dt, len(decoding), sum(1 for _, n in chunks if n),
                          sum(n for _, n in chunks), len(running)))
        now += dt
        for s in decoding:
            s.times.append(now)
        for s, n in chunks:
            s.prefilled += n
            if n and s.prefilled == s.request.prompt_len:
                s.times.append(now)                      # the prefill's last logits: token 1
        for s in running:
            if s.done and s.index not in done:
                done[s.index] = s.times[:s.request.output_len]
        if policy == "continuous" or all(s.done for s in running):
            running = [s for s in running if not s.done]
    traces = [RequestTrace(r.arrival, tuple(done[i]), r.prompt_len)
              for i, r in enumerate(requests)]
    return SimulationResult(policy, max_batch, chunk_size, list(requests), traces, steps)
