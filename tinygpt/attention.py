"""Day 04: attention.

Scaled dot-product attention lets every query position read a weighted average of the values,
weighted by how well its query matches each key:

    attention(Q, K, V) = softmax(Q K^T / sqrt(d) + mask) V

The causal mask stops a position from reading the future. Multi-head attention runs several
attentions side by side on slices of the channels (`split_heads` / `merge_heads`), and
grouped-query attention (GQA) lets several query heads share one key/value head (`repeat_kv`),
which shrinks the KV cache by the group size.

Conventions:
- Shapes: B batch, H query heads, H_kv key/value heads, T_q queries, T_k keys, d head_dim.
- Masks come in two forms. An *additive* float mask holds 0 where attention is allowed and -inf
  where it is not; it is added to the scores. A *boolean* mask holds True where attention is
  allowed (the convention of `torch.nn.functional.scaled_dot_product_attention`).
- Causal masks with T_q < T_k are aligned to the bottom right: the queries are the LAST T_q
  positions of the T_k keys, as when decoding with a KV cache. Query i sits at absolute position
  i + (T_k - T_q) and sees keys 0 .. i + (T_k - T_q).
- A query row whose every key is masked has no defined softmax and comes back as NaN, as in
  PyTorch; the causal masks here never produce such a row.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# --------------------------------------------------------------------------------------------
# masks


def _check_lengths(t_q: int, t_k: int | None) -> int:
    for name, value in (("t_q", t_q), ("t_k", t_k)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    t_k = t_q if t_k is None else t_k
    if t_k < t_q:
        raise ValueError(f"t_k ({t_k}) must be >= t_q ({t_q}): the queries are the last t_q of "
                         f"the t_k positions, so there cannot be more queries than keys")
    return t_k


def causal_mask_bool(t_q: int, t_k: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean causal mask of shape (t_q, t_k): True where query i may attend to key j.

    t_k defaults to t_q. Aligned to the bottom right: allowed iff j <= i + (t_k - t_q).
    """
    t_k = _check_lengths(t_q, t_k)
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def causal_mask(t_q: int, t_k: int | None = None, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Additive causal mask of shape (t_q, t_k): 0 where allowed, -inf above the diagonal.

    t_k defaults to t_q (the square mask of a full forward pass). With t_q < t_k the diagonal is
    shifted to the bottom right, so the t_q queries are the last t_q positions.
    Example: causal_mask(2, 4) = [[0, 0, 0, -inf], [0, 0, 0, 0]].
    """
    allowed = causal_mask_bool(t_q, t_k, device=device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, float("-inf"))


def sliding_window_mask(t_q: int, t_k: int | None, window: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean sliding-window causal mask (t_q, t_k): True where query i may attend to key j.

    Bottom-right aligned like causal_mask_bool: query i sits at position p = i + (t_k - t_q)
    and sees keys p - window + 1 .. p, the last `window` positions including its own (Mistral's
    convention in transformers: key j is visible iff j > p - window). window >= t_k is plain
    causal attention. Each layer of a windowed model reads at most `window` keys per query,
    so its KV cache needs only the last window - 1 positions besides the new ones (day 21).
    """
    t_k = _check_lengths(t_q, t_k)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    pos = torch.arange(t_q, device=device)[:, None] + (t_k - t_q)
    keys = torch.arange(t_k, device=device)[None, :]
    return (keys <= pos) & (keys > pos - window)


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean mask (True = attend) into an additive one; leave a float mask alone."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, float("-inf"))
    if not mask.dtype.is_floating_point:
        raise TypeError(f"mask must be a bool or floating point tensor, got dtype {mask.dtype}")
    return mask.to(dtype)


# --------------------------------------------------------------------------------------------
# scaled dot-product attention in NumPy


def _softmax_numpy(x: np.ndarray) -> np.ndarray:
    """Stable softmax over the last axis (subtract the row max before exp)."""
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=-1, keepdims=True)


