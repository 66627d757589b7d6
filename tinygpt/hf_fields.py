"""Reading the fields of a Hugging Face config for tinygpt.hf_models and tinygpt.hf_deepseek.

    hf_get(hf_config, name, default)    one field of a transformers config object or a
                                        config.json dict; an absent field takes transformers'
                                        default for the config's model_type (HF_DEFAULTS)
    hf_bool, hf_int_list                a field checked to be a bool / a list of ints
    kv_heads_and_eps(hf_config, n_heads)    num_key_value_heads and rms_norm_eps, checked

A transformers config object always holds every field (its class fills in the defaults); a
config.json may leave some out, and transformers then builds the model with its config class's
default for that family, which is not the same across families (Mixtral's rms_norm_eps is
1e-5, Llama's 1e-6). HF_DEFAULTS holds those defaults for the fields that change the model's
numbers or its context length without changing a weight's shape (tests/test_moe_hf.py checks
them against transformers' config classes), so a folder loads as transformers loads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MISSING = object()

# transformers 5's config-class defaults, per model_type, of the fields TinyGPT reads and
# cannot check against the weights' shapes (rope_theta: rope_parameters' default;
# max_position_embeddings: the context, which no weight's shape holds with RoPE)
_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "num_key_value_heads": None, "max_position_embeddings": 2048},
    "mistral": {**_COMMON, "num_key_value_heads": 8, "sliding_window": 4096,
                "max_position_embeddings": 131072},
    "qwen3_moe": {**_COMMON, "num_key_value_heads": 4, "sliding_window": 4096,
                  "use_sliding_window": False, "num_experts_per_tok": 8,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": None,
                  "max_position_embeddings": 32768},
    "mixtral": {**_COMMON, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8,
                "sliding_window": None, "num_experts_per_tok": 2,
                "max_position_embeddings": 131072},
    "deepseek_v3": {**_COMMON, "num_experts_per_tok": 8, "norm_topk_prob": True, "n_group": 8,
                    "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "rope_interleave": True,
                    "q_lora_rank": 1536, "n_routed_experts": 256,
                    "max_position_embeddings": 4096},
}


def model_type_of(hf_config: Any) -> Any:
    """hf_config's model_type ("llama" when absent, as tinygpt.hf_models reads it)."""
    if isinstance(hf_config, Mapping):
        return hf_config.get("model_type", "llama")
    return getattr(hf_config, "model_type", "llama")


def hf_get(hf_config: Any, name: str, default: Any = MISSING, family: str = "Llama") -> Any:
    """A field of a transformers config object or a config.json dict. When absent: its
    transformers default for hf_config's model_type if HF_DEFAULTS has one, else `default`,
    else a ValueError naming the field (`family` says whose config needs it)."""
    if isinstance(hf_config, Mapping):
        value = hf_config.get(name, MISSING)
    else:
        value = getattr(hf_config, name, MISSING)
    if value is MISSING:
        value = HF_DEFAULTS.get(model_type_of(hf_config), {}).get(name, default)
    if value is MISSING:
        raise ValueError(f"hf_config has no field {name!r}, which a {family} config needs")
    return value


def hf_bool(hf_config: Any, name: str, default: Any = MISSING) -> bool:
    """A true/false field: JSON's true or false (a string "false" would read as True)."""
    value = hf_get(hf_config, name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def hf_int_list(hf_config: Any, name: str) -> list[int]:
    """A list of integers >= 0 (layer indices); null or absent: []."""
    value = hf_get(hf_config, name, None)
    if value is None:
        return []
    if not isinstance(value, list | tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise ValueError(f"{name} must be null or a list of integers >= 0, got {value!r}")
    return list(value)


def kv_heads_and_eps(hf: Any, n_heads: Any) -> tuple[Any, float]:
    """hf_config's num_key_value_heads (None: one per query head, as in transformers; absent:
    its family's default, HF_DEFAULTS; else an int >= 1) and rms_norm_eps (absent: its
    family's default; else a finite number > 0)."""
    kv, eps = hf_get(hf, "num_key_value_heads", None), hf_get(hf, "rms_norm_eps")
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
        raise ValueError(f"num_key_value_heads must be None or an int >= 1, got {kv!r}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
        raise ValueError(f"rms_norm_eps must be a finite number > 0, got {eps!r}")
    return n_heads if kv is None else kv, float(eps)
