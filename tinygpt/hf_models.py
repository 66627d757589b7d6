"""Hugging Face checkpoints as TinyGPT: Llama (day 05), Qwen3-MoE and Mixtral (day 20).

    config_from_hf(hf_config)           a ModelConfig from a transformers config or config.json
    from_hf(state_dict, hf_config)      a TinyGPT holding the weights, for any of MODEL_TYPES
    from_hf_llama, from_hf_moe          the same for one family (the mixture-of-experts ones)
    hf_llama_key_map, config_to_hf, to_hf_llama     day 05's Llama, both ways
    moe_from_hf_block(module)           our MoE with the weights of one transformers MoE block:
                                        Qwen3-MoE's, Mixtral's or DeepSeek-V3's (router
                                        "sigmoid_groups", shared expert; the block only)

The families, as transformers 5 writes them (model_type in config.json):

    llama       dense SwiGLU layers; RoPE scalings "linear", "dynamic", "yarn", "llama3"
                become ModelConfig.rope_scaling (day 21, tinygpt.hf_rope says how)
    mistral     a Llama whose sliding_window W is ModelConfig.sliding_window on every layer
                (day 21; Mixtral's sliding_window, and Qwen3-MoE's when use_sliding_window,
                load the same way)
    qwen3_moe   softmax router, top k renormalized when norm_topk_prob; q/k norm (RMSNorm
                over head_dim before RoPE); layer i is sparse unless i is in mlp_only_layers or
                (i + 1) % decoder_sparse_step != 0, and dense layers are intermediate_size wide,
                experts moe_intermediate_size; num_experts (num_local_experts in
                transformers 5's own config.json), num_experts_per_tok
    mixtral     softmax router, top k always renormalized; every layer sparse, experts
                intermediate_size wide; num_local_experts, num_experts_per_tok

Expert weights come in two layouts, both accepted (per MoE layer, not mixed):

    per expert  what the Hub's checkpoints hold and what save_pretrained writes (transformers
                5.23 converts back on saving): model.layers.{i}.mlp.experts.{e}.gate_proj /
                up_proj / down_proj.weight (Qwen3-MoE); model.layers.{i}.block_sparse_moe.
                experts.{e}.w1 / w3 / w2.weight and block_sparse_moe.gate.weight (Mixtral)
    fused       what a transformers 5 model holds in memory (its state_dict(); transformers'
                conversion_mapping.py merges the per-expert keys on loading):
                mlp.experts.gate_up_proj (E, 2 I, D), gate rows first, then up; and
                mlp.experts.down_proj (E, D, I); Mixtral's router is mlp.gate.weight

Ours: layers.{i}.feed_forward.gate.weight (E, D), w1 and w3 (E, I, D), w2 (E, D, I) (see
tinygpt.moe), attention.q_norm.weight / k_norm.weight (head_dim,). head_dim is taken as given
(Qwen3-MoE: 128 with hidden_size / num_attention_heads = 64).

A field config.json leaves out takes transformers' default for its model_type, as transformers
builds the model (tinygpt.hf_fields.HF_DEFAULTS: Mixtral's rms_norm_eps 1e-5 and rope_theta 1e6,
Qwen3-MoE's 4 key/value heads, ...); a field of the wrong type is a ValueError naming it.

Refused with a ValueError naming the reason: biases, an activation other than SiLU, RoPE
scalings outside ROPE_TYPES (longrope, partial rotary factors), an odd head_dim, Qwen2-MoE's
gated shared expert. DeepSeek-V3 ("deepseek_v3", day 21) is converted by tinygpt.hf_deepseek.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tinygpt.hf_fields import MISSING as _MISSING
from tinygpt.hf_fields import hf_bool, hf_int_list
from tinygpt.hf_fields import hf_get as _hf_get
from tinygpt.hf_fields import kv_heads_and_eps as _kv_heads_and_eps
from tinygpt.hf_rope import hf_context, hf_rope, hf_rope_parameters, hf_window
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.moe import MoE
from tinygpt.positions import scaled_rope_cos_sin

MODEL_TYPES = ("llama", "mistral", "qwen3_moe", "mixtral", "deepseek_v3")

# families a user may meet, and why they are not loaded (yet)
REFUSED = {
    "qwen2_moe": "Qwen2-MoE gates its shared expert with a sigmoid (shared_expert_gate) and "
                 "has q/k/v biases, neither of which TinyGPT implements"}

# model types loaded as day 05's Llama (Mistral: a Llama with a sliding window, day 21)
LLAMA_LIKE = ("llama", "mistral")


# per-expert weight names in the Hub's layout: (gate, up, down)
EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                "mixtral": ("w1", "w3", "w2"),
                "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}


def check_model_type(model_type: Any) -> str:
    """`model_type` if TinyGPT loads it, else a ValueError listing MODEL_TYPES (and saying why
    for the families in REFUSED)."""
    if model_type in MODEL_TYPES:
        return model_type
    why = f": {REFUSED[model_type]}" if model_type in REFUSED else ""
    raise ValueError(f"hf_config.model_type must be one of {MODEL_TYPES}, got "
                     f"{model_type!r}{why}")


# --------------------------------------------------------------------------------------------
# Llama (day 05)


def hf_llama_key_map(cfg: ModelConfig) -> dict[str, str]:
    """Map every TinyGPT state_dict key to its Hugging Face LlamaForCausalLM key."""
    _check_dense(cfg, "hf_llama_key_map")
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


def _check_state(what: str, missing: list[str], unexpected: list[str],
                 tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError for keys `what` lacks or does not know (five of each shown), then for the first
    tensor that is not floating point or not finite, as GGUF and checkpoint loading refuse
    them: one min/max pass each (NaN propagates through both)."""
    if missing or unexpected:
        raise ValueError(f"state_dict does not match {what} with this config: missing keys "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected keys "
                         f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} has dtype {t.dtype}: weights must be floating point")
        if t.numel() and t.device.type != "meta" and not torch.stack(torch.aminmax(t)).isfinite(
                ).all():
            raise ValueError(f"{name} holds NaN or infinite values")


