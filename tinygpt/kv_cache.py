"""Day 11: the KV cache.

Without a cache, each generated token re-runs the model over the whole context, so step t costs
t positions of work. But under causal attention the key and value of position j depend only on
tokens 0 .. j: once computed they never change. A KV cache stores them, and generation splits
into two phases:

    prefill      run the prompt (B, T) once; every layer writes its keys and values into
                 positions 0 .. T-1 of its cache; the last position's logits give token 1
    decode step  run ONE new token (B, 1) at position t = cache.length: every layer writes its
                 k, v at offset t and attends over positions 0 .. t; RoPE rotates by t

A step then costs one position of work per layer plus reading the cache. The cache here is
preallocated: per layer, K and V buffers of shape (batch, n_kv_heads, max_len, head_dim) are
allocated once, on the model's device and dtype, and filled in place (no torch.cat growth).
With grouped-query attention only the n_kv_heads key/value heads are stored.

TinyGPT.forward(idx, kv_cache=cache) uses the cache (tinygpt.model); the pieces here are

    LayerKVCache / KVCache      the buffers, the offset, and clear errors for misuse
    prefill, decode_step        the two phases, returning the last position's logits
    DecodeStep                  the decode step the generate loop runs: the same computation
                                as decode_step with far fewer kernel launches; on the CPU on
                                tiled weights split over the cores (tinygpt.cpu_kernels, the
                                default), optionally compiled for CUDA graphs (GPU) or run on
                                oneDNN-prepacked weights (CPU), with fallbacks that say why
    kv_bytes_per_token, kv_cache_bytes_mha, max_batch_that_fits, max_context_that_fits
                                the memory calculator (built on tinygpt.flops and the
                                memory sizes of tinygpt.roofline.HARDWARE)

A cache is "dynamic" (the default: each step writes a slice at the integer offset
cache.length and attends over the filled part, whose length grows) or "static"
(static=True: writes with index_copy_ at a tensor of positions and attends over all max_len
slots with a mask, so every decode step has identical shapes, which CUDA graphs need).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as nnf

from tinygpt import flops as F
from tinygpt.mla import LatentLayerCache
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.moe import MoE, MoEDecode
from tinygpt.native import torch_single_thread

# torch dtype -> the dtype names of tinygpt.flops / tinygpt.roofline
DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16",
                                       torch.float16: "fp16"}


class CompileFallbackWarning(UserWarning):
    """A compiled decode step was asked for but cannot be used; the message says why."""


class PackFallbackWarning(UserWarning):
    """Prepacked CPU weights were asked for but cannot be used; the message says why."""


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# the cache


class LayerKVCache:
    """One layer's keys and values: k, v of shape (batch, n_kv_heads, max_len, head_dim)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        with torch.inference_mode(False):       # ordinary tensors: writable in and out of it
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, head_dim) at positions start .. start+T-1 of rows 0 .. B-1.

        Returns the filled part, views of shape (B, H_kv, start + T, head_dim): the keys and
        values of positions 0 .. start+T-1 that the T new queries attend over (causally, the
        new queries being the last T positions). Bounds are checked by KVCache.check_step.
        """
        batch, end = k.shape[0], start + k.shape[2]
        self.k[:batch, :, start:end] = k
        self.v[:batch, :, start:end] = v
        return self.k[:batch, :, :end], self.v[:batch, :, :end]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def narrowed(self, capacity: int) -> LayerKVCache:
        """This layer's first `capacity` slots: views of the same k and v (writes land here)."""
        view = copy.copy(self)
        view.k, view.v = self.k[:, :, :capacity], self.v[:, :, :capacity]
        return view

    def update_static(self, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, head_dim) at the positions input_pos (T,), in place.

        Returns all max_len slots, (B, H_kv, max_len, head_dim) each, and a boolean mask
        (T, max_len) that lets query i see slot j iff j <= input_pos[i]. The shapes do not
        depend on how much of the cache is filled, so a compiled step can be replayed.
        """
        batch = k.shape[0]
        keys, values = self.k[:batch], self.v[:batch]
        keys.index_copy_(2, input_pos, k)
        values.index_copy_(2, input_pos, v)
        slots = torch.arange(self.k.shape[2], device=input_pos.device)
        return keys, values, slots[None, :] <= input_pos[:, None]


class KVCache:
    """A preallocated cache for every layer of a model, and the offset of the next write.

    layers[i].k, layers[i].v: (batch_size, n_kv_heads, max_len, head_dim) on `device`, `dtype`.
    length: positions 0 .. length-1 are filled (a dynamic cache advances it on every forward;
    for a static cache the caller keeps it, see `static`). Use KVCache.for_model(model).

    latent=(kv_lora_rank, qk_rope_head_dim) (day 21, a model with multi-head latent attention,
    which for_model passes) makes every layer a tinygpt.mla.LatentLayerCache instead: the
    latent c (batch_size, max_len, kv_lora_rank) and the RoPE key k_pe (batch_size, max_len,
    qk_rope_head_dim), not decompressed keys and values; n_kv_heads is then 1 and head_dim
    kv_lora_rank + qk_rope_head_dim, the values stored per token and layer.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int,
                 head_dim: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, static: bool = False,
                 latent: tuple[int, int] | None = None) -> None:
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size),
                            ("n_kv_heads", n_kv_heads), ("max_len", max_len),
                            ("head_dim", head_dim)):
            _check_positive(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        self.batch_size, self.max_len = batch_size, max_len
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        if not isinstance(static, bool):
            raise TypeError(f"static must be True or False, got {static!r}")
        self.device, self.dtype, self.static = torch.device(device), dtype, static
        self.layers: list[LayerKVCache] | list[LatentLayerCache]
        if latent is not None:
            if (not isinstance(latent, tuple) or len(latent) != 2
                    or n_kv_heads != 1 or head_dim != sum(latent)):
                raise ValueError(f"latent must be (kv_lora_rank, qk_rope_head_dim) with "
                                 f"n_kv_heads=1 and head_dim their sum, got latent={latent!r}, "
                                 f"n_kv_heads={n_kv_heads}, head_dim={head_dim}")
            for name, value in zip(("kv_lora_rank", "qk_rope_head_dim"), latent, strict=True):
                _check_positive(name, value)
            self.layers = [LatentLayerCache(batch_size, max_len, *latent, device=self.device,
                                            dtype=dtype) for _ in range(n_layers)]
        else:
            self.layers = [LayerKVCache(batch_size, n_kv_heads, max_len, head_dim,
                                        device=self.device, dtype=dtype)
                           for _ in range(n_layers)]
        self.length = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 1, max_len: int | None = None,
                  *, static: bool = False, rolling: bool = False, slack: int = 0) -> KVCache:
        """A cache shaped for `model` (a TinyGPT), on the device and in the dtype of its weights.

        max_len defaults to model.cfg.max_seq_len and may not exceed it (RoPE has no angles for
        later positions). rolling=True (day 21, a dynamic cache of a model with a sliding
        window) gives each windowed layer a tinygpt.rolling.RollingLayerCache of
        sliding_window + slack slots instead of max_len (full-attention layers keep theirs).
        """
        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"model must carry a tinygpt ModelConfig as .cfg, got {cfg!r}")
        max_len = cfg.max_seq_len if max_len is None else _check_positive("max_len", max_len)
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len ({max_len}) must be <= the model's max_seq_len "
                             f"({cfg.max_seq_len})")
        weight = next(model.parameters())
        if cfg.attention == "mla":          # day 21: the latent and the RoPE key per token
            latent = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
            cache = cls(cfg.n_layers, batch_size, 1, max_len, sum(latent), device=weight.device,
                        dtype=weight.dtype, static=static, latent=latent)
        else:
            # a tensor-parallel shard (tinygpt.parallel) caches only its own KV heads
            n_kv_heads = getattr(model, "cache_kv_heads", cfg.n_kv_heads)
            cache = cls(cfg.n_layers, batch_size, n_kv_heads, max_len, cfg.head_dim,
                        device=weight.device, dtype=weight.dtype, static=static)
        if rolling is not False:    # refused for MLA, whose config has no sliding window
            from tinygpt.rolling import rolling_layers

            cache.layers = rolling_layers(cache, cfg, rolling, slack)
        return cache

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of every K (and V) buffer: (batch_size, n_kv_heads, max_len, head_dim)."""
        return (self.batch_size, self.n_kv_heads, self.max_len, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers (equals flops.kv_cache_bytes for max_len tokens;
        a latent cache: tinygpt.mla.kv_bytes_per_token_mla for max_len tokens)."""
        return sum(layer.nbytes for layer in self.layers)

    def reset(self) -> None:
        """Forget the contents: the next forward writes from position 0 again."""
        self.length = 0

    def narrowed(self, capacity: int) -> KVCache:
        """A static cache over the first `capacity` slots of this static one: every layer's
        buffers are views of the same storage, so a forward on it writes here and attends
        over `capacity` slots, not max_len (tinygpt.captured replays one CUDA graph per
        capacity). The caller keeps both lengths."""
        if not self.static:
            raise ValueError("narrowed() views a static cache (static=True); a dynamic one "
                             "already attends over its filled part only")
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or not 1 <= capacity <= self.max_len:
            raise ValueError(f"capacity must be an int in [1, max_len={self.max_len}], got "
                             f"{capacity!r}")
        view = copy.copy(self)
        view.max_len = capacity
        view.layers = [layer.narrowed(capacity) for layer in self.layers]
        return view

    def check_step(self, batch: int, n_new: int, device: torch.device,
                   dtype: torch.dtype) -> int:
        """Validate a forward of `n_new` tokens for `batch` sequences; return its start offset.

        Raises ValueError when the batch is larger than the cache's, when the cache is on
        another device or holds another dtype than the model, or (dynamic cache) when
        length + n_new exceeds max_len. A static cache returns 0 without reading `length`:
        its positions come as a tensor, and a compiled step must not depend on a Python int
        that changes every step (it would recompile).
        """
        if batch > self.batch_size:
            raise ValueError(f"batch size {batch} is larger than the KV cache's batch_size "
                             f"{self.batch_size}; make a cache with batch_size >= {batch}")
        if torch.device(device) != self.device and not (
                device.type == self.device.type and self.device.index is None):
            raise ValueError(f"the KV cache is on {self.device} but the model runs on {device}; "
                             f"create it with KVCache.for_model(model) after moving the model")
        if dtype != self.dtype:
            raise ValueError(f"the KV cache holds {self.dtype} but the model computes in {dtype}; "
                             f"create it with KVCache.for_model(model) after casting the model")
        if not self.static and self.length + n_new > self.max_len:
            raise ValueError(f"the KV cache is full: it holds max_len={self.max_len} positions, "
                             f"{self.length} are filled, and {n_new} more were given; reset() "
                             f"it or create a longer cache")
        return 0 if self.static else self.length

    def start_forward(self, cfg: ModelConfig, idx: torch.Tensor,
                      input_pos: torch.Tensor | None, weight: torch.Tensor) -> int:
        """Every check TinyGPT.forward(idx (B, T), input_pos, kv_cache=self) needs; returns
        the offset the T tokens are written at (0 for a static cache, see check_step).

        weight: a model weight, giving the device and dtype the cache must match.
        """
        batch, n_new = idx.shape
        start = self.check_step(batch, n_new, weight.device, weight.dtype)
        if len(self.layers) != cfg.n_layers:
            raise ValueError(f"the KV cache has {len(self.layers)} layers but the model has "
                             f"n_layers={cfg.n_layers}")
        if self.static and (input_pos is None or input_pos.ndim != 1):
            raise ValueError("a static KV cache needs input_pos of shape (T,): the slots to "
                             "write")
        if start + n_new > cfg.max_seq_len:
            raise ValueError(f"positions up to {start + n_new - 1} exceed max_seq_len="
                             f"{cfg.max_seq_len}; the KV cache is longer than the model's window")
        return start

    def advance(self, n_new: int) -> None:
        """Record that positions length .. length + n_new - 1 were written."""
        self.length += n_new


