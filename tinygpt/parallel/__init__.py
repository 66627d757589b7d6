"""Day 18: beyond one device. Tensor and pipeline parallelism on torch.distributed.

When a model's weights (or its KV cache) do not fit one device, or one device's memory bandwidth
is too little for the latency wanted, the model is split across several devices ("ranks") that
exchange activations. This module does it with torch.distributed: the ranks are processes, gloo
carries their messages on a CPU; the code is written for NCCL on GPUs too (one CUDA device per
rank), but it has not yet run on a machine with several GPUs.

Tensor parallelism (Megatron-LM's layout, Shoeybi et al. 2019), degree p:

    column-parallel  wq, wk, wv, w1 (gate), w3 (up): each rank keeps a slice of the OUTPUT
                     features (whole heads, or a slice of d_ff). No communication: each rank
                     computes its own heads / its slice of the hidden layer.
    row-parallel     wo, w2 (down): each rank keeps the slice of the INPUT features that matches
                     its heads / hidden slice, computes a partial sum of the full output, and
                     one all-reduce adds the p partial sums. Two all-reduces per layer.
    vocabulary       the embedding and the LM head are split over the vocabulary: the embedding
                     looks up the ids this rank owns (zeros elsewhere) and all-reduces; the
                     head computes this rank's slice of the logits and all-gathers them in
                     rank order (or `distributed_argmax` picks the greedy token from each
                     rank's local maximum, sending 2 numbers per rank instead of V / p).
    replicated       the RMSNorm weights (D numbers each) and RoPE tables.

Heads: rank r owns query heads r*H/p .. (r+1)*H/p - 1 and the key/value heads those queries read
(query head h reads KV head h // (H / H_kv)), so attention needs no communication and each
rank's KV cache holds only its own heads. When p > H_kv (more ranks than KV heads) and
p % H_kv == 0, each KV head is replicated on p / H_kv ranks: every rank then stores one KV head
and the KV cache per device stops shrinking with p. Any other degree is refused with a
ValueError, as is a degree that does not divide H or d_ff.

The pieces, readable top to bottom:

    run_ranks                 run fn(rank, world_size, ...) in local processes joined by a
                              process group (gloo; NCCL on GPUs); clear errors, never a hang
    plan_heads, shard_state_dict
                              which heads / rows / columns each rank keeps
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
    TensorParallelGPT         a TinyGPT whose layers are the above: generate(), the KV cache and
                              the day-17 engine run on it unchanged, one copy per rank
    shard_model               TensorParallelGPT from an ordinary TinyGPT (any loader's output)
    distributed_argmax        the greedy token without gathering the logits

Further down, in the same order:

    stage_layers, bubble_fraction, pipeline_run
                              pipeline parallelism: stages of whole layers, activations sent
                              with send/recv, micro-batches, the measured idle share against
                              GPipe's (p - 1) / (m + p - 1)
    LINKS, ring_allreduce_seconds, tp_decode_estimate, measure_allreduce, fit_link,
    measure_tp_decode         the cost model: bytes per all-reduce, a ring all-reduce on a
                              sourced link, the decode step split p ways, measured on gloo
    mixed_workload, compare_disaggregation
                              a prefill rank shipping paged KV blocks to a decode rank,
                              against the colocated engine with and without chunked prefill
    start_tensor_parallel, follow_leader
                              `serve --tensor-parallel-size N`: rank 0 serves and broadcasts
                              every step's arrivals, aborts and seeds; the others follow
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.positions import rope_cos_sin

# SmolLM2-135M-Instruct's shape (the course's real model: its GGUF's metadata): 30 layers,
# d_model 576, 9 heads over 3 KV heads, d_ff 1536, vocabulary 49,152, tied embeddings.
SMOLLM2_135M = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           d_ff=1536, max_seq_len=8192, rope_base=100000.0,
                           tie_embeddings=True)

# --------------------------------------------------------------------------------------------
# launching ranks as local processes


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
    forever. threads: torch threads for this rank (default: the cores shared out evenly).
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, backend: str,
               timeout_s: float, args: tuple, results) -> None:
    """Body of one launched rank: join the group, run fn, report its value or its traceback."""
    try:
        init_rank(rank, world_size, port, backend, timeout_s)
        value = fn(rank, world_size, *args)
        # by value (plain pickle), not as shared memory that dies with this process
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher as text
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT = None


def _context():
    """A 'forkserver' multiprocessing context with torch preloaded: the first launch starts a
    server process that imports torch once; each rank after that is a fork of it (a fraction
    of a second), never of a parent whose OpenMP threads may be mid-flight."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "tinygpt.parallel",
                                     "tinygpt.engine", "tinygpt.train"])
    return _CONTEXT


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 60.0,
              backend: str | None = None) -> list:
    """Run fn(rank, world_size, *args) in `world_size` local processes; return the values.

    fn must be importable (defined in a module, not in a notebook cell) and its arguments and
    return value picklable. The ranks share one process group (backend default:
    default_backend()). Returns the ranks' return values in rank order. Raises RuntimeError
    with the rank's traceback when a rank fails or dies, and TimeoutError when the ranks are
    not done after timeout_s seconds; either way every rank is stopped first.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    backend = default_backend(world_size) if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
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


# --------------------------------------------------------------------------------------------
# what each rank keeps


@dataclass(frozen=True)
class HeadPlan:
    """The heads of one rank: query heads q_start .. q_start + n_heads - 1 and KV heads
    kv_start .. kv_start + n_kv_heads - 1 of the full model; `replicas` ranks hold each KV
    head (1 unless the degree exceeds the KV heads)."""

    rank: int
    world_size: int
    q_start: int
    n_heads: int
    kv_start: int
    n_kv_heads: int
    replicas: int


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def plan_heads(cfg: ModelConfig, rank: int, world_size: int) -> HeadPlan:
    """Which query and key/value heads rank `rank` of `world_size` owns.

    Requires world_size to divide n_heads, and either world_size to divide n_kv_heads (each
    rank owns n_kv_heads / world_size KV heads) or n_kv_heads to divide world_size (each KV
    head is replicated on world_size / n_kv_heads ranks). ValueError otherwise.
    """
    _check_rank(rank, world_size)
    H, H_kv = cfg.n_heads, cfg.n_kv_heads
    if H % world_size:
        raise ValueError(f"the tensor-parallel degree ({world_size}) must divide n_heads ({H}) "
                         f"so that every rank owns whole heads; choose a degree among "
                         f"{[d for d in range(1, H + 1) if H % d == 0]}")
    n_heads = H // world_size
    q_start = rank * n_heads
    if H_kv % world_size == 0:
        n_kv = H_kv // world_size
        return HeadPlan(rank, world_size, q_start, n_heads, rank * n_kv, n_kv, 1)
    if world_size % H_kv == 0:                    # fewer KV heads than ranks: replicate them
        return HeadPlan(rank, world_size, q_start, n_heads, q_start // cfg.n_rep, 1,
                        world_size // H_kv)
    raise ValueError(f"the tensor-parallel degree ({world_size}) must divide n_kv_heads "
                     f"({H_kv}) or be a multiple of it: with {H_kv} KV heads over {world_size} "
                     f"ranks a rank's query heads would read KV heads another rank owns")


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ids [start, end) whose embedding rows and logits rank `rank` owns: contiguous
    slices of ceil(V / p) ids in rank order (the last may be shorter)."""
    _check_rank(rank, world_size)
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def _rows(weight: torch.Tensor, start: int, end: int, padded: int | None = None
          ) -> torch.Tensor:
    """weight[start:end] as a new tensor, zero rows appended up to `padded` rows."""
    out = weight[start:end].clone()
    if padded is not None and out.shape[0] < padded:
        out = torch.cat([out, out.new_zeros(padded - out.shape[0], *out.shape[1:])])
    return out


