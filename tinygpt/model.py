"""Day 05: the transformer block and the Llama-style TinyGPT model.

A decoder-only transformer in the Llama layout, readable top to bottom:

    idx (B, T) -> tok_embeddings -> L x Block -> norm -> output -> logits (B, T, V)

    Block:  h   = x + attention(attention_norm(x))        pre-norm residual
            out = h + feed_forward(ffn_norm(h))

- RMSNorm instead of LayerNorm: no mean subtraction, no bias; computed in float32.
- SwiGLU MLP: w2(silu(w1 x) * w3 x), three weight matrices of shape (d_ff, D) or (D, d_ff).
- Attention: no biases, rotary position embedding (RoPE) on queries and keys, grouped-query
  attention with n_kv_heads key/value heads. Positions are absolute and passed in (`input_pos`),
  so a KV cache can later feed one new token at position t.
- Optional weight tying: the LM head reuses the embedding matrix (V, D).

Day 20 adds three options, all off by default (every dense config builds the same model, and
checkpoints written before load unchanged; a new config.json also records head_dim):

- Mixture of experts (cfg.n_experts > 0): a sparse layer's feed_forward is tinygpt.moe.MoE
  (a router and E SwiGLU experts, k of them per token, optionally a shared expert) instead of
  one SwiGLU; layers listed in cfg.dense_layers keep the dense SwiGLU of width d_ff.
  Qwen3-MoE and Mixtral are this layout (tinygpt.hf_models loads them).
- q/k norm (cfg.qk_norm, Qwen3): an RMSNorm over head_dim on every query and key head, inside
  Attention.qkv, before RoPE.
- An explicit head_dim (cfg.head_dim; None derives d_model // n_heads as before): Qwen3's
  heads are 128 wide with d_model / n_heads = 64, so wq maps D to H * head_dim != D and wo
  maps it back.

Fast paths written for the dense layout (the engine's batched products, packed and quantized
steps, tensor-parallel shards, GGUF writers) ask cfg.fast_path_refusal() and run the modules
above instead, or refuse. Day 11's fused decode step and its C layers ask
tinygpt.kv_cache._fused_refusal: they run MoE layers too (tinygpt.moe.MoEDecode) and refuse
the rest.

The parameter names follow Meta's Llama reference code (wq, wk, wv, wo, w1, w2, w3, ...);
`from_hf_llama` / `to_hf_llama` translate to and from Hugging Face's LlamaForCausalLM. They
are written in tinygpt.hf_models, beside day 20's Qwen3-MoE and Mixtral loaders, and import
from here as well (see `__getattr__` at the end of this file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tinygpt.attention import (
    grouped_query_attention,
    merge_heads,
    sliding_window_mask,
    split_heads,
)
from tinygpt.moe import ROUTERS, MoE
from tinygpt.positions import apply_rope, check_rope_scaling, scaled_rope_cos_sin

if TYPE_CHECKING:                                   # day 11's cache; no import cycle at run time
    from tinygpt.kv_cache import KVCache, LayerKVCache


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-style decoder-only transformer.

    vocab_size: number of token ids V.   d_model: residual width D.   n_layers: blocks L.
    n_heads: query heads H.   n_kv_heads: key/value heads (GQA when < n_heads; must divide it).
    d_ff: hidden width of the SwiGLU MLP (of the dense layers).   max_seq_len: longest context
    the model accepts.   rope_base: RoPE theta.   norm_eps: RMSNorm epsilon.
    tie_embeddings: share the input embedding matrix with the LM head.

    Mixture of experts (day 20; n_experts = 0 is a dense model and the other fields then keep
    their defaults): n_experts E routed experts per sparse layer, top_k of them per token, each
    a SwiGLU of width d_expert; router "softmax" (norm_topk_prob: renormalize the top k) or
    "sigmoid_groups" (DeepSeek-V3: n_group groups, the best topk_group eligible, weights times
    routed_scale); n_shared_experts: a shared SwiGLU of width n_shared_experts * d_expert every
    token goes through; dense_layers: indices of layers that keep the dense SwiGLU (d_ff).
    qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).

    Multi-head latent attention (day 21, DeepSeek-V2/V3; attention="gqa", the default, keeps
    day 05's attention and the fields below at 0): attention="mla" caches a latent of
    kv_lora_rank values and a RoPE key of qk_rope_head_dim per token; heads' keys are
    qk_nope_head_dim + qk_rope_head_dim wide, values v_head_dim; q_lora_rank > 0 compresses
    the queries too. n_kv_heads must equal n_heads and head_dim is qk_rope_head_dim (RoPE's
    width). See tinygpt.mla.

    head_dim: the width of one attention head. None (the default) derives it as
    d_model // n_heads (d_model must then be divisible by n_heads); give it when a model's
    heads are wider or narrower than that: Qwen3 and Qwen3-MoE use 128 with
    hidden_size / num_attention_heads = 64 (Qwen3-30B-A3B: d_model 2048, 32 heads). The
    attention then maps D -> H * head_dim (wq), D -> H_kv * head_dim (wk, wv) and back
    H * head_dim -> D (wo). Either way `cfg.head_dim` is the effective width: __post_init__
    stores it, so a derived one is written to a checkpoint's config.json like any field, and
    `dataclasses.replace(cfg, d_model=..., n_heads=...)` keeps it unless you pass
    head_dim=None to derive it again. Configs differing only in an explicit head_dim equal to
    the derived one are equal.

    Long context (day 21; the defaults change nothing, and older checkpoints load):
    rope_scaling: () for plain RoPE, or the (key, value) pairs of a scaling as
    tinygpt.positions.check_rope_scaling takes them (a dict is accepted and stored sorted),
    e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; see tinygpt.positions
    for what "linear", "dynamic", "yarn" and "llama3" do. sliding_window: 0 (every layer sees
    the whole causal context) or W >= 1: a query at position t sees keys t - W + 1 .. t only
    (Mistral's convention); full_attention_layers: layers that keep full attention in a
    windowed model (hybrid local / global models, e.g. every sixth layer global).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 0
    d_expert: int = 0
    router: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    n_shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    head_dim: int | None = None
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    sliding_window: int = 0
    full_attention_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        from tinygpt.mla import check_config  # day 21's fields (mla imports this module)

        check_config(self)          # on a "gqa" config too: its MLA fields must all be 0
        self._resolve_head_dim()
        base, eps = self.rope_base, self.norm_eps
        if isinstance(base, bool) or not isinstance(base, int | float) or not 1 < base < math.inf:
            raise ValueError(f"rope_base must be a finite number > 1 (RoPE's theta), got "
                             f"{base!r}")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ValueError(f"norm_eps must be a finite number > 0, got {eps!r}")
        for name in ("tie_embeddings", "norm_topk_prob", "qk_norm"):   # "false" is truthy
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._check_moe()
        self._check_long_context()

    def _check_long_context(self) -> None:
        """The day-21 fields: the scaling validated and stored as sorted pairs; windows."""
        object.__setattr__(self, "rope_scaling", check_rope_scaling(self.rope_scaling))
        if self.rope_type == "dynamic" and self.head_dim < 4:   # its base takes ^ d / (d - 2)
            raise ValueError(f"head_dim must be >= 4 with 'dynamic' RoPE scaling, got "
                             f"{self.head_dim}")
        window, full = self.sliding_window, self.full_attention_layers
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"sliding_window must be an integer >= 0 (0: no window), got "
                             f"{window!r}")
        if not isinstance(full, (tuple, list)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in full):
            raise ValueError(f"full_attention_layers must be a tuple of layer indices, got "
                             f"{full!r}")
        if full and not window:
            raise ValueError(f"full_attention_layers={tuple(full)!r} needs sliding_window >= 1 "
                             f"(without a window every layer attends fully)")
        if len(set(full)) != len(full) or not all(0 <= i < self.n_layers for i in full):
            raise ValueError(f"full_attention_layers must be distinct layer indices in "
                             f"[0, n_layers={self.n_layers}), got {tuple(full)!r}")
        object.__setattr__(self, "full_attention_layers", tuple(sorted(full)))
        if window and getattr(self, "attention", "gqa") != "gqa":
            raise ValueError(f"sliding_window={window} is implemented for attention='gqa' "
                             f"(TinyGPT's Attention), got attention={self.attention!r}")

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window W (a query at t sees keys t - W + 1 .. t), or None when it
        attends to the whole causal context."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
            raise ValueError(f"i must be a layer index in [0, n_layers={self.n_layers}), got "
                             f"{i!r}")
        if not self.sliding_window or i in self.full_attention_layers:
            return None
        return self.sliding_window

    @property
    def rope_type(self) -> str:
        """The RoPE scaling's type: "default" (none), "linear", "dynamic", "yarn", "llama3"."""
        return dict(self.rope_scaling).get("rope_type", "default")

    def positions_refusal(self) -> str | None:
        """Why a path that computes attention or RoPE itself (fused decode steps and
        products, padded batches, tensor-parallel shards; the engine's runner masks windows
        in its padded batch but refuses dynamic RoPE) would get this model wrong, or None.
        Static scalings (linear, yarn, llama3) need no reason: they only change the model's
        rope_cos / rope_sin tables, which those paths read."""
        if self.sliding_window:
            return (f"the model has sliding-window attention (sliding_window="
                    f"{self.sliding_window}): the fused kernels attend over every cached key")
        if self.rope_type == "dynamic":
            return ("the model's RoPE is 'dynamic' (NTK) scaling: its frequencies change with "
                    "the sequence length, and only TinyGPT.forward recomputes them")
        return None

    def _resolve_head_dim(self) -> None:
        """Store the effective head_dim: the given one, or d_model // n_heads when None."""
        given = self.head_dim
        if given is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                                 f"({self.n_heads}), or give head_dim explicitly")
            if (self.d_model // self.n_heads) % 2:
                raise ValueError(f"head_dim = d_model / n_heads must be even for RoPE, got "
                                 f"{self.d_model // self.n_heads}")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        elif isinstance(given, bool) or not isinstance(given, int) or given < 2 or given % 2:
            raise ValueError(f"head_dim must be None (d_model // n_heads) or a positive even "
                             f"integer (RoPE rotates pairs of channels), got {given!r}")

    def _check_moe(self) -> None:
        """The day-20 fields: clear errors naming the field and what it may be."""
        for name in ("norm_topk_prob", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("n_experts", "top_k", "d_expert", "n_group", "topk_group",
                     "n_shared_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        dense = self.dense_layers
        if not isinstance(dense, (tuple, list)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ValueError(f"dense_layers must be a tuple of layer indices, got {dense!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(dense)))   # hashable, ordered
        if not self.is_moe:
            defaults = {f.name: f.default for f in fields(self)}
            for name in ("top_k", "d_expert", "router", "norm_topk_prob", "n_group",
                         "topk_group", "routed_scale", "n_shared_experts", "dense_layers"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs a mixture-of-experts "
                                     f"model: set n_experts >= 1 (n_experts=0 is dense)")
            return
        e = self.n_experts
        if not 1 <= self.top_k <= e:
            raise ValueError(f"top_k must be in [1, n_experts={e}], got {self.top_k!r}")
        if self.d_expert < 1:
            raise ValueError(f"d_expert must be >= 1 for a mixture-of-experts model, got "
                             f"{self.d_expert!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if isinstance(self.routed_scale, bool) or not isinstance(self.routed_scale,
                                                                 (int, float)) \
                or not 0 < self.routed_scale < math.inf:
            raise ValueError(f"routed_scale must be a finite number > 0, got "
                             f"{self.routed_scale!r}")
        if self.router == "softmax":
            for name in ("n_group", "topk_group", "routed_scale"):
                if getattr(self, name) != 1:
                    raise ValueError(f"{name} must be 1 with router 'softmax' (groups and a "
                                     f"scale are 'sigmoid_groups' options), got "
                                     f"{getattr(self, name)!r}")
        else:
            g = self.n_group
            if g < 1 or e % g or e // g < 2:
                raise ValueError(f"n_group must divide n_experts={e} into groups of at least 2 "
                                 f"experts, got {g!r}")
            if not 1 <= self.topk_group <= g or self.top_k > self.topk_group * (e // g):
                raise ValueError(f"topk_group must be in [1, n_group={g}] and keep at least "
                                 f"top_k={self.top_k} experts eligible, got {self.topk_group!r}")
        if len(set(dense)) != len(dense) or not all(0 <= i < self.n_layers for i in dense):
            raise ValueError(f"dense_layers must be distinct layer indices in [0, n_layers="
                             f"{self.n_layers}), got {dense!r}")
        if len(dense) == self.n_layers:
            raise ValueError(f"dense_layers lists all {self.n_layers} layers: no layer would be "
                             f"sparse; use n_experts=0 for a dense model")

    def __repr__(self) -> str:
        """Day 05's fields always; a later day's field only where it differs from its default
        (a head_dim only where it is not d_model // n_heads), so a dense config reads as it did
        on day 05."""
        shown = []
        for f in fields(self)[:10]:
            shown.append(f"{f.name}={getattr(self, f.name)!r}")
        for f in fields(self)[10:]:
            value = getattr(self, f.name)
            default = self.d_model // self.n_heads if f.name == "head_dim" else f.default
            if value != default:
                shown.append(f"{f.name}={value!r}")
        return f"ModelConfig({', '.join(shown)})"

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model (n_experts > 0)."""
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """True when layer i's feed_forward is a tinygpt.moe.MoE (False: day 05's SwiGLU)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
            raise ValueError(f"i must be a layer index in [0, n_layers={self.n_layers}), got "
                             f"{i!r}")
        return self.is_moe and i not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the sparse layers (empty for a dense model)."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    def fast_path_refusal(self) -> str | None:
        """Why the fast paths written for day 05's dense layers (the engine's batched products,
        packed and quantized steps, tensor-parallel shards, GGUF writers) cannot run this
        model, or None when they can. Those paths run the model's own modules instead (Block,
        Attention.qkv, MoE) or refuse with this reason. The fused decode step and its C layers
        ask tinygpt.kv_cache._fused_refusal instead, which lets MoE layers through
        (tinygpt.moe.MoEDecode, cpu_kernels.MoEDecodeLayers) and refuses the rest. An
        explicit head_dim is no reason: every fast path sizes heads by cfg.head_dim
        (tests/test_moe_model.py runs each one on heads twice d_model / n_heads wide)."""
        if self.attention == "mla":
            return (f"the model's attention is multi-head latent attention (attention='mla', "
                    f"kv_lora_rank={self.kv_lora_rank}): its cache holds latents, not K and V")
        if self.is_moe:
            return (f"the model has mixture-of-experts layers (n_experts={self.n_experts}, "
                    f"top_k={self.top_k}): their feed_forward is tinygpt.moe.MoE, not one "
                    f"SwiGLU")
        if self.qk_norm:
            return "the model normalizes queries and keys per head before RoPE (qk_norm=True)"
        return self.positions_refusal()

# --------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / sqrt(mean(x^2) + eps) * weight, over the last dimension.

    Like Llama, the normalization runs in float32 and is cast back to the input dtype before the
    (learned, initially 1) weight multiplies it. x: (..., dim) -> (..., dim).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """The Llama MLP: w2(silu(w1 x) * w3 x). w1 is the gate, w3 the up and w2 the down projection.

    x: (..., d_model) -> (..., d_model), through a hidden width d_ff.
    """

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and no biases.

    wq: D -> H * head_dim, wk and wv: D -> H_kv * head_dim, wo: H * head_dim -> D.
    With cfg.qk_norm, q_norm and k_norm (RMSNorm over head_dim, one weight shared by the heads)
    normalize each query and key head before RoPE (Qwen3); otherwise both are None.
    `qkv` computes rotated queries and keys and the values; `forward` attends and projects back.
    Keeping the two steps apart lets a KV cache slot in between them.
    `window` (day 21; set by Block from cfg.layer_window) is None for full causal attention,
    or W: a query at position t then sees keys t - W + 1 .. t (tinygpt.attention.
    sliding_window_mask), in the uncached forward and with either kind of cache.
    """

    window: int | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, D); cos, sin: (T, head_dim) or (B, T, head_dim) for the T positions of x.

        Returns q (B, H, T, head_dim) and k (B, H_kv, T, head_dim), both normalized per head
        (with q/k norm) and rotated by RoPE, and v (B, H_kv, T, head_dim).
        """
        q = split_heads(self.wq(x), self.n_heads)
        k = split_heads(self.wk(x), self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = split_heads(self.wv(x), self.n_kv_heads)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache | None = None,
                cache_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D); position t attends to positions 0 .. t, or with a
        window W (self.window) to max(0, t - W + 1) .. t.

        With a kv_cache (one layer's, see tinygpt.kv_cache) the new k, v are written into it
        first and the T queries attend over everything cached so far. cache_pos is the write
        offset (an int) of a dynamic cache, or the positions (T,) (a tensor) of a static one.
        """
        q, k, v = self.qkv(x, cos, sin)
        window, n_new = self.window, q.shape[2]
        if window is not None:
            return self.wo(merge_heads(self._windowed(q, k, v, kv_cache, cache_pos)))
        if kv_cache is None:
            y = grouped_query_attention(q, k, v, causal=True)   # (B, H, T, head_dim)
        elif isinstance(cache_pos, torch.Tensor):
            k, v, mask = kv_cache.update_static(k, v, cache_pos)
            y = grouped_query_attention(q, k, v, causal=False, mask=mask)
        else:
            k, v = kv_cache.update(k, v, cache_pos)             # (B, H_kv, cache_pos + T, hd)
            # one query is the newest position and may see every cached key: no mask needed
            y = grouped_query_attention(q, k, v, causal=n_new > 1)
        return self.wo(merge_heads(y))

    def _windowed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: LayerKVCache | None, cache_pos: int | torch.Tensor) -> torch.Tensor:
        """forward's attention under a sliding window of W = self.window: (B, H, T, hd).

        Uncached, and with a dynamic cache, the keys are the bottom-right-aligned ones of
        sliding_window_mask; a dynamic cache reads only the last W - 1 cached positions
        before the T new ones (a decode step attends over at most W keys, however long the
        sequence), and a rolling one (tinygpt.rolling) holds only those. A static cache
        masks slot j for the query at position p unless p - W < j <= p."""
        window, n_new = self.window, q.shape[2]
        if kv_cache is None:
            mask = sliding_window_mask(n_new, n_new, window, device=q.device)
            return grouped_query_attention(q, k, v, causal=False, mask=mask)
        if isinstance(cache_pos, torch.Tensor):
            k, v, mask = kv_cache.update_static(k, v, cache_pos)
            slots = torch.arange(k.shape[2], device=cache_pos.device)
            mask = mask & (slots[None, :] > cache_pos[:, None] - window)
            return grouped_query_attention(q, k, v, causal=False, mask=mask)
        k, v = kv_cache.update(k, v, cache_pos)   # every position, or a rolling cache's
        keep = cache_pos + n_new - max(0, cache_pos - window + 1)     # the last keys it sees
        k, v = k[:, :, -keep:], v[:, :, -keep:]
        mask = sliding_window_mask(n_new, k.shape[2], window, device=q.device)
        return grouped_query_attention(q, k, v, causal=False, mask=mask)


class Block(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    feed_forward is day 05's SwiGLU(d_model, d_ff), or on a sparse layer of a mixture-of-experts
    config (cfg.is_moe_layer(layer_index)) a tinygpt.moe.MoE built from cfg's fields.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.attention == "mla":
            from tinygpt.mla import MLAttention  # day 21 (mla imports this module)

            self.attention = MLAttention(cfg)
        else:
            self.attention = Attention(cfg)
        if cfg.layer_window(layer_index) is not None:          # day 21: sliding window
            self.attention.window = cfg.layer_window(layer_index)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward: SwiGLU | MoE
        if cfg.is_moe_layer(layer_index):
            self.feed_forward = MoE(
                cfg.d_model, cfg.n_experts, cfg.top_k, cfg.d_expert, router=cfg.router,
                renormalize=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
                scale=cfg.routed_scale, d_shared=cfg.n_shared_experts * cfg.d_expert)
        else:
            self.feed_forward = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache | None = None,
                cache_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D). kv_cache, cache_pos: as in Attention.forward."""
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, cache_pos)
        return h + self.feed_forward(self.ffn_norm(h))


# --------------------------------------------------------------------------------------------
# the model


def capturing(device: torch.device) -> bool:
    """True while `device`'s current CUDA stream is capturing a graph (tinygpt.captured): the
    step may not copy a value to the host then, so forward skips its range checks."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TinyGPT(nn.Module):
    """A Llama-style decoder-only language model.

    TinyGPT(cfg, seed=0) initializes every weight deterministically from `seed` (see
    `init_weights`); seed=None keeps PyTorch's default initialization, for callers that load
    weights right away. RoPE cos/sin tables for positions 0 .. max_seq_len - 1 are precomputed
    as (non-saved) buffers `rope_cos`, `rope_sin` of shape (max_seq_len, head_dim), with
    cfg.rope_scaling applied (tinygpt.positions.scaled_rope_cos_sin; YaRN's attention factor
    is in them). "dynamic" scaling's frequencies depend on the sequence length: the buffers
    hold those of its original context, and forward recomputes the tables when a pass
    reaches beyond it.
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = 0) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = scaled_rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base,
                                       cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if seed is not None:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: matrices ~ N(0, 0.02^2), norm weights 1.

        The projections that write into the residual stream (wo, w2, and the experts' stacked
        w2 of a MoE layer, (E, D, d_expert)) get std 0.02 / sqrt(2 L) (GPT-2's scaled init) so
        the residual does not grow with depth; the router (gate) and the experts' w1, w3 are
        matrices like any other, and DeepSeek's e_score_correction_bias, a buffer, stays 0.
        Draws come from a CPU
        generator seeded with `seed`, in parameter order, so the result is the same on any device.
        The draws are made on the CPU explicitly, so building the model inside a device context
        (`with torch.device("cuda"):`) does not pair a CPU generator with a CUDA tensor.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():          # a tied matrix is listed once
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            std = resid_std if name.endswith(("wo.weight", "w2.weight", "feed_forward.w2")) \
                else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * std)

    def _check_inputs(self, idx: torch.Tensor, input_pos: torch.Tensor | None) -> None:
        """Raise a clear TypeError / ValueError for malformed `idx` or `input_pos`."""
        cfg = self.cfg
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx must be a torch.LongTensor of shape (B, T), got "
                            f"{type(idx).__name__}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must hold integer token ids (torch.long), got dtype {idx.dtype}")
        if idx.ndim != 2:
            raise ValueError(f"idx must have shape (B, T), got shape {tuple(idx.shape)}; "
                             f"use idx[None] for a single sequence")
        B, T = idx.shape
        if B < 1 or T < 1:
            raise ValueError(f"idx must have B >= 1 and T >= 1, got shape {tuple(idx.shape)}")
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length T={T} exceeds max_seq_len={cfg.max_seq_len}")
        if torch.compiler.is_compiling() or capturing(idx.device):    # no host syncs then
            return
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or high >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), got values "
                             f"in [{low}, {high}]")
        if input_pos is None:
            return
        if not isinstance(input_pos, torch.Tensor) or input_pos.dtype not in (torch.int64,
                                                                              torch.int32):
            raise TypeError(f"input_pos must be an integer tensor of shape (T,) or (B, T), got "
                            f"{getattr(input_pos, 'dtype', type(input_pos).__name__)}")
        if input_pos.shape not in ((T,), (B, T)):
            raise ValueError(f"input_pos must have shape (T,) = ({T},) or (B, T) = ({B}, {T}), "
                             f"got {tuple(input_pos.shape)}")
        low, high = int(input_pos.min()), int(input_pos.max())
        if low < 0 or high >= cfg.max_seq_len:
            raise ValueError(f"input_pos must lie in [0, max_seq_len={cfg.max_seq_len}), got "
                             f"values in [{low}, {high}]")

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """Next-token logits for every position.

        idx: LongTensor (B, T) of token ids in [0, V), T <= max_seq_len.
        input_pos: LongTensor (T,) (or (B, T), one row per sequence) of the absolute positions of
        the tokens, used by RoPE; default arange(T). Attention stays causal over the T tokens.
        kv_cache: a tinygpt.kv_cache.KVCache (day 11). A dynamic cache holds kv_cache.length
        earlier positions: the T tokens are written after them, input_pos defaults to
        length .. length+T-1, attention also reads the cached positions, and kv_cache.length
        grows by T. A static cache needs input_pos (T,): the slots written, and the caller
        keeps kv_cache.length.
        Returns logits (B, T, V) in the model's dtype.
        """
        self._check_inputs(idx, input_pos)
        T = idx.shape[1]
        start = 0                  # with a cache: where the T tokens go (errors for misuse)
        if kv_cache is not None:
            start = kv_cache.start_forward(self.cfg, idx, input_pos, self.tok_embeddings.weight)
        if input_pos is None:
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, hd)
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]    # (.., T, head_dim)
        if self.cfg.rope_type == "dynamic":
            cos, sin = self._dynamic_tables(cos, sin, start, T, input_pos)
        x = self.tok_embeddings(idx)                                         # (B, T, D)
        if kv_cache is None:
            for layer in self.layers:
                x = layer(x, cos, sin)
        else:
            cache_pos = input_pos if kv_cache.static else start
            for layer, layer_cache in zip(self.layers, kv_cache.layers, strict=True):
                x = layer(x, cos, sin, layer_cache, cache_pos)
            if not kv_cache.static:
                kv_cache.advance(T)
        return self.output(self.norm(x))                                     # (B, T, V)

    def _dynamic_tables(self, cos: torch.Tensor, sin: torch.Tensor, start: int, T: int,
                        input_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of "dynamic" (NTK) scaling for this pass: its base grows with the pass's
        largest position + 1 (tinygpt.positions says how this matches transformers); within
        the original context the buffers' tables are those already."""
        cfg = self.cfg
        seq_len = start + T if input_pos is None else int(input_pos.max()) + 1
        if seq_len <= dict(cfg.rope_scaling)["original_max_position_embeddings"]:
            return cos, sin
        positions = torch.arange(start, start + T, device=cos.device) if input_pos is None \
            else input_pos
        cos, sin = scaled_rope_cos_sin(cfg.head_dim, positions, cfg.rope_base,
                                       cfg.rope_scaling, seq_len=seq_len)
        return cos.to(self.rope_cos.dtype), sin.to(self.rope_sin.dtype)


def count_parameters(cfg: ModelConfig) -> int:
    """Number of parameters of TinyGPT(cfg), in closed form (a tied matrix counts once).

        attention per layer   D * (H * hd) + 2 * D * (H_kv * hd) + (H * hd) * D
                              [+ 2 * hd with q/k norm]
        SwiGLU per layer      3 * D * d_ff                                  (a dense layer)
        MoE per layer         E * D  +  3 * E * D * d_expert  +  3 * D * (S * d_expert)
                              router     routed experts         shared experts (S of them)
        norms per layer       2 * D
        total                 V * D + sum over layers (attention + SwiGLU or MoE + norms) + D
                              [+ V * D if untied]

    Buffers are not parameters: RoPE's tables and DeepSeek's e_score_correction_bias (E,).
    """
    D, hd = cfg.d_model, cfg.head_dim
    attention = D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd + cfg.n_heads * hd * D
    attention += 2 * hd if cfg.qk_norm else 0
    if cfg.attention == "mla":                          # day 21: tinygpt.mla.MLAttention
        from tinygpt.mla import mla_parameters

        attention = mla_parameters(cfg)
    n_moe = len(cfg.moe_layers)
    dense = (cfg.n_layers - n_moe) * 3 * D * cfg.d_ff
    moe = n_moe * (cfg.n_experts * D + 3 * D * cfg.d_expert * (cfg.n_experts
                                                                 + cfg.n_shared_experts))
    embeddings = cfg.vocab_size * D
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return embeddings + cfg.n_layers * (attention + 2 * D) + dense + moe + D + lm_head


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token's forward pass uses: everything but the routed experts it skips.

        active = count_parameters(cfg) - n_moe_layers * (E - k) * 3 * D * d_expert

    That is the embeddings, the head, every attention, norm, router, shared expert and dense
    layer, and k of the E routed experts in each sparse layer: the "active parameters" model
    cards quote (Mixtral-8x7B: 12.9B of 46.7B; Mixtral's config gives exactly that, see
    tests/test_moe_model.py). Equals count_parameters for a dense model. The embedding matrix
    counts whole although a token reads one row of it (as model cards count it).
    """
    skipped = cfg.n_experts - cfg.top_k if cfg.is_moe else 0
    return count_parameters(cfg) - len(cfg.moe_layers) * skipped * 3 * cfg.d_model \
        * cfg.d_expert


# --------------------------------------------------------------------------------------------
# Hugging Face interoperability lives in tinygpt.hf_models (which imports this module)

_HF_NAMES = ("hf_llama_key_map", "config_from_hf", "from_hf_llama", "config_to_hf",
             "to_hf_llama")


def __getattr__(name: str) -> Any:
    """Day 05's Hugging Face conversions (from_hf_llama, to_hf_llama, config_from_hf,
    config_to_hf, hf_llama_key_map) are written in tinygpt.hf_models beside day 20's Qwen3-MoE
    and Mixtral ones; `from tinygpt.model import from_hf_llama` still works (PEP 562: the name
    is looked up there on first use, so the two modules do not import each other on load)."""
    if name in _HF_NAMES:
        from tinygpt import hf_models

        return getattr(hf_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