def supports_kv_cache(model: torch.nn.Module) -> bool:
    """True when model.forward accepts a `kv_cache` argument (TinyGPT does)."""
    try:
        return "kv_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# the two phases


@torch.inference_mode()
def prefill(model: torch.nn.Module, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
    """Run a prompt through the model, filling the cache: ids (B, T) -> last logits (B, V).

    Writes positions cache.length .. cache.length + T - 1 (0 .. T-1 for a fresh cache) in one
    forward pass and advances cache.length by T. Logits come back in float32.
    """
    if not cache.static:
        return model(ids, kv_cache=cache)[:, -1, :].float()
    start, n_new = cache.length, ids.shape[1]
    if start + n_new > cache.max_len:
        raise ValueError(f"the KV cache is full: it holds max_len={cache.max_len} positions, "
                         f"{start} are filled, and {n_new} more were given")
    positions = torch.arange(start, start + n_new, device=ids.device)
    logits = model(ids, input_pos=positions, kv_cache=cache)[:, -1, :].float()
    cache.advance(n_new)
    return logits


@torch.inference_mode()
def decode_step(model: torch.nn.Module, cache: KVCache, token: torch.Tensor) -> torch.Tensor:
    """Feed one new token per sequence at position cache.length: token (B, 1) -> logits (B, V).

    The token's keys and values are written at offset cache.length, attention reads positions
    0 .. cache.length, and cache.length grows by one. Logits come back in float32.
    """
    if token.ndim != 2 or token.shape[1] != 1:
        raise ValueError(f"token must have shape (B, 1), got {tuple(token.shape)}")
    return model(token, kv_cache=cache)[:, -1, :].float()


def _static_step(model: torch.nn.Module, cache: KVCache, token: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor:
    """One static-shape decode step: token (B, 1) at position pos (1,) -> logits (B, V)."""
    return model(token, input_pos=pos, kv_cache=cache)[:, -1, :].float()


class _Linear:
    """y = x @ W.T for one or more weights that share their input; returns a tuple, one
    output per weight (q, k, v share the normed input; so do the gate and up projections)."""

    def __init__(self, *weights: torch.Tensor) -> None:
        self.weights = weights

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(nnf.linear(x, w) for w in self.weights)


class _PackedLinear(_Linear):
    """The same products from one prepacked matrix: the weights stacked (one product for q, k
    and v, one for gate and up) and reordered once into oneDNN's blocked layout, whose
    inner-product kernel splits a batch-1 product across every core. The packed matrix is a
    copy made now: later changes to the model's weights do not reach it."""

    def __init__(self, *weights: torch.Tensor) -> None:
        self.sizes = [w.shape[0] for w in weights]
        stacked = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(stacked.detach(), 1)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return y.split(self.sizes, -1)


class _TiledProduct(_Linear):
    """The same products on tinygpt.cpu_kernels' tiled weights (stacked like _PackedLinear),
    for up to cpu_kernels.MAX_ROWS sequences; a larger batch runs the plain products. Weights
    the kernels do not take (refused by TiledLinear.refusal) run plain."""

    def __new__(cls, *weights: torch.Tensor, fmt: str = "fp32",
                blocks: dict | None = None) -> _Linear:
        from tinygpt.cpu_kernels import TiledLinear

        if TiledLinear.refusal(*weights, fmt=fmt) is not None or (
                fmt == "q4_1" and not all(id(w) in (blocks or {}) for w in weights)):
            return _Linear(*weights)
        return super().__new__(cls)

    def __init__(self, *weights: torch.Tensor, fmt: str = "fp32",
                 blocks: dict | None = None) -> None:
        from tinygpt.cpu_kernels import MAX_ROWS, TiledLinear

        super().__init__(*weights)
        self.tiled = TiledLinear(*weights, fmt=fmt, blocks=None if fmt != "q4_1" else
                                 [blocks[id(w)] for w in weights])
        self.max_rows = MAX_ROWS

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.numel() // x.shape[-1] > self.max_rows:
            return super().__call__(x)
        if x.dtype == torch.float32:
            return self.tiled(x)
        return tuple(y.to(x.dtype) for y in self.tiled(x.float()))    # bfloat16 activations


# model -> (the versions and addresses of its weights when tiled, the tiled products, head):
# generate() builds a DecodeStep per call, and tiling 500 MB of weights each time would cost
# more than a short generation; the entry is rebuilt when any weight changed or moved.
_TILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model: TinyGPT) -> tuple:
    return tuple((p._version, p.data_ptr()) for p in model.parameters())


def _tiled_refusal(model: torch.nn.Module, cache: KVCache) -> str | None:
    """Why the tiled CPU products cannot be used for this model and cache, or None."""
    from tinygpt import cpu_kernels

    if not isinstance(model, TinyGPT) or getattr(model, "quant_scheme", None) is not None:
        return "the tiled CPU products need a full-precision TinyGPT"
    if not getattr(model, "fused_decode", True):
        return "the tiled CPU products need a one-process model (not a tensor-parallel shard)"
    if _fused_refusal(model.cfg) is not None:           # day 20: the modules run instead
        return f"the tiled CPU layers are Llama layers; {_fused_refusal(model.cfg)}"
    if model.cfg.is_moe and getattr(model, "decode_weights", None) is not None:
        return ("Q8_0 / Q4_1 decode weights are made for dense layers (the experts' stacked "
                "weights are not quantized)")
    if cache.static:
        return "the tiled CPU products need a dynamic cache (static=False)"
    weight = model.output.weight
    if weight.device.type != "cpu":
        return f"the tiled CPU products are for CPU weights; the model is on {weight.device}"
    if weight.dtype not in cpu_kernels.WEIGHT_DTYPES:
        return (f"the tiled CPU products take float32 or bfloat16 models; this one is "
                f"{weight.dtype}")
    odd = [type(p).__name__ for p in model.parameters()
           if type(p) not in (torch.Tensor, torch.nn.Parameter)]
    if odd:
        return f"the tiled CPU products take plain tensors; this model holds {odd[0]} weights"
    return cpu_kernels.available()


def _fused_refusal(cfg: ModelConfig) -> str | None:
    """Why the fused step cannot compute this model's layers, or None when it can. It has no
    q/k norm, multi-head latent attention, sliding windows or dynamic RoPE (day 21:
    cfg.fast_path_refusal, cfg.positions_refusal); a mixture-of-experts layer runs in it
    through tinygpt.moe.MoEDecode (day 20)."""
    if cfg.qk_norm:
        return "the model normalizes queries and keys per head before RoPE (qk_norm=True)"
    if cfg.attention == "mla":                  # day 21: MLAttention's absorbed decode runs
        return cfg.fast_path_refusal()
    # day 21: a sliding window or dynamic RoPE (the step reads whole caches and fixed tables)
    return cfg.positions_refusal()


def _feed_forward(ff: torch.nn.Module, linear: Callable[..., _Linear]) -> tuple:
    """(gate_up, w2) products of a SwiGLU; (MoEDecode, None) for a MoE layer, which routes
    and runs only its chosen experts, each expert's products made by `linear`."""
    if isinstance(ff, MoE):
        return MoEDecode(ff, linear), None
    return linear(ff.w1.weight, ff.w3.weight), linear(ff.w2.weight)


def _fused_weights(model: TinyGPT, linear: Callable[..., _Linear] = _Linear) -> list[tuple]:
    """Per layer: (attention_norm weight, qkv, wo, ffn_norm weight, gate_up, w2), where qkv,
    wo, gate_up and w2 are `linear` products (each returns a tuple of outputs); on a MoE
    layer gate_up is its MoEDecode and w2 None."""
    return [(b.attention_norm.weight,
             linear(b.attention.wq.weight, b.attention.wk.weight, b.attention.wv.weight),
             linear(b.attention.wo.weight), b.ffn_norm.weight,
             *_feed_forward(b.feed_forward, linear))
            for b in model.layers]


def _moe_layers(weights: list[tuple]) -> list[tuple]:
    """The fused step's layers as cpu_kernels.MoEDecodeLayers takes them: each product's
    TiledLinear (None where a product is not tiled: its refusal then says so)."""
    def tiled(product):
        return getattr(product, "tiled", None)

    return [(n1, tiled(qkv), tiled(wo), n2, ("dense", tiled(gu), tiled(w2))
             if not isinstance(gu, MoEDecode) else
             ("moe", gu.moe, [tiled(p) for p in gu.gate_up], [tiled(p) for p in gu.down],
              gu.shared and tuple(tiled(p) for p in gu.shared)))
            for n1, qkv, wo, n2, gu, w2 in weights]


def _pack_refusal(model: torch.nn.Module, cache: KVCache) -> str | None:
    """Why pack_weights=True cannot be used for this model and cache, or None if it can."""
    if not isinstance(model, TinyGPT) or not getattr(model, "fused_decode", True):
        return f"pack_weights=True needs a one-process TinyGPT, got {type(model).__name__}"
    if model.cfg.fast_path_refusal() is not None:
        return f"pack_weights=True packs dense Llama layers; {model.cfg.fast_path_refusal()}"
    if cache.static:
        return "pack_weights=True needs a dynamic cache (static=False)"
    weight = model.output.weight
    if weight.device.type != "cpu":
        return f"pack_weights=True is for CPU weights; the model is on {weight.device}"
    if weight.dtype != torch.float32:
        return f"pack_weights=True supports float32 weights; the model's are {weight.dtype}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise"):
        return "pack_weights=True needs torch built with oneDNN (torch.backends.mkldnn)"
    return None