def shard_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig, rank: int,
                     world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a TinyGPT state dict, under the same keys.

    wq, wk, wv, w1, w3 (column-parallel): the rows of the rank's heads / d_ff slice;
    wo, w2 (row-parallel): the matching columns; tok_embeddings and output: the rows of the
    rank's vocabulary slice, zero-padded to ceil(V / p) rows so every rank's slice has one
    shape; norms: whole. ValueError when the degree does not divide the heads or d_ff.
    """
    plan = plan_heads(cfg, rank, world_size)
    if cfg.d_ff % world_size:
        raise ValueError(f"the tensor-parallel degree ({world_size}) must divide d_ff "
                         f"({cfg.d_ff})")
    hd, ff = cfg.head_dim, cfg.d_ff // world_size
    q0, q1 = plan.q_start * hd, (plan.q_start + plan.n_heads) * hd
    k0, k1 = plan.kv_start * hd, (plan.kv_start + plan.n_kv_heads) * hd
    f0, f1 = rank * ff, (rank + 1) * ff
    v0, v1 = vocab_range(cfg.vocab_size, rank, world_size)
    per_rank = -(-cfg.vocab_size // world_size)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key.split(".")[-2] if key.count(".") >= 1 else key
        if key in ("tok_embeddings.weight", "output.weight"):
            out[key] = _rows(tensor, v0, v1, per_rank)
        elif name == "wq":
            out[key] = _rows(tensor, q0, q1)
        elif name in ("wk", "wv"):
            out[key] = _rows(tensor, k0, k1)
        elif name == "wo":
            out[key] = tensor[:, q0:q1].clone()
        elif name in ("w1", "w3"):
            out[key] = _rows(tensor, f0, f1)
        elif name == "w2":
            out[key] = tensor[:, f0:f1].clone()
        else:                                           # RMSNorm weights: replicated
            out[key] = tensor.clone()
    return out


# --------------------------------------------------------------------------------------------
# the parallel layers (each holds this rank's shard as `weight`, like nn.Linear)


class CommStats:
    """Seconds, calls and bytes of this process's collectives (the measured all-reduce share)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def all_reduce(self, x: torch.Tensor, group=None) -> None:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor, group=None) -> None:
        t0 = time.perf_counter()
        dist.all_gather(parts, x, group=group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size() * len(parts)


COMM = CommStats()          # this process's collectives; reset() before measuring


class ColumnParallelLinear(nn.Module):
    """y_r = x @ W_r^T with W_r the rank's rows of W (out_features / p of them).

    x: (..., in_features) -> (..., out_features / p): this rank's slice of the output. No
    communication: what follows (attention on the rank's heads, SwiGLU on its hidden slice)
    needs only this slice.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T, with W_r the rank's columns of W.

    x: (..., in_features / p), the rank's slice of the input -> (..., out_features), the full
    output on every rank after ONE all-reduce (sum) over `group`.
    """

    def __init__(self, weight: torch.Tensor, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        COMM.all_reduce(y, self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + per_rank) of the vocabulary on this rank.

    ids (...) -> (..., D): the rank looks up the ids it owns, writes zeros for the others, and
    an all-reduce adds the p partial tables (exactly one rank contributes each row).
    """

    def __init__(self, weight: torch.Tensor, start: int, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[..., None]
        COMM.all_reduce(out, self.group)
        return out


class VocabParallelHead(nn.Module):
    """LM head rows for the rank's vocabulary slice; logits gathered in rank order.

    x: (..., D) -> logits (..., V) on every rank: each rank computes its ceil(V / p) logits,
    an all-gather collects the p slices, and they are concatenated in RANK order (rank r's
    slice holds ids r * ceil(V / p) ...), the zero-padded tail cut off.
    `local_logits` skips the gather (see distributed_argmax).
    """

    def __init__(self, weight: torch.Tensor, vocab_size: int, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.group = vocab_size, group

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        COMM.all_gather(parts, local, self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def distributed_argmax(local_logits: torch.Tensor, start: int, vocab_size: int,
                       group=None) -> torch.Tensor:
    """The greedy token from each rank's slice of the logits, without gathering them.

    local_logits: (B, V / p) this rank's logits for ids start ..; returns (B,) long, the same
    on every rank and equal to argmax of the full logits (first index on ties, like
    torch.argmax): each rank sends its best value and id, 2 numbers per row instead of V / p.
    """
    valid = local_logits.shape[-1] - max(0, start + local_logits.shape[-1] - vocab_size)
    local = local_logits[..., :valid]
    if valid > 0:
        value, index = local.max(dim=-1)
    else:
        value = torch.full(local_logits.shape[:-1], float("-inf"), device=local_logits.device)
        index = torch.zeros(local_logits.shape[:-1], dtype=torch.long,
                            device=local_logits.device)
    mine = torch.stack([value.float(), (index + start).float()], dim=-1)   # (B, 2)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    values = torch.stack([p[..., 0] for p in parts], dim=-1)                 # (B, p)
    ids = torch.stack([p[..., 1] for p in parts], dim=-1)
    best = values.max(dim=-1, keepdim=True).values
    # among ranks holding the maximum, the lowest id (ranks own increasing id ranges)
    ids = torch.where(values == best, ids, float("inf"))
    return ids.min(dim=-1).values.long()


# --------------------------------------------------------------------------------------------
# the tensor-parallel model


class TensorParallelGPT(TinyGPT):
    """One rank's shard of a TinyGPT: the same module tree and forward, parallel layers inside.

    It is a TinyGPT (the KV cache, generate(), the engine and its runner accept it); every
    rank must run the same calls in the same order, since each layer's all-reduce waits for
    all ranks. cfg is the FULL model's config; `plan` gives this rank's heads. The KV cache
    made for it (KVCache.for_model, PagedKVCache.for_model) holds `cache_kv_heads` heads.
    Build it with shard_model.
    """

    fused_decode = False            # DecodeStep's fused/packed fast path skips the all-reduces

    def __init__(self, cfg: ModelConfig, shard: Mapping[str, torch.Tensor], rank: int,
                 world_size: int, group=None) -> None:
        # the module tree of a miniature TinyGPT (same layers, heads and norm eps; no full-size
        # weight is ever allocated), whose every weight is then replaced by this rank's shard
        skeleton = dataclasses.replace(cfg, vocab_size=1, d_model=2 * cfg.n_heads, d_ff=1,
                                       max_seq_len=1, tie_embeddings=False)
        super().__init__(skeleton, seed=None)
        self.cfg = cfg
        self.rank, self.world_size, self.group = rank, world_size, group
        self.plan = plan_heads(cfg, rank, world_size)
        start, _ = vocab_range(cfg.vocab_size, rank, world_size)
        self.tok_embeddings = VocabParallelEmbedding(shard["tok_embeddings.weight"], start, group)
        head = shard["tok_embeddings.weight"] if cfg.tie_embeddings else shard["output.weight"]
        self.output = VocabParallelHead(head, cfg.vocab_size, group)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for i, block in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = block.attention, block.feed_forward
            attn.n_heads, attn.n_kv_heads = self.plan.n_heads, self.plan.n_kv_heads
            attn.head_dim = cfg.head_dim
            for name in ("wq", "wk", "wv"):
                setattr(attn, name, ColumnParallelLinear(shard[f"{p}attention.{name}.weight"]))
            attn.wo = RowParallelLinear(shard[f"{p}attention.wo.weight"], group)
            mlp.w1 = ColumnParallelLinear(shard[f"{p}feed_forward.w1.weight"])
            mlp.w3 = ColumnParallelLinear(shard[f"{p}feed_forward.w3.weight"])
            mlp.w2 = RowParallelLinear(shard[f"{p}feed_forward.w2.weight"], group)
            for norm in ("attention_norm", "ffn_norm"):
                getattr(block, norm).weight = nn.Parameter(shard[f"{p}{norm}.weight"],
                                                           requires_grad=False)
        self.norm.weight = nn.Parameter(shard["norm.weight"], requires_grad=False)
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.rope_cos, self.rope_sin = cos.to(self.norm.weight), sin.to(self.norm.weight)
        self.eval()

    @property
    def cache_kv_heads(self) -> int:
        """KV heads this rank's attention writes to its cache (its own, or 1 replica)."""
        return self.plan.n_kv_heads


def shard_model(model: TinyGPT, rank: int | None = None, world_size: int | None = None,
                group=None) -> TensorParallelGPT:
    """This rank's TensorParallelGPT from an ordinary TinyGPT (the shipped checkpoint, a
    Hugging Face or GGUF load: anything that returns a TinyGPT). rank and world_size default
    to the process group's. The shard copies only its slices; drop `model` afterwards to free
    the full weights."""
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    if rank is None or world_size is None:
        if not dist.is_initialized():
            raise ValueError("pass rank and world_size, or call this inside a process group "
                             "(run_ranks / init_rank)")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    with torch.no_grad():
        shard = shard_state_dict(model.state_dict(), model.cfg, rank, world_size)
    device = next(model.parameters()).device
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())   # NCCL: this rank's GPU
    return TensorParallelGPT(model.cfg, shard, rank, world_size, group).to(device)


# --------------------------------------------------------------------------------------------
# where a rank's model comes from


def load_source(source) -> TinyGPT:
    """The full model a rank shards, from a picklable description:

    "shipped"               the course's checkpoint (tinygpt.train.load_pretrained)
    (cfg, state_dict)       a ModelConfig and a TinyGPT state dict (shared memory between the
                            launcher and the ranks, so no copy per rank)
    a callable              called with no argument; returns a TinyGPT or (TinyGPT, tokenizer).
                            The hook for any loader: the real model's GGUF is one line,
                            functools.partial(<the GGUF loader>, <its path>).
    """
    if isinstance(source, str):
        if source != "shipped":
            raise ValueError(f"source must be 'shipped', (cfg, state_dict) or a callable, got "
                             f"{source!r}")
        from tinygpt.train import load_pretrained

        return load_pretrained()[0]
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], ModelConfig):
        model = TinyGPT(source[0], seed=None)
        model.load_state_dict(source[1])
        return model.eval()
    if callable(source):
        model = source()
        model = model[0] if isinstance(model, tuple) else model
        if not isinstance(model, TinyGPT):
            raise TypeError(f"the source callable must return a TinyGPT, got "
                            f"{type(model).__name__}")
        return model.eval()
    raise TypeError(f"source must be 'shipped', (cfg, state_dict) or a callable, got "
                    f"{type(source).__name__}")