def _check_dense(cfg: ModelConfig, what: str) -> None:
    why = cfg.fast_path_refusal()
    if why is not None and why != cfg.positions_refusal():     # windows, dynamic RoPE: fine
        raise ValueError(f"{what} describes a dense Llama: {why}")


def config_from_hf(hf_config: Any) -> ModelConfig:
    """ModelConfig equivalent to a Hugging Face config of one of MODEL_TYPES (a transformers
    config object, or its config.json as a dict; model_type defaults to "llama").

    Raises ValueError for variants TinyGPT cannot represent: biases, an activation other
    than SiLU, a RoPE type outside tinygpt.positions.ROPE_TYPES or a partial rotary factor
    (tinygpt.hf_rope), an odd head_dim; for the mixture-of-experts families see
    config_from_hf_moe. Scaled RoPE and a sliding window load (day 21). head_dim may differ
    from hidden_size / num_attention_heads.
    """
    model_type = check_model_type(_hf_get(hf_config, "model_type", "llama"))
    if model_type == "deepseek_v3":                 # day 21: multi-head latent attention
        from tinygpt.hf_deepseek import config_from_hf_deepseek

        return config_from_hf_deepseek(hf_config)
    if model_type not in LLAMA_LIKE:
        return config_from_hf_moe(hf_config)
    act = _hf_get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
    for name in ("attention_bias", "mlp_bias"):
        if hf_bool(hf_config, name, False):
            raise ValueError(f"{name}=True is not supported: TinyGPT's linear layers have no bias")
    d_model = _hf_get(hf_config, "hidden_size")
    n_heads = _hf_get(hf_config, "num_attention_heads")
    n_kv_heads, eps = _kv_heads_and_eps(hf_config, n_heads)
    theta, scaling, context = hf_rope(hf_config)
    window = _hf_get(hf_config, "sliding_window") if model_type == "mistral" else None
    return ModelConfig(
        vocab_size=_hf_get(hf_config, "vocab_size"),
        d_model=d_model,
        n_layers=_hf_get(hf_config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=_hf_get(hf_config, "intermediate_size"),
        max_seq_len=context,
        rope_base=theta,
        rope_scaling=scaling,
        sliding_window=hf_window(window, context),
        norm_eps=eps,
        tie_embeddings=hf_bool(hf_config, "tie_word_embeddings"),
        head_dim=_hf_get(hf_config, "head_dim", None),
    )


def from_hf_llama(state_dict: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
                  dtype: torch.dtype | None = None) -> TinyGPT:
    """Build a TinyGPT holding the weights of a Hugging Face LlamaForCausalLM.

    state_dict: the model's state_dict (or the model itself); keys "model.embed_tokens.weight",
    "model.layers.{i}.self_attn.q_proj.weight", ..., "lm_head.weight" (optional when tied).
    hf_config: its LlamaConfig or config.json dict. dtype: defaults to the embedding's dtype.
    ValueError on missing, unexpected, misshapen, non-float or non-finite weights, naming them.
    """
    if isinstance(state_dict, nn.Module):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors or an nn.Module, got "
                        f"{type(state_dict).__name__}")
    model_type = _hf_get(hf_config, "model_type", "llama")
    if model_type not in LLAMA_LIKE:
        raise ValueError(f"from_hf_llama loads model_type 'llama' or 'mistral', got "
                         f"{model_type!r}; "
                         f"tinygpt.hf_models.from_hf loads every one of {MODEL_TYPES}")
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
    wanted = set(key_map.values())
    _check_state("a LlamaForCausalLM", sorted(wanted - set(theirs)), sorted(set(theirs) - wanted),
                 {name: theirs[name] for name in key_map.values() if name in theirs})

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
    A mixture-of-experts or q/k-norm config is refused (a ValueError): a Llama has neither.
    """
    from transformers import LlamaConfig

    _check_dense(cfg, "config_to_hf")
    if cfg.sliding_window:
        raise ValueError(f"config_to_hf writes a LlamaConfig, which has no sliding window; "
                         f"cfg.sliding_window={cfg.sliding_window} (a MistralConfig has one)")

    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=hf_context(cfg), rms_norm_eps=cfg.norm_eps,
        rope_parameters=hf_rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
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


# --------------------------------------------------------------------------------------------
# Qwen3-MoE and Mixtral (day 20)


def _n_experts(hf_config: Any, family: str) -> int:
    """Qwen3-MoE's num_experts (the Hub's name) or num_local_experts (transformers 5's)."""
    names = ("num_local_experts",) if family == "mixtral" else ("num_experts", "num_local_experts")
    values = {n: _hf_get(hf_config, n, None) for n in names}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    given = {v for v in values.values() if v is not None}
    if len(given) != 1:
        raise ValueError(f"hf_config must give the number of experts once, as "
                         f"{' or '.join(names)}; got {values}")
    return given.pop()


def config_from_hf_moe(hf_config: Any) -> ModelConfig:
    """ModelConfig of a Hugging Face Qwen3-MoE or Mixtral config (object or config.json dict).

    See the module docstring for how the fields map. ValueError for what TinyGPT does not
    implement: biases, an activation other than SiLU, a RoPE type outside
    tinygpt.positions.ROPE_TYPES or a partial rotary factor; scaled RoPE and a sliding window
    load (day 21). head_dim may differ from hidden_size / num_attention_heads (Qwen3-30B-A3B:
    128 against 2048 / 32 = 64).
    """
    family = check_model_type(_hf_get(hf_config, "model_type"))
    if family in ("llama", "mistral", "deepseek_v3"):
        raise ValueError(f"config_from_hf_moe reads model_type 'qwen3_moe' or 'mixtral'; use "
                         f"config_from_hf for {family!r}")

    def get(name: str, default: Any = _MISSING) -> Any:
        return _hf_get(hf_config, name, default, family=family)

    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU experts), got {act!r}")
    for name in ("attention_bias", "mlp_bias", "qkv_bias"):
        if hf_bool(hf_config, name, False):
            raise ValueError(f"{name}=True is not supported: TinyGPT's linear layers have no bias")
    d_model, n_heads, n_layers = get("hidden_size"), get("num_attention_heads"), \
        get("num_hidden_layers")
    theta, scaling, context = hf_rope(hf_config)
    window = get("sliding_window")
    if family == "qwen3_moe" and not hf_bool(hf_config, "use_sliding_window"):
        window = None                                 # transformers ignores it then
    n_experts, top_k = _n_experts(hf_config, family), get("num_experts_per_tok")
    n_kv_heads, eps = _kv_heads_and_eps(hf_config, n_heads)
    if family == "mixtral":
        d_ff = d_expert = get("intermediate_size")
        dense, renormalize, qk_norm = [], True, False
    else:
        d_ff, d_expert = get("intermediate_size"), get("moe_intermediate_size")
        step, only = get("decoder_sparse_step"), hf_int_list(hf_config, "mlp_only_layers")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step must be an integer >= 1, got {step!r}")
        # transformers' Qwen3MoeDecoderLayer: sparse iff not mlp-only, experts, a step's layer
        dense = [i for i in range(n_layers)
                 if i in only or n_experts == 0 or (i + 1) % step != 0]
        renormalize, qk_norm = hf_bool(hf_config, "norm_topk_prob"), True
    moe: dict[str, Any] = {}
    if len(dense) < n_layers:                       # else a dense model (no expert anywhere)
        moe = dict(n_experts=n_experts, top_k=top_k, d_expert=d_expert,
                   norm_topk_prob=renormalize, dense_layers=tuple(dense))
    return ModelConfig(
        vocab_size=get("vocab_size"), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, d_ff=d_ff,
        max_seq_len=context, rope_base=theta, rope_scaling=scaling,
        sliding_window=hf_window(window, context), norm_eps=eps,
        tie_embeddings=hf_bool(hf_config, "tie_word_embeddings"), qk_norm=qk_norm,
        head_dim=get("head_dim", None), **moe)


