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

The parameter names follow Meta's Llama reference code (wq, wk, wv, wo, w1, w2, w3, ...);
`from_hf_llama` / `to_hf_llama` translate to and from Hugging Face's LlamaForCausalLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tinygpt.attention import grouped_query_attention, merge_heads, split_heads
from tinygpt.positions import apply_rope, rope_cos_sin

if TYPE_CHECKING:                                   # day 11's cache; no import cycle at run time
    from tinygpt.kv_cache import KVCache, LayerKVCache


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-style decoder-only transformer.

    vocab_size: number of token ids V.   d_model: residual width D.   n_layers: blocks L.
    n_heads: query heads H.   n_kv_heads: key/value heads (GQA when < n_heads; must divide it).
    d_ff: hidden width of the SwiGLU MLP.   max_seq_len: longest context the model accepts.
    rope_base: RoPE theta.   norm_eps: RMSNorm epsilon.   tie_embeddings: share the input
    embedding matrix with the LM head.
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim = d_model / n_heads must be even for RoPE, got "
                             f"{self.d_model // self.n_heads}")
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be > 0, got {self.rope_base!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads

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
    `qkv` computes rotated queries and keys and the values; `forward` attends and projects back.
    Keeping the two steps apart lets a KV cache slot in between them.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, D); cos, sin: (T, head_dim) or (B, T, head_dim) for the T positions of x.

        Returns q (B, H, T, head_dim) and k (B, H_kv, T, head_dim), both rotated by RoPE,
        and v (B, H_kv, T, head_dim).
        """
        q = apply_rope(split_heads(self.wq(x), self.n_heads), cos, sin)
        k = apply_rope(split_heads(self.wk(x), self.n_kv_heads), cos, sin)
        v = split_heads(self.wv(x), self.n_kv_heads)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache | None = None,
                cache_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D); position t attends to positions 0 .. t.

        With a kv_cache (one layer's, see tinygpt.kv_cache) the new k, v are written into it
        first and the T queries attend over everything cached so far. cache_pos is the write
        offset (an int) of a dynamic cache, or the positions (T,) (a tensor) of a static one.
        """
        q, k, v = self.qkv(x, cos, sin)
        if kv_cache is None:
            y = grouped_query_attention(q, k, v, causal=True)   # (B, H, T, head_dim)
        elif isinstance(cache_pos, torch.Tensor):
            k, v, mask = kv_cache.update_static(k, v, cache_pos)
            y = grouped_query_attention(q, k, v, causal=False, mask=mask)
        else:
            k, v = kv_cache.update(k, v, cache_pos)             # (B, H_kv, cache_pos + T, hd)
            # one query is the newest position and may see every cached key: no mask needed
            y = grouped_query_attention(q, k, v, causal=q.shape[2] > 1)
        return self.wo(merge_heads(y))