def _hidden(model: TinyGPT, prompt: list[int]) -> torch.Tensor:
    """The residual stream after the last block (before the final norm): (T, D)."""
    ids = torch.tensor([prompt], device=model.rope_cos.device)
    cos, sin = model.rope_cos[:len(prompt)], model.rope_sin[:len(prompt)]
    x = model.tok_embeddings(ids)
    for layer in model.layers:
        x = layer(x, cos, sin)
    return x[0]


def _tp_check_rank(rank: int, world_size: int, source, prompts: list[list[int]],
                   max_new_tokens: int) -> dict | None:
    """A rank of tp_check: the shard's logits, greedy tokens through generate() and through
    the engine. Rank 0 returns them; the others return whether their tokens equal rank 0's."""
    from tinygpt.engine import Engine
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    shard = shard_model(load_source(source), rank, world_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    with torch.inference_mode():
        device = shard.norm.weight.device
        logits = [shard(torch.tensor([p], device=device))[0].cpu() for p in prompts]
        tokens = [generate(shard, p, params).token_ids for p in prompts]
        engine = Engine(shard, max_running=len(prompts))
        engine_tokens = [r.token_ids for r in engine.generate(prompts, params)]
        last = torch.stack([lg[-1] for lg in logits])                         # (N, V)
        hidden = torch.stack([shard.norm(_hidden(shard, p))[-1] for p in prompts]).to(device)
        start, _ = vocab_range(shard.cfg.vocab_size, rank, world_size)
        greedy = distributed_argmax(shard.output.local_logits(hidden), start,
                                    shard.cfg.vocab_size).cpu()
    out = dict(logits=logits, tokens=tokens, engine_tokens=engine_tokens,
               kv_heads=shard.cache_kv_heads, plan=shard.plan,
               argmax_agree=torch.equal(greedy, last.argmax(-1)))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (tokens, engine_tokens,
                                      [lg[-1].sum().item() for lg in logits]))
    out["ranks_agree"] = all(e == everyone[0] for e in everyone)
    return out


