"""Day 21: a rolling KV cache for sliding-window layers.

A layer whose queries see only their last W keys (ModelConfig.sliding_window, Mistral's
convention: t - W + 1 .. t) never reads a key again once W newer positions exist, so its cache
does not have to grow with the sequence: a ring of W slots, position p in slot p % W, holds
everything the next token needs (Mistral 7B's "rolling buffer cache"). Its memory is fixed by
the window, not by the context: for Mistral-7B's W = 4096 and a 32k context, an eighth.

RollingLayerCache has LayerKVCache's `update`, with one difference: it returns the keys and
values of positions max(0, start - W + 1) .. start + T - 1 (in position order, gathered from
the ring and followed by the T new ones), not of 0 .. start + T - 1; Attention's windowed
forward masks them with sliding_window_mask either way (tinygpt.model). Only dynamic caches
roll (a static cache's fixed slots are what CUDA graphs replay).

Going back (speculative decoding's rollback sets cache.length lower) is only safe while the
positions it needs were not overwritten: a ring of W + slack slots keeps them for rewinds of
up to slack + 1 positions, and a longer rewind raises instead of attending to wrong keys.
KVCache.for_model(model, rolling=True, slack=...) builds such a cache.
"""

from __future__ import annotations

import torch


class RollingLayerCache:
    """One windowed layer's keys and values in a ring: k, v (batch, n_kv_heads, window +
    slack, head_dim), position p in slot p % (window + slack)."""

    def __init__(self, batch_size: int, n_kv_heads: int, window: int, head_dim: int, *,
                 slack: int = 0, device: torch.device, dtype: torch.dtype) -> None:
        for name, value, low in (("window", window, 1), ("slack", slack, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.window, self.slack, self.size = window, slack, window + slack
        shape = (batch_size, n_kv_heads, self.size, head_dim)
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.newest = 0                         # one past the highest position written

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, head_dim) of positions start .. start+T-1 into the ring;
        return the keys and values of positions max(0, start - window + 1) .. start + T - 1
        (B, H_kv, min(start, window - 1) + T, head_dim), oldest first.

        ValueError when `start` goes back further than the ring still holds (a rewind of more
        than slack + 1 positions after later ones were written)."""
        batch, n_new, size = k.shape[0], k.shape[2], self.size
        first = max(0, start - self.window + 1)
        if first < start and self.newest - 1 - size >= first:     # a needed slot was reused
            raise ValueError(f"the rolling cache cannot go back to position {start}: positions "
                             f"up to {self.newest - 1} were written over its window's keys "
                             f"(it holds window {self.window} + slack {self.slack} slots; a "
                             f"rewind of up to slack + 1 = {self.slack + 1} is safe)")
        old = torch.arange(first, start, device=self.k.device) % size
        keys = torch.cat((self.k[:batch, :, old], k), dim=2)
        values = torch.cat((self.v[:batch, :, old], v), dim=2)
        kept = min(n_new, size)                 # the newest `size` positions stay
        slots = torch.arange(start + n_new - kept, start + n_new, device=self.k.device) % size
        self.k[:batch, :, slots] = k[:, :, n_new - kept:]
        self.v[:batch, :, slots] = v[:, :, n_new - kept:]
        self.newest = max(self.newest, start + n_new) if start > 0 else start + n_new
        return keys, values


def rolling_layers(cache, cfg, rolling: object, slack: int) -> list:
    """cache.layers with a RollingLayerCache for every windowed layer of cfg (a ModelConfig);
    KVCache.for_model's rolling=True. ValueError naming what is wrong otherwise."""
    if rolling is not True:
        raise ValueError(f"rolling must be True or False, got {rolling!r}")
    if cache.static:
        raise ValueError("rolling=True needs a dynamic cache (static=False): a static cache's "
                         "slots are fixed positions")
    if not cfg.sliding_window:
        raise ValueError("rolling=True needs a model with a sliding window "
                         "(cfg.sliding_window >= 1); without one every key stays needed")
    return [layer if cfg.layer_window(i) is None else RollingLayerCache(
        cache.batch_size, cache.n_kv_heads, cfg.sliding_window, cache.head_dim, slack=slack,
        device=cache.device, dtype=cache.dtype) for i, layer in enumerate(cache.layers)]


def windowed_kv_cache_bytes(cfg, tokens: int, batch: int, dtype: str = "bf16") -> int:
    """Bytes of the KV cache `tokens` positions per sequence need when each windowed layer
    keeps only its last sliding_window positions (a rolling cache with slack 0; the paged
    engine holds a little more, whole blocks): tinygpt.flops.kv_cache_bytes with each
    windowed layer's tokens capped at the window. Equal to kv_cache_bytes without a window.

    Mistral-7B (32 layers, 8 KV heads of 128, W = 4096) at a 32,768-token context in bf16:
    0.54 GB against 4.29 GB for the full cache, an eighth.
    """
    from tinygpt import flops

    full = flops.kv_cache_bytes(cfg, tokens, batch, dtype)         # checks the arguments
    if not cfg.sliding_window:
        return full
    held = sum(tokens if cfg.layer_window(i) is None else min(tokens, cfg.sliding_window)
               for i in range(cfg.n_layers))
    elements = 2 * cfg.n_kv_heads * cfg.head_dim * held * batch
    return -(-elements * flops.DTYPE_BITS[dtype] // 8)