class Block(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache | None = None,
                cache_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D). kv_cache, cache_pos: as in Attention.forward."""
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, cache_pos)
        return h + self.feed_forward(self.ffn_norm(h))


# --------------------------------------------------------------------------------------------
# the model


class TinyGPT(nn.Module):
    """A Llama-style decoder-only language model.

    TinyGPT(cfg, seed=0) initializes every weight deterministically from `seed` (see
    `init_weights`); seed=None keeps PyTorch's default initialization, for callers that load
    weights right away. RoPE cos/sin tables for positions 0 .. max_seq_len - 1 are precomputed
    as (non-saved) buffers `rope_cos`, `rope_sin` of shape (max_seq_len, head_dim).
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = 0) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if seed is not None:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: matrices ~ N(0, 0.02^2), norm weights 1.

        The projections that write into the residual stream (wo, w2) get std 0.02 / sqrt(2 L)
        (GPT-2's scaled init) so the residual does not grow with depth. Draws come from a CPU
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
            std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
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
        if torch.compiler.is_compiling():                # skip the host syncs below
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


def count_parameters(cfg: ModelConfig) -> int:
    """Number of parameters of TinyGPT(cfg), in closed form (a tied matrix counts once).

        attention per layer   D * (H * hd) + 2 * D * (H_kv * hd) + (H * hd) * D
        SwiGLU per layer      3 * D * d_ff
        norms per layer       2 * D
        total                 V * D + L * (attention + SwiGLU + norms) + D  [+ V * D if untied]
    """
    D, hd = cfg.d_model, cfg.head_dim
    attention = D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd + cfg.n_heads * hd * D
    mlp = 3 * D * cfg.d_ff
    per_layer = attention + mlp + 2 * D
    embeddings = cfg.vocab_size * D
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return embeddings + cfg.n_layers * per_layer + D + lm_head


# --------------------------------------------------------------------------------------------
# Hugging Face Llama interoperability (transformers is only needed by `to_hf_llama`)


def hf_llama_key_map(cfg: ModelConfig) -> dict[str, str]:
    """Map every TinyGPT state_dict key to its Hugging Face LlamaForCausalLM key."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
    }
    for i in range(cfg.n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


_MISSING = object()


def _hf_get(hf_config: Any, name: str, default: Any = _MISSING) -> Any:
    """Read a field from a transformers config object or a config.json dict."""
    if isinstance(hf_config, Mapping):
        value = hf_config.get(name, default)
    else:
        value = getattr(hf_config, name, default)
    if value is _MISSING:
        raise ValueError(f"hf_config has no field {name!r}, which a Llama config needs")
    return value


def _hf_rope_theta(hf_config: Any) -> float:
    """RoPE theta of a Llama config; reject RoPE scaling variants TinyGPT does not implement.

    transformers 5 keeps it in `rope_parameters = {"rope_type": ..., "rope_theta": ...}`; older
    config.json files have a top-level `rope_theta` and an optional `rope_scaling` dict.
    """
    params = _hf_get(hf_config, "rope_parameters", None)
    if params is None:
        params = _hf_get(hf_config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE scaling type {rope_type!r} is not supported; TinyGPT implements "
                         f"only rope_type 'default' (plain RoPE with rope_theta)")
    return float(params.get("rope_theta", _hf_get(hf_config, "rope_theta", 10000.0)))


def config_from_hf(hf_config: Any) -> ModelConfig:
    """ModelConfig equivalent to a Hugging Face LlamaConfig (or its config.json as a dict).

    Raises ValueError for Llama variants TinyGPT cannot represent: biases, an activation other
    than SiLU, head_dim != hidden_size / num_attention_heads, or scaled RoPE.
    """
    model_type = _hf_get(hf_config, "model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"hf_config.model_type must be 'llama', got {model_type!r}")
    act = _hf_get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
    for name in ("attention_bias", "mlp_bias"):
        if _hf_get(hf_config, name, False):
            raise ValueError(f"{name}=True is not supported: TinyGPT's linear layers have no bias")
    d_model = _hf_get(hf_config, "hidden_size")
    n_heads = _hf_get(hf_config, "num_attention_heads")
    head_dim = _hf_get(hf_config, "head_dim", None)
    if head_dim is not None and n_heads and head_dim * n_heads != d_model:
        raise ValueError(f"head_dim ({head_dim}) must equal hidden_size / num_attention_heads "
                         f"({d_model} / {n_heads}); TinyGPT derives head_dim from d_model")
    n_kv_heads = _hf_get(hf_config, "num_key_value_heads", None) or n_heads
    return ModelConfig(
        vocab_size=_hf_get(hf_config, "vocab_size"),
        d_model=d_model,
        n_layers=_hf_get(hf_config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=_hf_get(hf_config, "intermediate_size"),
        max_seq_len=_hf_get(hf_config, "max_position_embeddings"),
        rope_base=_hf_rope_theta(hf_config),
        norm_eps=float(_hf_get(hf_config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_hf_get(hf_config, "tie_word_embeddings", False)),
    )


def from_hf_llama(state_dict: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
                  dtype: torch.dtype | None = None) -> TinyGPT:
    """Build a TinyGPT holding the weights of a Hugging Face LlamaForCausalLM.

    state_dict: the model's state_dict (or the model itself); keys "model.embed_tokens.weight",
    "model.layers.{i}.self_attn.q_proj.weight", ..., "lm_head.weight" (optional when tied).
    hf_config: its LlamaConfig or config.json dict. dtype: defaults to the embedding's dtype.
    Raises ValueError on missing, unexpected or wrongly shaped weights.
    """
    if isinstance(state_dict, nn.Module):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors or an nn.Module, got "
                        f"{type(state_dict).__name__}")
    cfg = config_from_hf(hf_config)
    key_map = hf_llama_key_map(cfg)
    theirs = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        lm_head = theirs.pop("lm_head.weight", None)
        embed = theirs.get("model.embed_tokens.weight")
        if lm_head is not None and embed is not None and not torch.equal(lm_head, embed):
            raise ValueError("hf_config.tie_word_embeddings is True but lm_head.weight differs "
                             "from model.embed_tokens.weight")
        del key_map["output.weight"]
    missing = sorted(set(key_map.values()) - set(theirs))
    unexpected = sorted(set(theirs) - set(key_map.values()))
    if missing or unexpected:
        raise ValueError(f"state_dict does not match a LlamaForCausalLM with this config: "
                         f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")

    if dtype is None:
        dtype = theirs["model.embed_tokens.weight"].dtype
    model = TinyGPT(cfg, seed=None).to(dtype)
    ours = model.state_dict()
    new_state = {}
    for our_key, their_key in key_map.items():
        tensor = theirs[their_key]
        if tuple(tensor.shape) != tuple(ours[our_key].shape):
            raise ValueError(f"{their_key} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(ours[our_key].shape)} for {cfg}")
        new_state[our_key] = tensor
    if cfg.tie_embeddings:
        new_state["output.weight"] = new_state["tok_embeddings.weight"]
    model.load_state_dict(new_state, strict=True)
    return model.eval()


def config_to_hf(cfg: ModelConfig, **overrides: Any):
    """A transformers LlamaConfig describing the same architecture as `cfg`.

    bos/eos/pad token ids are None unless given in `overrides`, which are passed to LlamaConfig.
    """
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_base)},
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@torch.no_grad()
def to_hf_llama(model: TinyGPT, attn_implementation: str = "sdpa", **config_overrides: Any):
    """A transformers LlamaForCausalLM (eval mode, same dtype and device) with `model`'s weights.

    attn_implementation: "sdpa" or "eager". config_overrides go to `config_to_hf`.
    """
    from transformers import LlamaForCausalLM

    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got "
                         f"{attn_implementation!r}")
    hf_config = config_to_hf(model.cfg, attn_implementation=attn_implementation,
                             **config_overrides)
    param = next(model.parameters())
    hf_model = LlamaForCausalLM(hf_config).to(device=param.device, dtype=param.dtype)
    key_map = hf_llama_key_map(model.cfg)
    ours = model.state_dict()
    hf_model.load_state_dict({theirs: ours[k] for k, theirs in key_map.items()}, strict=True)
    return hf_model.eval()