def tp_check(source, world_size: int, prompts: list[list[int]], max_new_tokens: int = 8,
             timeout_s: float = 120.0) -> dict:
    """Run the model from `source` (see load_source) tensor-parallel over `world_size` local
    ranks. Returns rank 0's dict: logits (per prompt (T, V)), tokens (greedy generate()),
    engine_tokens (greedy through the day-17 engine), kv_heads (per rank), plan, and
    ranks_agree (every rank saw the same tokens and logits)."""
    return run_ranks(_tp_check_rank, world_size, source, prompts, max_new_tokens,
                     timeout_s=timeout_s)[0]


# --------------------------------------------------------------------------------------------
# pipeline parallelism: layers split over ranks, activations sent rank to rank


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
    chunks = ids.chunk(micro_batches)
    T = ids.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
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
                x = torch.empty(chunk.shape[0], T, cfg.d_model)
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

    Clocks: time.perf_counter is the system's monotonic clock, shared by local processes, so
    the stages' intervals are comparable. Sending counts as idle time.
    """
    if ids.ndim != 2 or ids.shape[0] < micro_batches:
        raise ValueError(f"ids must be (B, T) with B >= micro_batches ({micro_batches}), got "
                         f"{tuple(ids.shape)}")
    out = run_ranks(_pipeline_rank, world_size, source, ids, micro_batches,
                    timeout_s=timeout_s, backend="gloo")            # CPU tensors
    start = min(o["start"] for o in out)
    makespan = max(o["end"] for o in out) - start
    busy = tuple(sum(b - a for a, b in o["busy"]) for o in out)
    return PipelineRun(world_size, micro_batches, busy, makespan,
                       1 - sum(busy) / (world_size * makespan),
                       bubble_fraction(world_size, micro_batches), out[-1]["logits"])


# --------------------------------------------------------------------------------------------
# the cost model: what tensor parallelism sends, and what that costs on a link


@dataclass(frozen=True)
class Link:
    """A link between devices: bandwidth in bytes/s per direction, the fixed cost of one
    collective in seconds, and where each figure comes from."""

    name: str
    bandwidth: float
    latency: float
    source: str


# Bandwidth: the vendors' figures, per direction. Latency: NOT a vendor figure (datasheets give
# none); an assumed order of magnitude for one small NCCL all-reduce, to be replaced by a
# measurement (measure_allreduce) wherever one can be made.
LINKS: dict[str, Link] = {
    "nvlink4-h100-sxm": Link(
        "nvlink4-h100-sxm", 450e9, 10e-6,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM column): NVLink 900 GB/s, the total of both "
        "directions over 18 fourth-generation links, so 450 GB/s each way; latency ASSUMED "
        "10 us per small all-reduce"),
    "nvlink3-a100-sxm": Link(
        "nvlink3-a100-sxm", 300e9, 10e-6,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM column): NVLink 600 GB/s total of both "
        "directions, so 300 GB/s each way; latency ASSUMED 10 us per small all-reduce"),
    "pcie5-x16": Link(
        "pcie5-x16", 63.0e9, 25e-6,
        "PCI-SIG PCI Express 5.0 specification: 32 GT/s per lane x 16 lanes, 128b/130b "
        "encoding: 32 x 16 x 128/130 / 8 = 63.0 GB/s each way (NVIDIA's H100 PCIe datasheet: "
        "128 GB/s for both directions, before the encoding); latency ASSUMED 25 us per small "
        "all-reduce through the host bridge"),
    "pcie4-x16": Link(
        "pcie4-x16", 31.5e9, 25e-6,
        "PCI-SIG PCI Express 4.0 specification: 16 GT/s per lane x 16 lanes, 128b/130b "
        "encoding: 16 x 16 x 128/130 / 8 = 31.5 GB/s each way (NVIDIA's A100 PCIe datasheet: "
        "64 GB/s for both directions, before the encoding); latency ASSUMED 25 us per small "
        "all-reduce"),
}


def _check_link(link) -> Link:
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"link must be a Link or one of {sorted(LINKS)}, got {link!r}")
        return LINKS[link]
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link or a LINKS name, got {type(link).__name__}")
    return link


def ring_allreduce_seconds(nbytes: float, world_size: int, link) -> float:
    """Time of one ring all-reduce of `nbytes` over `world_size` ranks on `link`:

        latency + 2 (p - 1) / p x nbytes / bandwidth

    A ring all-reduce is a reduce-scatter then an all-gather, each p - 1 steps moving
    nbytes / p per rank, so each rank sends (and receives) 2 (p - 1) / p x nbytes in all,
    whatever p. 0 for p = 1 (nothing to send).
    """
    link = _check_link(link)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if world_size == 1:
        return 0.0
    return link.latency + 2 * (world_size - 1) / world_size * nbytes / link.bandwidth


def allgather_seconds(nbytes: float, world_size: int, link) -> float:
    """Time of a ring all-gather whose result is `nbytes` (each rank sends (p-1)/p of it)."""
    link = _check_link(link)
    if world_size == 1:
        return 0.0
    return link.latency + (world_size - 1) / world_size * nbytes / link.bandwidth


def allreduce_bytes(cfg: ModelConfig, tokens: int = 1, dtype: str = "fp32") -> int:
    """Bytes of ONE all-reduce of tensor parallelism: the (tokens, d_model) activations after
    wo or w2. A layer does two, so a decode step at batch B sends 2 x L of B x D x bytes,
    whatever the degree (plus one for the embedding and the logits' gather)."""
    from tinygpt.flops import DTYPE_BITS

    if dtype not in DTYPE_BITS:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BITS)}, got {dtype!r}")
    return tokens * cfg.d_model * DTYPE_BITS[dtype] // 8


