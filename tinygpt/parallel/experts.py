"""Day 20: expert parallelism (EP). Each rank holds E / p experts; the tokens travel to them.

A mixture-of-experts layer (tinygpt.moe.MoE) has E experts, and a token uses k of them. Over
p ranks, expert parallelism gives rank r experts [r E/p, (r+1) E/p) of every MoE layer (E must
split evenly); the router (E, D), attention, norms, embeddings, dense layers and the shared
experts are replicated. One MoE layer's forward on rank r:

    1. split   the N tokens of the batch (flattened) into p contiguous chunks, the first
               N mod p ranks one token more (token_range); rank r routes its own chunk. At
               batch 1 decode rank 0 holds the one token and the others hold none
    2. counts  all-to-all of the (token, slot) pair counts per expert: rank r tells rank q how
               many rows it will send to each of q's experts (E / p int64 per peer)
    3. dispatch  all-to-all of the rows: rank r sends x[token] for every (token, slot) pair
               whose expert lives on rank q, sorted by expert (so by owner), to q
    4. experts  rank q runs each local expert once over all the rows it received (one product
               per expert; tinygpt.moe.dispatch with unit weights), an expert nobody chose
               costs nothing
    5. combine  all-to-all of the expert outputs back to the rows' home ranks, in the order
               they came (the reverse split sizes)
    6. weights  the home rank multiplies each row by its routing weight and adds the k rows of
               a token (index_add), plus the shared expert on its own tokens
    7. gather  all-gather of the p chunks' outputs, so every rank continues with the full
               (N, D) hidden states (the dense parts are replicated). gloo's all_gather needs
               equal sizes, so each chunk is padded to ceil(N / p) rows

Why all-to-all and not all-reduce: tensor parallelism (tinygpt.parallel.model) splits every
weight matrix, every rank computes a partial sum for every token, and an all-reduce adds the
partial sums; expert parallelism keeps each expert whole on one rank and moves the token rows
to where their experts' weights are, then moves the results back. What moves per MoE layer and
rank: about tokens x k x (p - 1) / p rows of D values out and as many back (a row whose expert
is at home does not leave), plus E / p counts per peer and the all-gather of the outputs;
tinygpt.parallel.cost.alltoall_bytes and ep_comm_estimate predict it, dispatch_rows counts it
for a given routing.

Where the load imbalance shows up: in step 4. The ranks wait for each other at the combine,
so the step takes as long as the rank whose experts received the most rows (a popular expert
makes its rank the busiest one; `last_rows` keeps the rows each rank ran). The all-to-all's
bytes are uneven too: the busiest receiver sets its time (cost.alltoall_seconds).

Why dropless: every (token, expert) pair is computed, however many pick the same expert. A
capacity per expert (tinygpt.moe.dispatch's `capacity`) would drop pairs past it, and whether
a token's pair is dropped would depend on the other tokens in the batch and on how the batch
was split over ranks: the same prompt would answer differently with other traffic. Inference
engines run dropless, and so does this: the split sizes follow the actual counts.

gloo (torch 2.13) runs all_to_all_single on CPU tensors with uneven input and output split
sizes, zero splits and empty tensors included (checked on a 2-core AMD EPYC with float32 and
bfloat16 rows, as the tests run them, int64 counts, and float16); its all_gather refuses
tensors of different sizes, hence the padding. The code passes its tensors as they are, so
NCCL on GPUs would run the same calls; it has not run there (it needs one GPU per rank).

    token_range, expert_range   which tokens a rank routes, which experts it holds
    dispatch_rows               (p, p) rows each rank sends each rank, for a routing
    EPStats, EP_COMM            this process's all-to-alls and all-gathers, timed and counted
    ExpertParallelMoE           one rank's shard of a MoE layer: (..., D) -> (..., D)
    expert_parallel_model       a TinyGPT whose MoE layers are their shards on this rank
    ep_check                    a model from a source on local ranks: logits, greedy tokens
    measure_ep_decode           greedy decode over p ranks against one process, the step split
                                into all-to-all, all-gather and the rest, with the cost model
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tinygpt.model import TinyGPT
from tinygpt.moe import MoE, dispatch, sort_by_expert
from tinygpt.parallel.cost import (
    Link,
    _check_decode_run,
    _check_link,
    ep_comm_estimate,
    fit_alltoall_link,
    measure_alltoall,
)
from tinygpt.parallel.ranks import _check_rank, _group_rank, run_ranks
from tinygpt.parallel.source import load_source, source_config

# --------------------------------------------------------------------------------------------
# the plan: which tokens and experts a rank owns


def expert_range(n_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """Experts [start, end) of `rank`: E / p whole experts each. ValueError unless p divides E."""
    _check_rank(rank, world_size)
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive integer, got {n_experts!r}")
    if n_experts % world_size:
        raise ValueError(f"n_experts (E={n_experts}) must be divisible by the expert-parallel "
                         f"degree world_size={world_size}: each rank holds E / world_size whole "
                         f"experts (degrees allowed: the divisors of {n_experts})")
    per = n_experts // world_size
    return rank * per, (rank + 1) * per


def token_range(n_tokens: int, rank: int, world_size: int) -> tuple[int, int]:
    """Tokens [start, end) of the flattened batch that `rank` routes: contiguous chunks, the
    first n_tokens mod p ranks one token more (a rank may hold none: batch 1 on 2 ranks)."""
    _check_rank(rank, world_size)
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
    base, extra = divmod(n_tokens, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def dispatch_rows(experts: torch.Tensor, n_experts: int, world_size: int) -> torch.Tensor:
    """(p, p) int64: rows[s, q] = (token, slot) rows rank s sends to rank q in the dispatch
    all-to-all, for the whole batch's routing `experts` (N, k) split by token_range (the
    combine sends rows.T back). The diagonal stays home; rows.sum(1) - diag is what leaves."""
    if not isinstance(experts, torch.Tensor) or experts.ndim != 2:
        raise ValueError(f"experts must be a tensor of shape (N, k), got "
                         f"{getattr(experts, 'shape', type(experts).__name__)}")
    per = expert_range(n_experts, 0, world_size)[1]
    owners = experts.reshape(experts.shape[0], -1) // per                      # (N, k)
    rows = torch.zeros(world_size, world_size, dtype=torch.int64)
    for s in range(world_size):
        start, end = token_range(experts.shape[0], s, world_size)
        rows[s] = torch.bincount(owners[start:end].reshape(-1).cpu(), minlength=world_size)
    return rows


# --------------------------------------------------------------------------------------------
# the collectives, timed and counted


class EPStats:
    """Seconds, calls and bytes of this process's expert-parallel collectives. Bytes count
    what crossed between ranks: a rank's own split of an all-to-all (and its own chunk of an
    all-gather) stays in memory and is not counted. A collective's seconds include waiting for
    the slowest rank to arrive: the load imbalance of the experts lands in the combine's.
    expert_rows, expert_seconds: the rows this rank's experts ran and the time they took."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.alltoall_seconds, self.alltoall_calls = 0.0, 0
        self.alltoall_bytes_sent, self.alltoall_bytes_received = 0, 0
        self.gather_seconds, self.gather_calls, self.gather_bytes = 0.0, 0, 0
        self.expert_rows, self.expert_seconds = 0, 0.0

    def snapshot(self) -> dict:
        """The counters as a plain dict (picklable, for a rank's return value)."""
        return dict(vars(self))

    def alltoall(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None,
                 in_splits: list[int] | None, rank: int, group=None) -> None:
        """all_to_all_single(out, x, out_splits, in_splits); splits in rows (None: equal)."""
        p = dist.get_world_size(group)
        row = math.prod(x.shape[1:]) * x.element_size()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        self.alltoall_seconds += time.perf_counter() - t0
        self.alltoall_calls += 1
        sent = in_splits if in_splits is not None else [x.shape[0] // p] * p
        got = out_splits if out_splits is not None else [out.shape[0] // p] * p
        self.alltoall_bytes_sent += (x.shape[0] - sent[rank]) * row
        self.alltoall_bytes_received += (out.shape[0] - got[rank]) * row

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor, group=None) -> None:
        t0 = time.perf_counter()
        dist.all_gather(parts, x, group=group)
        self.gather_seconds += time.perf_counter() - t0
        self.gather_calls += 1
        self.gather_bytes += x.numel() * x.element_size() * (len(parts) - 1)


EP_COMM = EPStats()         # this process's expert-parallel collectives; reset() before measuring


# --------------------------------------------------------------------------------------------
# the layer


class ExpertParallelMoE(nn.Module):
    """One rank's shard of a tinygpt.moe.MoE layer: x (..., D) -> (..., D), the full layer's
    output on every rank (see the module docstring for the steps).

    `moe` is the shard: the MoE's router over all E experts, its shared expert and bias, and
    only experts [expert_start, expert_start + n_local) in w1, w3, w2 (their local index is
    expert - expert_start). Every rank must call forward with the same x (the replicated
    hidden states): the all-to-alls wait for all ranks. With world_size 1 no process group is
    needed and nothing is sent. last_experts: this rank's tokens' routing (n_r, k);
    last_rows: the rows its experts ran in the last forward. stats (default EP_COMM) counts
    the collectives.
    """

    def __init__(self, moe: MoE, rank: int | None = None, world_size: int | None = None,
                 group=None, stats: EPStats | None = None) -> None:
        super().__init__()
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a tinygpt.moe.MoE, got {type(moe).__name__}")
        rank, world_size = _group_rank(rank, world_size, group)
        start, end = expert_range(moe.n_experts, rank, world_size)
        with torch.no_grad():                  # the shard: everything but the other experts
            memo = {id(getattr(moe, name)): nn.Parameter(
                getattr(moe, name).detach()[start:end].clone(), requires_grad=False)
                for name in ("w1", "w3", "w2")}
            memo[id(moe.last_experts)] = None
            self.moe = copy.deepcopy(moe, memo)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.n_experts, self.expert_start, self.n_local = moe.n_experts, start, end - start
        self.stats = EP_COMM if stats is None else stats
        self.last_experts: torch.Tensor | None = None
        self.last_rows = 0

    def _alltoall(self, out: torch.Tensor, x: torch.Tensor, out_splits=None,
                  in_splits=None) -> None:
        if self.world_size == 1:
            out.copy_(x)
        else:
            self.stats.alltoall(out, x, out_splits, in_splits, self.rank, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, p, n_local = x.shape, self.world_size, self.n_local
        flat = x.reshape(-1, shape[-1])
        n, d = flat.shape
        if n == 0:                  # every rank holds the same (empty) batch: nothing to send
            return torch.zeros_like(x)
        start, end = token_range(n, self.rank, p)
        local = flat[start:end]
        weights, experts = self.moe.route(local)                              # (n_r, k)
        self.last_experts = experts
        order, tokens, counts = sort_by_expert(experts, self.n_experts)       # by owner too
        # 2. the counts: rank q receives, from each rank s, s's pairs per expert of q's
        recv_counts = torch.empty_like(counts)
        self._alltoall(recv_counts, counts)
        recv_counts = recv_counts.view(p, n_local)
        send_splits = counts.view(p, n_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        # 3. dispatch: the rows, sorted by expert, to their experts' ranks
        received = flat.new_empty(sum(recv_splits), d)
        self._alltoall(received, local[tokens], recv_splits, send_splits)
        # 4. the local experts: one product per expert over the rows from every rank (source
        # order, so token order: the rows the one-process dispatch gives that expert)
        local_ids = torch.arange(n_local, device=x.device).repeat(p)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1))
        ones = torch.ones(len(local_ids), 1, device=x.device)
        t0 = time.perf_counter()
        done = dispatch(received, ones, local_ids[:, None], self.moe.w1, self.moe.w3,
                        self.moe.w2)
        self.stats.expert_seconds += time.perf_counter() - t0
        self.last_rows = len(local_ids)
        self.stats.expert_rows += len(local_ids)
        # 5. combine: the outputs back to their home ranks, in the order they were sent
        back = flat.new_empty(len(tokens), d)
        self._alltoall(back, done, send_splits, recv_splits)
        # 6. the routing weights on the home rank, the k rows of a token summed (in float32,
        # or x's dtype when wider: a float64 run stays float64, as in tinygpt.moe)
        acc = torch.promote_types(back.dtype, torch.float32)
        out = torch.zeros_like(local)
        out.index_add_(0, tokens, (back.to(acc) * weights.reshape(-1)[order, None].to(acc))
                       .to(x.dtype))
        if self.moe.shared is not None:
            out = out + self.moe.shared(local)
        # 7. every rank gets every chunk (padded to the largest: gloo's all_gather wants equal
        # sizes)
        if p == 1:
            return out.reshape(shape)
        chunk = token_range(n, 0, p)[1]
        padded = out.new_zeros(chunk, d)
        padded[:len(out)] = out
        parts = [torch.empty_like(padded) for _ in range(p)]
        self.stats.all_gather(parts, padded, self.group)
        sizes = [token_range(n, q, p) for q in range(p)]
        full = torch.cat([part[:e - s] for part, (s, e) in zip(parts, sizes, strict=True)])
        return full.reshape(shape)

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, world_size={self.world_size}, experts=[{self.expert_start}, "
                f"{self.expert_start + self.n_local}) of {self.n_experts}")


def expert_parallel_model(model: TinyGPT, rank: int | None = None,
                          world_size: int | None = None, group=None,
                          stats: EPStats | None = None) -> TinyGPT:
    """Turn `model` into its expert-parallel shard on this rank, IN PLACE, and return it:
    every layer whose feed_forward is a tinygpt.moe.MoE gets an ExpertParallelMoE holding this
    rank's E / p experts (the other experts are dropped with the full layer); everything else
    stays, replicated. rank and world_size default to the process group's. generate(), the
    KV cache and decode_step run on the result unchanged, every rank calling them with the
    same inputs (its fused decode fast paths are off: they run a tinygpt.moe.MoE layer
    through MoEDecode, but an ExpertParallelMoE is not a MoE, so they would take it for a
    SwiGLU)."""
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    rank, world_size = _group_rank(rank, world_size, group)
    moe_layers = [i for i, block in enumerate(model.layers)
                  if isinstance(block.feed_forward, MoE)]
    if not moe_layers:
        raise ValueError("model has no MoE layer (layers.{i}.feed_forward a tinygpt.moe.MoE): "
                         "there are no experts to split")
    for i in moe_layers:
        block = model.layers[i]
        block.feed_forward = ExpertParallelMoE(block.feed_forward, rank, world_size, group,
                                               stats)
    if getattr(model, "fused_decode", True):
        model.fused_decode = False              # DecodeStep's fused path reads SwiGLU weights
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return model.eval()


# --------------------------------------------------------------------------------------------
# checked and measured on local ranks


def _ep_check_rank(rank: int, world_size: int, source, prompts: list[list[int]],
                   max_new_tokens: int) -> dict:
    """A rank of ep_check: the shard's logits and greedy tokens, and whether all ranks agree."""
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    model = expert_parallel_model(load_source(source), rank, world_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    EP_COMM.reset()
    with torch.inference_mode():
        device = model.norm.weight.device
        logits = [model(torch.tensor([p], device=device))[0].cpu() for p in prompts]
        tokens = [generate(model, p, params).token_ids for p in prompts]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (tokens, [lg.sum().item() for lg in logits]))
    return dict(logits=logits, tokens=tokens, stats=EP_COMM.snapshot(),
                ranks_agree=all(e == everyone[0] for e in everyone))


def ep_check(source, world_size: int, prompts: list[list[int]], max_new_tokens: int = 8,
             timeout_s: float = 120.0) -> list[dict]:
    """Run the MoE model from `source` (see load_source) expert-parallel over `world_size`
    local ranks. Returns each rank's dict: logits (per prompt (T, V)), tokens (greedy
    generate()), stats (EPStats counters over the run) and ranks_agree (every rank saw the
    same tokens and logits)."""
    return run_ranks(_ep_check_rank, world_size, source, prompts, max_new_tokens,
                     timeout_s=timeout_s)


def _ep_decode_rank(rank: int, world_size: int, source, batch: int, prompt_len: int,
                    new_tokens: int) -> dict:
    """Greedy decode of `batch` sequences on one rank (world_size 1: the plain model):
    seconds per step and the collectives' share."""
    from tinygpt.kv_cache import KVCache, decode_step, prefill

    torch.set_num_threads(1)                  # one core per rank, and for one process alike
    model = load_source(source)
    if world_size > 1:
        model = expert_parallel_model(model, rank, world_size)
    moe = [b.feed_forward for b in model.layers
           if isinstance(b.feed_forward, MoE | ExpertParallelMoE)]
    first = moe[0].moe if isinstance(moe[0], ExpertParallelMoE) else moe[0]
    cache = KVCache.for_model(model, batch_size=batch, max_len=prompt_len + new_tokens + 3)
    device = model.norm.weight.device
    ids = (torch.arange(batch * prompt_len, device=device).view(batch, prompt_len) * 7 + 3) \
        % model.cfg.vocab_size
    with torch.inference_mode():
        token = prefill(model, cache, ids).argmax(-1, keepdim=True)
        for _ in range(2):                                    # warm-up steps
            token = decode_step(model, cache, token).argmax(-1, keepdim=True)
        if world_size > 1:
            dist.barrier()
        EP_COMM.reset()
        tokens, steps = [], []                     # per step: (seconds, all-to-all, gather)
        for _ in range(new_tokens):
            t0, a0, g0 = time.perf_counter(), EP_COMM.alltoall_seconds, EP_COMM.gather_seconds
            token = decode_step(model, cache, token).argmax(-1, keepdim=True)
            tokens.append(token[:, 0].tolist())
            steps.append((time.perf_counter() - t0, EP_COMM.alltoall_seconds - a0,
                          EP_COMM.gather_seconds - g0))
    s = EP_COMM.snapshot()
    return dict(step_seconds=sum(t for t, _, _ in steps) / new_tokens, steps=steps,
                tokens=tokens, alltoall_seconds=s["alltoall_seconds"] / new_tokens,
                gather_seconds=s["gather_seconds"] / new_tokens,
                alltoall_calls=s["alltoall_calls"] / new_tokens,
                alltoall_bytes=s["alltoall_bytes_sent"] / new_tokens,
                expert_rows=s["expert_rows"] / new_tokens,
                expert_seconds=s["expert_seconds"] / new_tokens, n_moe_layers=len(moe),
                top_k=first.top_k, n_experts=first.n_experts, d_model=model.cfg.d_model)


@dataclass(frozen=True)
class EPDecodeMeasurement:
    """Measured greedy decode, one process against `world_size` expert-parallel ranks, per
    step: the slowest rank's step split into its all-to-alls, all-gathers and the rest, with
    the cost model's all-to-all time on a link fitted on the same machine beside it. The
    measured all-to-all time includes waiting for the other ranks (a rank whose experts got
    more rows, or that the operating system scheduled late); the cost model's is transfer
    only. `steps`: the slowest rank's (seconds, all-to-all, all-gather) of every step."""

    world_size: int
    batch: int
    one_step_seconds: float              # one process, the plain MoE model
    ep_step_seconds: float               # the slowest rank's
    alltoall_seconds: float              # per step, that rank's time inside all-to-alls
    gather_seconds: float                # per step, inside the outputs' all-gathers
    alltoall_calls: float                # per step (3 per MoE layer)
    alltoall_bytes: float                # per step, the most any rank sent to the others
    expert_rows: tuple[float, ...]       # per step and rank, rows its experts ran (the load)
    expert_seconds: tuple[float, ...]    # per step and rank, the time its experts took
    predicted_alltoall_seconds: float    # ep_comm_estimate on `link`, uniform routing
    predicted_gather_seconds: float
    link: Link
    tokens: list                         # per step, the batch's greedy tokens (EP)
    one_tokens: list                     # the same from one process
    tokens_identical: bool
    steps: tuple[tuple[float, float, float], ...]

    @property
    def other_seconds(self) -> float:
        """The step without its collectives: attention, experts, router, head."""
        return self.ep_step_seconds - self.alltoall_seconds - self.gather_seconds

    @property
    def alltoall_share(self) -> float:
        return self.alltoall_seconds / self.ep_step_seconds


def measure_ep_decode(source, world_size: int = 2, batch: int = 1, prompt_len: int = 16,
                      new_tokens: int = 16, link: Link | None = None,
                      timeout_s: float = 300.0) -> EPDecodeMeasurement:
    """Greedy decode of `batch` sequences of the MoE model from `source` in one process, then
    over `world_size` expert-parallel gloo ranks (one thread each); the all-to-all time
    predicted on `link` (default: fitted to all-to-alls measured now on the same ranks).
    world_size >= 2, prompt_len + new_tokens + 3 <= max_seq_len: ValueError before any rank
    starts."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    cfg = source_config(source)
    _check_decode_run(cfg, world_size, prompt_len, new_tokens)
    if not cfg.is_moe:
        raise ValueError("the model from source has no MoE layer (n_experts is not set): there "
                         "are no experts to split; measure a dense model with measure_tp_decode")
    expert_range(cfg.n_experts, 0, world_size)                  # p must divide E
    if link is not None:
        _check_link(link)
    if link is None:
        link = fit_alltoall_link(measure_alltoall(world_size, backend="gloo"), world_size,
                                 "this machine's all-to-all (fitted)")
    one = run_ranks(_ep_decode_rank, 1, source, batch, prompt_len, new_tokens,
                    timeout_s=timeout_s, backend="gloo")[0]
    many = run_ranks(_ep_decode_rank, world_size, source, batch, prompt_len, new_tokens,
                     timeout_s=timeout_s, backend="gloo")
    worst = max(many, key=lambda r: r["step_seconds"])
    predicted = ep_comm_estimate(batch, one["top_k"], one["d_model"], one["n_experts"],
                                 world_size, link, one["n_moe_layers"], "fp32")
    return EPDecodeMeasurement(
        world_size, batch, one["step_seconds"], worst["step_seconds"],
        worst["alltoall_seconds"], worst["gather_seconds"], worst["alltoall_calls"],
        max(r["alltoall_bytes"] for r in many), tuple(r["expert_rows"] for r in many),
        tuple(r["expert_seconds"] for r in many), predicted.alltoall_seconds,
        predicted.gather_seconds, link, worst["tokens"], one["tokens"],
        all(r["tokens"] == one["tokens"] for r in many), tuple(worst["steps"]))
