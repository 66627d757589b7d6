"""Launching ranks: local processes joined by one torch.distributed process group.

    run_ranks         fn(rank, world_size, *args) in `world_size` local processes; their
                      return values in rank order. A failing or dead rank raises RuntimeError
                      with its traceback, a rank that is not done raises TimeoutError: never a
                      hang, and every rank is stopped first
    init_rank         join the group (gloo, or NCCL with one CUDA device per rank); every
                      collective bounded by a timeout
    default_backend   'nccl' when there is one CUDA device per rank, else 'gloo'
    free_port         a free TCP port on 127.0.0.1 for the rendezvous

The processes come from a 'forkserver' context (_context) that preloads torch and this package
once, so a launch costs a fork, not a fresh interpreter. A function run on ranks must be
importable by its module and name (defined in a module, not a notebook cell); its arguments and
return value must be picklable.
"""

from __future__ import annotations

import datetime
import functools
import math
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinygpt import thread_count, usable_cores


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend(world_size: int = 1) -> str:
    """'nccl' when NCCL is available and there is one CUDA device per rank, else 'gloo'."""
    if dist.is_nccl_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def init_rank(rank: int, world_size: int, port: int, backend: str = "gloo",
              timeout_s: float = 60.0, threads: int | None = None) -> None:
    """Join the process group of `world_size` local ranks rendezvousing on 127.0.0.1:port.

    timeout_s bounds every collective: a rank whose peer died raises instead of waiting
    forever. threads: torch threads for this rank (default: the cores this process may run
    on, tinygpt.usable_cores(), shared out evenly, at least 1).
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout_s)
    if threads is None:
        threads = max(1, usable_cores() // world_size)
    torch.set_num_threads(thread_count(threads, "threads"))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, backend: str,
               timeout_s: float, args: tuple, results) -> None:
    """Body of one launched rank: join the group, run fn, report its value or its traceback."""
    try:
        try:
            init_rank(rank, world_size, port, backend, timeout_s)
        except BaseException:  # noqa: BLE001 - the launcher may start the group again
            results.put((rank, "init-error", traceback.format_exc()))
            return
        value = fn(rank, world_size, *args)
        # by value (plain pickle), not as shared memory that dies with this process
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher as text
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT = None             # the one forkserver context of this process (see _context)


def _context():
    """A 'forkserver' multiprocessing context with torch preloaded: the first launch starts a
    server process that imports torch once; each rank after that is a fork of it (a fraction
    of a second), never of a parent whose OpenMP threads may be mid-flight. Preloading the
    package tinygpt.parallel imports every room of it (its __init__ re-exports them), so every
    function a rank runs (in ranks, model, pipeline, cost, disaggregation, serving) is already
    imported in the fork."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "tinygpt.parallel",
                                     "tinygpt.engine", "tinygpt.train"])
    return _CONTEXT


RENDEZVOUS_ATTEMPTS = 3     # launches of a group whose ranks could not connect (see run_ranks)