@dataclass(frozen=True)
class TPEstimate:
    """Predicted decode step of a tensor-parallel model (seconds and bytes per device)."""

    world_size: int
    compute_seconds: float       # the roofline's decode step over p (weights and cache split)
    comm_seconds: float          # 2 L all-reduces + the embedding's + the logits' all-gather
    seconds: float
    allreduces: int
    weight_bytes_per_device: float
    kv_bytes_per_device: float

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.seconds


def tp_decode_estimate(cfg: ModelConfig, hw, link, world_size: int, batch: int = 1,
                       context_len: int = 512, dtype: str = "bf16") -> TPEstimate:
    """The decode step of `cfg` split over `world_size` devices of kind `hw` (a
    tinygpt.roofline.Hardware or its name) joined by `link` (a Link or a LINKS name).

    Compute: the roofline's decode step (tinygpt.roofline.decode_estimate) over p: each
    device reads 1/p of the weights and of the KV cache (replicated KV heads are counted
    once per replica). Communication: 2 L + 1 ring all-reduces of batch x D values and one
    all-gather of the batch's V logits, at `link`'s bandwidth and latency. Tensor parallelism
    lowers the latency when the compute saved, t1 (1 - 1/p), exceeds what the messages add.
    """
    from tinygpt import flops as F
    from tinygpt.roofline import decode_estimate, get_hardware

    hw = get_hardware(hw) if isinstance(hw, str) else hw
    plan = plan_heads(cfg, 0, world_size)
    one = decode_estimate(cfg, hw, batch, context_len, dtype)
    compute = one.seconds / world_size
    n_ar = 2 * cfg.n_layers + (1 if world_size > 1 else 0)
    comm = n_ar * ring_allreduce_seconds(allreduce_bytes(cfg, batch, dtype), world_size, link)
    comm += allgather_seconds(batch * cfg.vocab_size * 4, world_size, link)
    kv_heads = plan.n_kv_heads
    kv = F.kv_cache_bytes(cfg, context_len, batch, dtype) * kv_heads / cfg.n_kv_heads
    return TPEstimate(world_size, compute, comm, compute + comm,
                      n_ar if world_size > 1 else 0,
                      F.weight_bytes(cfg, dtype) / world_size, kv)