class DecodeStep:
    """A callable decode step: step(token (B, 1)) -> logits (B, V) float32; advances the cache.

    With a dynamic cache and a TinyGPT, the eager step is decode_step's computation written
    for one token: torch's fused kernels (F.rms_norm, F.scaled_dot_product_attention with
    GQA), RoPE as x * cos + roll(x) * sin_signed, the weights looked up once instead of
    through module attributes, and no module calls. At batch 1 a small model's decode step is
    bound by per-kernel overhead, and this cuts the kernels per layer by about two thirds.
    Logits agree with decode_step to float rounding (tests check it); other models run
    decode_step itself, and so does a TinyGPT with q/k norm (day 20) or multi-head latent
    attention (day 21), with tiled_reason / pack_reason saying why. A mixture-of-experts
    layer (day 20) runs in the step as tinygpt.moe.MoEDecode: it routes the tokens and runs
    only the chosen experts' products (on the tiled CPU products below, each expert's gate and
    up stacked, its down apart; there each layer runs as two C calls around the router,
    cpu_kernels.MoEDecodeLayers; pack_weights is for dense layers only). A quantized model
    (tinygpt.quant.quantize_model) is refused with a TypeError: its step is
    tinygpt.quant.QuantizedDecodeStep.

    compile=True (opt-in, CUDA only) runs a static-shape step through
    torch.compile(mode="reduce-overhead"), which captures it in a CUDA graph and replays it,
    removing the per-kernel launch cost that dominates small-batch decode. The cache must
    then be static (KVCache.for_model(model, static=True)). When compilation cannot be used
    (no CUDA device, a dynamic cache, or torch.compile failing) the step runs eagerly, a
    CompileFallbackWarning gives the reason, and `reason` keeps it; `compiled` tells which
    path runs.

    tiled=True (the default) runs the products of a float32 or bfloat16 TinyGPT on the CPU
    with a dynamic cache on tinygpt.cpu_kernels' tiled weights, every product split over the
    cores (a model marked by cpu_kernels.q8_0_model / q4_1_model streams Q8_0 / Q4_1 blocks).
    The tiles are built once per model (cached; rebuilt when a weight changes) and checked
    against F.linear on a probe; `tiled` tells whether they run and `tiled_reason` why not
    (other devices, dtypes, a static cache, tiled=False: the plain products, the oracle).
    Batches of more than cpu_kernels.MAX_ROWS sequences run the plain products. On a plain
    cache the whole step then runs as one C call (cpu_kernels.DecodeLayers: per layer the
    norms, RoPE, the cache write, attention and SiLU between the products, which cost a fifth
    of a SmolLM2-sized step as torch operations, then the final norm and the head; activations
    in float32, also for a bfloat16 model, whose plain step rounds them to bfloat16 after
    every operation), and torch's own
    operations in the step run on one thread, leaving the cores to the products' threads.

    pack_weights=True (opt-in, CPU, float32) is the older CPU option for larger models. At
    batch 1 every product is a matrix times one vector, so the step should stream the weights
    at memory bandwidth, which the plain step falls well short of. The step then keeps a
    prepacked copy of the weights (q/k/v stacked, gate/up stacked, oneDNN's blocked layout)
    and runs oneDNN's inner product.
    The copy doubles the weights' memory and is a snapshot, and each product pays a fixed
    ~30 us (AVX-512 EPYC, 2026-11-21), so it loses on tiny models. Packing is checked against
    the plain products when the step is built; when it cannot be used a PackFallbackWarning
    says why, `pack_reason` keeps it, and `packed` tells which path runs.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, compile: bool = False,
                 pack_weights: bool = False, tiled: bool = True) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        for name, flag in (("compile", compile), ("pack_weights", pack_weights),
                           ("tiled", tiled)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        # a quantized model's products are QuantizedLinear layers, which the fused step here
        # cannot read; tinygpt.quant.QuantizedDecodeStep builds its own in its _try_pack
        if getattr(model, "quant_scheme", None) is not None \
                and type(self)._try_pack is DecodeStep._try_pack:
            raise TypeError(f"DecodeStep runs full-precision weights; this model is quantized "
                            f"({model.quant_scheme}): use tinygpt.quant.QuantizedDecodeStep("
                            f"model, cache)")
        self.model, self.cache = model, cache
        self.compiled, self.reason = False, None
        self.packed, self.pack_reason = False, None
        self.tiled, self.tiled_reason = False, None
        self._compiled_fn = None
        self._weights = None
        if pack_weights:
            self._try_pack()
        elif tiled:
            self._try_tile()
        else:
            self.tiled_reason = "tiled=False: the plain products run"
        # the fused step reads the weights directly: not for a tensor-parallel shard, whose
        # layers all-reduce (tinygpt.parallel sets fused_decode = False), nor for q/k norm
        # layers (day 20), which it does not compute: those run decode_step, the modules
        if isinstance(model, TinyGPT) and not cache.static and getattr(
                model, "fused_decode", True) and _fused_refusal(model.cfg) is None:
            if self._weights is None:
                self._weights = _fused_weights(model)
                self._head = _Linear(model.output.weight)
            half = model.cfg.head_dim // 2
            sin = model.rope_sin
            # rotate_half(x) * sin == roll(x, half) * sin_signed: one kernel instead of four
            self._sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self._layers = None
        if self.tiled and all(type(layer) is LayerKVCache for layer in cache.layers):
            from tinygpt.cpu_kernels import DecodeLayers

            layers = [(n1, getattr(qkv, "tiled", None), getattr(wo, "tiled", None), n2,
                       getattr(gu, "tiled", None), getattr(w2, "tiled", None))
                      for n1, qkv, wo, n2, gu, w2 in self._weights]
            args = (layers, cache.layers, model.rope_cos, self._sin_signed)
            if DecodeLayers.refusal(*args) is None:     # the final norm and head in the call
                head = getattr(self._head, "tiled", None)
                self._layers = DecodeLayers(*args, model.cfg.n_heads, model.cfg.n_kv_heads,
                                            model.cfg.norm_eps, final_norm=model.norm.weight,
                                            head=head if head is not None and head.code ==
                                            layers[0][1].code else None)
                self._final_norm = None
            elif model.cfg.is_moe:        # day 20: attention halves and chosen experts in C
                from tinygpt.cpu_kernels import MoEDecodeLayers

                args = (_moe_layers(self._weights), *args[1:])
                if MoEDecodeLayers.refusal(*args) is None:
                    self._layers = MoEDecodeLayers(*args, model.cfg.n_heads,
                                                   model.cfg.n_kv_heads, model.cfg.norm_eps)
                    self._final_norm = model.norm.weight.float()
        if compile:
            self._try_compile()

    def _try_tile(self) -> None:
        """Use tinygpt.cpu_kernels' tiled products when they apply (cached per model, checked
        against F.linear on a probe when built); otherwise keep tiled_reason and run plain."""
        model = self.model
        reason = _tiled_refusal(model, self.cache)
        if reason is None:
            key = _weights_key(model)
            entry = _TILED.get(model)
            if entry is None or entry[0] != key:
                with torch.inference_mode():
                    from tinygpt.cpu_kernels import WEIGHT_DTYPES, kernel_input

                    fmt = getattr(model, "decode_weights", None) or \
                        WEIGHT_DTYPES[model.output.weight.dtype]
                    product = functools.partial(_TiledProduct, fmt=fmt,
                                                blocks=getattr(model, "decode_blocks", None))
                    weights = _fused_weights(model, product)
                    head = product(model.output.weight)
                    products = [p for layer in weights for p in layer[1:] if
                                isinstance(p, _TiledProduct)]
                    if not products:
                        reason = "the tiled kernels take none of this model's products"
                    for product in products[:1] + products[-1:]:
                        weight = torch.cat(product.weights)
                        probe = torch.randn(1, weight.shape[1],
                                            generator=torch.Generator().manual_seed(0))
                        # q8_0 / q4_1 round their input to 8 bits first: the oracle does too
                        want = nnf.linear(kernel_input(probe, product.tiled.fmt),
                                          weight.float())
                        got = torch.cat(product.tiled(probe), -1)
                        if not torch.allclose(got, want, rtol=1e-4,
                                              atol=1e-4 * want.abs().max().item()):
                            reason = "the tiled product disagreed with F.linear on a probe"
                    if reason is None:
                        entry = _TILED[model] = (key, weights, head)
        if reason is not None:
            self.tiled_reason = reason
            return
        self._weights, self._head, self.tiled = entry[1], entry[2], True
        from tinygpt.cpu_kernels import MAX_ROWS

        self._max_rows = MAX_ROWS       # larger batches run the plain products

    def _try_pack(self) -> None:
        model = self.model
        reason = _pack_refusal(model, self.cache)
        if reason is None:
            with torch.inference_mode():
                try:
                    weights, head = _fused_weights(model, _PackedLinear), \
                        _PackedLinear(model.output.weight)
                    probe = torch.randn(2, model.cfg.d_model, generator=torch.Generator()
                                        .manual_seed(0))
                    want = nnf.linear(probe, model.output.weight)
                    if not torch.allclose(head(probe)[0], want, rtol=1e-4,
                                          atol=1e-4 * want.abs().max().item()):
                        reason = "oneDNN's packed product disagreed with torch's on a probe"
                except RuntimeError as err:
                    reason = f"packing failed ({type(err).__name__}: {err})"
        if reason is not None:
            self.pack_reason = f"{reason}; the step uses the unpacked weights"
            warnings.warn(self.pack_reason, PackFallbackWarning, stacklevel=3)
            return
        self._weights, self._head, self.packed = weights, head, True

    def _fall_back(self, reason: str) -> None:
        self.compiled, self.reason = False, reason
        warnings.warn(reason, CompileFallbackWarning, stacklevel=3)

    def _try_compile(self) -> None:
        cache = self.cache
        if cache.device.type != "cuda":
            self._fall_back(f"compile=True needs a CUDA device for CUDA graphs; the cache is on "
                            f"{cache.device}, so the eager step is used")
        elif not cache.static:
            self._fall_back("compile=True needs a static cache (KVCache.for_model(model, "
                            "static=True)): a dynamic cache changes shape every step; the eager "
                            "step is used")
        else:
            for layer in cache.layers:      # fixed addresses: no copies into the CUDA graph
                for buffer in ((layer.c, layer.k_pe) if isinstance(layer, LatentLayerCache)
                               else (layer.k, layer.v)):
                    torch._dynamo.mark_static_address(buffer)
            self._compiled_fn = torch.compile(_static_step, mode="reduce-overhead",
                                              fullgraph=True)
            self.compiled = True

    @torch.inference_mode()
    def _fused(self, token: torch.Tensor) -> torch.Tensor:
        """decode_step for a TinyGPT, in fewer kernels: token (B, 1) -> logits (B, V)."""
        model, cache, cfg = self.model, self.cache, self.model.cfg
        embedding = model.tok_embeddings.weight
        if token.ndim != 2 or token.shape[1] != 1:
            raise ValueError(f"token must have shape (B, 1), got {tuple(token.shape)}")
        batch = token.shape[0]
        start = cache.check_step(batch, 1, embedding.device, embedding.dtype)
        if start + 1 > cfg.max_seq_len:
            raise ValueError(f"position {start} exceeds max_seq_len={cfg.max_seq_len}")
        if not torch.compiler.is_compiling():
            model._check_inputs(token, None)
        n_heads, n_kv, head_dim, dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, (cfg.d_model,)
        gqa, half, eps = n_heads != n_kv, head_dim // 2, cfg.norm_eps
        if self._layers is not None and batch <= self._max_rows:
            # the step in C, one call (cpu_kernels.DecodeLayers), x in float32
            x = nnf.embedding(token[:, 0], embedding).float()                 # (B, D)
            logits = self._layers(x, start)                # x ends normed by model.norm
            cache.advance(1)
            if logits is not None:                         # the head ran in the same call
                return logits
            if self._final_norm is not None:
                x = nnf.rms_norm(x, dim, self._final_norm, eps)
            return self._head(x)[0].float()
        cos, sin = model.rope_cos[start], self._sin_signed[start]             # (head_dim,)
        x = nnf.embedding(token, embedding)                                   # (B, 1, D)
        for (attention_norm, qkv, wo, ffn_norm, gate_up, w2), layer in zip(
                self._weights, cache.layers, strict=True):
            h = nnf.rms_norm(x, dim, attention_norm, eps)
            q, k, v = qkv(h)
            q = q.view(batch, n_heads, 1, head_dim)
            k = k.view(batch, n_kv, 1, head_dim)
            v = v.view(batch, n_kv, 1, head_dim)
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
            keys = layer.k if batch == cache.batch_size else layer.k[:batch]
            values = layer.v if batch == cache.batch_size else layer.v[:batch]
            keys.narrow(2, start, 1).copy_(k)
            values.narrow(2, start, 1).copy_(v)
            y = nnf.scaled_dot_product_attention(q, keys.narrow(2, 0, start + 1),
                                                 values.narrow(2, 0, start + 1), enable_gqa=gqa)
            x = x + wo(y.view(batch, 1, n_heads * head_dim))[0]              # (B,H,1,hd) order
            h = nnf.rms_norm(x, dim, ffn_norm, eps)
            if w2 is None:                  # a mixture of experts: tinygpt.moe.MoEDecode
                x = x + gate_up(h)
                continue
            gate, up = gate_up(h)
            x = x + w2(nnf.silu(gate) * up)[0]
        cache.advance(1)
        x = nnf.rms_norm(x[:, -1], dim, model.norm.weight, eps)
        return self._head(x)[0].float()

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (1, r): r new tokens of sequence 0 at the cache's length -> their logits
        (r, V) float32, the cache advanced by r. Speculative decoding's verify pass (day 14)
        feeds the last token and its drafts this way. On the tiled CPU layers (a float32 or
        bfloat16 TinyGPT on a dynamic cache) the positions run through
        cpu_kernels.DecodeLayers in groups of up to MAX_ROWS, each attending causally to the
        positions before it, so a pass of r tokens reads the weights ceil(r / MAX_ROWS)
        times instead of running the model's modules; otherwise the model's own forward (on a
        static cache at input_pos = length .. length + r - 1, as prefill)."""
        if tokens.ndim != 2 or tokens.shape[0] != 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape (1, r) with r >= 1, got "
                             f"{tuple(tokens.shape)}")
        model, cache = self.model, self.cache
        if self._layers is None and not cache.static:
            with torch.inference_mode():
                return model(tokens, kv_cache=cache)[0].float()
        if self._layers is None:            # a static cache: its slots as a tensor, as prefill
            start, r = cache.length, tokens.shape[1]
            if start + r > cache.max_len:
                raise ValueError(f"the KV cache is full: it holds max_len={cache.max_len} "
                                 f"positions, {start} are filled, and {r} more were given")
            positions = torch.arange(start, start + r, device=tokens.device)
            with torch.inference_mode():
                logits = model(tokens, input_pos=positions, kv_cache=cache)[0].float()
            cache.advance(r)
            return logits
        cfg, r = model.cfg, tokens.shape[1]
        embedding = model.tok_embeddings.weight
        start = cache.check_step(1, r, embedding.device, embedding.dtype)
        if start + r > cfg.max_seq_len:
            raise ValueError(f"positions {start}..{start + r - 1} exceed "
                             f"max_seq_len={cfg.max_seq_len}")
        model._check_inputs(tokens, None)
        with torch.inference_mode(), self.token_threads():
            x = nnf.embedding(tokens[0], embedding).float()                  # (r, D)
            logits = [self._layers(x[i:i + self._max_rows], start + i, consecutive=True)
                      for i in range(0, r, self._max_rows)]
            cache.advance(r)
            if logits[0] is not None:                      # the head ran in the same calls
                return torch.cat(logits)
            if self._final_norm is not None:
                x = nnf.rms_norm(x, (cfg.d_model,), self._final_norm, cfg.norm_eps)
            return self._head(x)[0].float()

    def token_threads(self, batch: int = 1):
        """A context for one token's work around this step (the step, and sampling after it):
        torch on one thread while the tiled CPU products run (tinygpt.native.
        torch_single_thread says why), else nothing changes. generate() holds it for the
        step and the sampling together: a two-thread argmax between two steps wakes an
        OpenMP team that then spins beside the products (SmolLM2 in float32 on the 2-core
        AVX-512 EPYC, 2026-11-25: about 1 ms of a 20 ms token)."""
        if self._weights is not None and self.tiled and batch <= self._max_rows:
            return torch_single_thread()
        return contextlib.nullcontext()

    def _eager(self, token: torch.Tensor) -> torch.Tensor:
        if self._weights is not None and self.tiled:
            # The tiled products split themselves over the cores with their own threads;
            # torch's operations in the step would otherwise start OpenMP teams of their own
            # between them, whose workers then compete with the product threads for the same
            # cores (with torch's attention over 9 heads in the step, before the layers ran
            # in C, a step on the busy AVX-512 EPYC (2026-11-25) took 5x longer). At batch 1
            # these operations are far too small to gain from a split.
            with self.token_threads(token.shape[0]):
                return self._fused(token)
        if self._weights is not None:
            return self._fused(token)
        if not self.cache.static:
            return decode_step(self.model, self.cache, token)
        pos = torch.tensor([self.cache.length], device=token.device)
        if self.cache.length + 1 > self.cache.max_len:
            raise ValueError(f"the KV cache is full: it holds max_len={self.cache.max_len} "
                             f"positions; reset() it or create a longer cache")
        with torch.inference_mode():
            logits = _static_step(self.model, self.cache, token, pos)
        self.cache.advance(1)
        return logits

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return self._eager(token)
        cache = self.cache
        if cache.length + 1 > cache.max_len:
            raise ValueError(f"the KV cache is full: it holds max_len={cache.max_len} "
                             f"positions; reset() it or create a longer cache")
        pos = torch.tensor([cache.length], device=token.device)
        try:
            with torch.inference_mode():
                logits = self._compiled_fn(self.model, cache, token, pos).clone()
        except Exception as err:  # noqa: BLE001 - any compiler failure means: run eagerly
            self._fall_back(f"torch.compile failed ({type(err).__name__}: {err}); the eager "
                            f"step is used")
            return self._eager(token)
        cache.advance(1)
        return logits


