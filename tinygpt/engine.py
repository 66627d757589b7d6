"""Day 17: a serving engine. Requests come and go; one continuously refilled batch serves them.

Three rooms, arrows one way (engine -> scheduler, engine -> runner -> paged cache):

    tinygpt/scheduler.py  which sequences run in the next step and how many tokens each feeds:
                          decodes first, prefill chunks in the token budget, admission against
                          free blocks, preemption of the newest when the pool runs dry
    tinygpt/runner.py     one forward pass over every scheduled token on the paged cache
    tinygpt/engine.py     this module: requests in, tokens out

Engine is the synchronous core: add_request(), step() (one scheduled forward pass and the
tokens it produced), run() / generate() to drive it to the end. Each request keeps its own
copy of the batch-1 token loop (tinygpt.generate.token_events): its generator, penalties, stop
strings and held-back text, fed the logits the batch computed for it. So a request's output
depends only on its own prompt, parameters and seed, never on what it was batched with, and at
temperature 0 it equals its batch-1 `generate` (tests/test_engine.py).

What the HTTP server (the tinygpt/server/ package) needs is an asynchronous interface:

    request = await engine.submit(prompt_ids, params, eos_ids)   # EngineFull: queue is full
    async for event in request: ...                               # Event per new token
    request.cancel()                                              # marks it (see below)
    engine.stats()                                                # EngineStats

cancel() only marks the request (from any thread); the worker ends it later: AsyncEngine's
before the engine's next step, freeing its KV blocks then; SerialEngine's at the running
request's next token, or when a waiting one's turn comes.

AsyncEngine is that interface over Engine: a worker thread steps the engine while requests
arrive and leave. SerialEngine is the same interface over the plain loop: one request at a
time with tinygpt.generate.stream (the KV-cached batch-1 loop) while the others wait; it is the
reference a batching engine must match and the baseline it must beat.

Log-probabilities: a request may ask for the log-probability of each token it generates
(`logprobs=k`: the chosen token's and the k most likely, k may be 0) and of each prompt token
given the ones before it (`prompt_logprobs=k`). They are the log-softmax of the model's own
logits, before temperature, penalties or filters change them (vLLM's default), so they are the
same whatever the sampling knobs. A request with prompt_logprobs prefills every prompt token
(it never starts on cached blocks, whose logits were not kept).

Prefix caching (Engine(prefix_caching=True); tinygpt.paged explains the block keys): full
blocks outlive their requests, and a new request that begins with the same tokens starts on
them; the outputs are the same as without (tests/test_engine.py runs both against batch-1
`generate`).

Forced tokens (day 19, Engine(fast_forward=True), the default): when a request's constraint
has forced() (tinygpt.structured's grammars: the tokens the grammar allows and no other), the
step that samples its token also appends the run the grammar then forces, without sampling,
exactly as batch-1 `stream` does; the next step feeds the whole run to the model in one pass,
a short chunk among the decodes (tinygpt.scheduler, step 1), so a run of k forced tokens costs
one forward pass instead of k. The tokens are the same as without it (greedy; and a seeded
sampler draws only for sampled tokens, as `stream` does): tests/test_engine_forced.py runs both
and batch-1 `generate` under random arrivals, budgets and preemptions. A request that asks for
logprobs does not fast-forward (each token's log-probability needs the model at its position).

Threads: the model runs on the worker thread; events reach the request's asyncio queue through
the event loop's call_soon_threadsafe, so `async for` never blocks the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from tinygpt.generate import (
    GenerationResult,
    TokenEvent,
    _check_args,
    model_limits,
    prepare_prompt,
    stream,
    token_events,
)
from tinygpt.metrics import RequestTrace, inter_token_latencies, ttft
from tinygpt.model import TinyGPT
from tinygpt.native import torch_single_thread
from tinygpt.paged import PagedKVCache
from tinygpt.runner import ModelRunner
from tinygpt.sampling import DEFAULT_ORDER, SamplingParams, check_order, check_token_id
from tinygpt.scheduler import Scheduler, Seq

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class EngineFull(RuntimeError):
    """The waiting queue is full: the request was not admitted (a server answers 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (a server answers 503)."""


@dataclass(frozen=True)
class Event:
    """One streamed step of a request.

    token_id  the new token (None on a final event that carries no token: cancelled, error)
    text      the text it releases ("" while held back; see tinygpt.generate.TokenEvent)
    finish_reason  None until the last event: "stop" (EOS or a stop string), "length"
              (max_new_tokens), "cancelled" or "error" (then `error` says what went wrong)
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None      # with logprobs: the token's log-probability
    top_logprobs: tuple[tuple[int, float], ...] = ()    # (id, log-probability), best first


@dataclass
class EngineStats:
    running: int
    waiting: int
    submitted: int
    finished: int
    cancelled: int
    rejected: int
    tokens_generated: int
    max_waiting: int
    kv_blocks_used: int = 0      # the paged engine's pool (0 and 0 for SerialEngine)
    kv_blocks_total: int = 0
    preemptions: int = 0
    prefix_cached_blocks: int = 0     # blocks findable by a prefix key
    prefix_query_tokens: int = 0      # tokens of admitted requests (prompt + outputs so far)
    prefix_hit_tokens: int = 0        # ... found in cached blocks instead of computed


def check_eos_ids(eos_ids: object, vocab_size: int) -> tuple[int, ...]:
    """eos_ids as a tuple: a sequence (list, tuple) of ints in [0, vocab_size), possibly
    empty. A bare int is refused (it is no sequence), as is anything else."""
    if isinstance(eos_ids, str | bytes) or not isinstance(eos_ids, Sequence):
        raise TypeError(f"eos_ids must be a sequence of ints (token ids), such as (0,) or [], "
                        f"got {type(eos_ids).__name__} {eos_ids!r}")
    for i, eos in enumerate(eos_ids):
        check_token_id(f"eos_ids[{i}]", eos, vocab_size)
    return tuple(eos_ids)


def to_event(event: TokenEvent) -> Event:
    """A token loop's TokenEvent as the server's Event: an EOS or a stop string is "stop",
    max_new_tokens is "length". An EOS event's text is what the loop held back until then
    (the end of a possible stop string): it belongs to the reply; the EOS itself is no text."""
    finish = event.finish_reason
    reason = None if finish is None else ("length" if finish == "length" else "stop")
    return Event(event.token_id, event.text or "", reason)


@dataclass(eq=False)
class Request:
    """A submitted request: an async iterator of Events; cancel() to stop it."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...]
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: object = None              # what may come next (tinygpt.generate.stream's)
    scoring: bool = False                  # its one token only scores the prompt (server's echo)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None        # when the engine first ran it (queue time ends)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # with prompt_logprobs: one (log-probability, top) per prompt token, None for the first;
    # set before the first event arrives
    prompt_logprob_list: list | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _error: str | None = None              # why the engine could not take it
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def cancel(self) -> None:
        """Stop generating (a waiting request never starts); safe from any thread, twice."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_time(self) -> float | None:
        """Seconds between submit() and the engine first running it (None before that)."""
        return None if self.started_at is None else self.started_at - self.submitted_at

    def trace(self) -> RequestTrace | None:
        """The request's timestamps as tinygpt.bench's RequestTrace (None before a token)."""
        if not self.token_times:
            return None
        return RequestTrace(self.submitted_at, tuple(self.token_times), len(self.prompt_ids))

    def _put(self, event: Event) -> None:      # called on the worker thread
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:                   # its event loop has closed: nobody is reading
            self._cancel.set()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if event.finish_reason is not None:
                return


# ------------------------------------------------------------------------------------------------
# the engine: scheduler + runner + one token loop per request


@dataclass(frozen=True)
class StepRecord:
    """What one step did (Engine.log, for the timeline widget and the tests).

    prefill: request id -> tokens it fed as a prompt chunk (or a recompute after preemption);
    decode: ids that fed one token; waiting: ids still queued after the step; preempted: ids
    taken out before it; finished: ids that ended with it; seconds: the step's wall time;
    forced: request id -> tokens appended without sampling after its sampled one (day 19; the
    next step feeds them, in `prefill` since they are several).
    """

    index: int
    prefill: dict
    decode: tuple
    waiting: tuple
    preempted: tuple
    finished: tuple
    seconds: float
    forced: dict = field(default_factory=dict)   # request id -> tokens its grammar forced


@dataclass(eq=False)
class _Active:
    """The engine's side of one request: its sequence and its own batch-1 token loop."""

    seq: Seq
    loop: object                  # the token_events generator
    holder: dict                  # the logits the loop reads next
    eos_ids: tuple[int, ...]
    submitted_at: float
    started_at: float | None = None       # first admitted (queue time ends)
    token_times: list[float] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    token_logprobs: list = field(default_factory=list)     # (logprob, top) per output
    prompt_entries: dict = field(default_factory=dict)     # position -> (logprob, top)
    forcing: _Forcing | None = None       # its constraint, when it fast-forwards


class _Forcing:
    """A constraint with forced() (day 19's fast-forward), its answer kept until the next
    advance: the engine asks first (does the request need the model before its next token?),
    then the token loop asks the same question and gets the same list, computed once."""

    def __init__(self, inner) -> None:
        self.inner, self._forced = inner, None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return self.inner.mask(logits)

    def advance(self, token_id: int) -> None:
        self._forced = None
        self.inner.advance(token_id)

    def forced(self) -> list[int]:
        if self._forced is None:
            self._forced = list(self.inner.forced())
        return self._forced


def logprob_entries(logits: torch.Tensor, targets: Sequence[int], k: int
                    ) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """logits (n, V) and the n tokens that followed -> per row (log-probability of the
    target, the k most likely (id, log-probability), best first): log-softmax of the raw
    logits."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(list(targets), device=logp.device)[:, None])[:, 0]
    out = []
    if k > 0:
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices.tolist(),
                                                              values.tolist(), strict=True)]
    else:
        tops = [()] * logp.shape[0]
    for value, top in zip(chosen.tolist(), tops, strict=True):
        out.append((value, top))
    return out


class Engine:
    """Continuous batching over a paged KV cache (synchronous; see the module docstring).

    model: a TinyGPT in eval mode. tokenizer: decode(list[int]) -> str, for text and stop
    strings (optional without them). block_size, num_blocks: the paged pool (block_size in
    [1, max_seq_len]; num_blocks default: room for max_running sequences of
    min(max_seq_len, 512) positions). Every argument is checked before the pool is allocated.
    max_running: sequences in the batch at once. token_budget: tokens one step may feed
    (decodes count one each; prefill chunks share the rest). record: keep a StepRecord per
    step in `log` (the timeline widget draws it). prefix_caching: reuse the full KV blocks
    of earlier requests' prefixes (see the module docstring). batched: run a float32 CPU
    model's products through tinygpt.cpu_gemm (the default; False: the model's own modules,
    the oracle; see tinygpt.runner.ModelRunner). fast_forward: append the tokens a request's
    constraint forces without sampling and feed them in one pass (the default; False: one
    decode step per token, the oracle; see the module docstring).
    """

    def __init__(self, model: TinyGPT, tokenizer=None, *, block_size: int = 16,
                 num_blocks: int | None = None, max_running: int = 32,
                 token_budget: int = 256, order: Sequence[str] = DEFAULT_ORDER,
                 record: bool = False, prefix_caching: bool = False,
                 batched: bool = True, fast_forward: bool = True) -> None:
        if not isinstance(model, TinyGPT):
            raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError("tokenizer must have a decode(list[int]) -> str method")
        # every argument before the pool is sized and allocated
        window = model.cfg.max_seq_len
        if isinstance(block_size, bool) or not isinstance(block_size, int) \
                or not 1 <= block_size <= window:
            raise ValueError(f"block_size must be an int in [1, {window}] (the model's "
                             f"max_seq_len: a larger block holds positions no request reaches), "
                             f"got {block_size!r}")
        for name, value in (("max_running", max_running), ("token_budget", token_budget)) + (
                () if num_blocks is None else (("num_blocks", num_blocks),)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, flag in (("record", record), ("prefix_caching", prefix_caching),
                           ("batched", batched), ("fast_forward", fast_forward)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        order = check_order(order)
        if num_blocks is None:
            per_seq = -(-min(window, 512) // block_size)
            num_blocks = max_running * per_seq
        self.model, self.tokenizer, self.order = model, tokenizer, order
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size,
                                            prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.cache, max_running=max_running,
                                   token_budget=token_budget)
        self.runner = ModelRunner(model, self.cache, batched=batched)
        self.record, self.fast_forward = record, fast_forward
        self.log: list[StepRecord] = []
        self.steps = 0
        self.tokens_generated = 0
        self.tokens_forced = 0            # of them appended without sampling (fast-forward)
        self._active: dict[Hashable, _Active] = {}
        self._results: dict[Hashable, _Active] = {}     # finished, until release()
        self._failed: dict[Hashable, str] = {}          # failed alone, until failures()
        self._ids = itertools.count()

    def check_request(self, prompt_ids, params: SamplingParams,
                      eos_ids: Sequence[int] = (), *, logprobs: int | None = None,
                      prompt_logprobs: int | None = None, constraint=None) -> list[int]:
        """The checks add_request makes, with nothing changed (a server calls it before
        queueing, with the same arguments). Returns the prompt as a list of ids."""
        vocab_size, max_seq_len = model_limits(self.model)
        eos_ids = check_eos_ids(eos_ids, vocab_size)
        _check_args(self.model, params, eos_ids, self.tokenizer, None,
                    self.order, constraint)
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= vocab_size):
                raise ValueError(f"{name} must be None or an int in [0, {vocab_size}], got "
                                 f"{value!r}")
        prompt = prepare_prompt(prompt_ids, vocab_size, max_seq_len)[0].tolist()
        positions = len(prompt) + params.max_new_tokens - 1
        if positions > max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens "
                             f"({params.max_new_tokens}) - 1 = {positions} positions exceed the "
                             f"model's max_seq_len={max_seq_len}")
        blocks = -(-positions // self.cache.block_size)
        if blocks > self.cache.allocator.num_blocks:
            raise ValueError(f"the request can need {blocks} KV blocks; the pool has "
                             f"num_blocks={self.cache.allocator.num_blocks}")
        return prompt

    def add_request(self, prompt_ids, params: SamplingParams, *, eos_ids: Sequence[int] = (),
                    request_id: Hashable | None = None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, constraint=None) -> Hashable:
        """Queue a request; returns its id (`request_id`, or a fresh int that no queued,
        running or unreleased finished request holds; a given id must not be one of those
        either). Sampling uses a generator seeded with params.seed (torch's global one when
        the seed is None).
        logprobs / prompt_logprobs: None, or how many top alternatives (>= 0) to keep beside
        each generated / prompt token's log-probability (see the module docstring).
        constraint: what may come next, as tinygpt.generate.stream takes it (log-probabilities
        stay those of the model's raw logits)."""
        prompt = self.check_request(prompt_ids, params, eos_ids, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, constraint=constraint)
        if request_id is None:              # the next automatic id no request holds
            request_id = next(self._ids)
            while request_id in self._active or request_id in self._results:
                request_id = next(self._ids)
        elif request_id in self._active or request_id in self._results:
            raise ValueError(f"request_id {request_id!r} is already in the engine (queued, "
                             f"running, or finished and not yet release()d)")
        device = self.cache.k.device
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        holder: dict = {}
        eos_ids = tuple(eos_ids)
        forcing = None
        if (self.fast_forward and logprobs is None
                and callable(getattr(constraint, "forced", None))):
            constraint = forcing = _Forcing(constraint)
        loop = token_events(lambda ids: holder.pop("logits"),
                            torch.tensor([prompt], device=device), params,
                            eos_ids, self.tokenizer, generator,
                            self.order, self.model.cfg.max_seq_len, constraint,
                            fast_forward=forcing is not None)
        seq = Seq(request_id, prompt, params.max_new_tokens, arrival=self.steps,
                  cache_prefix=prompt_logprobs is None)
        self.scheduler.add(seq)
        self._active[request_id] = _Active(seq, loop, holder, eos_ids, time.perf_counter(),
                                           logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                           forcing=forcing)
        return request_id

    def abort(self, request_id: Hashable) -> None:
        """Drop a request now (cancelled): its blocks return to the pool before the next step."""
        active = self._active.pop(request_id, None)
        if active is not None:
            self.scheduler.finish(active.seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[tuple[Hashable, TokenEvent]]:
        """Schedule, run one forward pass, sample for every sequence that reached its last
        token, and free the finished. Returns (request id, TokenEvent) per new token."""
        if not self.runner.batched:
            return self._step()
        with torch_single_thread():       # the products use the cores (tinygpt.cpu_gemm)
            return self._step()

    def _step(self) -> list[tuple[Hashable, TokenEvent]]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq in plan.admitted:
            active = self._active[seq.id]
            if active.started_at is None:
                active.started_at = t0
        out: list[tuple[Hashable, TokenEvent]] = []
        if not plan.scheduled:
            return out
        sampling = [item.samples for item in plan.scheduled]
        decode = [item.n == 1 and item.start >= len(item.seq.prompt_ids)
                  for item in plan.scheduled]
        work = [(item.seq.id, item.seq.tokens(item.start, item.n), item.start)
                for item in plan.scheduled]
        wants = [self._active[item.seq.id].prompt_logprobs is not None
                 and item.start + 1 < len(item.seq.prompt_ids) for item in plan.scheduled]
        if any(wants):
            logits, every = self.runner.forward(work, every_position=wants)
            for item, rows in zip(plan.scheduled, every, strict=True):
                if rows is not None:
                    self._record_prompt_logprobs(item, rows)
        else:
            logits = self.runner.forward(work)
        self.scheduler.complete(plan.scheduled)
        now = time.perf_counter()
        finished = []
        forced: dict = {}
        for row, (item, samples) in enumerate(zip(plan.scheduled, sampling, strict=True)):
            if not samples:
                continue
            active = self._active[item.seq.id]
            active.holder["logits"] = logits[row:row + 1]
            try:
                event = next(active.loop)
                if active.logprobs is not None:
                    active.token_logprobs.extend(logprob_entries(
                        logits[row:row + 1], [event.token_id], active.logprobs))
                done = self._emit(active, event, now, out)
                # day 19: the tokens its grammar now forces, appended without sampling; the
                # next step feeds them in one pass (the scheduler's decodes, a short chunk)
                while not done and active.forcing is not None and active.forcing.forced():
                    for _ in range(len(active.forcing.forced())):
                        done = self._emit(active, next(active.loop), now, out)
                        forced[item.seq.id] = forced.get(item.seq.id, 0) + 1
                        self.tokens_forced += 1
                        if done:
                            break
            except Exception as err:  # noqa: BLE001 - its own loop (a constraint) failed: it alone
                self.scheduler.finish(item.seq)
                del self._active[item.seq.id]
                self._failed[item.seq.id] = f"{type(err).__name__}: {err}"
                finished.append(item.seq.id)
                continue
            if done:
                self.scheduler.finish(item.seq)
                self._results[item.seq.id] = self._active.pop(item.seq.id)
                finished.append(item.seq.id)
        self.steps += 1
        if self.record:
            self.log.append(StepRecord(
                self.steps - 1,
                {i.seq.id: i.n for i, d in zip(plan.scheduled, decode, strict=True) if not d},
                tuple(i.seq.id for i, d in zip(plan.scheduled, decode, strict=True) if d),
                tuple(s.id for s in self.scheduler.waiting),
                tuple(s.id for s in plan.preempted), tuple(finished),
                time.perf_counter() - t0, forced))
        return out

    def _emit(self, active: _Active, event: TokenEvent, now: float,
              out: list[tuple[Hashable, TokenEvent]]) -> bool:
        """A request's new token: into its sequence, its events and `out`; True when it
        ends the request."""
        active.seq.output_ids.append(event.token_id)
        active.token_times.append(now)
        active.events.append(event)
        self.tokens_generated += 1
        out.append((active.seq.id, event))
        return event.finish_reason is not None

    def _record_prompt_logprobs(self, item, rows: torch.Tensor) -> None:
        """Prompt log-probabilities from a chunk's every-position logits: the logits at
        position p give the log-probability of prompt token p + 1."""
        active, prompt = self._active[item.seq.id], item.seq.prompt_ids
        end = min(item.start + item.n, len(prompt) - 1)      # positions start .. end - 1
        if end <= item.start:
            return
        targets = prompt[item.start + 1:end + 1]
        entries = logprob_entries(rows[:end - item.start], targets, active.prompt_logprobs)
        for offset, entry in enumerate(entries):
            active.prompt_entries.setdefault(item.start + 1 + offset, entry)

    def prompt_logprobs(self, request_id: Hashable) -> list | None:
        """A request's prompt log-probabilities once its prompt is computed: [None, then
        (log-probability, top) per prompt token after the first]; None if not asked for."""
        active = self._active.get(request_id) or self._results.get(request_id)
        if active is None or active.prompt_logprobs is None:
            return None
        prompt = active.seq.prompt_ids
        return [None] + [active.prompt_entries.get(p) for p in range(1, len(prompt))]

    def token_logprobs(self, request_id: Hashable) -> list:
        """(log-probability, top) per generated token so far (empty if not asked for)."""
        active = self._active.get(request_id) or self._results.get(request_id)
        return [] if active is None else active.token_logprobs

    def result(self, request_id: Hashable) -> GenerationResult:
        """A finished request's GenerationResult (as tinygpt.generate.generate returns it)."""
        active = self._results[request_id]
        text = None
        if self.tokenizer is not None:
            text = "".join(e.text or "" for e in active.events)
        return GenerationResult(active.seq.prompt_ids, list(active.seq.output_ids),
                                active.events[-1].finish_reason, text)

    def trace(self, request_id: Hashable) -> RequestTrace | None:
        """The request's timestamps as tinygpt.bench's RequestTrace (None before a token)."""
        active = self._results.get(request_id) or self._active.get(request_id)
        if active is None or not active.token_times:
            return None
        return RequestTrace(active.submitted_at, tuple(active.token_times),
                            len(active.seq.prompt_ids))

    def started_at(self, request_id: Hashable) -> float | None:
        """When the request was first admitted (perf_counter seconds; None while queued)."""
        active = self._active.get(request_id) or self._results.get(request_id)
        return None if active is None else active.started_at

    def failures(self) -> dict[Hashable, str]:
        """The requests whose own token loop raised (a constraint's grammar past its limits,
        say) since the last call, each with its error: they left the engine in that step, and
        every other request went on. Clears the list."""
        failed, self._failed = self._failed, {}
        return failed

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request's result (a server does, once it has streamed it)."""
        self._results.pop(request_id, None)

    def run(self) -> None:
        """Step until every queued request has finished."""
        while self.has_work:
            self.step()

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams],
                 *, eos_ids: Sequence[int] = ()) -> list[GenerationResult]:
        """Every prompt through the engine at once; results in the prompts' order. Every
        request is checked before any is queued (a bad one queues none), and the results are
        released once read (requests queued earlier with add_request run too, and keep
        theirs)."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token-id lists, got "
                             f"{prompts!r}")
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt: "
                             f"{len(params)} for {len(prompts)} prompts")
        for p, sp in zip(prompts, params, strict=True):
            self.check_request(p, sp, eos_ids)
        ids = [self.add_request(p, sp, eos_ids=eos_ids) for p, sp in zip(prompts, params,
                                                                          strict=True)]
        self.run()
        results = [self.result(i) for i in ids]
        for i in ids:
            self.release(i)
        return results


class _Frontend:
    """What both asynchronous engines share: a bounded queue's admission (EngineFull,
    EngineClosed), the counts, and how a request ends. Subclasses start a worker thread."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_waiting: int, on_finish) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            # (0 would refuse every request, an idle engine's too: each waits a moment)
            raise ValueError(f"max_waiting must be an int >= 1, got {max_waiting!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_waiting, self.on_finish = max_waiting, on_finish
        self._lock = threading.Condition()
        self._closed = False
        self._ids = itertools.count(1)
        self._counts = dict(submitted=0, finished=0, cancelled=0, rejected=0, tokens=0)

    def _enqueue(self, prompt: list[int], params: SamplingParams, eos_ids: Sequence[int],
                 queue: deque, waiting, **options) -> Request:
        """A new Request appended to `queue`, unless shutting down or `waiting()` requests
        already wait (called on the event loop)."""
        request = Request(next(self._ids), prompt, params, tuple(eos_ids),
                          asyncio.get_running_loop(), **options)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            if not self._thread.is_alive():
                raise EngineClosed("the engine's worker thread has stopped; restart the server")
            if waiting() >= self.max_waiting:
                self._counts["rejected"] += 1
                raise EngineFull(f"{waiting()} requests are waiting (the limit is "
                                 f"{self.max_waiting}); try again later")
            queue.append(request)
            self._counts["submitted"] += 1
            self._lock.notify()
        return request

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (False after shutdown, or if it ever died)."""
        return self._thread.is_alive()

    def _forget(self, request: Request) -> None:
        """Drop the worker's reference to a request that ended (under the lock)."""

    def _held(self) -> list[Request]:
        """Every request submitted and not yet ended (under the lock)."""
        raise NotImplementedError

    def _work(self) -> None:
        """The worker thread: serve until shutdown. Should the loop itself ever fail (a bug,
        not a request's error, which ends that request alone), every request it holds ends
        with the error and the engine refuses new ones, so no client waits forever."""
        try:
            self._serve()
        except BaseException as err:
            log.exception("the engine's worker thread stopped")
            with self._lock:
                self._closed = True
                held = self._held()
            for request in held:
                self._finish(request, Event(None, "", "error", f"the engine stopped: "
                                                               f"{type(err).__name__}: {err}"))

    def _finish(self, request: Request, event: Event) -> None:
        request.finish_reason = event.finish_reason
        with self._lock:
            self._forget(request)
            self._counts["cancelled" if event.finish_reason == "cancelled" else "finished"] += 1
        request._put(event)
        if self.on_finish is not None:
            try:
                self.on_finish(request)
            except Exception:      # noqa: BLE001 - a callback's bug must not stop the worker
                log.exception("on_finish failed for request %s", request.id)


class AsyncEngine(_Frontend):
    """Engine behind the server's interface (see the module docstring): a worker thread steps
    the engine; submit() queues, at most max_waiting requests wait (EngineFull beyond).

    model, tokenizer: as for Engine. on_finish: called on the worker thread with each finished
    Request (metrics). engine_options: Engine's keyword arguments (block_size, num_blocks,
    max_running, token_budget, order, record, prefix_caching, batched, fast_forward).
    """

    engine_class = Engine      # tinygpt.parallel's leader engine mirrors each step to its ranks

    def __init__(self, model: TinyGPT, tokenizer, *, max_waiting: int = 64, on_finish=None,
                 **engine_options) -> None:
        super().__init__(model, tokenizer, max_waiting, on_finish)
        self.engine = self.engine_class(model, tokenizer, **engine_options)
        self._inbox: deque[Request] = deque()
        self._live: dict[int, Request] = {}          # in the engine (waiting or running)
        self._thread = threading.Thread(target=self._work, name="tinygpt-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
                     eos_ids: Sequence[int] = (), *, logprobs: int | None = None,
                     prompt_logprobs: int | None = None, constraint=None,
                     scoring: bool = False) -> Request:
        """Queue a request; EngineFull when max_waiting already wait, EngineClosed after
        shutdown() began, ValueError / TypeError for arguments the engine cannot take.
        logprobs, prompt_logprobs, constraint: as Engine.add_request's. scoring: the request
        generates only to score its prompt (kept on the Request for on_finish's metrics)."""
        prompt = self.engine.check_request(prompt_ids, params, eos_ids, logprobs=logprobs,
                                           prompt_logprobs=prompt_logprobs,
                                           constraint=constraint)
        request = self._enqueue(prompt, params, eos_ids, self._inbox,
                                lambda: len(self._inbox) + len(self.engine.scheduler.waiting),
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                constraint=constraint, scoring=bool(scoring))
        return request

    def stats(self) -> EngineStats:
        with self._lock:
            c, scheduler, cache = self._counts, self.engine.scheduler, self.engine.cache
            return EngineStats(running=len(scheduler.running),
                               waiting=len(scheduler.waiting) + len(self._inbox),
                               submitted=c["submitted"], finished=c["finished"],
                               cancelled=c["cancelled"], rejected=c["rejected"],
                               tokens_generated=self.engine.tokens_generated,
                               max_waiting=self.max_waiting,
                               kv_blocks_used=cache.used_blocks,
                               kv_blocks_total=cache.allocator.num_blocks,
                               preemptions=scheduler.num_preemptions,
                               prefix_cached_blocks=cache.cached_blocks,
                               prefix_query_tokens=scheduler.prefix_query_tokens,
                               prefix_hit_tokens=scheduler.prefix_hit_tokens)

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Take no new requests and cancel the waiting ones; the running ones get `grace_s`
        seconds to finish, then are cancelled; returns when the worker has stopped."""
        with self._lock:
            self._closed = True            # the worker cancels every waiting request
            self._lock.notify_all()
        deadline = time.monotonic() + grace_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            for request in self._live.values():
                request.cancel()
            self._lock.notify_all()
        await asyncio.to_thread(self._thread.join, 10.0)

    # -- the worker (the only thread that touches the engine) ----------------------------------

    def _held(self) -> list[Request]:
        return [*self._live.values(), *self._inbox]

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not self._inbox and not engine.has_work and not self._closed:
                    self._lock.wait()
                if self._closed and not self._inbox and not engine.has_work:
                    return
                # drained in place: submit() chose this deque before taking the lock, so a new
                # one put here would lose a request appended to the old one meanwhile
                arrivals = list(self._inbox)
                self._inbox.clear()
                for request in arrivals:
                    self._live[request.id] = request
                    try:
                        engine.add_request(request.prompt_ids, request.params,
                                           eos_ids=request.eos_ids, request_id=request.id,
                                           logprobs=request.logprobs,
                                           prompt_logprobs=request.prompt_logprobs,
                                           constraint=request.constraint)
                    except Exception as err:  # noqa: BLE001 (checked in submit; never fatal)
                        request.cancel()
                        request._error = f"{type(err).__name__}: {err}"
                if self._closed:               # shutting down: nobody new starts (a preempted
                    for seq in engine.scheduler.waiting:    # one waits again: it has its grace)
                        if seq.preemptions == 0:
                            self._live[seq.id].cancel()
            for request in [r for r in self._live.values() if r.cancelled]:
                engine.abort(request.id)
                self._finish(request, Event(None, "", "cancelled") if request._error is None
                             else Event(None, "", "error", request._error))
            if not engine.has_work:
                continue
            try:
                events = engine.step()
            except Exception as err:  # noqa: BLE001 (fail the batch, keep the server up)
                batch = [seq.id for seq in engine.scheduler.running] or list(self._live)
                for request in [self._live[i] for i in batch if i in self._live]:
                    engine.abort(request.id)
                    self._finish(request, Event(None, "", "error",
                                                f"{type(err).__name__}: {err}"))
                continue
            for request_id, token_event in events:
                request = self._live[request_id]
                if request.started_at is None:
                    request.started_at = engine.started_at(request_id)
                request.token_times.append(time.perf_counter())
                out = to_event(token_event)
                if request.prompt_logprobs is not None and request.prompt_logprob_list is None:
                    request.prompt_logprob_list = engine.prompt_logprobs(request_id)
                if request.logprobs is not None:
                    value, top = engine.token_logprobs(request_id)[-1]
                    out = dataclasses.replace(out, logprob=value, top_logprobs=top)
                if out.finish_reason is None:
                    request._put(out)
                else:
                    engine.release(request_id)
                    self._finish(request, out)
            for request_id, error in engine.failures().items():
                self._finish(self._live[request_id], Event(None, "", "error", error))

    def _forget(self, request: Request) -> None:
        self._live.pop(request.id, None)


class SerialEngine(_Frontend):
    """One request at a time on a worker thread; a bounded FIFO queue for the rest.

    model, tokenizer: a TinyGPT in eval mode and its tokenizer (decode for text and stop
    strings). max_waiting: requests that may wait (>= 1); one more is refused with EngineFull.
    on_finish: called with each finished Request (metrics): on the worker thread, except for
    the requests still waiting when shutdown() begins, which it ends on the event loop.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, max_waiting: int = 64,
                 on_finish=None) -> None:
        super().__init__(model, tokenizer, max_waiting, on_finish)
        self._waiting: deque[Request] = deque()
        self._running: Request | None = None
        self._thread = threading.Thread(target=self._work, name="tinygpt-engine", daemon=True)
        self._thread.start()

    # -- the interface -------------------------------------------------------------------------

    async def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
                     eos_ids: Sequence[int] = (), *, logprobs: int | None = None,
                     prompt_logprobs: int | None = None, constraint=None,
                     scoring: bool = False) -> Request:
        """Queue a request; raises EngineFull when max_waiting requests already wait,
        EngineClosed after shutdown() began, and ValueError / TypeError for arguments that
        tinygpt.generate.stream cannot take (checked here as stream checks them; the prompt
        as AsyncEngine takes it: a list of ids or a (T,) / (1, T) tensor). Log-probabilities
        are the batching engine's (ValueError here)."""
        if logprobs is not None or prompt_logprobs is not None:
            raise ValueError("logprobs and echo need the batching engine (serve with "
                             "--engine batch)")
        vocab_size, max_seq_len = model_limits(self.model)
        eos_ids = check_eos_ids(eos_ids, vocab_size)
        _check_args(self.model, params, eos_ids, self.tokenizer, None,
                    DEFAULT_ORDER, constraint)
        prompt = prepare_prompt(prompt_ids, vocab_size, max_seq_len)[0].tolist()
        return self._enqueue(prompt, params, eos_ids, self._waiting,
                             lambda: len(self._waiting), constraint=constraint,
                             scoring=bool(scoring))

    def stats(self) -> EngineStats:
        with self._lock:
            c = self._counts
            return EngineStats(running=int(self._running is not None),
                               waiting=len(self._waiting), submitted=c["submitted"],
                               finished=c["finished"], cancelled=c["cancelled"],
                               rejected=c["rejected"], tokens_generated=c["tokens"],
                               max_waiting=self.max_waiting)

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Take no new requests, cancel the waiting ones, give the running one `grace_s`
        seconds to finish, then cancel it; returns when the worker has stopped. Calling it
        again (the server does, once on the signal and once on exit) waits for the same end."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting)       # drained in place, as AsyncEngine's inbox
            self._waiting.clear()
            self._lock.notify_all()
        for request in waiting:
            request.cancel()
            self._finish(request, Event(None, "", "cancelled"))
        deadline = time.monotonic() + grace_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            if self._running is not None:
                self._running.cancel()
        await asyncio.to_thread(self._thread.join, 10.0)

    # -- the worker ----------------------------------------------------------------------------

    def _held(self) -> list[Request]:
        return [r for r in (self._running, *self._waiting) if r is not None]

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._lock.wait()
                if not self._waiting:          # closed and drained
                    return
                request = self._running = self._waiting.popleft()
            try:
                self._run(request)
            finally:
                with self._lock:
                    self._running = None

    def _run(self, request: Request) -> None:
        if request.cancelled:
            self._finish(request, Event(None, "", "cancelled"))
            return
        request.started_at = time.perf_counter()
        try:
            for event in stream(self.model, request.prompt_ids, request.params,
                                eos_id=request.eos_ids, tokenizer=self.tokenizer,
                                constraint=request.constraint):
                if request.cancelled:
                    self._finish(request, Event(None, "", "cancelled"))
                    return
                request.token_times.append(time.perf_counter())
                with self._lock:
                    self._counts["tokens"] += 1
                out = to_event(event)
                if out.finish_reason is not None:
                    self._finish(request, out)
                    return
                request._put(out)
        except Exception as err:  # noqa: BLE001 (one request's failure must not stop the engine)
            self._finish(request, Event(None, "", "error", f"{type(err).__name__}: {err}"))


def latency_samples(request: Request) -> tuple[float | None, list[float]]:
    """(TTFT, inter-token latencies) of a finished request, by tinygpt.bench's definitions."""
    trace = request.trace()
    if trace is None:
        return None, []
    return ttft(trace), inter_token_latencies(trace)