def _allreduce_rank(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    """Mean seconds of an all-reduce of each size (float32 elements) on this group."""
    out = {}
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    for n in sizes:
        x = torch.ones(n, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        # back to back, as a decode step issues them: a barrier before each one would hide
        # the wait for a peer the operating system has not scheduled yet
        t0 = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        out[n] = (time.perf_counter() - t0) / repeats
    return out


def measure_allreduce(world_size: int = 2, sizes: tuple[int, ...] = (576, 49152, 1 << 20),
                      repeats: int = 30, backend: str | None = None) -> dict[int, float]:
    """Measured seconds of one all-reduce of n float32 values on local ranks (gloo on a CPU,
    NCCL on GPUs), for each n in sizes: `repeats` back-to-back all-reduces, the slowest
    rank's mean."""
    per_rank = run_ranks(_allreduce_rank, world_size, list(sizes), repeats, backend=backend)
    return {n: max(r[n] for r in per_rank) for n in sizes}


def fit_link(measured: Mapping[int, float], world_size: int, name: str = "measured") -> Link:
    """A Link fitted to measure_allreduce's figures by least squares on
    t = latency + 2 (p - 1) / p x bytes / bandwidth (bytes = 4 n)."""
    xs = [2 * (world_size - 1) / world_size * 4 * n for n in measured]
    ts = list(measured.values())
    k = len(xs)
    mean_x, mean_t = sum(xs) / k, sum(ts) / k
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts, strict=True)) / var
    slope = max(slope, 1e-15)
    latency = max(mean_t - slope * mean_x, 0.0)
    return Link(name, 1 / slope, latency,
                f"fitted to {k} all-reduce sizes measured on this machine's ranks")