# --------------------------------------------------------------------------------------------
# memory calculator


def kv_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """Cache bytes one token adds per sequence: 2 x layers x kv_heads x head_dim x bytes."""
    return F.kv_cache_bytes(cfg, 1, 1, dtype)


def kv_cache_bytes_mha(cfg: ModelConfig, tokens: int, batch: int, dtype: str = "bf16") -> int:
    """The cache the same model would need without GQA (one K/V head per query head).

    kv_cache_bytes_mha / flops.kv_cache_bytes = n_heads / n_kv_heads, the GQA saving.
    """
    F._check_cfg(cfg)
    return F.kv_cache_bytes(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads), tokens, batch,
                            dtype)


def _free_bytes(cfg: ModelConfig, hw, dtype: str, reserve_bytes: int) -> int:
    """Device memory left for the KV cache next to the weights (may be negative)."""
    from tinygpt.roofline import Hardware, get_hardware

    if isinstance(hw, str):
        hw = get_hardware(hw)
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a tinygpt.roofline.Hardware or a HARDWARE name, got "
                        f"{type(hw).__name__}")
    F._check_int("reserve_bytes", reserve_bytes, minimum=0)
    return int(hw.memory) - F.weight_bytes(cfg, dtype) - reserve_bytes


def max_batch_that_fits(cfg: ModelConfig, hw, context_len: int, dtype: str = "bf16", *,
                        kv_dtype: str | None = None, reserve_bytes: int = 0) -> int:
    """Largest batch whose KV cache of `context_len` tokens per sequence fits next to the weights.

    hw: a tinygpt.roofline.Hardware or a name in HARDWARE (its `memory` in bytes is used).
    dtype: weight dtype; kv_dtype: cache dtype (default dtype). reserve_bytes: memory kept
    for activations and the framework. Returns 0 when not even one sequence fits (or the
    weights alone do not). Memory only: the context is not compared with cfg.max_seq_len.
    """
    F._check_int("context_len", context_len)
    kv = dtype if kv_dtype is None else kv_dtype
    free = _free_bytes(cfg, hw, dtype, reserve_bytes)
    per_sequence = F.kv_cache_bytes(cfg, context_len, 1, kv)
    if free < per_sequence:
        return 0
    batch = free // per_sequence
    while F.kv_cache_bytes(cfg, context_len, batch + 1, kv) <= free:   # int4 rounding
        batch += 1
    return batch


def max_context_that_fits(cfg: ModelConfig, hw, batch: int = 1, dtype: str = "bf16", *,
                          kv_dtype: str | None = None, reserve_bytes: int = 0) -> int:
    """Largest tokens per sequence whose KV cache for `batch` sequences fits next to the weights.

    Arguments as in max_batch_that_fits. Returns 0 when nothing fits. Memory only: compare
    the answer with cfg.max_seq_len, the longest context the model itself accepts.
    """
    F._check_int("batch", batch)
    kv = dtype if kv_dtype is None else kv_dtype
    free = _free_bytes(cfg, hw, dtype, reserve_bytes)
    per_token = F.kv_cache_bytes(cfg, 1, batch, kv)
    if free < per_token:
        return 0
    tokens = free // per_token
    while F.kv_cache_bytes(cfg, tokens + 1, batch, kv) <= free:        # int4 rounding
        tokens += 1
    return tokens