def _common_key_map(cfg: ModelConfig) -> dict[str, str]:
    """Our key -> the Hugging Face key of everything but the feed-forward blocks."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    per_layer = {"attention_norm.weight": "input_layernorm.weight",
                 "attention.wq.weight": "self_attn.q_proj.weight",
                 "attention.wk.weight": "self_attn.k_proj.weight",
                 "attention.wv.weight": "self_attn.v_proj.weight",
                 "attention.wo.weight": "self_attn.o_proj.weight",
                 "ffn_norm.weight": "post_attention_layernorm.weight"}
    if cfg.qk_norm:
        per_layer["attention.q_norm.weight"] = "self_attn.q_norm.weight"
        per_layer["attention.k_norm.weight"] = "self_attn.k_norm.weight"
    for i in range(cfg.n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
        if not cfg.is_moe_layer(i):
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                names[f"layers.{i}.feed_forward.{ours}.weight"] = \
                    f"model.layers.{i}.mlp.{theirs}.weight"
    return names


class _Keys:
    """Their tensors by key, taken one by one; what is left over or was missing is reported."""

    def __init__(self, state: Mapping[str, torch.Tensor], family: str) -> None:
        self.left: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if family == "mixtral":                  # the Hub's name of the MoE block
                key = key.replace(".block_sparse_moe.", ".mlp.")
            if key in self.left:
                raise ValueError(f"state_dict holds {key!r} twice (as block_sparse_moe and mlp)")
            self.left[key] = tensor
        self.missing: list[str] = []

    def take(self, key: str) -> torch.Tensor | None:
        if key not in self.left:
            self.missing.append(key)
            return None
        return self.left.pop(key)

    def has(self, key: str) -> bool:
        return key in self.left


def _experts(keys: _Keys, prefix: str, cfg: ModelConfig, family: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w1, w3 (E, I, D) and w2 (E, D, I) of one MoE layer, from either layout (see the module
    docstring); None when keys are missing (recorded in keys.missing)."""
    e, i, d = cfg.n_experts, cfg.d_expert, cfg.d_model
    fused = [f"{prefix}experts.gate_up_proj", f"{prefix}experts.down_proj"]
    per_expert = [k for k in keys.left if k.startswith(f"{prefix}experts.")
                  and k[len(f"{prefix}experts."):].split(".")[0].isdigit()]
    if any(keys.has(k) for k in fused):
        if per_expert:
            raise ValueError(f"{prefix}experts holds both the fused layout (gate_up_proj, "
                             f"down_proj) and per-expert weights ({per_expert[0]}, ...): "
                             f"give one layout per layer")
        gate_up, down = keys.take(fused[0]), keys.take(fused[1])
        if gate_up is None or down is None:
            return None
        if tuple(gate_up.shape) != (e, 2 * i, d):
            raise ValueError(f"{fused[0]} has shape {tuple(gate_up.shape)}, expected "
                             f"(n_experts, 2 * d_expert, d_model) = {(e, 2 * i, d)}")
        return gate_up[:, :i], gate_up[:, i:], down
    gate, up, down_name = EXPERT_NAMES[family]
    stacked = []
    for name in (gate, up, down_name):
        parts = [keys.take(f"{prefix}experts.{j}.{name}.weight") for j in range(e)]
        if any(p is None for p in parts):
            return None
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{prefix}experts.*.{name}.weight come in several shapes "
                             f"{sorted(shapes)}")
        stacked.append(torch.stack(parts))
    return stacked[0], stacked[1], stacked[2]