def _tp_decode_rank(rank: int, world_size: int, source, prompt_len: int,
                    new_tokens: int) -> dict:
    """Greedy decode timing on one rank: seconds per step and the collectives' seconds."""
    from tinygpt.kv_cache import KVCache, decode_step, prefill

    torch.set_num_threads(1)         # one core per rank; one process: torch's batch-1 products
    model = load_source(source)      # do not spread over a second core anyway
    if world_size > 1:
        model = shard_model(model, rank, world_size)
    cache = KVCache.for_model(model, max_len=prompt_len + new_tokens + 3)
    device = model.norm.weight.device
    ids = torch.arange(prompt_len, device=device)[None] % model.cfg.vocab_size
    with torch.inference_mode():
        token = prefill(model, cache, ids).argmax(-1, keepdim=True)
        for _ in range(2):                                    # warm-up steps
            token = decode_step(model, cache, token).argmax(-1, keepdim=True)
        if world_size > 1:
            dist.barrier()
        COMM.reset()
        tokens, t0 = [], time.perf_counter()
        for _ in range(new_tokens):
            token = decode_step(model, cache, token).argmax(-1, keepdim=True)
            tokens.append(int(token))
        seconds = time.perf_counter() - t0
    return dict(step_seconds=seconds / new_tokens, comm_seconds=COMM.seconds / new_tokens,
                comm_calls=COMM.calls / new_tokens, comm_bytes=COMM.bytes / new_tokens,
                tokens=tokens)


@dataclass(frozen=True)
class TPDecodeMeasurement:
    """Measured greedy decode, one process against `world_size` tensor-parallel ranks, with
    the cost model's prediction from a link fitted on the same machine (fit_link)."""

    world_size: int
    one_step_seconds: float          # one process
    tp_step_seconds: float           # the slowest rank's
    comm_seconds: float              # per step, the slowest rank's time inside collectives
    comm_calls: float                # collectives per step
    comm_bytes: float                # bytes per step and rank handed to collectives
    predicted_comm_seconds: float    # comm_calls collectives on the fitted link
    predicted_step_seconds: float    # one_step / p + predicted comm
    link: Link
    tokens_identical: bool

    @property
    def speedup(self) -> float:
        return self.one_step_seconds / self.tp_step_seconds

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.tp_step_seconds


def measure_tp_decode(source, world_size: int, prompt_len: int = 16, new_tokens: int = 16,
                      link: Link | None = None, timeout_s: float = 300.0) -> TPDecodeMeasurement:
    """Time greedy decode of the model from `source` in one process, then over `world_size`
    tensor-parallel ranks; predict the parallel step with the cost model on `link` (default:
    fitted to all-reduces measured now on the same ranks)."""
    if link is None:
        link = fit_link(measure_allreduce(world_size, backend="gloo"), world_size,
                        "this machine (fitted)")
    one = run_ranks(_tp_decode_rank, 1, source, prompt_len, new_tokens, timeout_s=timeout_s,
                    backend="gloo")[0]
    many = run_ranks(_tp_decode_rank, world_size, source, prompt_len, new_tokens,
                     timeout_s=timeout_s, backend="gloo")       # both on the CPU
    worst = max(many, key=lambda r: r["step_seconds"])
    source_cfg = load_source(source).cfg if not isinstance(source, tuple) else source[0]
    per_ar = ring_allreduce_seconds(allreduce_bytes(source_cfg, 1, "fp32"), world_size, link)
    n_ar = worst["comm_calls"] - 1                     # all-reduces; the last is the gather
    predicted_comm = n_ar * per_ar + allgather_seconds(source_cfg.vocab_size * 4, world_size,
                                                       link)
    return TPDecodeMeasurement(
        world_size, one["step_seconds"], worst["step_seconds"],
        max(r["comm_seconds"] for r in many), worst["comm_calls"], worst["comm_bytes"],
        predicted_comm, one["step_seconds"] / world_size + predicted_comm, link,
        all(r["tokens"] == one["tokens"] for r in many))


