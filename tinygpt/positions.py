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
    emb = _angles(positions, rope_inv_freq(head_dim, base, dtype=angle_dtype), angle_dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _angles(positions: int | torch.Tensor, inv_freq: torch.Tensor, angle_dtype: torch.dtype
            ) -> torch.Tensor:
    """Each position times each frequency, the half repeated: (..., head_dim), for cos / sin.
    positions: a length (0 .. n - 1) or an integer tensor of positions >= 0."""
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
    return torch.cat((angles, angles), dim=-1)          # (..., head_dim)


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


# --------------------------------------------------------------------------------------------
# 4. RoPE scaling (day 21): running a model past the context it was trained on
#
# A RoPE model trained on contexts of L positions has only seen angles pos * inv_freq[i] with
# pos < L. Channel pairs whose wavelength 2 pi / inv_freq[i] is shorter than L have turned
# through every angle many times, so any position is familiar to them; pairs whose wavelength
# is longer than L have only seen part of a turn, and a position beyond L shows them angles
# they never saw. Every scaling below changes the inverse frequencies (never the weights) so
# that a longer context maps onto familiar angles; they differ in which channels they touch.
#
# linear   Position interpolation (Chen et al. 2023, "Extending Context Window of Large
#          Language Models via Positional Interpolation"; first posted by kaiokendev):
#          positions are divided by `factor`, i.e. every inv_freq[i] / factor. Position
#          factor * L then looks like position L. Cheap, but the short wavelengths, which told
#          neighbouring tokens apart, are squeezed too: the model needs some fine-tuning.
# dynamic  NTK-aware scaling (bloc97, 2023, on r/LocalLLaMA; "dynamic" by emozilla): instead
#          of dividing positions, grow the base so the LONGEST wavelength stretches by about
#          the factor while the shortest barely move ("high frequencies extrapolate, low ones
#          interpolate"). Dynamic: the base depends on the current sequence length s,
#          base' = base * (factor * s / L - (factor - 1)) ** (d / (d - 2)), and is the plain
#          base for s <= L, so short prompts are untouched and need no fine-tuning.
#          transformers recomputes inv_freq whenever a forward's largest position + 1 exceeds
#          the longest length seen so far, and keeps it until a forward shorter than L resets
#          it; with a KV cache the cached keys keep the rotation of the step that wrote them,
#          so a cached generation differs (slightly) from re-running the whole sequence. We
#          compute the base from each forward's largest position + 1 (no state): the same as
#          transformers for a fresh model and positions that only grow, as in generate().
# yarn     YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
#          Models"): per channel, by how many full turns r_i = L / wavelength_i it makes in the
#          original context. Channels with r_i > beta_fast (32) keep their frequency
#          (extrapolate), channels with r_i < beta_slow (1) are divided by the factor
#          (interpolate), and a linear ramp over the channel index blends the two in between.
#          Interpolation makes attention flatter (more distant keys look alike), so YaRN
#          sharpens it again by multiplying cos and sin by an attention factor
#          0.1 ln(factor) + 1 (which scales every q.k score by its square); DeepSeek's configs
#          give mscale / mscale_all_dim and the factor becomes
#          (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1).
# llama3   Meta's Llama 3.1 (2024): a piecewise version of the same idea with wavelengths in
#          positions: wavelengths shorter than L / high_freq_factor keep their frequency,
#          longer than L / low_freq_factor are divided by the factor, and those in between
#          blend smoothly with s = (L / wavelength - low_freq_factor) /
#          (high_freq_factor - low_freq_factor): (1 - s) * inv_freq / factor + s * inv_freq.
#
# A scaling is given as a mapping (or a tuple of (key, value) pairs, how ModelConfig stores
# it) with "rope_type" and the keys of ROPE_SCALING_KEYS, as transformers' rope_parameters
# name them; `original_max_position_embeddings` is L. The inverse frequencies are computed
# with the same float32 operations as transformers' ROPE_INIT_FUNCTIONS, so they agree bit
# for bit (tests/test_rope_scaling.py).

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# rope_type -> (required keys, optional keys)
ROPE_SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
}


def _number(value: object, name: str, minimum: float, strict: bool = True) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) \
        and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"rope scaling {name} must be a finite number "
                         f"{'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)


