"""The model shapes the benchmarks run, and building them with seeded random weights.

Speed does not depend on what the weights say, only on their shapes and dtype, so the bench
builds models from a config (`build`); the shipped checkpoint's shape comes from its config.
"""

from __future__ import annotations

import dataclasses

import torch

from tinygpt import flops as F
from tinygpt.generate import model_device
from tinygpt.kv_cache import DTYPE_NAMES
from tinygpt.model import ModelConfig, TinyGPT


def course_model_config() -> ModelConfig:
    """The shape of the course's shipped checkpoint, read from its config.json (one source for
    every place that describes it)."""
    from tinygpt.train import PRETRAINED_DIR, _model_config_from, checkpoint_metadata

    meta = checkpoint_metadata(PRETRAINED_DIR)
    return _model_config_from(meta["model_config"], PRETRAINED_DIR / "config.json")


def medium_model_config() -> ModelConfig:
    """A ~31M-parameter Llama-style model (126 MB in fp32), GQA with 4 of 8 heads."""
    return ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                       d_ff=1376, max_seq_len=1024)


def bandwidth_model_config() -> ModelConfig:
    """A ~152M-parameter model (610 MB in fp32) whose weights dwarf its cache and the CPU's
    caches, with matrices large enough (1024 x 2816) that each product streams at close to
    memory bandwidth; smaller models lose a larger share of the step to fixed per-kernel costs.
    """
    return ModelConfig(vocab_size=8192, d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4,
                       d_ff=2816, max_seq_len=1024)


def cuda_bandwidth_model_config() -> ModelConfig:
    """The GPU's bandwidth model: ~1.1B parameters (2.2 GB in bf16), shaped like Llama 3.2 1B
    (d_model 2048, 16 layers, 32 query and 8 KV heads, d_ff 8192) with a 32k vocabulary."""
    return ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                       d_ff=8192, max_seq_len=2048)


def smollm2_config() -> ModelConfig:
    """SmolLM2-135M's shape (its GGUF's metadata): ~135M parameters, 538 MB in float32."""
    return ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       d_ff=1536, max_seq_len=2048, rope_base=100000.0, norm_eps=1e-5,
                       tie_embeddings=True)


def model_info(model: TinyGPT) -> dict:
    """Config, parameter count, weight bytes, dtype and device of a model, for the report."""
    dtype = next(model.parameters()).dtype
    return {"config": dataclasses.asdict(model.cfg), "parameters": F.param_count(model.cfg),
            "weight_bytes": F.weight_bytes(model.cfg, DTYPE_NAMES.get(dtype, "fp32")),
            "dtype": str(dtype), "device": str(model_device(model))}


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32) -> TinyGPT:
    """A TinyGPT of shape `cfg` with seeded random weights, on `device` in `dtype`, in eval
    mode."""
    return TinyGPT(cfg, seed=seed).to(device=device, dtype=dtype).eval()