class _RendezvousFailed(RuntimeError):
    """A rank could not join the process group (before any of fn ran)."""


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 60.0,
              backend: str | None = None) -> list:
    """Run fn(rank, world_size, *args) in `world_size` local processes; return the values.

    fn must be importable (defined in a module, not in a notebook cell) and its arguments and
    return value picklable. The ranks share one process group (backend default:
    default_backend()). Returns the ranks' return values in rank order. Raises RuntimeError
    with the rank's traceback when a rank fails or dies, and TimeoutError when the ranks are
    not done after timeout_s seconds; either way every rank is stopped first. A group whose
    ranks cannot connect (gloo's mesh broken by a port another process took between our
    choosing it and the ranks binding it: on a busy machine it happens) is launched again on a
    new port, up to RENDEZVOUS_ATTEMPTS times; fn has not run in any rank then.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    _check_importable(fn)
    _check_timeout(timeout_s)
    backend = default_backend(world_size) if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _launch(fn, world_size, args, timeout_s, backend)
        except _RendezvousFailed as err:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise RuntimeError(f"{err} (after {attempt} launches)") from None
    raise AssertionError("unreachable")


def _launch(fn: Callable, world_size: int, args: tuple, timeout_s: float,
            backend: str) -> list:
    """One launch of run_ranks' group on a fresh port."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, backend,
                                                  timeout_s, args, results), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, status, value = results.get(timeout=0.1)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None
                        and r not in values]
                if dead and results.empty():
                    time.sleep(0.2)                        # a last report may be in flight
                    if results.empty():
                        raise RuntimeError(f"rank {dead[0]} died with exit code "
                                           f"{procs[dead[0]].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size} ranks were not done after "
                                       f"{timeout_s} s (ranks done: {sorted(values)})") from None
                continue
            if status == "init-error":
                raise _RendezvousFailed(f"rank {rank} of {world_size} could not join the "
                                        f"process group:\n{value}")
            if status == "error":            # a dead peer is the cause worth naming first
                time.sleep(0.2)
                dead = [f"rank {r} died with exit code {p.exitcode} before reporting; "
                        for r, p in enumerate(procs) if r != rank and p.exitcode not in (None, 0)]
                raise RuntimeError(f"{''.join(dead)}rank {rank} of {world_size} failed:\n"
                                   f"{value}")
            values[rank] = pickle.loads(value)      # our own rank's bytes
    finally:
        for proc in procs:
            proc.join(timeout=2.0 if len(values) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        results.close()
    return [values[rank] for rank in range(world_size)]


def _check_rank(rank: int, world_size: int) -> None:
    """ValueError unless world_size is a positive int and rank an int in [0, world_size)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def _group_rank(rank, world_size, group=None) -> tuple[int, int]:
    """rank and world_size for a shard, defaulting to the process group's. Inside a process
    group a given one must be the group's (a shard built for another rank or degree would
    compute wrong values, or wait in a collective that never completes): ValueError naming
    the argument otherwise. Outside one both must be given."""
    if dist.is_initialized():
        actual = {"rank": dist.get_rank(group), "world_size": dist.get_world_size(group)}
        for name, given in (("rank", rank), ("world_size", world_size)):
            if given is not None and (isinstance(given, bool) or given != actual[name]):
                raise ValueError(f"{name}={given!r} contradicts the process group, whose "
                                 f"{name} is {actual[name]}: pass {actual[name]} or None")
        rank, world_size = actual["rank"], actual["world_size"]
    elif rank is None or world_size is None:
        raise ValueError("pass rank and world_size, or call this inside a process group "
                         "(run_ranks / init_rank)")
    _check_rank(rank, world_size)
    return rank, world_size


def _check_timeout(timeout_s) -> None:
    """ValueError unless timeout_s is a number of seconds a process group can wait: > 0 and
    finite (torch.distributed holds it as a datetime.timedelta)."""
    ok = not isinstance(timeout_s, bool) and isinstance(timeout_s, (int, float)) \
        and math.isfinite(timeout_s) and timeout_s > 0
    if ok:
        try:
            datetime.timedelta(seconds=timeout_s)
        except OverflowError:
            ok = False
    if not ok:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got "
                         f"{timeout_s!r}")


def _check_importable(fn) -> None:
    """TypeError unless fn is callable; ValueError when a launched rank could not find it by
    module and name: a lambda, a function defined inside another, or one defined in a
    __main__ that has no file (python -c, a notebook cell, the interactive prompt)."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    qualname = getattr(target, "__qualname__", "")
    module = getattr(target, "__module__", None)
    if "<" in qualname:                             # <lambda>, <locals>
        where = "a lambda" if "<lambda>" in qualname else "a function defined inside another"
    elif module == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        where = "defined in a __main__ without a file (python -c, a notebook cell)"
    else:
        return
    raise ValueError(f"fn ({qualname or fn!r}) is {where}: the ranks import the function they "
                     f"run by its module and name; define it at the top level of a module the "
                     f"ranks can import (a .py file) and pass that function")
