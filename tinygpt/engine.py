"""Day 17: a serving engine. What an HTTP server talks to, and the plain engine behind it.

A serving engine takes requests as they arrive and streams each one's tokens back while other
requests come and go. The server (tinygpt/server.py) needs only this:

    request = await engine.submit(prompt_ids, params, eos_ids)   # EngineFull: queue is full
    async for event in request: ...                               # Event per new token
    request.cancel()                                              # frees its place at once
    engine.stats()                                                # EngineStats

SerialEngine is that interface over the plain loop: one worker thread runs one request at a
time with tinygpt.generate.stream (the KV-cached batch-1 loop), the others wait in a bounded
queue. It is the reference a batching engine must match token for token at temperature 0,
and the baseline it must beat.

Threads: the model runs on the worker thread; events reach the request's asyncio queue through
the event loop's call_soon_threadsafe, so `async for` never blocks the server.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from tinygpt.bench.metrics import RequestTrace, inter_token_latencies, ttft
from tinygpt.generate import stream
from tinygpt.sampling import SamplingParams

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


@dataclass(eq=False)
class Request:
    """A submitted request: an async iterator of Events; cancel() to stop it."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...]
    loop: asyncio.AbstractEventLoop
    submitted_at: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def cancel(self) -> None:
        """Stop generating (a waiting request never starts); safe from any thread, twice."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def trace(self) -> RequestTrace | None:
        """The request's timestamps as tinygpt.bench's RequestTrace (None before a token)."""
        if not self.token_times:
            return None
        return RequestTrace(self.submitted_at, tuple(self.token_times), len(self.prompt_ids))

    def _put(self, event: Event) -> None:      # called on the worker thread
        self.loop.call_soon_threadsafe(self._events.put_nowait, event)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if event.finish_reason is not None:
                return


class SerialEngine:
    """One request at a time on a worker thread; a bounded FIFO queue for the rest.

    model, tokenizer: a TinyGPT in eval mode and its tokenizer (decode for text and stop
    strings). max_waiting: requests that may wait (>= 0); one more is refused with EngineFull.
    on_finish: called on the worker thread with each finished Request (metrics).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, max_waiting: int = 64,
                 on_finish=None) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_waiting, self.on_finish = max_waiting, on_finish
        self._waiting: deque[Request] = deque()
        self._running: Request | None = None
        self._lock = threading.Condition()
        self._closed = False
        self._ids = itertools.count(1)
        self._counts = dict(submitted=0, finished=0, cancelled=0, rejected=0, tokens=0)
        self._thread = threading.Thread(target=self._work, name="tinygpt-engine", daemon=True)
        self._thread.start()

    # -- the interface -------------------------------------------------------------------------

    async def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
                     eos_ids: Sequence[int] = ()) -> Request:
        """Queue a request; raises EngineFull when max_waiting requests already wait, and
        EngineClosed after shutdown() began. Arguments are checked by the caller (the server)
        and again by tinygpt.generate.stream on the worker."""
        request = Request(next(self._ids), list(prompt_ids), params, tuple(eos_ids),
                          asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                self._counts["rejected"] += 1
                raise EngineFull(f"{len(self._waiting)} requests are waiting (the limit is "
                                 f"{self.max_waiting}); try again later")
            self._waiting.append(request)
            self._counts["submitted"] += 1
            self._lock.notify()
        return request

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
            waiting, self._waiting = list(self._waiting), deque()
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

    def _work(self) -> None:
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
        eos = request.eos_ids[0] if request.eos_ids else None
        try:
            for event in stream(self.model, request.prompt_ids, request.params, eos_id=eos,
                                tokenizer=self.tokenizer):
                if request.cancelled:
                    self._finish(request, Event(None, "", "cancelled"))
                    return
                request.token_times.append(time.perf_counter())
                with self._lock:
                    self._counts["tokens"] += 1
                finish = event.finish_reason
                reason = None if finish is None else ("length" if finish == "length" else "stop")
                if reason is None and event.token_id in request.eos_ids:
                    reason = "stop"
                if reason is not None:
                    text = "" if event.token_id in request.eos_ids else event.text or ""
                    self._finish(request, Event(event.token_id, text, reason))
                    return
                request._put(Event(event.token_id, event.text or ""))
        except Exception as err:  # noqa: BLE001 (one request's failure must not stop the engine)
            self._finish(request, Event(None, "", "error", f"{type(err).__name__}: {err}"))

    def _finish(self, request: Request, event: Event) -> None:
        request.finish_reason = event.finish_reason
        with self._lock:
            self._counts["cancelled" if event.finish_reason == "cancelled" else "finished"] += 1
        request._put(event)
        if self.on_finish is not None:
            self.on_finish(request)


def latency_samples(request: Request) -> tuple[float | None, list[float]]:
    """(TTFT, inter-token latencies) of a finished request, by tinygpt.bench's definitions."""
    trace = request.trace()
    if trace is None:
        return None, []
    return ttft(trace), inter_token_latencies(trace)