def check_rope_scaling(scaling: object) -> tuple[tuple[str, object], ...]:
    """Validate a RoPE scaling and return it as sorted (key, value) pairs (hashable, JSON-able).

    scaling: None or empty (no scaling), a mapping, or an iterable of (key, value) pairs with
    "rope_type" in ROPE_TYPES and exactly the keys ROPE_SCALING_KEYS allows for it. Returns ()
    for no scaling (rope_type "default"). ValueError names the key and the allowed values.
    """
    if scaling is None:
        return ()
    if not isinstance(scaling, dict):
        try:
            scaling = dict(scaling)                       # pairs, e.g. from a JSON list of lists
        except (TypeError, ValueError):
            raise ValueError(f"rope_scaling must be a mapping or (key, value) pairs with "
                             f"'rope_type' in {ROPE_TYPES}, got {scaling!r}") from None
    if not scaling:
        return ()
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling['rope_type'] must be one of {ROPE_TYPES}, got "
                         f"{rope_type!r}")
    required, optional = ROPE_SCALING_KEYS[rope_type]
    given = set(scaling) - {"rope_type"}
    missing, extra = set(required) - given, given - set(required) - set(optional)
    if missing or extra:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the keys {required}"
                         f"{f' and may have {optional}' if optional else ''}; missing "
                         f"{sorted(missing)}, unexpected {sorted(extra)}")
    if rope_type == "default":
        return ()
    _number(scaling["factor"], "factor", 0.0)
    if "original_max_position_embeddings" in scaling:
        length = scaling["original_max_position_embeddings"]
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"rope scaling original_max_position_embeddings must be a positive "
                             f"integer, got {length!r}")
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                 "low_freq_factor", "high_freq_factor"):
        if name in required or scaling.get(name) is not None:     # an optional key may be None
            _number(scaling[name], name, 0.0)
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        raise ValueError(f"rope scaling truncate must be True or False, got "
                         f"{scaling['truncate']!r}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rope scaling high_freq_factor ({scaling['high_freq_factor']}) must be "
                         f"> low_freq_factor ({scaling['low_freq_factor']})")
    return tuple(sorted(scaling.items()))


def yarn_attention_factor(factor: float, mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """YaRN's factor on cos and sin: 0.1 ln(factor) + 1 (1 for factor <= 1), or with DeepSeek's
    mscale and mscale_all_dim both given, the ratio of 0.1 m ln(factor) + 1 for the two."""
    def get(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if mscale and mscale_all_dim:
        return float(get(mscale) / get(mscale_all_dim))
    return get(1.0)


def rope_scaled_inv_freq(head_dim: int, base: float, scaling: object,
                         seq_len: int | None = None, dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim / 2,) of a scaled RoPE and the factor on cos and sin.

    scaling: as check_rope_scaling takes it (None / () is plain RoPE, factor 1).
    seq_len: the current sequence length, read by "dynamic" only (None: its original length,
    i.e. the plain base). In float32 (the default) the operations are those of transformers'
    ROPE_INIT_FUNCTIONS; dtype=torch.float64 runs the same formulas in float64 (a reference).
    """
    params = dict(check_rope_scaling(scaling))
    inv_freq = rope_inv_freq(head_dim, base, dtype=dtype)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if rope_type == "linear":                     # positions / factor == inv_freq / factor
        return inv_freq / factor, 1.0
    original = params.get("original_max_position_embeddings")
    if rope_type == "dynamic":
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                    or seq_len < 1):
            raise ValueError(f"seq_len must be None or a positive integer, got {seq_len!r}")
        if head_dim < 4:                              # the power below divides by head_dim - 2
            raise ValueError(f"head_dim must be >= 4 with 'dynamic' scaling, got {head_dim}")
        length = original if seq_len is None else max(seq_len, original)
        grown = base * ((factor * length / original) - (factor - 1)) ** (head_dim
                                                                          / (head_dim - 2))
        return rope_inv_freq(head_dim, grown, dtype=dtype), 1.0
    if rope_type == "llama3":
        low_wavelen = original / params["low_freq_factor"]
        high_wavelen = original / params["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        long = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - params["low_freq_factor"]) / (
            params["high_freq_factor"] - params["low_freq_factor"])
        blended = (1 - smooth) * long / factor + smooth * long
        middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(middle, blended, long), 1.0
    # yarn
    attention = params.get("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, params.get("mscale"),
                                          params.get("mscale_all_dim"))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def channel(turns: float) -> float:
        """The channel pair index whose wavelength makes `turns` turns in `original`."""
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel(beta_fast), channel(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                 # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(dtype)                       # 1: extrapolate (keep), 0: interpolate
    pos_freqs = float(base) ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def scaled_rope_cos_sin(head_dim: int, positions: int | torch.Tensor, base: float = 10000.0,
                        scaling: object = None, seq_len: int | None = None,
                        dtype: torch.dtype = torch.float32
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin with a scaling: the tables of rope_scaled_inv_freq's frequencies, both times
    its attention factor (YaRN's; 1 otherwise), as transformers' rotary embeddings multiply
    them. positions, dtype: as in rope_cos_sin; seq_len: for "dynamic" (see
    rope_scaled_inv_freq). Plain RoPE (scaling None) gives rope_cos_sin's tables exactly."""
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq, attention = rope_scaled_inv_freq(head_dim, base, scaling, seq_len, angle_dtype)
    emb = _angles(positions, inv_freq, angle_dtype)
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos.to(dtype), sin.to(dtype)
