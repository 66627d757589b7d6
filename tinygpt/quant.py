"""Day 15: quantization: int8 and int4 weight-only, and an int8 KV cache.

A decode step at batch 1 reads every weight once per token (days 09-10), so its time is about
the bytes of the weights over the memory bandwidth. Storing the weights in fewer bits moves
fewer bytes. Weight-only quantization keeps the activations in floating point: each product
turns the stored integers back into numbers (dequantizes) on the fly, which costs arithmetic
that a bandwidth-bound step has to spare.

The schemes, for a weight W of shape (N, K) (out_features, in_features) of an nn.Linear:

    "int8"       symmetric, one scale per output channel (per row n):
                     s[n] = max_k |W[n, k]| / 127        q = round(W / s) in [-127, 127]
                     W ~ q * s                            8 bits per weight + N scales
                 The range is symmetric ([-127, 127], -128 unused) so that +-max both map
                 exactly to +-127 and zero maps to 0.
    "int4-gG"    asymmetric, groups of G = 32, 64 or 128 consecutive inputs of a row:
                     lo = min(min(group), 0)   hi = max(max(group), 0)
                     s = (hi - lo) / 15   z = round(-lo / s) in [0, 15]
                     q = clamp(round(W / s) + z, 0, 15)   W ~ (q - z) * s
                 The range is widened to contain 0 so that 0 is exactly representable (q = z)
                 and an all-zero padding does not change a group's statistics. Rows whose
                 length K is not a multiple of G are padded with zero columns to one (the
                 shipped checkpoint's down projection has K = 352).
                 Storage: two 4-bit values per byte, LOW nibble first: byte j of a row holds
                 column 2j in bits 0-3 and column 2j + 1 in bits 4-7 (pack_int4 /
                 unpack_int4). Scales are float32, zero points uint8 (one of each per group).

What quantize_model swaps and what stays in higher precision (float32 here):

    quantized    every nn.Linear inside the transformer blocks: wq, wk, wv, wo, w1, w2, w3
                 (over 90% of the bytes a decode step reads in the shipped checkpoint and in
                 the bench's 152M model, the embedding lookup reading one row; and each sits
                 after an RMSNorm, feeding a residual add, which keeps the rounding noise
                 small relative to the signal)
    kept         the token embedding: a lookup reads one row per token, not the matrix, so
                 quantizing it saves memory but not decode bandwidth;
                 the RMSNorm weights: D numbers per norm, negligible bytes, and each one
                 scales a whole channel of every activation;
                 the LM head by default (lm_head=False): nothing normalizes after it, so its
                 error lands directly on the logits, and with tie_embeddings it IS the
                 embedding matrix. quantize_model(..., lm_head=True) quantizes it too (when
                 untied); the tests and notebook measure what that costs.

Kernels (QuantizedLinear.kernel). The plain path, "dequant", rebuilds W in the activation dtype
and runs F.linear: it is the oracle. Where torch has a fused weight-only kernel for the scheme
on the device it is used instead ("auto"), after a probe checks it against the plain path on
the first forward on that device (tolerance FUSED_RTOL of the largest output):

    int8, CPU and CUDA    torch.ops.aten._weight_int8pack_mm     bfloat16 activations (float16
                          ones stay float16 on CUDA; its float32 path on CPU is several times
                          slower than F.linear)
    int4, CPU             torch.ops.aten._weight_int4pack_mm_for_cpu   bfloat16 activations
    int4, CUDA            torch.ops.aten._weight_int4pack_mm          bfloat16 activations

Both fused kernels store dequantization as (q - 8) * s + m with a float "mid" value m; this
module's integer zero point converts exactly: m = (8 - z) * s. Where no kernel fits (MPS, a
shape the kernel rejects, a failed probe) the layer falls back to "dequant" with a
KernelFallbackWarning saying why. kernel="dynamic" (CPU, int8) uses fbgemm's dynamically
quantized linear instead: the SAME int8 weights, but the activations of each call are also
rounded to integers on the fly, with one scale per call and 7 bits (fbgemm's reduce_range,
which keeps its x86 kernel's 16-bit pair sums from saturating): W8A8 rather than weight-only,
which adds error and is faster on x86 (tinygpt.bench.quant).

KV-cache quantization (QuantizedKVCache): keys and values stored as int8 with one float32
scale per token and head (symmetric, absmax / 127 over head_dim), dequantized when attention
reads them. It plugs into TinyGPT.forward like day 11's KVCache (it is one).
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as nnf
from torch import nn

from tinygpt.kv_cache import DecodeStep, KVCache, _Linear, _pack_refusal, _PackedLinear
from tinygpt.model import TinyGPT

SCHEMES: tuple[str, ...] = ("int8", "int4-g32", "int4-g64", "int4-g128")
KERNELS: tuple[str, ...] = ("auto", "dequant", "dynamic")
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
# A fused kernel must agree with dequantize-then-matmul to this fraction of the largest |output|
# on the probe (bfloat16 activations round to 8 significant bits, about 0.4%; fbgemm's dynamic
# path also rounds the activations to 7-bit integers).
FUSED_RTOL = 2e-2
DYNAMIC_RTOL = 6e-2


def _outside_stacklevel() -> int:
    """warnings.warn's stacklevel for the first caller outside torch and tinygpt: a fallback
    found during a forward is reported at the line that ran the model (not inside
    nn.Module's call machinery)."""
    import sys

    inside = tuple(os.path.join(Path(m).parent, "") for m in (torch.__file__, __file__))
    frame, level = sys._getframe(1), 1       # level 1: the function that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


class KernelFallbackWarning(UserWarning):
    """A fused quantized kernel was wanted but cannot be used; the message says why."""


# --------------------------------------------------------------------------------------------
# checks


def parse_scheme(scheme: str) -> tuple[int, int | None]:
    """"int8" -> (8, None); "int4-g64" -> (4, 64). Anything else is a ValueError."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "int8":
        return 8, None
    return 4, int(re.fullmatch(r"int4-g(\d+)", scheme).group(1))


def _check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"{name} must have shape (out_features, in_features), got "
                         f"{tuple(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating point tensor, got {weight.dtype}")
    if weight.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{name} holds NaN or infinite values; they cannot be quantized")


def _check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 \
            or group_size % 2:
        raise ValueError(f"group_size must be a positive even integer (the schemes use "
                         f"{GROUP_SIZES}), got {group_size!r}")
    return group_size


# --------------------------------------------------------------------------------------------
# int8, symmetric, per output channel


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight (N, K) -> (q int8 (N, K) in [-127, 127], scale (N,) fp32).

    scale[n] = max_k |weight[n, k]| / 127 (an all-zero row gets scale 1 and q = 0), and
    q = round(weight / scale), round half to even. dequantize_int8(q, scale) ~ weight with an
    error of at most scale / 2 per entry.
    """
    _check_weight(weight)
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 (N, K), scale (N,) -> q * scale, float32 (N, K)."""
    if q.dtype != torch.int8 or q.ndim != 2:
        raise TypeError(f"q must be an int8 tensor of shape (N, K), got {q.dtype} "
                        f"{tuple(q.shape)}")
    if scale.shape != (q.shape[0],):
        raise ValueError(f"scale must have shape (N,) = ({q.shape[0]},), got "
                         f"{tuple(scale.shape)}")
    return q.float() * scale.float()[:, None]


def quantize_per_tensor_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with ONE scale for the whole matrix (the outlier demo's baseline):
    weight (N, K) -> (q int8 (N, K), scale () fp32); W ~ q * scale."""
    _check_weight(weight)
    w = weight.detach().float()
    amax = w.abs().max()
    scale = amax / 127 if amax > 0 else torch.ones(())
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


# --------------------------------------------------------------------------------------------
# int4, asymmetric, group-wise


def quantize_int4(weight: torch.Tensor, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit: weight (N, K) -> (q, scale, zero).

    q: uint8 (N, K_pad) with values 0..15, UNPACKED (pack_int4 packs it), where K_pad is K
    rounded up to a multiple of group_size (extra columns quantize zeros).
    scale: float32 (N, G) and zero: uint8 (N, G) with values 0..15, G = K_pad / group_size.
    Per group: lo = min(min, 0), hi = max(max, 0), scale = (hi - lo) / 15,
    zero = round(-lo / scale), q = clamp(round(w / scale) + zero, 0, 15). An all-zero group
    gets scale 1 and zero 0.
    """
    _check_weight(weight)
    _check_group_size(group_size)
    n, k = weight.shape
    k_pad = math.ceil(k / group_size) * group_size
    w = nnf.pad(weight.detach().float(), (0, k_pad - k)).view(n, k_pad // group_size,
                                                               group_size)
    lo = w.amin(dim=-1).clamp(max=0)
    hi = w.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(n, k_pad).to(torch.uint8), scale, zero.to(torch.uint8)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    in_features: int | None = None) -> torch.Tensor:
    """q uint8 (N, K_pad) unpacked, scale (N, G), zero (N, G) -> (q - zero) * scale, float32
    (N, in_features) (the padding columns are dropped; default: keep all K_pad)."""
    if q.ndim != 2 or q.dtype != torch.uint8:
        raise TypeError(f"q must be an unpacked uint8 tensor of shape (N, K_pad), got "
                        f"{q.dtype} {tuple(q.shape)}")
    n, k_pad = q.shape
    if scale.ndim != 2 or scale.shape[0] != n or zero.shape != scale.shape \
            or k_pad % scale.shape[1]:
        raise ValueError(f"scale and zero must both have shape (N, G) with G dividing K_pad; "
                         f"got q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero "
                         f"{tuple(zero.shape)}")
    group = k_pad // scale.shape[1]
    w = (q.view(n, -1, group).float() - zero.float()[..., None]) * scale.float()[..., None]
    w = w.view(n, k_pad)
    return w if in_features is None else w[:, :in_features]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte: q uint8 (..., K) with values 0..15, K even -> (..., K / 2).

    Byte j holds q[..., 2j] in its low nibble (bits 0-3) and q[..., 2j + 1] in its high nibble
    (bits 4-7): packed = q[..., 0::2] | (q[..., 1::2] << 4).
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        raise TypeError(f"q must be a uint8 tensor, got {getattr(q, 'dtype', type(q))}")
    if q.ndim < 1 or q.shape[-1] % 2:
        raise ValueError(f"the last dimension of q must be even, got shape {tuple(q.shape)}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"q must hold 4-bit values 0..15, got a maximum of {int(q.max())}")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: packed uint8 (..., K / 2) -> q uint8 (..., K), values 0..15."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got "
                        f"{getattr(packed, 'dtype', type(packed))}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def fake_quantize(weight: torch.Tensor, bits: int = 8, granularity: str = "channel",
                  group_size: int = 128) -> torch.Tensor:
    """Quantize and dequantize `weight` (N, K) symmetrically at `bits` bits with one scale per
    tensor, per output channel (row) or per group of `group_size` inputs of a row; returns the
    float32 (N, K) result. For comparing granularities at equal bits (the outlier problem)."""
    _check_weight(weight)
    if isinstance(bits, bool) or bits not in (2, 3, 4, 5, 6, 7, 8):
        raise ValueError(f"bits must be an integer in 2..8, got {bits!r}")
    if granularity not in ("tensor", "channel", "group"):
        raise ValueError(f"granularity must be 'tensor', 'channel' or 'group', got "
                         f"{granularity!r}")
    qmax = 2 ** (bits - 1) - 1
    n, k = weight.shape
    w = weight.detach().float()
    if granularity == "group":
        _check_group_size(group_size)
        k_pad = math.ceil(k / group_size) * group_size
        w = nnf.pad(w, (0, k_pad - k)).view(n, k_pad // group_size, group_size)
        amax = w.abs().amax(dim=-1, keepdim=True)
    elif granularity == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().max()
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    out = torch.round(w / scale).clamp(-qmax, qmax) * scale
    return out.reshape(n, -1)[:, :k]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius norms, in float64); 0 when both are zero."""
    if approx.shape != exact.shape:
        raise ValueError(f"shapes differ: {tuple(approx.shape)} vs {tuple(exact.shape)}")
    diff = (approx.double() - exact.double()).norm().item()
    norm = exact.double().norm().item()
    return 0.0 if diff == 0 else diff / norm if norm > 0 else math.inf


# --------------------------------------------------------------------------------------------
# the quantized linear layer


def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or \
        "x86" in torch.backends.quantized.supported_engines


class QuantizedLinear(nn.Module):
    """A bias-free linear layer with quantized weights: x (..., K) -> (..., N) in x's dtype.

    QuantizedLinear(weight (N, K), scheme, kernel="auto") quantizes `weight` now (see the
    module docstring for the schemes). Buffers (they move with .to() and are in state_dict):
        int8:  qweight int8 (N, K), scale float32 (N,)
        int4:  qweight uint8 (N, K_pad / 2) packed (low nibble = even column), scale float32
               (N, G), zero uint8 (N, G)
    kernel: "auto" uses the fused torch kernel for the scheme on the input's device when there
    is one and it passes a probe against dequantize-then-matmul (FUSED_RTOL), else falls back
    to "dequant" with a KernelFallbackWarning; "dequant" always rebuilds the weight and calls
    F.linear (the oracle); "dynamic" (int8, CPU) uses fbgemm's dynamically quantized linear.
    After a forward, `kernel_used` names the path that ran and `fallback_reason` says why a
    fused kernel was not used (None when it was, or when none was asked for).
    """

    def __init__(self, weight: torch.Tensor, scheme: str, kernel: str = "auto") -> None:
        super().__init__()
        bits, group = parse_scheme(scheme)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "dynamic" and bits != 8:
            raise ValueError(f"kernel='dynamic' (fbgemm's int8 dynamic linear) needs scheme "
                             f"'int8', got {scheme!r}")
        _check_weight(weight)
        self.scheme, self.bits, self.group_size, self.requested = scheme, bits, group, kernel
        self.out_features, self.in_features = weight.shape
        if bits == 8:
            q, scale = quantize_int8(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)
            self.zero = None
        else:
            q, scale, zero = quantize_int4(weight, group)
            self.register_buffer("qweight", pack_int4(q))
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)
        self._kernels: dict[tuple, object] = {}
        self.kernel_used: str | None = None
        self.fallback_reason: str | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, kernel: str = "auto"
                    ) -> QuantizedLinear:
        """Quantize an nn.Linear without bias (raises ValueError for one with a bias)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if linear.bias is not None:
            raise ValueError("linear has a bias; QuantizedLinear quantizes bias-free layers "
                             "(TinyGPT's)")
        return cls(linear.weight, scheme, kernel)

    @classmethod
    def stack(cls, linears: Iterable[QuantizedLinear]) -> QuantizedLinear:
        """One layer computing the outputs of several that share their input, concatenated
        (q, k, v; gate and up). Per-row scales and groups stack exactly: the result equals
        the layers one by one."""
        linears = list(linears)
        if not linears or not all(isinstance(m, QuantizedLinear) for m in linears):
            raise TypeError("stack needs one or more QuantizedLinear layers")
        first = linears[0]
        if any((m.scheme, m.in_features, m.requested) != (first.scheme, first.in_features,
                                                          first.requested) for m in linears):
            raise ValueError("stacked layers must share scheme, in_features and kernel")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.scheme, out.bits, out.group_size = first.scheme, first.bits, first.group_size
        out.requested, out.in_features = first.requested, first.in_features
        out.out_features = sum(m.out_features for m in linears)
        out.register_buffer("qweight", torch.cat([m.qweight for m in linears]))
        out.register_buffer("scale", torch.cat([m.scale for m in linears]))
        if first.zero is not None:
            out.register_buffer("zero", torch.cat([m.zero for m in linears]))
        else:
            out.zero = None
        out._kernels, out.kernel_used, out.fallback_reason = {}, None, None
        return out

    @property
    def weight_bytes(self) -> int:
        """Bytes of the stored weight: quantized values, scales and zero points."""
        return sum(t.nbytes for t in (self.qweight, self.scale, self.zero) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies by: float32 (N, K)."""
        if self.bits == 8:
            return dequantize_int8(self.qweight, self.scale)
        return dequantize_int4(unpack_int4(self.qweight), self.scale, self.zero,
                               self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scheme={self.scheme!r}, kernel={self.requested!r}")

    # ---------------------------------------------------------------- kernels

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return nnf.linear(x, self.dequantize().to(x.dtype))

    def _refusal(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why no fused kernel can run this layer on `device` for `dtype` inputs, or None."""
        ops, n, k = torch.ops.aten, self.out_features, self.in_features
        if self.requested == "dynamic":
            if device.type != "cpu":
                return f"kernel='dynamic' is fbgemm's CPU kernel; the layer is on {device}"
            if not _fbgemm_available():
                return "this torch build has no fbgemm/x86 quantized engine"
            return None
        if device.type not in ("cpu", "cuda"):
            return f"torch has no fused {self.scheme} kernel on {device.type}"
        if self.bits == 8:
            if not hasattr(ops, "_weight_int8pack_mm"):
                return "this torch has no aten._weight_int8pack_mm"
            if k % 16:
                return (f"_weight_int8pack_mm needs in_features divisible by 16, got {k} "
                        f"(torch 2.13's CPU kernel reads past the row otherwise)")
            return None
        k_pad = self.qweight.shape[1] * 2
        if device.type == "cpu":
            if not hasattr(ops, "_weight_int4pack_mm_for_cpu"):
                return "this torch has no aten._weight_int4pack_mm_for_cpu"
            if n % 16:
                return f"_weight_int4pack_mm_for_cpu needs out_features divisible by 16, got {n}"
            return None
        if not hasattr(ops, "_weight_int4pack_mm"):
            return "this torch has no aten._weight_int4pack_mm"
        if n % 8 or k_pad % 256:
            return (f"_weight_int4pack_mm needs out_features divisible by 8 and (padded) "
                    f"in_features divisible by 256, got {n} and {k_pad}")
        return None

    def _build(self, device: torch.device, dtype: torch.dtype):
        """The fused forward for 2-D inputs on `device`: x (M, K) -> (M, N) in x's dtype."""
        n, k, ops = self.out_features, self.in_features, torch.ops.aten
        if self.requested == "dynamic":
            with warnings.catch_warnings():       # quantized tensors are deprecated in torch
                warnings.simplefilter("ignore", UserWarning)
                qt = torch._make_per_channel_quantized_tensor(
                    self.qweight.cpu(), self.scale.double().cpu(),
                    torch.zeros(n, dtype=torch.long), 0)
                packed = torch.ops.quantized.linear_prepack(qt, None)

            def dynamic(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.quantized.linear_dynamic(x.float(), packed, True).to(x.dtype)

            return dynamic
        act = dtype if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) \
            else torch.bfloat16
        if self.bits == 8:
            weight, scale = self.qweight, self.scale.to(act)

            def int8pack(x: torch.Tensor) -> torch.Tensor:
                return ops._weight_int8pack_mm(x.to(act), weight, scale).to(x.dtype)

            return int8pack
        q = unpack_int4(self.qweight)                                   # (N, K_pad) 0..15
        k_pad, group = q.shape[1], self.group_size
        mid = (8 - self.zero.float()) * self.scale                        # (q - 8) s + mid
        scales_and_zeros = torch.stack([self.scale, mid], dim=-1).transpose(0, 1) \
            .contiguous().to(torch.bfloat16)                            # (G, N, 2)
        if device.type == "cpu":
            packed = ops._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            mm = ops._weight_int4pack_mm_for_cpu
        else:       # torchao's CUDA convention: the EVEN column in the HIGH nibble
            inner_k_tiles = 8 if k_pad % 1024 == 0 else 4 if k_pad % 512 == 0 else 2
            packed = ops._convert_weight_to_int4pack(q[:, 0::2] << 4 | q[:, 1::2],
                                                     inner_k_tiles)
            mm = ops._weight_int4pack_mm

        def int4pack(x: torch.Tensor) -> torch.Tensor:
            xb = nnf.pad(x.to(torch.bfloat16), (0, k_pad - k))
            return mm(xb, packed, group, scales_and_zeros).to(x.dtype)

        return int4pack

    def _kernel_for(self, device: torch.device, dtype: torch.dtype):
        """The fused forward for inputs of `dtype` on `device`, or None for the plain path;
        built and probed once per (device, dtype)."""
        if self.requested == "dequant":
            return None
        key = (device, dtype)
        if key in self._kernels:
            return self._kernels[key]
        fn, reason = None, self._refusal(device, dtype)
        if reason is None:
            with torch.inference_mode(False), torch.no_grad():
                try:
                    fn = self._build(device, dtype)
                    gen = torch.Generator().manual_seed(0)
                    probe = torch.randn(3, self.in_features, generator=gen).to(device, dtype)
                    want, got = self._plain(probe).float(), fn(probe).float()
                    rtol = DYNAMIC_RTOL if self.requested == "dynamic" else FUSED_RTOL
                    worst = (got - want).abs().max().item()
                    if not worst <= rtol * want.abs().max().item() + 1e-6:
                        reason = (f"the fused {self.scheme} kernel disagreed with "
                                  f"dequantize-then-matmul on a probe ({worst:.3g} > {rtol} x "
                                  f"max |output|)")
                except RuntimeError as err:
                    reason = f"the fused kernel failed ({type(err).__name__}: {err})"
        if reason is not None:
            fn = None
            self.fallback_reason = f"{reason}; this layer uses dequantize-then-matmul"
            warnings.warn(self.fallback_reason, KernelFallbackWarning,
                          stacklevel=_outside_stacklevel())
        self._kernels[key] = fn
        return fn

    def kernel_name(self, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> str:
        """The path a forward on `device` with `dtype` inputs takes: "int8pack", "int4pack",
        "dynamic" or "dequant" (builds and probes the kernel if needed)."""
        fn = self._kernel_for(torch.device(device), dtype)
        return "dequant" if fn is None else fn.__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor (activations), got {x.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must have last dimension in_features={self.in_features}, got "
                             f"shape {tuple(x.shape)}")
        fn = self._kernel_for(x.device, x.dtype)
        self.kernel_used = "dequant" if fn is None else fn.__name__
        if fn is None:
            return self._plain(x)
        y = fn(x.reshape(-1, self.in_features).contiguous())   # the kernels read rows in place
        return y.reshape(*x.shape[:-1], self.out_features)


# --------------------------------------------------------------------------------------------
# whole models

_BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def quantize_model(model: TinyGPT, scheme: str, *, lm_head: bool = False,
                   kernel: str = "auto") -> TinyGPT:
    """A quantized copy of `model`: every linear of every block (wq, wk, wv, wo, w1, w2, w3)
    becomes a QuantizedLinear of `scheme` ("int8", "int4-g32", "int4-g64", "int4-g128");
    with lm_head=True the LM head too (not allowed with tied embeddings: it is the embedding
    matrix). Embeddings and norms stay as they are (see the module docstring for why).
    The original model is not changed. The copy has `quant_scheme` set and is in eval mode.
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    parse_scheme(scheme)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if not isinstance(lm_head, bool):
        raise TypeError(f"lm_head must be True or False, got {lm_head!r}")
    if lm_head and model.cfg.tie_embeddings:
        raise ValueError("lm_head=True needs an untied LM head: with tie_embeddings the head is "
                         "the embedding matrix, which stays in full precision")
    if getattr(model, "quant_scheme", None) is not None:
        raise ValueError(f"model is already quantized ({model.quant_scheme!r}); quantize the "
                         f"full-precision model")
    if model.cfg.attention == "mla":                     # day 21
        raise ValueError(f"quantize_model quantizes Llama blocks' wq, wk, wv, wo, w1, w2, w3; "
                         f"{model.cfg.fast_path_refusal()}")
    if model.cfg.is_moe:
        raise ValueError(f"quantize_model quantizes the nn.Linear layers of dense blocks; "
                         f"{model.cfg.fast_path_refusal()}, whose experts are stacked "
                         f"(E, d_expert, D) tensors it does not cover")
    # copy everything except the weights that are about to be replaced
    replaced = [model.get_submodule(f"layers.{i}.{name}").weight
                for i in range(model.cfg.n_layers) for name in _BLOCK_LINEARS]
    if lm_head:
        replaced.append(model.output.weight)
    memo = {id(w): None for w in replaced}
    quantized = copy.deepcopy(model, memo)
    for i, block in enumerate(quantized.layers):
        for name in _BLOCK_LINEARS:
            parent_name, attr = name.split(".")
            source = model.get_submodule(f"layers.{i}.{name}")
            setattr(block.get_submodule(parent_name), attr,
                    QuantizedLinear.from_linear(source, scheme, kernel))
    if lm_head:
        quantized.output = QuantizedLinear.from_linear(model.output, scheme, kernel)
    quantized.quant_scheme = scheme
    return quantized.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as stored: parameters (a shared one counted once) plus the
    quantized layers' buffers (values, scales, zero points); RoPE tables are not weights."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.nbytes
    return total + sum(m.weight_bytes for m in model.modules() if isinstance(m, QuantizedLinear))


def layer_errors(model: TinyGPT, quantized: TinyGPT) -> dict[str, float]:
    """Relative weight error ||W~ - W|| / ||W|| of every quantized layer, by its name."""
    errors = {}
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear):
            errors[name] = relative_error(module.dequantize(),
                                          model.get_submodule(name).weight.float().cpu()
                                          .to(module.qweight.device))
    if not errors:
        raise ValueError("quantized has no QuantizedLinear layer: pass quantize_model's result")
    return errors


@torch.inference_mode()
def greedy_agreement(reference: TinyGPT, model: TinyGPT, prompts: torch.Tensor,
                     max_new_tokens: int = 16) -> dict[str, float]:
    """How often `model` picks the same greedy token as `reference`.

    prompts: (P, T) token ids. The reference continues each prompt greedily for
    max_new_tokens tokens; both models then read prompt + that continuation in one forward,
    and at each of the max_new_tokens positions where a token was chosen their argmaxes are
    compared (teacher forcing, so one early difference does not count again at every later
    token). Returns {"token_agreement": fraction of compared positions that agree,
    "sequence_agreement": fraction of prompts whose every position agrees}.
    """
    if not isinstance(prompts, torch.Tensor) or prompts.ndim != 2:
        raise ValueError("prompts must be a (P, T) tensor of token ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    ids = prompts
    for _ in range(max_new_tokens - 1):        # the last chosen token needs no further step
        nxt = reference(ids)[:, -1].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    window = slice(prompts.shape[1] - 1, ids.shape[1])
    want = reference(ids)[:, window].argmax(dim=-1)
    got = model(ids)[:, window].argmax(dim=-1)
    same = want == got
    return {"token_agreement": same.float().mean().item(),
            "sequence_agreement": same.all(dim=1).float().mean().item()}


# --------------------------------------------------------------------------------------------
# int8 KV cache


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per vector of the last dimension (per token and head):
    x (..., head_dim) -> (q int8 (..., head_dim), scale float32 (..., 1)); x ~ q * scale."""
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


class QuantizedLayerKVCache:
    """One layer's keys and values as int8 with per-token, per-head scales:
    k_q, v_q int8 (batch, n_kv_heads, max_len, head_dim); k_scale, v_scale float32
    (batch, n_kv_heads, max_len, 1). update / update_static behave as LayerKVCache's, returning
    dequantized keys and values in the cache's compute dtype."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape, scale_shape = (batch_size, n_kv_heads, max_len, head_dim), \
            (batch_size, n_kv_heads, max_len, 1)
        self.dtype = dtype
        with torch.inference_mode(False):
            self.k_q = torch.zeros(shape, device=device, dtype=torch.int8)
            self.v_q = torch.zeros(shape, device=device, dtype=torch.int8)
            self.k_scale = torch.ones(scale_shape, device=device, dtype=torch.float32)
            self.v_scale = torch.ones(scale_shape, device=device, dtype=torch.float32)

    @property
    def k(self):
        raise TypeError("an int8 KV cache has no float key buffer to write into: run the model "
                        "(TinyGPT.forward / tinygpt.kv_cache.decode_step) on a QuantizedKVCache, "
                        "not DecodeStep's fused path")

    v = k

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k_q, self.v_q, self.k_scale, self.v_scale))

    def narrowed(self, capacity: int) -> QuantizedLayerKVCache:
        """This layer's first `capacity` slots: views of the same buffers (writes land here)."""
        view = copy.copy(self)
        for name in ("k_q", "v_q", "k_scale", "v_scale"):
            setattr(view, name, getattr(self, name)[:, :, :capacity])
        return view

    def _read(self, batch: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.k_q[:batch, :, :end].float() * self.k_scale[:batch, :, :end]
        values = self.v_q[:batch, :, :end].float() * self.v_scale[:batch, :, :end]
        return keys.to(self.dtype), values.to(self.dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize k, v (B, H_kv, T, head_dim) into positions start .. start+T-1; return the
        dequantized keys and values of positions 0 .. start+T-1, (B, H_kv, start+T, head_dim)."""
        batch, end = k.shape[0], start + k.shape[2]
        for q_buf, s_buf, x in ((self.k_q, self.k_scale, k), (self.v_q, self.v_scale, v)):
            q, s = quantize_kv(x)
            q_buf[:batch, :, start:end] = q
            s_buf[:batch, :, start:end] = s
        return self._read(batch, end)

    def update_static(self, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize k, v (B, H_kv, T, head_dim) into the slots input_pos (T,); return every slot
        dequantized and the (T, max_len) visibility mask, as LayerKVCache.update_static."""
        batch = k.shape[0]
        for q_buf, s_buf, x in ((self.k_q, self.k_scale, k), (self.v_q, self.v_scale, v)):
            q, s = quantize_kv(x)
            q_buf[:batch].index_copy_(2, input_pos, q)
            s_buf[:batch].index_copy_(2, input_pos, s)
        keys, values = self._read(batch, self.k_q.shape[2])
        slots = torch.arange(self.k_q.shape[2], device=input_pos.device)
        return keys, values, slots[None, :] <= input_pos[:, None]


class QuantizedKVCache(KVCache):
    """Day 11's KVCache with keys and values stored as int8, one float32 scale per token and
    KV head (QuantizedLayerKVCache). Same constructor, narrowed and for_model, except that
    for_model refuses rolling=True and an MLA model (no int8 rolling or latent layers); `dtype`
    is the dtype the model computes in (what attention gets back). Per token and layer it holds
    2 x n_kv_heads x (head_dim + 4) bytes instead of 2 x n_kv_heads x head_dim x 4 (float32).
    DecodeStep's fused path writes float buffers and cannot use it; run TinyGPT.forward,
    prefill and decode_step."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int,
                 head_dim: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, static: bool = False) -> None:
        # the parent checks the arguments on a one-position cache, then the layers are replaced
        super().__init__(n_layers, 1, n_kv_heads, 1, head_dim, device=device, dtype=dtype,
                         static=static)
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.batch_size, self.max_len = batch_size, max_len
        self.layers = [QuantizedLayerKVCache(batch_size, n_kv_heads, max_len, head_dim,
                                             device=self.device, dtype=dtype)
                       for _ in range(n_layers)]

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 1, max_len: int | None = None,
                  *, static: bool = False, rolling: bool = False,
                  slack: int = 0) -> QuantizedKVCache:
        """KVCache.for_model with int8 layers; ValueError for rolling=True or an MLA model."""
        if rolling is not False:
            raise ValueError(f"rolling must be False for a QuantizedKVCache (it has no int8 "
                             f"rolling layer; use KVCache.for_model), got {rolling!r}")
        cfg = getattr(model, "cfg", None)
        if getattr(cfg, "attention", None) == "mla":
            raise ValueError(f"model must not use multi-head latent attention for a "
                             f"QuantizedKVCache (it has no int8 latent layer; use "
                             f"KVCache.for_model): {cfg.fast_path_refusal()}")
        return super().for_model(model, batch_size, max_len, static=static)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's int8 keys and values and their scales."""
        return sum(layer.nbytes for layer in self.layers)


# --------------------------------------------------------------------------------------------
# the decode step on quantized weights


class _Product:
    """Callable products for DecodeStep's fused step: one layer, outputs split by `sizes`."""

    def __init__(self, layer: nn.Module, sizes: list[int]) -> None:
        self.layer, self.sizes = layer, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.layer(x).split(self.sizes, -1)


class QuantizedDecodeStep(DecodeStep):
    """DecodeStep (day 11's fused eager step) for a quantize_model() copy: q/k/v and gate/up
    each run as ONE stacked QuantizedLinear (one kernel call), wo and w2 as their own, with
    the layers' kernel (kernel="auto": torch's fused int8 / int4 kernels; "dynamic": fbgemm).
    A full-precision float32 LM head on CPU runs on oneDNN's prepacked weights, as in
    DecodeStep(pack_weights=True). Needs a dynamic, full-precision KVCache.
    step(token (B, 1)) -> logits (B, V) float32, advancing the cache. A q/k-norm model (day 20)
    runs decode_step instead, through its QuantizedLinear modules (`pack_reason` says why).
    """

    def __init__(self, model: TinyGPT, cache: KVCache) -> None:
        if not isinstance(model, TinyGPT) or getattr(model, "quant_scheme", None) is None:
            raise TypeError("model must be a quantized TinyGPT (tinygpt.quant.quantize_model)")
        if not isinstance(cache, KVCache) or cache.static or isinstance(cache,
                                                                        QuantizedKVCache):
            raise ValueError("cache must be a dynamic full-precision KVCache "
                             "(KVCache.for_model(model))")
        super().__init__(model, cache, pack_weights=True)

    def _try_pack(self) -> None:          # DecodeStep's hook for the step's products
        model = self.model
        if model.cfg.fast_path_refusal() is not None:      # q/k norm: the modules run
            self.pack_reason = f"the fused step is for dense Llama layers; " \
                f"{model.cfg.fast_path_refusal()}"
            return
        products = []
        for block in model.layers:
            a, f = block.attention, block.feed_forward
            qkv = [a.wq, a.wk, a.wv]
            gate_up = [f.w1, f.w3]
            products.append((
                block.attention_norm.weight,
                _Product(QuantizedLinear.stack(qkv), [m.out_features for m in qkv]),
                _Product(a.wo, [a.wo.out_features]), block.ffn_norm.weight,
                _Product(QuantizedLinear.stack(gate_up), [m.out_features for m in gate_up]),
                _Product(f.w2, [f.w2.out_features])))
        head = model.output
        if isinstance(head, QuantizedLinear):
            self._head = _Product(head, [head.out_features])
        else:
            with torch.inference_mode(False), torch.no_grad():
                self._head = _PackedLinear(head.weight) if _pack_refusal(model, self.cache) \
                    is None else _Linear(head.weight)
        self._weights, self.packed = products, True

    @property
    def kernels(self) -> dict[str, str]:
        """The kernel each product of the first layer ran with ({} before the first step, and
        for a model whose modules run: see pack_reason)."""
        if self._weights is None:
            return {}
        qkv, wo, _, gate_up, w2 = self._weights[0][1:]
        return {name: p.layer.kernel_used for name, p in
                (("qkv", qkv), ("wo", wo), ("gate_up", gate_up), ("w2", w2))
                if p.layer.kernel_used is not None}


# --------------------------------------------------------------------------------------------
# torchao, the reference (a development dependency: tests and `python -m tinygpt bench`)


def torchao_quantize(model: TinyGPT, scheme: str, *, lm_head: bool = False
                     ) -> tuple[TinyGPT | None, str | None]:
    """The same scheme through torchao, on a copy of `model`: (quantized copy, None), or
    (None, the reason torchao cannot run it here). The same layers are quantized as by
    quantize_model.

        "int8"       torchao's Int8WeightOnlyConfig (symmetric, per output row)
        "int4-gG"    IntxWeightOnlyConfig(int4, PerGroup(G), asymmetric): the same scheme as
                     this module's (torchao's Int4WeightOnlyConfig, the packed tinygemm
                     format, has no CPU path in torchao 0.18); it needs in_features divisible
                     by G and stores the 4-bit values unpacked, one per int8
    """
    parse_scheme(scheme)
    if model.cfg.attention == "mla" or model.cfg.is_moe:
        return None, f"quantize_model covers dense Llama blocks only: " \
            f"{model.cfg.fast_path_refusal()}"
    if lm_head and model.cfg.tie_embeddings:
        return None, "lm_head=True needs an untied LM head: with tie_embeddings the head is " \
            "the embedding matrix, which quantize_model keeps in full precision"
    try:
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
        from torchao.quantization.quant_primitives import MappingType
    except ImportError as err:
        return None, f"torchao is not installed ({err}); pip install -e '.[dev]'"
    bits, group = parse_scheme(scheme)
    names = [f"layers.{i}.{n}" for i in range(model.cfg.n_layers) for n in _BLOCK_LINEARS]
    if lm_head:
        names.append("output")
    if bits == 4:
        ragged = sorted({model.get_submodule(n).in_features for n in names
                         if model.get_submodule(n).in_features % group})
        if ragged:
            return None, (f"torchao's int4 group-wise scheme needs in_features divisible by "
                          f"the group size {group}; this model has in_features {ragged}")
        config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group),
                                      mapping_type=MappingType.ASYMMETRIC)
    else:
        config = Int8WeightOnlyConfig()
    reference = copy.deepcopy(model)
    wanted = set(names)
    try:
        quantize_(reference, config, filter_fn=lambda module, fqn: fqn in wanted)
    except (RuntimeError, NotImplementedError, AssertionError, ValueError) as err:
        return None, f"torchao failed on this device ({type(err).__name__}: {err})"
    return reference.eval(), None