# --------------------------------------------------------------------------------------------
# disaggregated prefill and decode: one rank prefills, another decodes, KV blocks in between


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
    from tinygpt.bench.metrics import percentile

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
                active.append(i)
                received += 1
                pending = None
                if received < n:
                    header = torch.zeros(4, dtype=torch.long)
                    pending = dist.irecv(header, src=0)
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


# --------------------------------------------------------------------------------------------
# serving: rank 0 runs the HTTP server and the engine; every other rank mirrors each step


SERVE_TIMEOUT_S = 7 * 24 * 3600.0   # an idle server's workers wait in a collective; a rank
                                    # that dies is caught by the watchdogs, not by this timeout


def _leader_engine_class():
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

        def add_request(self, prompt_ids, params, *, eos_ids=(), request_id=None,
                        logprobs=None, prompt_logprobs=None):
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
            dist.broadcast_object_list(message, src=0)
            out = super().step()
            self._last = [(request_id, event.token_id) for request_id, event in out]
            return out

        def close(self) -> None:
            """Tell the other ranks to exit (after checking the last step's tokens)."""
            dist.broadcast_object_list([("stop", [], self._last)], src=0)

    return LeaderEngine


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
                  parent_pid: int) -> None:
    """Rank r > 0 of a served model: its shard and its engine, stepping when rank 0 says."""
    from tinygpt.engine import Engine

    _watch_parent(parent_pid)
    try:                                        # `ps` and /proc show which process is a rank
        with open("/proc/self/comm", "w") as comm:
            comm.write(f"tinygpt-rank-{rank}")
    except OSError:
        pass
    init_rank(rank, world_size, port, timeout_s=SERVE_TIMEOUT_S)
    loaded = source()
    model, tokenizer = (loaded[0], loaded[1]) if isinstance(loaded, tuple) else (loaded, None)
    engine = Engine(shard_model(model, rank, world_size), tokenizer, **engine_options)
    del model, loaded
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


def _watch_workers(procs: list) -> None:
    """Rank 0's watchdog: when a worker rank dies, say which and take the server down now
    (its collectives would otherwise fail every request, or wait)."""
    import sys
    import threading

    def watch() -> None:
        while True:
            for rank, proc in enumerate(procs, start=1):
                if proc.exitcode is not None:
                    print(f"error: tensor-parallel rank {rank} exited with code {proc.exitcode}; "
                          f"the server cannot run without it and stops now",
                          file=sys.stderr, flush=True)
                    for other in procs:
                        if other.is_alive():
                            other.kill()
                    os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="tinygpt-rank-watch").start()


def start_tensor_parallel(model: TinyGPT, tokenizer, source, world_size: int, *,
                          max_waiting: int = 64, **engine_options):
    """The server's engine for `serve --tensor-parallel-size N`: an AsyncEngine on rank 0.

    model, tokenizer: rank 0's loaded model (it is sharded here); source: a picklable
    zero-argument callable returning (model, tokenizer), which each other rank calls to load
    its copy (the server passes functools.partial(load_model, path); any loader, the GGUF
    one included, fits). Ranks 1 .. N-1 start as local processes; a watchdog takes the
    server down with a message when one dies. engine_options: Engine's keyword arguments.
    """
    from tinygpt.engine import AsyncEngine

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    plan_heads(model.cfg, 0, world_size)                     # refuse a bad degree up front
    if model.cfg.d_ff % world_size:
        raise ValueError(f"the tensor-parallel degree ({world_size}) must divide d_ff "
                         f"({model.cfg.d_ff})")
    ctx = _context()
    port = free_port()
    procs = [ctx.Process(target=_serve_worker, args=(rank, world_size, port, source,
                                                     engine_options, os.getpid()),
                         daemon=True, name=f"tinygpt-rank-{rank}")
             for rank in range(1, world_size)]
    for proc in procs:
        proc.start()
    _watch_workers(procs)
    init_rank(0, world_size, port, timeout_s=SERVE_TIMEOUT_S)
    shard = shard_model(model, 0, world_size)

    class ParallelAsyncEngine(AsyncEngine):
        engine_class = _leader_engine_class()

    return ParallelAsyncEngine(shard, tokenizer, max_waiting=max_waiting, **engine_options)
