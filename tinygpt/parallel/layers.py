"""The parallel layers: each holds this rank's shard as `weight`, like nn.Linear.

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

    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
    distributed_argmax     the greedy token without gathering the logits

The shards they hold come from tinygpt.parallel.sharding; their collectives go through COMM
(tinygpt.parallel.comm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinygpt.parallel.comm import COMM


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
