"""Hugging Face DeepSeek-V3 checkpoints as TinyGPT (day 21): multi-head latent attention
(tinygpt.mla) and day 20's mixture of experts with DeepSeek's router.

    config_from_hf_deepseek(hf_config)     a ModelConfig from a DeepseekV3Config / config.json
    from_hf_deepseek(state_dict, hf_config)    a TinyGPT holding the weights
    mla_from_hf_attention(module)          our MLAttention with one DeepseekV3Attention's weights

tinygpt.hf_models.from_hf / config_from_hf / tinygpt.loading.load_model reach these through
model_type "deepseek_v3". The names, per layer i (model.layers.{i}.):

    self_attn.q_proj                   attention.wq        (q_lora_rank null)
    self_attn.q_a_proj, q_a_layernorm, q_b_proj     attention.wq_a, q_norm, wq_b
    self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj     attention.wkv_a, kv_norm, wkv_b
    self_attn.o_proj                   attention.wo
    mlp.gate_proj / up_proj / down_proj            feed_forward.w1 / w3 / w2 (the first
                                       first_k_dense_replace layers, intermediate_size wide)
    mlp.gate.weight, mlp.gate.e_score_correction_bias      feed_forward.gate.weight,
                                       feed_forward.e_score_correction_bias
    mlp.experts.{e}.gate_proj / up_proj / down_proj (what save_pretrained writes) or the fused
                                       mlp.experts.gate_up_proj / down_proj (in memory)
                                       feed_forward.w1, w3 (E, I, D), w2 (E, D, I)
    mlp.shared_experts.gate_proj / up_proj / down_proj     feed_forward.shared.w1 / w3 / w2
                                       (n_shared_experts 0: none; transformers' 0-wide
                                       tensors, which add nothing, are skipped)

rope_interleave (DeepSeek-V3's default): the checkpoint's RoPE channels rotate in interleaved
pairs; the RoPE rows of the query projection (per head) and of kv_a_proj_with_mqa are
reordered, even channels first, so that tinygpt's rotate-half RoPE gives the same scores
(see tinygpt.mla). Multi-token-prediction layers (model.layers.{num_hidden_layers}...) are
skipped, as transformers skips them.

RoPE scaling (DeepSeek-V3's YaRN: factor 40 over 4,096 positions) becomes
ModelConfig.rope_scaling (tinygpt.hf_rope, tinygpt.positions), and with mscale_all_dim the
softmax scale grows by mscale^2 (tinygpt.mla.softmax_scale), as transformers does.

Refused with a ValueError naming the reason: RoPE types tinygpt.positions does not implement,
biases, an activation other than SiLU, num_key_value_heads other than num_attention_heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tinygpt.hf_fields import MISSING, hf_bool, hf_get, kv_heads_and_eps
from tinygpt.hf_models import _experts, _Keys, assemble
from tinygpt.hf_rope import hf_rope
from tinygpt.mla import MLAttention
from tinygpt.model import ModelConfig, TinyGPT

FAMILY = "deepseek_v3"


def config_from_hf_deepseek(hf_config: Any) -> ModelConfig:
    """ModelConfig of a DeepSeek-V3 config (transformers object or config.json dict)."""
    def get(name: str, default: Any = MISSING) -> Any:
        return hf_get(hf_config, name, default, family="DeepSeek-V3")

    def count(name: str, low: int = 0) -> int:
        """An integer >= low; where low is 0, null reads as 0 (q_lora_rank null: no query
        compression, as in transformers)."""
        value = get(name)
        if value is None and low == 0:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}"
                             f"{' or null' if low == 0 else ''}, got {value!r}")
        return value

    model_type = get("model_type", FAMILY)
    if model_type != FAMILY:
        raise ValueError(f"hf_config.model_type must be {FAMILY!r}, got {model_type!r}")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
    if hf_bool(hf_config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported: TinyGPT's linear layers have "
                         "no bias")
    rope_base, rope_scaling, context = hf_rope(hf_config)
    n_heads, n_layers = get("num_attention_heads"), get("num_hidden_layers")
    n_kv, eps = kv_heads_and_eps(hf_config, n_heads)    # absent or null: one per head
    if n_kv != n_heads:
        raise ValueError(f"num_key_value_heads must equal num_attention_heads ({n_heads}) for "
                         f"multi-head latent attention, got {n_kv!r}")
    # n_routed_experts (transformers 5 may write num_local_experts, its alias); 0 or null:
    # no experts, every layer dense (TinyGPT's reading; transformers needs experts)
    routed = "num_local_experts" if hf_get(hf_config, "n_routed_experts", None) is None and \
        hf_get(hf_config, "num_local_experts", None) is not None else "n_routed_experts"
    n_experts, first_dense = count(routed), count("first_k_dense_replace")
    moe: dict[str, Any] = {}
    if n_experts and first_dense < n_layers:
        scale = get("routed_scaling_factor")
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise ValueError(f"routed_scaling_factor must be a number, got {scale!r}")
        moe = dict(n_experts=n_experts, top_k=count("num_experts_per_tok", 1),
                   d_expert=get("moe_intermediate_size"), router="sigmoid_groups",
                   norm_topk_prob=hf_bool(hf_config, "norm_topk_prob"),
                   n_group=count("n_group", 1), topk_group=count("topk_group", 1),
                   routed_scale=float(scale), n_shared_experts=count("n_shared_experts"),
                   dense_layers=tuple(range(first_dense)))
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_heads, d_ff=get("intermediate_size"),
        max_seq_len=context, rope_base=rope_base, rope_scaling=rope_scaling,
        norm_eps=eps, tie_embeddings=hf_bool(hf_config, "tie_word_embeddings"), attention="mla",
        q_lora_rank=count("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"), **moe)


def _rope_order(rope: int, interleave: bool) -> torch.Tensor:
    """The RoPE channels in tinygpt's order: evens then odds when interleaved."""
    if interleave:
        return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    return torch.arange(rope)


