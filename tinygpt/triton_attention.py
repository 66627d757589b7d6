"""Day 16, on a GPU: the tiled attention forward of tinygpt.flash as one Triton kernel.

tinygpt.flash.tiled_attention walks the tiles in a Python loop; here each (query block,
batch-head) pair is one Triton program that keeps its Q block, the running maximum m, the
running sum l and the unnormalised output acc in registers / SRAM while it streams the K and V
blocks past them. The score tile S = Q K^T never reaches slow memory. The update per key
block is the online softmax of flash.py:

    m' = max(m, rowmax(S_blk))       l' = l * exp(m - m') + rowsum(exp(S_blk - m'))
    acc' = acc * exp(m - m') + exp(S_blk - m') V_blk           out = acc / l  (at the end)

Shapes are (B, H, T, D): q (B, H, Tq, D), k and v (B, H, Tk, D). Causal attention is aligned
bottom-right as in tinygpt.attention and tinygpt.flash: query i sits at position Tk - Tq + i
and sees keys 0 .. Tk - Tq + i, so Tq == Tk is prefill, Tq == 1 is a decode step and
1 < Tq < Tk is a chunk of prefill on top of a cache. fp16, bf16 and fp32 inputs; the
arithmetic (scores, m, l, acc) is fp32 and the output has the input's dtype.

Without a GPU, Triton's interpreter runs the same kernel on the CPU with NumPy: set
TRITON_INTERPRET=1 before triton (and this module) is imported, and pass CPU tensors.
`triton_available()` says whether the kernel can run here and why not.
"""

from __future__ import annotations

import math
import os

import torch

try:                                   # triton is optional: the module imports without it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def triton_available() -> tuple[bool, str]:
    """(can the kernel run here, why or why not)."""
    if triton is None:
        return False, "triton is not installed"
    if _interpreting():
        return True, "TRITON_INTERPRET is set: the kernel runs in Triton's CPU interpreter"
    if torch.cuda.is_available():
        return True, f"CUDA device: {torch.cuda.get_device_name()}"
    return False, "no CUDA device and TRITON_INTERPRET is not set"


if triton is not None:

    @triton.jit
    def _attention_forward(
        Q, K, V, O,                                    # pointers to the first element
        sq_b, sq_h, sq_t, sq_d,                        # strides of q, in elements
        sk_b, sk_h, sk_t, sk_d,
        sv_b, sv_h, sv_t, sv_d,
        so_b, so_h, so_t, so_d,
        n_heads, TQ, TK, scale,
        CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # This program owns query rows q_start .. q_start + BLOCK_Q - 1 of one batch-head.
        q_start = tl.program_id(0) * BLOCK_Q
        batch = tl.program_id(1) // n_heads
        head = tl.program_id(1) % n_heads
        rows = q_start + tl.arange(0, BLOCK_Q)                 # (BLOCK_Q,) query indices
        dims = tl.arange(0, HEAD_DIM)                          # (HEAD_DIM,)
        row_ok = rows < TQ                                     # the last block may overhang

        q_ptrs = Q + batch * sq_b + head * sq_h + rows[:, None] * sq_t + dims[None, :] * sq_d
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_Q, HEAD_DIM), loaded once

        m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)   # running row maximum
        l = tl.zeros((BLOCK_Q,), dtype=tl.float32)                 # running sum of exp(s - m)
        acc = tl.zeros((BLOCK_Q, HEAD_DIM), dtype=tl.float32)      # running sum of exp(s - m) v

        # Bottom-right causal alignment: query row i sits at key position offset + i, so no key
        # after offset + (last row of this block) is visible and those blocks are skipped.
        offset = TK - TQ
        if CAUSAL:
            hi = tl.minimum(TK, offset + q_start + BLOCK_Q)
        else:
            hi = TK

        k_base = K + batch * sk_b + head * sk_h
        v_base = V + batch * sv_b + head * sv_h
        for k_start in range(0, hi, BLOCK_K):
            keys = k_start + tl.arange(0, BLOCK_K)             # (BLOCK_K,) key indices
            key_ok = keys < TK
            k = tl.load(k_base + keys[:, None] * sk_t + dims[None, :] * sk_d,
                        mask=key_ok[:, None], other=0.0)       # (BLOCK_K, HEAD_DIM)
            v = tl.load(v_base + keys[:, None] * sv_t + dims[None, :] * sv_d,
                        mask=key_ok[:, None], other=0.0)

            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_Q, BLOCK_K)
            visible = key_ok[None, :]                          # padding keys past TK: never
            if CAUSAL:
                visible = visible & (keys[None, :] <= offset + rows[:, None])
            s = tl.where(visible, s, float("-inf"))

            # The online softmax step. A row with nothing visible yet keeps m = -inf; using 0 in
            # its place keeps exp(-inf - (-inf)) = nan out (such a row has l = acc = 0 anyway).
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])                    # (BLOCK_Q, BLOCK_K), <= 1
            correction = tl.exp(m - m_safe)                    # rescales what came before
            l = l * correction + tl.sum(p, axis=1)
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new

        # Every real row sees key 0, so l > 0 there; overhanging rows are not stored.
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        o_ptrs = O + batch * so_b + head * so_h + rows[:, None] * so_t + dims[None, :] * so_d
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])