def sdpa_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray,
               mask: np.ndarray | None = None) -> np.ndarray:
    """softmax(q k^T / sqrt(d) + mask) v in NumPy.

    q: (..., T_q, d).   k: (..., T_k, d).   v: (..., T_k, d_v).
    mask: None, an additive float mask or a boolean mask (True = attend), broadcastable to
    (..., T_q, T_k). Returns (..., T_q, d_v).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError("q, k and v need at least 2 dimensions (..., T, d)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d, got {q.shape[-1]} and "
                         f"{k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of positions T_k, got "
                         f"{k.shape[-2]} and {v.shape[-2]}")
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])       # (..., T_q, T_k)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + mask
    return _softmax_numpy(scores) @ v


# --------------------------------------------------------------------------------------------
# scaled dot-product attention in torch


def attention_weights(q: torch.Tensor, k: torch.Tensor, causal: bool = True,
                      mask: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """The attention probabilities softmax(q k^T * scale + mask).

    q: (..., T_q, d).   k: (..., T_k, d) with the same leading dimensions as q.
    causal: apply `causal_mask(T_q, T_k)` (bottom-right aligned).   mask: optional bool or
    additive mask broadcastable to (..., T_q, T_k), combined with the causal one.
    scale: defaults to 1 / sqrt(d). Softmax runs in float32 (float64 for float64 inputs: half
    precision is upcast, double precision is never rounded down); returns (..., T_q, T_k) in
    q's dtype.
    """
    if q.ndim < 2 or q.ndim != k.ndim:
        raise ValueError(f"q and k must have the same number (>= 2) of dimensions, got shapes "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must have the same leading (batch, head) dimensions, got "
                         f"{tuple(q.shape[:-2])} and {tuple(k.shape[:-2])}; for grouped-query "
                         f"attention use grouped_query_attention")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and "
                         f"{k.shape[-1]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale                            # (..., T_q, T_k)
    t_q, t_k = q.shape[-2], k.shape[-2]
    if causal:
        scores = scores + causal_mask(t_q, t_k, dtype=scores.dtype, device=scores.device)
    if mask is not None:
        scores = scores + _as_additive(mask, scores.dtype)
    softmax_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    return torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 causal: bool = True, mask: torch.Tensor | None = None,
                                 scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, written out.

    q: (..., T_q, d).   k: (..., T_k, d).   v: (..., T_k, d_v), same leading dimensions.
    causal: bottom-right aligned causal mask (T_q <= T_k). mask: optional bool (True = attend)
    or additive float mask broadcastable to (..., T_q, T_k); applied on top of the causal one.
    Returns (..., T_q, d_v). Equals torch.nn.functional.scaled_dot_product_attention for T_q = T_k
    (that function's is_causal aligns to the top left when T_q < T_k; this one does not).
    """
    if v.shape[:-2] != k.shape[:-2] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have shape (..., T_k, d_v) matching k {tuple(k.shape)}, got "
                         f"{tuple(v.shape)}")
    weights = attention_weights(q, k, causal=causal, mask=mask, scale=scale)
    return weights @ v


# --------------------------------------------------------------------------------------------
# heads


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, D) -> (B, n_heads, T, D / n_heads): head h holds channels h*d .. (h+1)*d - 1."""
    if x.ndim != 3:
        raise ValueError(f"x must have shape (B, T, D), got shape {tuple(x.shape)}")
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")
    B, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"D ({D}) must be divisible by n_heads ({n_heads})")
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) -> (B, T, H * d), the inverse of `split_heads`."""
    if x.ndim != 4:
        raise ValueError(f"x must have shape (B, H, T, d), got shape {tuple(x.shape)}")
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, d) -> (B, H_kv * n_rep, T, d), each kv head repeated n_rep times in a row.

    Output head h is input head h // n_rep, so query head h of a GQA layer uses kv head
    h // n_rep. Same as torch.repeat_interleave(x, n_rep, dim=1).
    """
    if x.ndim != 4:
        raise ValueError(f"x must have shape (B, H_kv, T, d), got shape {tuple(x.shape)}")
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be a positive integer, got {n_rep!r}")
    if n_rep == 1:
        return x
    B, H_kv, T, d = x.shape
    return x[:, :, None].expand(B, H_kv, n_rep, T, d).reshape(B, H_kv * n_rep, T, d)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            causal: bool = True, mask: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """Attention where H query heads share H_kv key/value heads (H_kv divides H).

    q: (B, H, T_q, d).   k, v: (B, H_kv, T_k, d).   Query head h reads kv head h // (H / H_kv).
    causal, mask, scale: as in `scaled_dot_product_attention`. Returns (B, H, T_q, d).
    H_kv = H is ordinary multi-head attention; H_kv = 1 is multi-query attention.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must have shape (B, H, T, d), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if v.shape[1] != n_kv_heads:
        raise ValueError(f"k and v must have the same number of heads, got {n_kv_heads} and "
                         f"{v.shape[1]}")
    if n_heads % n_kv_heads:
        raise ValueError(f"the number of kv heads ({n_kv_heads}) must divide the number of "
                         f"query heads ({n_heads})")
    n_rep = n_heads // n_kv_heads
    return scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                        causal=causal, mask=mask, scale=scale)
