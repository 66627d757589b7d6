"""What each rank keeps: the heads, rows and columns of a tensor-parallel shard.

Heads: rank r owns query heads r*H/p .. (r+1)*H/p - 1 and the key/value heads those queries read
(query head h reads KV head h // (H / H_kv)), so attention needs no communication and each
rank's KV cache holds only its own heads. When p > H_kv (more ranks than KV heads) and
p % H_kv == 0, each KV head is replicated on p / H_kv ranks: every rank then stores one KV head
and the KV cache per device stops shrinking with p. Any other degree is refused with a
ValueError, as is a degree that does not divide H or d_ff.

    HeadPlan, plan_heads   which query and KV heads a rank owns (and how many replicas)
    vocab_range            the ids whose embedding rows and logits a rank owns
    shard_state_dict       a rank's part of a TinyGPT state dict, under the same keys

Pure tensor slicing: nothing here talks to another rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tinygpt.model import ModelConfig
from tinygpt.parallel.ranks import _check_rank


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


def _check_d_ff(cfg: ModelConfig, world_size: int) -> None:
    """ValueError unless the tensor-parallel degree divides d_ff (each rank owns a slice)."""
    if cfg.d_ff % world_size:
        raise ValueError(f"the tensor-parallel degree ({world_size}) must divide d_ff "
                         f"({cfg.d_ff})")


def shard_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig, rank: int,
                     world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a TinyGPT state dict, under the same keys.

    wq, wk, wv, w1, w3 (column-parallel): the rows of the rank's heads / d_ff slice;
    wo, w2 (row-parallel): the matching columns; tok_embeddings and output: the rows of the
    rank's vocabulary slice, zero-padded to ceil(V / p) rows so every rank's slice has one
    shape; norms: whole. ValueError when the degree does not divide the heads or d_ff.
    """
    plan = plan_heads(cfg, rank, world_size)
    _check_d_ff(cfg, world_size)
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
