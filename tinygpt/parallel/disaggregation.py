"""Disaggregated prefill and decode: one rank prefills, another decodes, KV blocks in between.

    Workload, mixed_workload   short prompts that decode for a while, long prompts arriving
                               while they do (DistServe's interference case)
    compare_disaggregation     the decode inter-token latency of the short requests: the
                               colocated day-17 engine without and with chunked prefill,
                               against a prefill rank shipping paged KV blocks to a decode
                               rank; and whether all three gave the same greedy tokens
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinygpt.parallel.ranks import run_ranks
from tinygpt.parallel.source import load_source


@dataclass(frozen=True)
class Workload:
    """Requests arriving over time: arrival seconds (from the start), prompts, new tokens."""

    arrivals: tuple[float, ...]
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]


def mixed_workload(vocab_size: int, n_short: int = 6, n_long: int = 3, short_len: int = 8,
                   long_len: int = 384, new_tokens: int = 32, long_new_tokens: int = 4,
                   spacing_s: float = 0.15, seed: int = 0) -> Workload:
    """Short prompts that decode for a while, and long prompts arriving while they decode
    (DistServe's interference case: a long prefill stalls every running decode)."""
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
    tokens per step), and a prefill rank + a decode rank."""
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
