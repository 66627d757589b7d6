"""Day 03: embeddings and positions.

A transformer sees token ids, not words: the first layer turns each id into a row of a learned
table (an *embedding*). Attention by itself is blind to order, so position information has to be
added somewhere. This module holds the three ideas of the day:

1. Embedding lookup. ``table[ids]`` picks rows; it is exactly the matrix product
   ``one_hot(ids) @ table``, which is why an embedding is "just a linear layer on one-hot inputs".
2. Sinusoidal encoding ("Attention Is All You Need", 2017): a fixed (T, d) matrix added to the
   embeddings, ``PE[p, 2i] = sin(p / base^(2i/d))`` and ``PE[p, 2i+1] = cos(p / base^(2i/d))``.
3. Rotary position embedding (RoPE, Su et al. 2021), used by Llama: rotate pairs of query/key
   channels by an angle proportional to the position. The score ``q_m . k_n`` then depends only
   on the offset ``m - n``. We follow the Hugging Face Llama convention ("rotate half"): channel
   ``j`` is paired with channel ``j + head_dim/2``, the frequencies are
   ``inv_freq[i] = base^(-2i/head_dim)`` and cos/sin tables of shape (T, head_dim) repeat the
   (T, head_dim/2) angles twice.

Shapes: B batch, H heads, T positions, d / head_dim channels, V vocabulary size.
"""

from __future__ import annotations

import math

import numpy as np
import torch

Array = np.ndarray | torch.Tensor

# --------------------------------------------------------------------------------------------
# 1. embedding lookup


def _check_ids(ids: Array, num_classes: int, name: str = "ids") -> None:
    """Raise unless `ids` is an integer array/tensor with values in [0, num_classes)."""
    if isinstance(ids, torch.Tensor):
        is_int = not (ids.dtype.is_floating_point or ids.dtype.is_complex
                      or ids.dtype == torch.bool)
        empty = ids.numel() == 0
    elif isinstance(ids, np.ndarray):
        is_int = np.issubdtype(ids.dtype, np.integer)
        empty = ids.size == 0
    else:
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(ids).__name__}")
    if not is_int:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if empty:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_classes:
        raise ValueError(f"{name} must lie in [0, {num_classes}), got values in [{low}, {high}]")


def _check_table(table: Array) -> None:
    if not isinstance(table, np.ndarray | torch.Tensor):
        raise TypeError(f"table must be a numpy array or torch tensor, got {type(table).__name__}")
    if table.ndim != 2:
        raise ValueError(f"table must have shape (V, d), got shape {tuple(table.shape)}")