def from_hf_moe(state_dict: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
                dtype: torch.dtype | None = None) -> TinyGPT:
    """A TinyGPT holding the weights of a Hugging Face Qwen3MoeForCausalLM or
    MixtralForCausalLM: its state_dict (the fused expert layout), the model itself, or the
    tensors of a folder's *.safetensors (per-expert keys). hf_config: its config object or
    config.json dict. dtype: defaults to the embedding's dtype.

    ValueError on missing, unexpected, wrongly shaped, non-float or non-finite weights, naming
    them (and for Qwen2-MoE's shared_expert_gate, which TinyGPT does not implement).
    """
    if isinstance(state_dict, nn.Module):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors or an nn.Module, got "
                        f"{type(state_dict).__name__}")
    cfg = config_from_hf_moe(hf_config)
    family = _hf_get(hf_config, "model_type")
    gated = sorted(k for k in state_dict if "shared_expert" in k)
    if gated:
        raise ValueError(f"state_dict has a shared expert ({gated[0]}, ...): Qwen2-MoE's "
                         f"sigmoid-gated shared expert is not implemented ({family} has none)")
    keys = _Keys(state_dict, family)
    key_map = _common_key_map(cfg)
    if cfg.tie_embeddings:
        lm_head = keys.left.pop("lm_head.weight", None)
        embed = keys.left.get("model.embed_tokens.weight")
        if lm_head is not None and embed is not None and not torch.equal(lm_head, embed):
            raise ValueError("hf_config.tie_word_embeddings is True but lm_head.weight differs "
                             "from model.embed_tokens.weight")
        del key_map["output.weight"]
    new_state = {ours: keys.take(theirs) for ours, theirs in key_map.items()}
    names = dict(key_map)
    for i in cfg.moe_layers:
        prefix, ours = f"model.layers.{i}.mlp.", f"layers.{i}.feed_forward."
        new_state[ours + "gate.weight"] = keys.take(prefix + "gate.weight")
        names[ours + "gate.weight"] = prefix + "gate.weight"
        experts = _experts(keys, prefix, cfg, family)
        if experts is not None:
            for name, tensor in zip(("w1", "w3", "w2"), experts, strict=True):
                new_state[ours + name], names[ours + name] = tensor, f"{prefix}experts ({name})"
    return assemble(cfg, new_state, names, keys, family, dtype)


