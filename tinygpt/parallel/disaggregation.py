"""Disaggregated prefill and decode: one rank prefills, another decodes, KV blocks in between.

    Workload, mixed_workload   short prompts that decode for a while, long prompts arriving
                               while they do (DistServe's interference case)
    compare_disaggregation     the decode inter-token latency of the short requests: the
                               colocated day-17 engine without and with chunked prefill,
                               against a prefill rank shipping paged KV blocks to a decode
                               rank; and whether all three gave the same greedy tokens
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinygpt.parallel.ranks import run_ranks
from tinygpt.parallel.source import load_source, source_config


@dataclass(frozen=True)
class Workload:
    """Requests arriving over time: arrival seconds (from the start, never decreasing),
    prompts (non-empty, token ids >= 0), new tokens (>= 1 each); one entry per request in
    each, at least one request. ValueError otherwise."""

    arrivals: tuple[float, ...]
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = {name: len(getattr(self, name))
                 for name in ("arrivals", "prompts", "max_new_tokens")}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"arrivals, prompts and max_new_tokens must have one entry per "
                             f"request each, got lengths {sizes}")
        if not self.prompts:
            raise ValueError("a Workload needs at least one request, got none")
        for i, t in enumerate(self.arrivals):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                    or t < 0:
                raise ValueError(f"arrivals[{i}] must be a finite number of seconds >= 0, got "
                                 f"{t!r}")
            if i and t < self.arrivals[i - 1]:
                raise ValueError(f"arrivals must be in increasing order, ties allowed "
                                 f"(requests are added in that order), got arrivals[{i - 1}]="
                                 f"{self.arrivals[i - 1]!r} then arrivals[{i}]={t!r}")
        for i, prompt in enumerate(self.prompts):
            if len(prompt) == 0 or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                       for t in prompt):
                raise ValueError(f"prompts[{i}] must be a non-empty sequence of token ids "
                                 f"(ints >= 0), got {prompt!r}")
        for i, n in enumerate(self.max_new_tokens):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max_new_tokens[{i}] must be an int >= 1, got {n!r}")


def mixed_workload(vocab_size: int, n_short: int = 6, n_long: int = 3, short_len: int = 8,
                   long_len: int = 384, new_tokens: int = 32, long_new_tokens: int = 4,
                   spacing_s: float = 0.15, seed: int = 0) -> Workload:
    """Short prompts that decode for a while, and long prompts arriving while they decode
    (DistServe's interference case: a long prefill stalls every running decode). Short
    prompt i is short_len + i tokens long; long prompt j arrives at spacing_s x (j + 1)."""
    for name, value, low in (("vocab_size", vocab_size, 1), ("n_short", n_short, 0),
                             ("n_long", n_long, 0), ("short_len", short_len, 1),
                             ("long_len", long_len, 1), ("new_tokens", new_tokens, 1),
                             ("long_new_tokens", long_new_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if n_short + n_long < 1:
        raise ValueError("n_short + n_long must be at least 1: a workload needs a request")
    if isinstance(spacing_s, bool) or not isinstance(spacing_s, (int, float)) \
            or not math.isfinite(spacing_s) or spacing_s < 0:
        raise ValueError(f"spacing_s must be a finite number of seconds >= 0, got "
                         f"{spacing_s!r}")
    gen = torch.Generator().manual_seed(seed)
    arrivals, prompts, new = [], [], []
    for i in range(n_short):
        arrivals.append(0.0)
        prompts.append(tuple(torch.randint(0, vocab_size, (short_len + i,), generator=gen)
                             .tolist()))
        new.append(new_tokens)
    for j in range(n_long):
        arrivals.append(spacing_s * (j + 1))
        prompts.append(tuple(torch.randint(0, vocab_size, (long_len,), generator=gen).tolist()))
        new.append(long_new_tokens)
    return Workload(tuple(arrivals), tuple(prompts), tuple(new))


def _itl_summary(token_times: dict[int, list[float]], decoding: set[int]) -> dict:
    from tinygpt.metrics import percentile

    gaps = [b - a for i in decoding for a, b in zip(token_times[i], token_times[i][1:],
                                                     strict=False)]
    return dict(itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99),
                itl_max=max(gaps), gaps=len(gaps))


def _colocated_rank(rank: int, world_size: int, source, workload: Workload,
                    token_budget: int) -> dict:
    """The day-17 engine on one process, requests added as their arrival time passes."""
    from tinygpt.engine import Engine
    from tinygpt.sampling import SamplingParams

    torch.set_num_threads(1)
    model = load_source(source)
    engine = Engine(model, max_running=len(workload.prompts), token_budget=token_budget)
    pending = list(range(len(workload.prompts)))
    times: dict[int, list[float]] = {i: [] for i in pending}
    start = time.perf_counter()
    with torch.inference_mode():
        while pending or engine.has_work:
            now = time.perf_counter() - start
            while pending and workload.arrivals[pending[0]] <= now:
                i = pending.pop(0)
                engine.add_request(list(workload.prompts[i]), SamplingParams(
                    temperature=0.0, max_new_tokens=workload.max_new_tokens[i]), request_id=i)
            if not engine.has_work:
                time.sleep(0.001)
                continue
            for request_id, _ in engine.step():
                times[request_id].append(time.perf_counter())
    tokens = {i: engine.result(i).token_ids for i in times}
    return dict(tokens=tokens, times=times)


def _disaggregated_rank(rank: int, world_size: int, source, workload: Workload,
                        block_size: int) -> dict:
    """Rank 0 prefills each request as it arrives and sends its KV blocks and first token to
    rank 1, which decodes every request it holds, one batched step at a time."""
    from tinygpt.paged import PagedKVCache
    from tinygpt.runner import ModelRunner

    torch.set_num_threads(1)
    model = load_source(source)
    cfg = model.cfg
    n = len(workload.prompts)
    longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_new_tokens,
                                             strict=True))
    per_seq = -(-longest // block_size)
    cache = PagedKVCache.for_model(model, num_blocks=n * per_seq, block_size=block_size)
    runner = ModelRunner(model, cache)
    dist.barrier()
    start = time.perf_counter()
    with torch.inference_mode():
        if rank == 0:
            for i in range(n):
                wait = workload.arrivals[i] - (time.perf_counter() - start)
                if wait > 0:
                    time.sleep(wait)
                prompt = list(workload.prompts[i])
                cache.add(i)
                cache.reserve(i, len(prompt))
                logits = runner.forward([(i, prompt, 0)])
                first = int(logits[0].argmax())
                blocks = torch.tensor(cache.tables[i])
                dist.send(torch.tensor([i, len(prompt), len(blocks), first]), dst=1)
                dist.send(cache.k[:, blocks].contiguous(), dst=1)      # (L, blocks, Hkv, bs, hd)
                dist.send(cache.v[:, blocks].contiguous(), dst=1)
                cache.free(i)
            return {}
        times: dict[int, list[float]] = {}
        tokens: dict[int, list[int]] = {}
        active: list[int] = []
        transfers: dict[int, tuple[int, float]] = {}
        received = 0
        header = torch.zeros(4, dtype=torch.long)
        pending = dist.irecv(header, src=0)
        while received < n or active:
            # take every request whose blocks have arrived (never block while others decode)
            while pending is not None and (not active or pending.is_completed()):
                pending.wait()
                i, length, n_blocks, first = header.tolist()
                shape = (cfg.n_layers, n_blocks, *cache.k.shape[2:])
                k, v = torch.empty(shape, dtype=cache.k.dtype), torch.empty(shape,
                                                                            dtype=cache.v.dtype)
                # from the header's arrival to the last block's: this includes any wait for
                # the prefill rank to be scheduled and send, so it bounds the transfer above
                t0 = time.perf_counter()
                dist.recv(k, src=0)
                dist.recv(v, src=0)
                transfers[i] = (k.nbytes + v.nbytes, time.perf_counter() - t0)
                cache.add(i)
                cache.reserve(i, length)
                mine = torch.tensor(cache.tables[i])
                cache.k[:, mine], cache.v[:, mine] = k, v
                cache.lengths[i] = length
                tokens[i], times[i] = [first], [time.perf_counter()]
                if workload.max_new_tokens[i] > 1:
                    active.append(i)
                else:                                   # the prefill's token was the last
                    cache.free(i)
                received += 1
                pending = None
                if received < n:
                    header = torch.zeros(4, dtype=torch.long)
                    pending = dist.irecv(header, src=0)
            if not active:          # then every request is done: the loop above waits for
                continue            # the next one's blocks while none is active
            work = []
            for i in active:
                cache.reserve(i, 1)
                work.append((i, [tokens[i][-1]], cache.lengths[i]))
            logits = runner.forward(work)
            now = time.perf_counter()
            for row, i in enumerate(list(active)):
                cache.lengths[i] += 1
                tokens[i].append(int(logits[row].argmax()))
                times[i].append(now)
                if len(tokens[i]) >= workload.max_new_tokens[i]:
                    active.remove(i)
                    cache.free(i)
        return dict(tokens=tokens, times=times, transfers=transfers)


@dataclass(frozen=True)
class DisaggregationReport:
    """Decode inter-token latency (seconds) of the short requests under a mixed workload:
    colocated without chunking, colocated with chunked prefill, and disaggregated; whether
    every configuration produced the same greedy tokens; KV bytes and seconds per request, in
    request order (the decode rank's receive of the blocks, timed from the header's arrival to
    the last block's: it includes any wait for the prefill rank, not the transfer alone)."""

    colocated: dict
    chunked: dict
    disaggregated: dict
    tokens_identical: bool
    kv_bytes: tuple[int, ...]
    kv_seconds: tuple[float, ...]


def compare_disaggregation(source, workload: Workload, chunk_tokens: int = 64,
                           block_size: int = 16, timeout_s: float = 300.0
                           ) -> DisaggregationReport:
    """Run `workload` three ways and measure the decode ITL of the short requests (those
    that arrive first and generate the most tokens): the colocated engine with a token budget
    that takes a whole long prompt at once, the same with chunked prefill (`chunk_tokens`
    tokens per step), and a prefill rank + a decode rank.

    Checked before any rank starts: the workload's token ids within the model's vocabulary
    and every prompt plus its new tokens within max_seq_len; some request generating at
    least 2 tokens (an inter-token latency needs 2); chunk_tokens at least the number of
    requests (the engine's token budget must cover a decode step of them all); block_size
    an int in [1, max_seq_len]. ValueError otherwise.
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    cfg = source_config(source)
    n = len(workload.prompts)
    for i, (prompt, new) in enumerate(zip(workload.prompts, workload.max_new_tokens,
                                          strict=True)):
        if max(prompt) >= cfg.vocab_size:
            raise ValueError(f"workload.prompts[{i}] holds token id {max(prompt)}, outside "
                             f"the model's vocabulary [0, {cfg.vocab_size})")
        if len(prompt) + new > cfg.max_seq_len:
            raise ValueError(f"workload request {i}: {len(prompt)} prompt tokens + "
                             f"{new} new tokens exceed the model's max_seq_len="
                             f"{cfg.max_seq_len}")
    if max(workload.max_new_tokens) < 2:
        raise ValueError("every request of the workload generates 1 token: the decode "
                         "inter-token latency needs a request with max_new_tokens >= 2")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < n:
        raise ValueError(f"chunk_tokens must be an int >= the workload's {n} requests (a step "
                         f"decodes them all at once), got {chunk_tokens!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) \
            or not 1 <= block_size <= cfg.max_seq_len:
        raise ValueError(f"block_size must be an int in [1, {cfg.max_seq_len}] (the model's "
                         f"max_seq_len), got {block_size!r}")
    longest = max(len(p) for p in workload.prompts)
    whole = run_ranks(_colocated_rank, 1, source, workload, longest + len(workload.prompts),
                      timeout_s=timeout_s)[0]
    chunked = run_ranks(_colocated_rank, 1, source, workload, chunk_tokens,
                        timeout_s=timeout_s)[0]
    _, decode = run_ranks(_disaggregated_rank, 2, source, workload, block_size,
                          timeout_s=timeout_s, backend="gloo")      # CPU tensors
    most = max(workload.max_new_tokens)
    decoding = {i for i, m in enumerate(workload.max_new_tokens) if m == most}
    same = all(run["tokens"][i] == whole["tokens"][i] for run in (chunked, decode)
               for i in range(len(workload.prompts)))
    moved = [decode["transfers"][i] for i in sorted(decode["transfers"])]
    return DisaggregationReport(_itl_summary(whole["times"], decoding),
                                _itl_summary(chunked["times"], decoding),
                                _itl_summary(decode["times"], decoding), same,
                                tuple(b for b, _ in moved), tuple(t for _, t in moved))
