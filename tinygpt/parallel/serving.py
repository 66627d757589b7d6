"""Serving: rank 0 runs the HTTP server and the engine; every other rank mirrors each step.

    start_tensor_parallel   `serve --tensor-parallel-size N`: starts ranks 1 .. N-1 as local
                            processes and returns rank 0's AsyncEngine, whose leader engine
                            broadcasts every step's arrivals, aborts and seeds
    follow_leader           the loop of rank r > 0: apply rank 0's step message, step the
                            engine, check the tokens against rank 0's

Watchdogs keep the processes together: a worker whose server is gone exits, and the server
stops with a message when a worker dies or when a step has not finished after STEP_TIMEOUT_S
(a rank stopped or starved: every rank waits in the step's collectives for it). The rendezvous
is retried on a fresh port when the one chosen was taken meanwhile. _mirror_rank runs the same
protocol without HTTP (tests).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from tinygpt.model import TinyGPT
from tinygpt.parallel.model import check_tensor_parallel, shard_model
from tinygpt.parallel.ranks import RENDEZVOUS_ATTEMPTS, _context, free_port, init_rank
from tinygpt.parallel.sharding import plan_heads
from tinygpt.parallel.source import load_source

SERVE_TIMEOUT_S = 7 * 24 * 3600.0   # an idle server's workers wait in a collective; a rank
                                    # that dies or stalls is caught by rank 0's watchdog, not
                                    # by this timeout
STEP_TIMEOUT_S = 120.0              # a mirrored step (broadcast, forward, collectives) longer
                                    # than this means a rank is stopped or starved: the
                                    # server stops (an engine step takes milliseconds to
                                    # seconds; the workers load their model before serving)


class _StepClock:
    """When rank 0's current step started (time.monotonic(), None between steps), and the
    worker processes: what rank 0's watchdog reads (procs under `lock`, which the launcher
    holds while it replaces them)."""

    def __init__(self, procs: list | None = None) -> None:
        import threading

        self.started: float | None = None
        self.procs: list = [] if procs is None else procs
        self.lock = threading.Lock()


def _rank_problem(procs: list, clock: _StepClock | None, step_timeout_s: float,
                  now: float) -> str | None:
    """Why the tensor-parallel server cannot go on, or None: a worker rank that exited (rank
    r is procs[r - 1]), or a step running for more than step_timeout_s seconds."""
    for rank, proc in enumerate(procs, start=1):
        if proc.exitcode is not None:
            return (f"tensor-parallel rank {rank} exited with code {proc.exitcode}; the "
                    f"server cannot run without it and stops now")
    started = None if clock is None else clock.started
    if started is not None and now - started > step_timeout_s:
        return (f"a tensor-parallel step has not finished after {now - started:.0f} s "
                f"(the bound is {step_timeout_s:.0f} s): a rank is stopped or starved of CPU, "
                f"and every rank waits for it; the server stops now")
    return None


def _leader_engine_class(clock: _StepClock | None = None):
    """The LeaderEngine class; `clock` (the server's) records when each step starts."""
    from tinygpt.engine import Engine

    class LeaderEngine(Engine):
        """Rank 0's engine: before each step it broadcasts the requests added and aborted
        since the last one (and the tokens that step produced, which every rank checks
        against its own), so every rank's engine schedules the same batch and calls the same
        collectives. Requests without a seed get one drawn here: ranks sampling from
        generators of their own would pick different tokens from identical logits."""

        def __init__(self, model, tokenizer=None, **options) -> None:
            super().__init__(model, tokenizer, **options)
            self._pending: list[tuple] = []
            self._last: list[tuple] | None = None

        takes_constraints = False         # (the server offers no structured outputs then)

        def add_request(self, prompt_ids, params, *, eos_ids=(), request_id=None,
                        logprobs=None, prompt_logprobs=None, constraint=None):
            if constraint is not None:    # each rank would need its own copy of the matcher
                raise ValueError("constraint: structured outputs are not implemented over "
                                 "tensor-parallel ranks")
            if params.seed is None:
                params = dataclasses.replace(params, seed=int(torch.randint(2**62, ())))
            request_id = super().add_request(prompt_ids, params, eos_ids=eos_ids,
                                             request_id=request_id, logprobs=logprobs,
                                             prompt_logprobs=prompt_logprobs)
            self._pending.append(("add", list(prompt_ids), params, tuple(eos_ids), request_id,
                                  logprobs, prompt_logprobs))
            return request_id

        def abort(self, request_id) -> None:
            super().abort(request_id)
            self._pending.append(("abort", request_id))

        def step(self):
            message = [("step", self._pending, self._last)]
            self._pending = []
            if clock is not None:
                clock.started = time.monotonic()
            try:
                dist.broadcast_object_list(message, src=0)
                out = super().step()
            except RuntimeError as err:      # gloo's own words name no rank: say which died
                dead = _dead_ranks(clock)
                if not dead:
                    raise
                raise RuntimeError(f"tensor-parallel {dead} died during the step; the server "
                                   f"stops") from err
            finally:
                if clock is not None:
                    clock.started = None
            self._last = [(request_id, event.token_id) for request_id, event in out]
            return out

        def close(self) -> None:
            """Tell the other ranks to exit (after checking the last step's tokens)."""
            dist.broadcast_object_list([("stop", [], self._last)], src=0)

    return LeaderEngine


def _dead_ranks(clock: _StepClock | None) -> str:
    """'rank 1, rank 3' for the worker ranks that have exited (after a moment for the
    operating system to report them), or ''."""
    if clock is None:
        return ""
    time.sleep(0.2)
    return ", ".join(f"rank {rank}" for rank, proc in enumerate(clock.procs, start=1)
                     if proc.exitcode is not None)


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when the process that started it is gone (never linger)."""
    import threading

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)                  # signal 0: only asks "alive?"
            except ProcessLookupError:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="tinygpt-parent-watch").start()


def _serve_worker(rank: int, world_size: int, port: int, source, engine_options: dict,
                  parent_pid: int, threads: int) -> None:
    """Rank r > 0 of a served model: its shard and its engine, stepping when rank 0 says."""
    from tinygpt.engine import Engine

    _watch_parent(parent_pid)
    try:                                        # `ps` and /proc show which process is a rank
        with open("/proc/self/comm", "w") as comm:
            comm.write(f"tinygpt-rank-{rank}")
    except OSError:
        pass
    init_rank(rank, world_size, port, timeout_s=SERVE_TIMEOUT_S, threads=threads)
    loaded = source()
    model, tokenizer = (loaded[0], loaded[1]) if isinstance(loaded, tuple) else (loaded, None)
    engine = Engine(shard_model(model, rank, world_size), tokenizer, **engine_options)
    del model, loaded
    print(f"tensor-parallel rank {rank} of {world_size} ready ({torch.get_num_threads()} torch "
          f"threads)", file=sys.stderr, flush=True)
    dist.barrier()                              # every rank loaded: rank 0 starts serving
    follow_leader(engine, rank)
    dist.destroy_process_group()


def follow_leader(engine, rank: int, keep_results: bool = False) -> dict:
    """The loop of rank r > 0: receive rank 0's step message (arrivals, aborts, the tokens
    rank 0 produced in the previous step), check the previous step's tokens against this
    rank's, apply the arrivals and aborts, step the engine; until rank 0 says stop.

    keep_results: return {request_id: token ids} of the finished requests (tests); otherwise
    finished results are released as rank 0's server releases them. RuntimeError when the
    ranks disagree on a token.
    """
    last, results = None, {}
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            command, pending, leader_last = message[0]
            if leader_last is not None and leader_last != last:
                raise RuntimeError(f"rank {rank} produced tokens {last} in the last step, rank "
                                   f"0 {leader_last}: the ranks disagree")
            if command == "stop":
                return results
            for op in pending:
                if op[0] == "add":
                    _, prompt, params, eos_ids, request_id, logprobs, prompt_logprobs = op
                    engine.add_request(prompt, params, eos_ids=eos_ids, request_id=request_id,
                                       logprobs=logprobs, prompt_logprobs=prompt_logprobs)
                else:
                    engine.abort(op[1])
            events = engine.step()
            last = [(request_id, event.token_id) for request_id, event in events]
            for request_id, event in events:
                if event.finish_reason is not None:
                    if keep_results:
                        results[request_id] = engine.result(request_id).token_ids
                    engine.release(request_id)          # as rank 0's server does


def _mirror_rank(rank: int, world_size: int, source, prompts: list[list[int]],
                 params: list) -> dict:
    """A served model's protocol without HTTP: rank 0's leader engine takes the requests, the
    others follow it. Returns {request_id: token ids} on every rank."""
    shard = shard_model(load_source(source), rank, world_size)
    torch.manual_seed(1000 + rank)   # as in a server: nothing keeps the ranks' global RNGs equal
    if rank > 0:
        from tinygpt.engine import Engine

        return follow_leader(Engine(shard, max_running=len(prompts)), rank, keep_results=True)
    engine = _leader_engine_class()(shard, max_running=len(prompts))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    with torch.inference_mode():
        engine.run()
    engine.close()
    return {i: engine.result(i).token_ids for i in ids}


def _watch_workers(clock: _StepClock) -> None:
    """Rank 0's watchdog: when a worker rank dies, or a step runs past STEP_TIMEOUT_S, say
    why and take the server down now (its collectives would otherwise fail every request, or
    wait for ever). It watches clock.procs, whatever list that holds at the time."""
    import threading

    def watch() -> None:
        while True:
            with clock.lock:
                procs = list(clock.procs)
                problem = _rank_problem(procs, clock, STEP_TIMEOUT_S, time.monotonic())
            if problem is not None:
                print(f"error: {problem}", file=sys.stderr, flush=True)
                for other in procs:
                    if other.is_alive():
                        other.kill()
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="tinygpt-rank-watch").start()


def start_tensor_parallel(model: TinyGPT, tokenizer, source, world_size: int, *,
                          max_waiting: int = 64, threads: int | None = None,
                          **engine_options):
    """The server's engine for `serve --tensor-parallel-size N`: an AsyncEngine on rank 0.

    model, tokenizer: rank 0's loaded model (it is sharded here); source: a picklable
    zero-argument callable returning (model, tokenizer), which each other rank calls to load
    its copy (the server passes functools.partial(load_model, path); any loader, the GGUF
    one included, fits). Ranks 1 .. N-1 start as local processes; a watchdog takes the
    server down with a message when one dies or a step outlasts STEP_TIMEOUT_S. threads:
    torch threads of every rank (default: tinygpt.usable_cores() // N, at least 1).
    engine_options: Engine's keyword arguments. RuntimeError when the ranks cannot form their
    group (after RENDEZVOUS_ATTEMPTS ports, each taken by another process meanwhile).
    """
    from tinygpt import thread_count, usable_cores
    from tinygpt.engine import AsyncEngine

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    check_tensor_parallel(model.cfg)                         # a MoE model, before any rank
    plan_heads(model.cfg, 0, world_size)                     # refuse a bad degree up front
    if model.cfg.d_ff % world_size:
        raise ValueError(f"the tensor-parallel degree ({world_size}) must divide d_ff "
                         f"({model.cfg.d_ff})")
    threads = max(1, usable_cores() // world_size) if threads is None \
        else thread_count(threads, "threads")
    ctx = _context()
    clock = _StepClock()
    _watch_workers(clock)
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        port = free_port()
        procs = [ctx.Process(target=_serve_worker, args=(rank, world_size, port, source,
                                                         engine_options, os.getpid(), threads),
                             daemon=True, name=f"tinygpt-rank-{rank}")
                 for rank in range(1, world_size)]
        for proc in procs:
            proc.start()
        clock.procs = procs
        try:
            init_rank(0, world_size, port, timeout_s=SERVE_TIMEOUT_S, threads=threads)
            break
        except RuntimeError as err:     # DistNetworkError: the port was taken meanwhile
            with clock.lock:            # not the watchdog's to report: they are stopped here
                clock.procs = []
            for proc in procs:
                proc.kill()
                proc.join(timeout=2.0)
            if attempt == RENDEZVOUS_ATTEMPTS:
                reason = str(err).strip().splitlines()[-1] if str(err).strip() \
                    else type(err).__name__
                raise RuntimeError(f"the {world_size} tensor-parallel ranks could not form "
                                   f"their process group on 127.0.0.1 ({attempt} ports "
                                   f"tried): {reason}") from None
    shard = shard_model(model, 0, world_size)
    dist.barrier()                      # the workers have loaded their shards
    print(f"tensor-parallel rank 0 of {world_size} ready ({torch.get_num_threads()} torch "
          f"threads)", file=sys.stderr, flush=True)

    class ParallelAsyncEngine(AsyncEngine):
        engine_class = _leader_engine_class(clock)

    return ParallelAsyncEngine(shard, tokenizer, max_waiting=max_waiting, **engine_options)