def assemble(cfg: ModelConfig, new_state: dict[str, torch.Tensor], names: dict[str, str],
             keys: _Keys, family: str, dtype: torch.dtype | None) -> TinyGPT:
    """The TinyGPT holding `new_state` (ours -> tensor; `names`: ours -> the checkpoint's), once
    `keys` are all taken; ValueError for missing, unexpected, misshapen, non-float or
    non-finite weights (_check_state and the shapes)."""
    _check_state(f"a {family} model", keys.missing, sorted(keys.left),
                 {names[key]: tensor for key, tensor in new_state.items()})
    dtype = new_state["tok_embeddings.weight"].dtype if dtype is None else dtype
    with torch.device("meta"):                    # shapes only: the weights are assigned below
        model = TinyGPT(cfg, seed=None)
    ours = model.state_dict()
    for key, tensor in new_state.items():
        if tuple(tensor.shape) != tuple(ours[key].shape):
            raise ValueError(f"{names[key]} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(ours[key].shape)} for {cfg}")
        wide = key.endswith("e_score_correction_bias")     # float32 at least (tinygpt.moe.MoE)
        to = torch.promote_types(dtype, torch.float32) if wide else dtype
        new_state[key] = tensor.to(to, copy=True).contiguous()   # never the caller's
    if cfg.tie_embeddings:
        new_state["output.weight"] = new_state["tok_embeddings.weight"]
    model.load_state_dict(new_state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return _real_rope_tables(model).eval()


def _real_rope_tables(model: TinyGPT) -> TinyGPT:
    """RoPE's tables of a model built on the meta device, computed for real."""
    cfg = model.cfg
    weight = model.tok_embeddings.weight
    cos, sin = scaled_rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base,
                                   cfg.rope_scaling)
    model.register_buffer("rope_cos", cos.to(weight), persistent=False)
    model.register_buffer("rope_sin", sin.to(weight), persistent=False)
    return model


