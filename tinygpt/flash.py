"""Day 16: attention without the score matrix. Online softmax and tiled (Flash-style) attention.

Plain attention writes the (Tq, Tk) score matrix S = Q K^T / sqrt(d) to memory, reads it back
for the softmax, writes the probabilities P, and reads them again for P V. For long sequences
that traffic, not the arithmetic, sets the time. Tiled attention never stores S or P: it walks
key blocks for each query block, keeping per row a running maximum m, a running sum l of
exp(s - m) and an unnormalised output acc. When a new block raises the maximum from m to m',
everything accumulated so far is rescaled by exp(m - m'):

    m' = max(m, rowmax(S_blk))       l' = l * exp(m - m') + rowsum(exp(S_blk - m'))
    acc' = acc * exp(m - m') + exp(S_blk - m') V_blk           out = acc / l  (at the end)

That is the online softmax (one pass for the normaliser) applied inside attention; the result
equals softmax(S) V up to rounding, for any block sizes.

`attention_traffic` counts the elements moved between slow memory (GPU HBM, main memory) and
fast memory (on-chip SRAM, cache) by both algorithms, and `tiled_attention(..., counter=...)`
counts what its loop actually loads and stores, so the model can be checked against the code.
Causal attention is aligned bottom-right, as in tinygpt.attention: with Tq queries and Tk keys,
query i sits at position Tk - Tq + i and sees keys 0 .. Tk - Tq + i.
"""

from __future__ import annotations

import math
from collections import Counter

import torch


def _block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def online_softmax_stats(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running maximum m and sum l = sum(exp(x - m)) over the last axis, in one pass over
    blocks of `block` entries: x (..., N) -> m, l (...,).

    Masked entries (-inf) are allowed, also a whole leading block of them: while a row's
    maximum is still -inf, its exponentials are taken against 0 instead (every term is 0
    either way), since -inf - -inf would be NaN. A row that is -inf throughout ends with
    m = -inf and l = 0."""
    _block("block", block)
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block):
        chunk = x[..., start:start + block]
        m_new = torch.maximum(m, chunk.max(dim=-1).values)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + torch.exp(chunk - safe[..., None]).sum(dim=-1)
        m = m_new
    return m, l


def online_softmax(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """softmax over the last axis with the normaliser from online_softmax_stats."""
    m, l = online_softmax_stats(x, block)
    return torch.exp(x - m[..., None]) / l[..., None]


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    block_q: int = 64, block_k: int = 64, scale: float | None = None,
                    counter: Counter | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v, one (block_q x block_k) tile at a time.

    q (..., Tq, d), k and v (..., Tk, d) with the same leading shape (repeat grouped KV heads
    first, e.g. tinygpt.attention.repeat_kv). Returns (..., Tq, d). scale defaults to
    1 / sqrt(d). counter: a Counter that receives the elements each tile loads ("load_q",
    "load_k", "load_v") and stores ("store_o"), per batch-head (see attention_traffic).
    """
    _block("block_q", block_q)
    _block("block_k", block_k)
    if q.ndim < 2 or q.shape[:-2] != k.shape[:-2] or k.shape != v.shape or \
            q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., Tq, d), k and v (..., Tk, d) must agree, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if causal and tq > tk:
        raise ValueError(f"causal attention needs Tq <= Tk (bottom-right alignment), got "
                         f"Tq={tq}, Tk={tk}")
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    offset = tk - tq                                   # query i sits at position offset + i
    for qs in range(0, tq, block_q):
        qb = q[..., qs:qs + block_q, :]
        rows = qb.shape[-2]
        if counter is not None:
            counter["load_q"] += rows * d
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros(qb.shape[:-1], dtype=q.dtype, device=q.device)
        acc = torch.zeros_like(qb)
        last_key = offset + qs + rows - 1 if causal else tk - 1   # no later key is visible
        for ks in range(0, last_key + 1, block_k):
            kb, vb = k[..., ks:ks + block_k, :], v[..., ks:ks + block_k, :]
            if counter is not None:
                counter["load_k"] += kb.shape[-2] * d
                counter["load_v"] += vb.shape[-2] * d
            s = (qb @ kb.transpose(-1, -2)) * scale                  # (..., rows, cols)
            if causal:
                pos_q = torch.arange(offset + qs, offset + qs + rows, device=q.device)
                pos_k = torch.arange(ks, ks + kb.shape[-2], device=q.device)
                s = s.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
            m_new = torch.maximum(m, s.max(dim=-1).values)
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe[..., None])
            correction = torch.exp(m - safe)
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p @ vb
            m = m_new
        out[..., qs:qs + rows, :] = acc / l[..., None]
        if counter is not None:
            counter["store_o"] += rows * d
    return out


def attention_traffic(tq: int, tk: int, d: int, *, block_q: int, block_k: int,
                      causal: bool = True, bytes_per_element: int = 4) -> dict:
    """Bytes between slow and fast memory for one batch-head of attention.

    plain: read Q and K, write S (Tq x Tk), read S, write P, read P and V, write O:
           2 Tq d + 2 Tk d + 4 Tq Tk elements (the matrices do not fit in fast memory).
    tiled: read each query block once, read the K and V blocks each query block needs
           (causal: only up to the block's last visible key), write O once.
    Returns {"plain", "tiled"} in bytes and "fast_memory_elements", the working set a tile
    needs on chip: a Q block, a K and a V block, the score tile and the accumulator.
    """
    for name, value in (("tq", tq), ("tk", tk), ("d", d), ("block_q", block_q),
                        ("block_k", block_k), ("bytes_per_element", bytes_per_element)):
        _block(name, value)
    if causal and tq > tk:
        raise ValueError(f"causal attention needs tq <= tk, got tq={tq}, tk={tk}")
    plain = 2 * tq * d + 2 * tk * d + 4 * tq * tk
    tiled, offset = 0, tk - tq
    for qs in range(0, tq, block_q):
        rows = min(block_q, tq - qs)
        visible = offset + qs + rows if causal else tk     # keys 0 .. visible - 1
        loaded = sum(min(block_k, tk - ks) for ks in range(0, visible, block_k))
        tiled += 2 * rows * d + 2 * loaded * d             # Q in, O out, K and V in
    working = block_q * d * 2 + 2 * block_k * d + block_q * block_k
    return {"plain": plain * bytes_per_element, "tiled": tiled * bytes_per_element,
            "fast_memory_elements": working}
