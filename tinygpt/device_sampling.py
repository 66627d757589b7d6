"""Sampling without leaving the device: the token choice of a captured (CUDA graph) step.

tinygpt.sampling is written for clarity: Python branches on each knob (`if p == 1: ...`) and a
`torch.multinomial` draw. Inside a CUDA graph nothing may branch on a tensor's value on the host
or copy one back (a `.item()` stalls the stream and cannot be captured), and every request of a
batch may have its own knobs. This module makes the same choice with:

- per-row knobs as tensors of shape (B,): temperature, top_k, top_p, min_p (`RowParams`), so a
  new request changes buffer contents, not the captured graph;
- "off" expressed as values that keep everything (top_k = V, top_p = 1, min_p = 0) and greedy
  rows chosen with `torch.where`, not with Python `if`s;
- the draw as an exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is a
  sample from p (P(i wins) = p_i / sum p). `Tensor.exponential_` takes a generator, and a CUDA
  graph can replay it with fresh random numbers once the generator is registered with the
  graph (torch.cuda.CUDAGraph.register_generator_state).

The filters run in Hugging Face's order (temperature, top-k, top-p, min-p) and keep exactly the
sets tinygpt.sampling's functions keep (ties with the k-th largest survive top-k; top-p keeps
the token that crosses p). Penalties and typical sampling need the request's history or an
entropy sort and stay on the host path: `row_params` refuses them, so a caller picks the fast
path only when they are off.

    params = row_params([SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(0.0)])
    ids = sample_rows(logits, params, generator)     # (2,) long, no host sync
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from tinygpt.sampling import SamplingParams, sharpened

HOST_ONLY = {"typical_p": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
             "presence_penalty": 0.0}


@dataclass
class RowParams:
    """Per-row sampling knobs, each a tensor of shape (B,) on the logits' device.

    temperature float32 (0 = greedy), top_k int64 (0 = off), top_p float32 (1 = off),
    min_p float32 (0 = off).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]

    def copy_(self, other: RowParams) -> RowParams:
        """Copy `other`'s values into these tensors in place (a captured graph's buffers keep
        their addresses). Batches must match."""
        if other.batch != self.batch:
            raise ValueError(f"other must have batch {self.batch}, got {other.batch}")
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name), non_blocking=True)
        return self


def fast_path_refusal(params: SamplingParams) -> str | None:
    """Why `params` cannot be sampled on the device path (None when it can)."""
    if not isinstance(params, SamplingParams):
        return f"params must be a SamplingParams, got {type(params).__name__}"
    used = [f"{name}={getattr(params, name)!r}" for name, off in HOST_ONLY.items()
            if getattr(params, name) != off]
    if used:
        return (f"{', '.join(used)} need(s) the host path (penalties and typical sampling are "
                f"not computed on the device); the device path supports temperature, top_k, "
                f"top_p and min_p")
    return None


def row_params(params: Sequence[SamplingParams], device: torch.device | str = "cpu"
               ) -> RowParams:
    """RowParams for one SamplingParams per row. Raises TypeError when params is not a
    non-empty sequence or one of its elements is not a SamplingParams, and ValueError (naming
    the knob) for a request that needs the host path; see fast_path_refusal."""
    if isinstance(params, SamplingParams) or not isinstance(params, Sequence) or not params:
        raise TypeError("params must be a non-empty sequence of SamplingParams (one per row)")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        why = fast_path_refusal(p)
        if why is not None:
            raise ValueError(f"params[{i}]: {why}")
    return RowParams(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                 device=device),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))


def _check(logits: torch.Tensor, params: RowParams) -> None:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor of shape (B, V), got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if params.batch != logits.shape[0]:
        raise ValueError(f"params must have one row per logits row: {params.batch} rows for "
                         f"logits of batch {logits.shape[0]}")


def filtered_logits(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p per row, as new float32 (B, V) logits with the
    removed tokens at -inf. Greedy rows (temperature 0) are scaled by 1 (their draw is the
    argmax anyway). A row whose logits / T overflows (a tiny T) is divided shifted by its max,
    as tinygpt.sampling.apply_temperature does; a temperature that float32 rounds to 0 (below
    1e-45) is greedy. No host synchronization."""
    _check(logits, params)
    vocab = logits.shape[1]
    # (torch.full, not torch.tensor: a tensor made from a Python number is a copy from the
    # host, which a capturing stream refuses)
    neg_inf = torch.full((), float("-inf"), device=logits.device)
    temperature = torch.where(params.temperature > 0, params.temperature,
                              torch.ones_like(params.temperature))[:, None]
    raw = logits.float()
    x = raw / temperature
    overflow = ~torch.isfinite(x.amax(dim=-1, keepdim=True)) \
        & torch.isfinite(raw.amax(dim=-1, keepdim=True))
    x = torch.where(overflow, sharpened(raw, temperature), x)

    # top-k: the k-th largest value of each row; k = 0 (off) or k >= V keeps everything
    sorted_x = torch.sort(x, dim=-1, descending=True).values
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab),
                    torch.full_like(params.top_k, vocab))
    kth = sorted_x.gather(1, (k - 1)[:, None])
    x = torch.where(x >= kth, x, neg_inf)

    # top-p: keep a token while the mass before it (sorted, stable) is < p; p = 1 keeps all
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = (mass_before < params.top_p[:, None]) | (params.top_p[:, None] >= 1)
    keep_sorted[:, 0].fill_(True)    # the most likely token, also when p rounds to 0 in float32
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    x = torch.where(keep, x, neg_inf)

    # min-p: probability at least min_p times the row's largest; 0 keeps all
    probs = torch.softmax(x, dim=-1)
    threshold = params.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return torch.where(probs >= threshold, x, neg_inf)


def sample_rows(logits: torch.Tensor, params: RowParams,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row: logits (B, V) -> ids (B,) long, without a host synchronization.

    Greedy rows (temperature 0) take the argmax of the raw logits (first index on ties, as
    tinygpt.sampling does); the others draw from softmax(filtered_logits) by an exponential
    race with `generator` (torch's default generator for the device when None).
    """
    _check(logits, params)
    greedy = torch.argmax(logits, dim=-1)
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)     # a zero draw would make 0 / 0
    drawn = torch.argmax(probs / race, dim=-1)
    return torch.where(params.temperature > 0, drawn, greedy)