def from_hf(state_dict: Mapping[str, torch.Tensor] | nn.Module, hf_config: Any,
            dtype: torch.dtype | None = None) -> TinyGPT:
    """A TinyGPT from any of MODEL_TYPES: from_hf_llama or from_hf_moe by hf_config's
    model_type (default "llama"); ValueError listing the allowed types for any other."""
    model_type = check_model_type(_hf_get(hf_config, "model_type", "llama"))
    if model_type == "deepseek_v3":                 # day 21 (hf_deepseek imports this module)
        from tinygpt.hf_deepseek import from_hf_deepseek

        return from_hf_deepseek(state_dict, hf_config, dtype)
    if model_type in LLAMA_LIKE:
        return from_hf_llama(state_dict, hf_config, dtype)
    return from_hf_moe(state_dict, hf_config, dtype)


# --------------------------------------------------------------------------------------------
# one transformers MoE block as ours (DeepSeek-V3's whole model, with latent attention, is
# day 21's; its MoE block converts here)

HF_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "DeepseekV3MoE")


@torch.no_grad()
def moe_from_hf_block(module: nn.Module) -> MoE:
    """Our tinygpt.moe.MoE with the weights of one transformers MoE block (one of HF_BLOCKS),
    in the dtype and on the device of its weights, in eval mode.

    Every block has `gate` (the router: weight (E, D), top_k) and `experts` (fused
    gate_up_proj (E, 2 I, D), gate rows first, and down_proj (E, D, I)).
    Qwen3MoeSparseMoeBlock: router "softmax", renormalize = gate.norm_topk_prob.
    MixtralSparseMoeBlock: router "softmax", always renormalized.
    DeepseekV3MoE: router "sigmoid_groups" with gate's n_group (num_group), topk_group,
    norm_topk_prob, routed_scaling_factor and e_score_correction_bias (a buffer: it biases
    the choice, not the weights), and shared_experts, a SwiGLU of n_shared_experts * I.
    """
    kind = type(module).__name__
    if kind not in HF_BLOCKS:
        why = " (its shared expert is sigmoid-gated, which TinyGPT does not implement)" \
            if kind == "Qwen2MoeSparseMoeBlock" else ""
        raise TypeError(f"module must be one of transformers' {HF_BLOCKS}, got {kind}{why}")
    gate, experts = module.gate, module.experts
    n_experts, d_model = gate.weight.shape
    d_expert = experts.down_proj.shape[-1]
    shared = getattr(module, "shared_experts", None)
    options: dict[str, Any] = dict(router="softmax",
                                   renormalize=bool(getattr(gate, "norm_topk_prob", True)))
    if kind == "DeepseekV3MoE":
        options = dict(router="sigmoid_groups", renormalize=bool(gate.norm_topk_prob),
                       n_group=gate.num_group, topk_group=gate.topk_group,
                       scale=float(gate.routed_scaling_factor),
                       d_shared=0 if shared is None else shared.gate_proj.weight.shape[0])
    moe = MoE(d_model, n_experts, gate.top_k, d_expert, **options).to(
        device=gate.weight.device, dtype=experts.down_proj.dtype)
    moe.gate.weight.copy_(gate.weight)
    if kind == "DeepseekV3MoE":
        moe.e_score_correction_bias.copy_(gate.e_score_correction_bias)
    moe.w1.copy_(experts.gate_up_proj[:, :d_expert])
    moe.w3.copy_(experts.gate_up_proj[:, d_expert:])
    moe.w2.copy_(experts.down_proj)
    if moe.shared is not None:
        moe.shared.w1.weight.copy_(shared.gate_proj.weight)
        moe.shared.w3.weight.copy_(shared.up_proj.weight)
        moe.shared.w2.weight.copy_(shared.down_proj.weight)
    return moe.eval()