def one_hot(ids: Array, num_classes: int) -> Array:
    """One-hot encode integer ids.

    ids: integer array/tensor of any shape (...), values in [0, num_classes).
    Returns a float array/tensor of shape (..., num_classes) (NumPy in, NumPy out; torch in,
    torch out) with a single 1.0 per row, at column ``ids[...]``.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    _check_ids(ids, num_classes)
    if isinstance(ids, torch.Tensor):
        return torch.nn.functional.one_hot(ids.long(), num_classes).to(torch.float32)
    return (ids[..., None] == np.arange(num_classes)).astype(np.float64)


def embedding_lookup(table: Array, ids: Array) -> Array:
    """Embedding as a row index: ``table[ids]``.

    table: (V, d) array/tensor.   ids: integer array/tensor of shape (...), values in [0, V).
    Returns (..., d) with the same type and dtype as `table`.
    """
    _check_table(table)
    _check_ids(ids, table.shape[0])
    if isinstance(table, torch.Tensor):
        return table[torch.as_tensor(ids, device=table.device).long()]
    return table[np.asarray(ids)]


def embedding_onehot_matmul(table: Array, ids: Array) -> Array:
    """Embedding as a matrix product: ``one_hot(ids, V) @ table``; equal to `embedding_lookup`.

    table: (V, d).   ids: integer (...), values in [0, V).   Returns (..., d).
    Costs V times more multiplications than the lookup, which is why nobody computes it this way.
    """
    _check_table(table)
    if isinstance(table, torch.Tensor):
        ids = torch.as_tensor(ids, device=table.device)
        return one_hot(ids, table.shape[0]).to(table.dtype) @ table
    return one_hot(np.asarray(ids), table.shape[0]).astype(table.dtype) @ table


# --------------------------------------------------------------------------------------------
# 2. sinusoidal encoding


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_base(base: float) -> None:
    if isinstance(base, bool) or not isinstance(base, int | float) or not base > 1:
        raise ValueError(f"base must be a number > 1, got {base!r}")


def sinusoidal_encoding(seq_len: int, d_model: int, base: float = 10000.0) -> np.ndarray:
    """Fixed sinusoidal position encoding of "Attention Is All You Need".

    Returns a float64 array PE of shape (seq_len, d_model) with, for i = 0 .. d_model/2 - 1,
        PE[p, 2i]     = sin(p / base^(2i / d_model))
        PE[p, 2i + 1] = cos(p / base^(2i / d_model))
    Channels are interleaved (sin, cos, sin, cos, ...); d_model must be even.
    """
    _check_positive_int(seq_len, "seq_len")
    _check_positive_int(d_model, "d_model")
    if d_model % 2:
        raise ValueError(f"d_model must be even, got {d_model}")
    _check_base(base)
    positions = np.arange(seq_len, dtype=np.float64)[:, None]            # (T, 1)
    inv_freq = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # (d/2,)
    angles = positions * inv_freq                                        # (T, d/2)
    pe = np.empty((seq_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angles)
    pe[:, 1::2] = np.cos(angles)
    return pe


# --------------------------------------------------------------------------------------------
# 3. rotary position embedding (RoPE), Hugging Face Llama convention


def rope_inv_freq(head_dim: int, base: float = 10000.0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RoPE inverse frequencies ``inv_freq[i] = base^(-2i / head_dim)``, i = 0 .. head_dim/2 - 1.

    Returns a tensor of shape (head_dim / 2,). In float32 (the default) it is computed the same
    way as Hugging Face's Llama, so cos/sin tables agree bit for bit.
    """
    _check_positive_int(head_dim, "head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    _check_base(base)
    exponents = torch.arange(0, head_dim, 2, dtype=dtype) / head_dim
    return 1.0 / (float(base) ** exponents)


def rope_cos_sin(
    head_dim: int,
    positions: int | torch.Tensor,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables for RoPE.

    positions: an int T (meaning positions 0 .. T-1) or an integer tensor of absolute positions
    of any shape (...), e.g. (T,) or (B, T).
    Returns (cos, sin), each of shape (..., head_dim) — (T, head_dim) for an int — where
    ``angles = positions * inv_freq`` (..., head_dim/2) is concatenated with itself. Angles are
    computed in float32 like Hugging Face's Llama (in float64 when dtype is float64) and the
    tables cast to `dtype`.
    """
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = rope_inv_freq(head_dim, base, dtype=angle_dtype)
    if isinstance(positions, torch.Tensor):
        if positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got minimum {int(positions.min())}")
        pos = positions.to(angle_dtype)
        inv_freq = inv_freq.to(positions.device)
    elif isinstance(positions, int) and not isinstance(positions, bool):
        _check_positive_int(positions, "positions (sequence length)")
        pos = torch.arange(positions, dtype=angle_dtype)
    else:
        raise TypeError(f"positions must be an int or an integer tensor, got {positions!r}")
    angles = pos[..., None] * inv_freq                   # (..., head_dim/2)
    emb = torch.cat((angles, angles), dim=-1)           # (..., head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the two halves (x1, x2) of the last dimension to (-x2, x1).

    x: (..., d) with d even. Returns the same shape. Together with `apply_rope` this rotates each
    channel pair (j, j + d/2) by its angle.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"the last dimension of x must be even, got {d}")
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their positions: ``x * cos + rotate_half(x) * sin``.

    x: (B, H, T, head_dim).   cos, sin: (T, head_dim), shared by the batch, or (B, T, head_dim),
    one row of positions per sequence (from `rope_cos_sin`). Returns (B, H, T, head_dim) in the
    dtype of x.
    """
    if x.ndim != 4:
        raise ValueError(f"x must have shape (B, H, T, head_dim), got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    B, _, T, head_dim = x.shape
    if cos.ndim == 2 and cos.shape == (T, head_dim):
        pass
    elif cos.ndim == 3 and cos.shape == (B, T, head_dim):
        cos, sin = cos[:, None], sin[:, None]            # (B, 1, T, head_dim) broadcasts over H
    else:
        raise ValueError(f"cos/sin must have shape (T, head_dim) = {(T, head_dim)} or "
                         f"(B, T, head_dim) = {(B, T, head_dim)}, got {tuple(cos.shape)}")
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def rope_score(q: torch.Tensor, k: torch.Tensor, pos_q: int, pos_k: int,
               base: float = 10000.0) -> float:
    """Attention score ``RoPE(q, pos_q) . RoPE(k, pos_k)`` for one query and one key vector.

    q, k: (head_dim,). Returns a Python float. Under RoPE it depends on pos_q - pos_k only.
    """
    if q.ndim != 1 or q.shape != k.shape:
        raise ValueError(f"q and k must be vectors of the same shape (head_dim,), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    for name, pos in (("pos_q", pos_q), ("pos_k", pos_k)):
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {pos!r}")
    head_dim = q.shape[0]
    cos, sin = rope_cos_sin(head_dim, torch.tensor([pos_q, pos_k]), base, dtype=q.dtype)
    qr = apply_rope(q.view(1, 1, 1, head_dim), cos[:1], sin[:1])
    kr = apply_rope(k.view(1, 1, 1, head_dim), cos[1:], sin[1:])
    return float((qr * kr).sum())


def rope_wavelengths(head_dim: int, base: float = 10000.0) -> list[float]:
    """Wavelength 2*pi / inv_freq[i] (in positions) of every RoPE channel pair, shortest first."""
    return [2 * math.pi / float(f) for f in rope_inv_freq(head_dim, base)]
