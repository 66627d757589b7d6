"""Where a rank's model comes from: a picklable description each rank loads for itself.

    load_source   "shipped", (cfg, state_dict) or a zero-argument callable -> the full TinyGPT
                  that the rank then shards (tinygpt.parallel.model.shard_model) or splits
                  into stages (tinygpt.parallel.pipeline)
    source_config the source's ModelConfig, for the launcher's checks before any rank starts
"""

from __future__ import annotations

from tinygpt.model import ModelConfig, TinyGPT


def load_source(source) -> TinyGPT:
    """The full model a rank shards, from a picklable description:

    "shipped"               the course's checkpoint (tinygpt.train.load_pretrained)
    (cfg, state_dict)       a ModelConfig and a TinyGPT state dict (shared memory between the
                            launcher and the ranks, so no copy per rank)
    a callable              called with no argument; returns a TinyGPT or (TinyGPT, tokenizer).
                            The hook for any loader: the real model's GGUF is one line,
                            functools.partial(<the GGUF loader>, <its path>).
    """
    if isinstance(source, str):
        if source != "shipped":
            raise ValueError(f"source must be 'shipped', (cfg, state_dict) or a callable, got "
                             f"{source!r}")
        from tinygpt.train import load_pretrained

        return load_pretrained()[0]
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], ModelConfig):
        model = TinyGPT(source[0], seed=None)
        model.load_state_dict(source[1])
        return model.eval()
    if callable(source):
        model = source()
        model = model[0] if isinstance(model, tuple) else model
        if not isinstance(model, TinyGPT):
            raise TypeError(f"the source callable must return a TinyGPT, got "
                            f"{type(model).__name__}")
        return model.eval()
    raise TypeError(f"source must be 'shipped', (cfg, state_dict) or a callable, got "
                    f"{type(source).__name__}")


def source_config(source) -> ModelConfig:
    """The ModelConfig of the model `source` describes (see load_source), for checks made
    before launching ranks: read from a (cfg, state_dict) pair, else loaded once here."""
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], ModelConfig):
        return source[0]
    return load_source(source).cfg
