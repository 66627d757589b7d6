"""Day 21: RoPE scalings and sliding windows of Hugging Face configs, for tinygpt.hf_models.

    hf_rope(hf_config)          (rope_theta, ModelConfig.rope_scaling as a dict, max_seq_len)
    hf_window(window, context)  ModelConfig.sliding_window of a config's sliding_window
    hf_rope_parameters(cfg)     transformers' rope_parameters for a ModelConfig's RoPE
    hf_context(cfg)             transformers' max_position_embeddings for it

transformers 5 keeps RoPE in rope_parameters {"rope_type", "rope_theta", ...}; older
config.json files have a top-level rope_theta and an optional rope_scaling dict (with "type"
or "rope_type"). What each scaling does is written in tinygpt.positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tinygpt.hf_fields import hf_get
from tinygpt.positions import ROPE_TYPES

_UNSET = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _positive(name: str, value: Any) -> float:
    """A finite number > 0 (rope_theta), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _length(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _first(*values: Any) -> Any:
    """The first value that is not None (0 and 0.0 are values: `or` would skip them)."""
    return next((v for v in values if v is not None), None)


def hf_rope(hf_config: Any) -> tuple[float, dict[str, Any], int]:
    """(rope_theta, TinyGPT's rope_scaling as a dict ({} for none), max_seq_len) of a
    transformers config object or config.json dict (an absent max_position_embeddings is the
    family's default, tinygpt.hf_fields, as transformers' config classes fill it in; null or
    anything but an int >= 1 is a ValueError).

    As transformers' standardize_rope_params does, yarn and llama3 take
    original_max_position_embeddings from the top level when it is there, else from the
    parameters, else max_position_embeddings, and a yarn factor of None is
    max_position_embeddings / original_max_position_embeddings. "dynamic" grows the base past
    max_position_embeddings (transformers' original length, recorded as
    original_max_position_embeddings), so max_seq_len is then max_position_embeddings * factor.
    ValueError for rope types outside ROPE_TYPES (longrope, ...), a partial_rotary_factor
    other than 1, a rope_theta that is not a finite number > 0 and rope_parameters that are no
    dict, naming them. An absent rope_theta is the family's default (tinygpt.hf_fields).
    """
    context = hf_get(hf_config, "max_position_embeddings")     # absent: the family's default
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"hf_config.max_position_embeddings must be a positive integer, got "
                         f"{context!r}")
    name = "rope_parameters"
    params = _get(hf_config, name)
    if params is None:
        name, params = "rope_scaling", _get(hf_config, "rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"{name} must be null or a dict ({{'rope_type': ..., 'rope_theta': "
                         f"...}}), got {params!r}")
    params = dict(params or {})
    # rope_parameters' rope_theta, else the top level's, else the family's default
    theta = _positive("rope_theta", _first(params.pop("rope_theta", None),
                                           hf_get(hf_config, "rope_theta", 10000.0)))
    rope_type = _first(params.pop("rope_type", None), params.get("type"), "default")
    params.pop("type", None)
    partial = _first(params.pop("partial_rotary_factor", None),
                     _get(hf_config, "partial_rotary_factor"))
    if partial is not None and (isinstance(partial, bool) or partial != 1):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported: TinyGPT rotates "
                         f"every channel of a head (partial_rotary_factor 1)")
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE scaling type {rope_type!r} is not supported; TinyGPT implements "
                         f"rope_type in {ROPE_TYPES} (tinygpt.positions)")
    if rope_type == "default":
        return theta, {}, context
    scaling = dict(params, rope_type=rope_type)
    if rope_type in ("yarn", "llama3"):
        top = _get(hf_config, "original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = _length(
            "original_max_position_embeddings",
            _first(top, params.get("original_max_position_embeddings"), context))
    if rope_type == "yarn":
        if scaling.get("factor") is None:
            scaling["factor"] = context / scaling["original_max_position_embeddings"]
        scaling = {k: v for k, v in scaling.items() if v is not None or k not in _UNSET}
    if rope_type == "dynamic":
        if not isinstance(scaling.get("factor"), int | float) or scaling["factor"] < 1:
            raise ValueError(f"a dynamic RoPE scaling needs a factor >= 1, got "
                             f"{scaling.get('factor')!r}")
        scaling["original_max_position_embeddings"] = context
        context = int(context * scaling["factor"])
    return theta, scaling, context


def hf_window(window: Any, context: int) -> int:
    """ModelConfig.sliding_window of a config's sliding_window: 0 when it is null or no shorter
    than the context (the window then hides nothing, and the fast paths stay open)."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be null or a positive integer, got {window!r}")
    return window if window < context else 0


def hf_context(cfg: Any) -> int:
    """transformers' max_position_embeddings for a ModelConfig: its max_seq_len, except for a
    dynamic scaling, whose original length transformers reads from there."""
    if cfg.rope_type == "dynamic":
        return dict(cfg.rope_scaling)["original_max_position_embeddings"]
    return cfg.max_seq_len


def hf_rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers' rope_parameters for a ModelConfig's RoPE (a dynamic scaling's original
    length goes to max_position_embeddings, hf_context)."""
    params: dict[str, Any] = {"rope_type": "default", **dict(cfg.rope_scaling)}
    if params["rope_type"] == "dynamic":
        del params["original_max_position_embeddings"]
    return {**params, "rope_theta": float(cfg.rope_base)}
