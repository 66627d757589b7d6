"""Pipeline parallelism: layers split over ranks, activations sent rank to rank.

    stage_layers     the contiguous layers each stage runs
    bubble_fraction  GPipe's idle share of p equal stages fed m micro-batches: (p - 1) / (m + p - 1)
    pipeline_run     a batch through the stages (local ranks, send/recv) in micro-batches; the
                     measured idle share beside GPipe's, and the logits (Huang et al. 2019)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinygpt.parallel.ranks import _check_rank, run_ranks
from tinygpt.parallel.source import load_source, source_config


def stage_layers(n_layers: int, rank: int, world_size: int) -> range:
    """The layers stage `rank` of `world_size` runs: contiguous, the first n_layers % p stages
    one layer longer. ValueError when there are fewer layers than stages."""
    _check_rank(rank, world_size)
    if n_layers < world_size:
        raise ValueError(f"{n_layers} layers cannot fill {world_size} pipeline stages")
    base, extra = divmod(n_layers, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle share of a pipeline of equal stages: (p - 1) / (m + p - 1).

    Each of the p stages works m slots out of the m + p - 1 slots the pipeline takes to fill
    and drain; the (p - 1) slots at the ends are idle.
    """
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return (stages - 1) / (micro_batches + stages - 1)


def _pipeline_rank(rank: int, world_size: int, source, ids: torch.Tensor,
                   micro_batches: int) -> dict:
    """One pipeline stage: receive each micro-batch's activations from the previous stage,
    run this stage's layers, send them on; the last stage returns the logits."""
    model = load_source(source)
    cfg = model.cfg
    layers = [model.layers[i] for i in stage_layers(cfg.n_layers, rank, world_size)]
    chunks = ids.tensor_split(micro_batches)            # exactly m pieces (chunk may give fewer)
    T = ids.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    if cfg.rope_type == "dynamic":      # its base grows with T, as TinyGPT.forward computes it
        cos, sin = model._dynamic_tables(cos, sin, 0, T, None)
    busy: list[tuple[float, float]] = []
    logits, sends = [], []
    last = rank == world_size - 1
    with torch.inference_mode():
        dist.barrier()
        start = time.perf_counter()
        for chunk in chunks:
            if rank == 0:
                t0 = time.perf_counter()
                x = model.tok_embeddings(chunk)
            else:
                x = torch.empty(chunk.shape[0], T, cfg.d_model,
                                dtype=model.tok_embeddings.weight.dtype)
                dist.recv(x, src=rank - 1)              # waiting here is the bubble
                t0 = time.perf_counter()
            for layer in layers:
                x = layer(x, cos, sin)
            if last:
                logits.append(model.output(model.norm(x)))
            busy.append((t0, time.perf_counter()))
            if not last:
                sends.append(dist.isend(x.contiguous(), dst=rank + 1))
        for work in sends:
            work.wait()
        end = time.perf_counter()
    return dict(start=start, end=end, busy=busy,
                logits=torch.cat(logits) if last else None)


def _check_ids(cfg, ids: torch.Tensor) -> None:
    """TinyGPT.forward's checks of its token ids, made here before any rank starts."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must hold integer token ids (torch.long), got dtype {ids.dtype}")
    T = ids.shape[1]
    if T < 1:
        raise ValueError(f"ids must have B >= 1 and T >= 1, got shape {tuple(ids.shape)}")
    if T > cfg.max_seq_len:
        raise ValueError(f"sequence length T={T} exceeds max_seq_len={cfg.max_seq_len}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), got values "
                         f"in [{low}, {high}]")


@dataclass(frozen=True)
class PipelineRun:
    """A measured pipeline: per-stage busy seconds, the makespan, the measured idle share
    1 - sum(busy) / (p x makespan), GPipe's formula beside it, and the logits (B, T, V)."""

    stages: int
    micro_batches: int
    busy: tuple[float, ...]
    makespan: float
    idle_fraction: float
    predicted_idle: float
    logits: torch.Tensor


def pipeline_run(source, world_size: int, ids: torch.Tensor, micro_batches: int,
                 timeout_s: float = 120.0) -> PipelineRun:
    """Run ids (B, T) through the model from `source` split into `world_size` pipeline stages
    (local ranks, send/recv), fed as `micro_batches` micro-batches; measure the idle share.

    The B rows split into exactly `micro_batches` micro-batches (torch.tensor_split: B = 5
    in 4 gives 2, 1, 1, 1 rows). Clocks: time.perf_counter is the system's monotonic clock,
    shared by local processes, so the stages' intervals are comparable. Sending counts as idle
    time. ids and the degree are checked as the one-process model checks them (dtype, token
    range, 1 <= T <= max_seq_len; at least one layer per stage) before any rank starts.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
        raise TypeError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.LongTensor of shape (B, T), got "
                        f"{type(ids).__name__}")
    if ids.ndim != 2 or ids.shape[0] < micro_batches:
        raise ValueError(f"ids must be (B, T) with B >= micro_batches ({micro_batches}), got "
                         f"{tuple(ids.shape)}")
    cfg = source_config(source)
    stage_layers(cfg.n_layers, 0, world_size)           # a valid degree, with enough layers
    _check_ids(cfg, ids)
    out = run_ranks(_pipeline_rank, world_size, source, ids, micro_batches,
                    timeout_s=timeout_s, backend="gloo")            # CPU tensors
    start = min(o["start"] for o in out)
    makespan = max(o["end"] for o in out) - start
    busy = tuple(sum(b - a for a, b in o["busy"]) for o in out)
    ran = len(out[0]["busy"])                       # the micro-batches the stages ran
    return PipelineRun(world_size, ran, busy, makespan, 1 - sum(busy) / (world_size * makespan),
                       bubble_fraction(world_size, ran), out[-1]["logits"])