def _query_rows(w: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """A query projection (H * (nope + rope), in) with each head's RoPE rows in `order`."""
    nope = cfg.qk_nope_head_dim
    w = w.reshape(cfg.n_heads, nope + cfg.qk_rope_head_dim, -1)
    return torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1).flatten(0, 1)


def _latent_rows(w: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """kv_a_proj_with_mqa (kv_lora_rank + rope, D) with its RoPE rows in `order`."""
    r = cfg.kv_lora_rank
    return torch.cat([w[:r], w[r:][order]])


def _attention_map(cfg: ModelConfig) -> dict[str, str]:
    """Our attention key (under attention.) -> theirs (under self_attn.)."""
    names = {"wkv_a.weight": "kv_a_proj_with_mqa.weight", "kv_norm.weight":
             "kv_a_layernorm.weight", "wkv_b.weight": "kv_b_proj.weight",
             "wo.weight": "o_proj.weight"}
    if cfg.q_lora_rank:
        names.update({"wq_a.weight": "q_a_proj.weight", "q_norm.weight":
                      "q_a_layernorm.weight", "wq_b.weight": "q_b_proj.weight"})
    else:
        names["wq.weight"] = "q_proj.weight"
    return names


def _convert_attention(theirs: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       interleave: bool) -> dict[str, torch.Tensor]:
    """Our attention tensors from theirs (keys as in _attention_map, RoPE rows reordered)."""
    order = _rope_order(cfg.qk_rope_head_dim, interleave)
    ours = {}
    for key, their_key in _attention_map(cfg).items():
        tensor = theirs[their_key]
        if key in ("wq.weight", "wq_b.weight"):
            tensor = _query_rows(tensor, cfg, order)
        elif key == "wkv_a.weight":
            tensor = _latent_rows(tensor, cfg, order)
        ours[key] = tensor
    return ours


@torch.no_grad()
def mla_from_hf_attention(module: nn.Module) -> MLAttention:
    """Our MLAttention with the weights of one transformers DeepseekV3Attention (its config
    gives the shapes and rope_interleave), in its dtype and on its device, in eval mode."""
    if type(module).__name__ != "DeepseekV3Attention":
        raise TypeError(f"module must be a transformers DeepseekV3Attention, got "
                        f"{type(module).__name__}")
    cfg = config_from_hf_deepseek(module.config)
    weight = module.o_proj.weight
    mla = MLAttention(cfg).to(device=weight.device, dtype=weight.dtype)
    theirs = {k: v for k, v in module.state_dict().items()}
    ours = _convert_attention(theirs, cfg, hf_bool(module.config, "rope_interleave"))
    mla.load_state_dict(ours, strict=True)
    return mla.eval()


def from_hf_deepseek(state_dict: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
                     dtype: torch.dtype | None = None) -> TinyGPT:
    """A TinyGPT holding the weights of a DeepseekV3ForCausalLM: its state_dict, the model
    itself, or a folder's safetensors tensors. dtype defaults to the embedding's.
    ValueError on missing, unexpected or wrongly shaped weights, naming them."""
    if isinstance(state_dict, nn.Module):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors or an nn.Module, got "
                        f"{type(state_dict).__name__}")
    cfg = config_from_hf_deepseek(hf_config)
    interleave = hf_bool(hf_config, "rope_interleave")
    mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + 8))
    keys = _Keys({k: v for k, v in state_dict.items() if not k.startswith(mtp)}, FAMILY)
    if not cfg.n_shared_experts:    # transformers still builds (and saves) a 0-wide one: no-op
        for key in [k for k, t in keys.left.items() if ".mlp.shared_experts." in k
                    and not t.numel()]:
            del keys.left[key]
    new_state: dict[str, torch.Tensor | None] = {}
    names: dict[str, str] = {}

    def take(ours: str, theirs: str) -> None:
        new_state[ours], names[ours] = keys.take(theirs), theirs

    take("tok_embeddings.weight", "model.embed_tokens.weight")
    take("norm.weight", "model.norm.weight")
    if cfg.tie_embeddings:
        lm_head = keys.left.pop("lm_head.weight", None)
        embed = new_state["tok_embeddings.weight"]              # taken above (None: missing)
        if lm_head is not None and embed is not None and not torch.equal(lm_head, embed):
            raise ValueError("hf_config.tie_word_embeddings is True but lm_head.weight differs "
                             "from model.embed_tokens.weight")
    else:
        take("output.weight", "lm_head.weight")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        take(ours + "attention_norm.weight", theirs + "input_layernorm.weight")
        take(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight")
        attention = {k: keys.take(theirs + "self_attn." + k)
                     for k in _attention_map(cfg).values()}
        if all(t is not None for t in attention.values()):
            their_names = _attention_map(cfg)
            for key, tensor in _convert_attention(attention, cfg, interleave).items():
                new_state[ours + "attention." + key] = tensor
                names[ours + "attention." + key] = f"{theirs}self_attn.{their_names[key]}"
        ff, mlp = ours + "feed_forward.", theirs + "mlp."
        if not cfg.is_moe_layer(i):
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                take(f"{ff}{a}.weight", f"{mlp}{b}.weight")
            continue
        take(ff + "gate.weight", mlp + "gate.weight")
        take(ff + "e_score_correction_bias", mlp + "gate.e_score_correction_bias")
        experts = _experts(keys, mlp, cfg, FAMILY)
        if experts is not None:
            for name, tensor in zip(("w1", "w3", "w2"), experts, strict=True):
                new_state[ff + name], names[ff + name] = tensor, f"{mlp}experts ({name})"
        if cfg.n_shared_experts:
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                take(f"{ff}shared.{a}.weight", f"{mlp}shared_experts.{b}.weight")
    return assemble(cfg, new_state, names, keys, FAMILY, dtype)