def _power_of_two(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high or \
            value & (value - 1):
        raise ValueError(f"{name} must be a power of two in {low}..{high}, got {value!r}")
    return value


def _check(q, k, v, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, H, T, D), got {shape}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}.dtype must be float16, bfloat16 or float32, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (B, H, Tq, D) and k (B, H, Tk, D) must agree in B, H and D, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)} (repeat grouped KV heads first)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    _power_of_two("head_dim", q.shape[-1], 16, 128)
    tq, tk = q.shape[2], k.shape[2]
    if tq < 1 or tk < 1:
        raise ValueError(f"q and k need at least one position each, got Tq={tq}, Tk={tk}")
    if causal and tq > tk:
        raise ValueError(f"causal attention needs Tq <= Tk (bottom-right alignment), got "
                         f"Tq={tq}, Tk={tk}")


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                     block_q: int = 64, block_k: int = 64,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ bottom-right causal mask]) v by the Triton kernel.

    q (B, H, Tq, D), k and v (B, H, Tk, D); D a power of two in 16..128; block_q and block_k
    powers of two in 16..256 (tl.dot needs tiles of at least 16). A block larger than the
    next power of two above the length is shrunk to it, so a decode step (Tq = 1) runs
    16-row tiles rather than 64. scale defaults to 1 / sqrt(D). Returns (B, H, Tq, D) in
    q's dtype. CUDA tensors, or CPU tensors with TRITON_INTERPRET=1. fp32 tiles take twice
    the on-chip memory of fp16 ones: at D = 128 use 32 x 32 blocks (64 x 64 needs ~180 KB).
    """
    _power_of_two("block_q", block_q, 16, 256)
    _power_of_two("block_k", block_k, 16, 256)
    _check(q, k, v, causal)
    ok, reason = triton_available()
    if not ok:
        raise RuntimeError(f"triton_attention cannot run: {reason}")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"q is on {q.device}: the kernel needs a CUDA tensor, or "
                           "TRITON_INTERPRET=1 set before triton is imported to run on the CPU")
    if q.device.type == "cuda" and _interpreting():
        raise RuntimeError(f"q is on {q.device} but TRITON_INTERPRET is set: the interpreter "
                           "runs on CPU tensors")

    b, h, tq, d = q.shape
    tk = k.shape[2]
    block_q = min(block_q, max(16, triton.next_power_of_2(tq)))
    block_k = min(block_k, max(16, triton.next_power_of_2(tk)))
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    # fp32 inputs: exact fp32 products rather than TF32, so results match the PyTorch reference.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(tq, block_q), b * h)               # one program per query block and head
    _attention_forward[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, tq, tk, scale,
        CAUSAL=bool(causal), BLOCK_Q=block_q, BLOCK_K=block_k, HEAD_DIM=d,
        PRECISION=precision,
    )
    return out
