"""Day 21: multi-head latent attention (MLA, DeepSeek-V2 and -V3).

A KV cache of ordinary attention holds, per layer and token, a key and a value for every KV
head: 2 x n_kv_heads x head_dim numbers. MLA caches one small vector per token instead:

    c     = kv_norm(x W_dkv)          the latent, kv_lora_rank wide (DeepSeek-V3: 512)
    k_pe  = RoPE(x W_kr)              the RoPE key, qk_rope_head_dim wide (64), shared by heads

so (kv_lora_rank + qk_rope_head_dim) numbers per layer and token (576 for DeepSeek-V3, against
128 heads x (192 + 128) = 40,960 for the keys and values it decompresses into). Every head's
key and value are linear in the latent, through wkv_b = [W_uk; W_uv] per head:

    k_h = [c W_uk_h, k_pe]            (qk_nope_head_dim + qk_rope_head_dim wide)
    v_h = c W_uv_h                    (v_head_dim wide)

Queries come from x through wq (or a low-rank wq_a -> q_norm -> wq_b, q_lora_rank wide) and
split per head into q_nope_h and q_pe_h (RoPE-rotated); scores are scaled by
1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).

Two ways to decode from the latent cache, equal up to rounding:

    naive      decompress every cached latent into K and V (wkv_b), then attend as usual:
               the oracle, and the right way to prefill (many queries share one expansion)
    absorbed   never build K or V. By associativity of the products,
                   q_nope_h . (c_j W_uk_h) = (q_nope_h W_uk_h^T) . c_j
                   sum_j p_j (c_j W_uv_h) = (sum_j p_j c_j) W_uv_h
               so the query is moved into latent space once (q_abs_h = q_nope_h W_uk_h^T,
               kv_lora_rank wide), scored against the cached latents directly, the weighted sum
               of latents is taken, and only then projected by W_uv_h and wo.

The RoPE part cannot be absorbed: RoPE rotates q and k by position-dependent angles, so
q R_m W_uk^T c_n has a rotation R_m (R_n) between the two products that changes with every
position and no fixed matrix can be folded into the query. That is why MLA gives RoPE its own
decoupled key k_pe, shared by all heads and cached beside the latent, and scores are
q_abs_h . c_j + q_pe_h . k_pe_j.

Cost at decode, per head and cached token: the absorbed scores and weighted sum run over the
latent's kv_lora_rank values instead of the head's widths (DeepSeek-V3: 512 + 64 for the
score and 512 for the sum, 1,088 multiply-adds, against 192 + 128 = 320 over a decompressed
cache: more flops), but the bytes read per token and layer are the latent's 576 values for
all 128 heads at once instead of 40,960: decode reads the cache, so it is
bandwidth that counts and MLA turns attention from memory-bound towards compute-bound.
Decoding naively from the latent cache is the worst of both: every step decompresses every
cached latent (2 x S x kv_lora_rank x H x (nope + v) FLOPs). One float32 decode step of a
DeepSeek-V2-Lite-shaped layer (D 2048, 16 heads, latent 512, RoPE key 64, nope and v 128)
over 4,096 cached tokens took 230 and 344 ms naive and 12 and 8 ms absorbed, two runs each,
on a 2-core AMD EPYC with AVX-512, shared with other work (2026-11-27).

Pieces:

    check_config(cfg)              the MLA fields of a tinygpt.model.ModelConfig, clear errors
    MLAttention                    the attention module (weights wq | wq_a, q_norm, wq_b;
                                   wkv_a, kv_norm, wkv_b; wo), TinyGPT's attention when
                                   cfg.attention == "mla"; forward(x, cos, sin, cache, pos)
    LatentLayerCache               one layer's cache: c (B, max_len, kv_lora_rank) and
                                   k_pe (B, max_len, qk_rope_head_dim), the interface of
                                   tinygpt.kv_cache.LayerKVCache (update, update_static)
    kv_bytes_per_token_mla(cfg)    the latent cache's bytes per token, and
    kv_bytes_per_token_expanded    what the decompressed K and V would take

Where it runs: TinyGPT builds MLAttention when cfg.attention == "mla"; KVCache.for_model
gives such a model LatentLayerCache layers, so generate() and DecodeStep (which runs the
modules) decode absorbed; day 17's engine keeps one paged pool of [latent, RoPE key] rows
(tinygpt.paged.PagedKVCache latent=kv_lora_rank) and its runner computes the absorbed form as
multi-query attention: one shared key per token, queries [q_nope W_uk, q_pe] per head, and the
latent (the key's first kv_lora_rank columns) as the value.

RoPE here is the "rotate half" layout of tinygpt.positions. DeepSeek-V3's checkpoints rotate
interleaved pairs (x0, x1), (x2, x3), ... (rope_interleave); transformers' rotation of them
returns the channels as [even ones, odd ones] rotated by rotate-half, so permuting the RoPE
rows of the query and key projections (evens first) at load time gives the same scores
(tinygpt.hf_deepseek does that).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as nnf
from torch import nn

from tinygpt.model import RMSNorm
from tinygpt.positions import apply_rope

if TYPE_CHECKING:
    from tinygpt.model import ModelConfig

ATTENTIONS = ("gqa", "mla")
DECODES = ("absorbed", "naive")
LATENT_EPS = 1e-6     # q_norm's and kv_norm's epsilon: DeepSeek's (transformers' default), fixed
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


def check_config(cfg: ModelConfig) -> None:
    """Validate the MLA fields of `cfg` (called by ModelConfig.__post_init__ before head_dim is
    resolved); for attention "mla" set head_dim to qk_rope_head_dim (the width of RoPE's tables,
    as transformers' DeepseekV3Config does). ValueError naming the field and what it may be."""
    if cfg.attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {cfg.attention!r}")
    for name in MLA_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if cfg.attention == "gqa":
        given = [name for name in MLA_FIELDS if getattr(cfg, name)]
        if given:
            raise ValueError(f"{given[0]}={getattr(cfg, given[0])!r} needs multi-head latent "
                             f"attention: set attention='mla' (attention='gqa' has no latent)")
        return
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1 with attention='mla', got "
                             f"{getattr(cfg, name)!r}")
    rope = cfg.qk_rope_head_dim
    if rope < 2 or rope % 2:
        raise ValueError(f"qk_rope_head_dim must be a positive even integer with "
                         f"attention='mla' (RoPE rotates pairs of channels), got {rope!r}")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"n_kv_heads must equal n_heads ({cfg.n_heads}) with attention='mla' "
                         f"(every head decompresses its own key and value), got "
                         f"{cfg.n_kv_heads!r}")
    if cfg.head_dim is None:
        object.__setattr__(cfg, "head_dim", rope)
    elif cfg.head_dim != rope:
        raise ValueError(f"head_dim must be None or qk_rope_head_dim={rope} with "
                         f"attention='mla' (it sizes RoPE's tables), got {cfg.head_dim!r}")
    if cfg.qk_norm:
        raise ValueError("qk_norm=True is Qwen3's per-head norm of ordinary attention; "
                         "attention='mla' normalizes its latents instead (q_norm, kv_norm)")
    if getattr(cfg, "sliding_window", 0):
        raise ValueError(f"sliding_window must be 0 with attention='mla' (MLAttention attends "
                         f"over the whole causal context), got {cfg.sliding_window!r}")


def mla_parameters(cfg: ModelConfig) -> int:
    """Parameters of one MLAttention(cfg) (the latent norms included)."""
    D, H = cfg.d_model, cfg.n_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    r, qr = cfg.kv_lora_rank, cfg.q_lora_rank
    query = D * qr + qr + qr * H * qk if qr else D * H * qk
    return (query + D * (r + cfg.qk_rope_head_dim) + r
            + r * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)


def softmax_scale(cfg: ModelConfig) -> float:
    """The scale of MLA's scores: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times
    mscale^2 when cfg.rope_scaling (e.g. DeepSeek-V3's YaRN) gives mscale_all_dim and a factor
    > 1, with mscale = 0.1 mscale_all_dim ln(factor) + 1 (DeepSeek's and transformers'
    yarn_get_mscale): longer contexts flatten the softmax, and this sharpens it back."""
    _check_mla(cfg)
    scale = 1 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    params = dict(cfg.rope_scaling)
    m_all, factor = params.get("mscale_all_dim"), params.get("factor", 1)
    if params.get("rope_type", "default") != "default" and m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1
        scale *= mscale * mscale
    return scale


def kv_bytes_per_token_mla(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes the latent cache holds per token (all layers): (kv_lora_rank + qk_rope_head_dim)
    x n_layers x dtype_bytes. DeepSeek-V3 in bf16: (512 + 64) x 61 x 2 = 70,272."""
    _check_mla(cfg)
    _check_dtype_bytes(dtype_bytes)
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.n_layers * dtype_bytes


def kv_bytes_per_token_expanded(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes per token of the decompressed cache the same model would need (every head's key,
    qk_nope_head_dim + qk_rope_head_dim wide, and value, v_head_dim wide, in every layer).
    DeepSeek-V3 in bf16: 128 x (192 + 128) x 61 x 2 = 4,997,120."""
    _check_mla(cfg)
    _check_dtype_bytes(dtype_bytes)
    per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return cfg.n_heads * per_head * cfg.n_layers * dtype_bytes


def _check_mla(cfg: ModelConfig) -> None:
    if getattr(cfg, "attention", None) != "mla":
        raise ValueError(f"cfg must be a ModelConfig with attention='mla', got attention="
                         f"{getattr(cfg, 'attention', None)!r}")


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if isinstance(dtype_bytes, bool) or dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be one of (1, 2, 4, 8), got {dtype_bytes!r}")


# --------------------------------------------------------------------------------------------
# the cache


class LatentLayerCache:
    """One layer's latent cache: c (batch, max_len, kv_lora_rank) and k_pe (batch, max_len,
    qk_rope_head_dim), allocated once and written in place; the interface of
    tinygpt.kv_cache.LayerKVCache (bounds are checked by KVCache.check_step)."""

    def __init__(self, batch_size: int, max_len: int, kv_lora_rank: int, rope_dim: int, *,
                 device: torch.device, dtype: torch.dtype) -> None:
        with torch.inference_mode(False):
            self.c = torch.zeros(batch_size, max_len, kv_lora_rank, device=device, dtype=dtype)
            self.k_pe = torch.zeros(batch_size, max_len, rope_dim, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.c.nbytes + self.k_pe.nbytes

    def narrowed(self, capacity: int) -> LatentLayerCache:
        """This layer's first `capacity` slots: views of the same c and k_pe."""
        view = copy.copy(self)
        view.c, view.k_pe = self.c[:, :capacity], self.k_pe[:, :capacity]
        return view

    def update(self, c: torch.Tensor, k_pe: torch.Tensor, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write c (B, T, kv_lora_rank), k_pe (B, T, rope) at positions start .. start+T-1;
        return the filled parts (B, start + T, .) of rows 0 .. B-1."""
        batch, end = c.shape[0], start + c.shape[1]
        self.c[:batch, start:end] = c
        self.k_pe[:batch, start:end] = k_pe
        return self.c[:batch, :end], self.k_pe[:batch, :end]

    def update_static(self, c: torch.Tensor, k_pe: torch.Tensor, input_pos: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write at the positions input_pos (T,); return all max_len slots and the mask
        (T, max_len): query i sees slot j iff j <= input_pos[i]."""
        batch = c.shape[0]
        latents, keys = self.c[:batch], self.k_pe[:batch]
        latents.index_copy_(1, input_pos, c)
        keys.index_copy_(1, input_pos, k_pe)
        slots = torch.arange(self.c.shape[1], device=input_pos.device)
        return latents, keys, slots[None, :] <= input_pos[:, None]


# --------------------------------------------------------------------------------------------
# the attention module


class MLAttention(nn.Module):
    """Multi-head latent attention with the weights of transformers' DeepseekV3Attention.

        wq     D -> H * (nope + rope)               (q_lora_rank = 0), or
        wq_a   D -> q_lora_rank, q_norm, wq_b  q_lora_rank -> H * (nope + rope)
        wkv_a  D -> kv_lora_rank + rope             the latent (then kv_norm) and the RoPE key
        wkv_b  kv_lora_rank -> H * (nope + v)       per head: W_uk (nope rows), W_uv (v rows)
        wo     H * v -> D

    (nope, rope, v: qk_nope_head_dim, qk_rope_head_dim, v_head_dim.) forward(x, cos, sin) is
    the uncached attention (decompressed K and V, causal); with a LatentLayerCache the new
    latents are written first, a prompt of several tokens attends naively and one token
    decodes the way `decode` says: "absorbed" (the default) or "naive" (the oracle).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _check_mla(cfg)
        self.n_heads, self.kv_lora_rank = cfg.n_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
            cfg.v_head_dim
        qk, H, D = self.nope + self.rope, cfg.n_heads, cfg.d_model
        self.scale = softmax_scale(cfg)
        self.wq = self.wq_a = self.q_norm = self.wq_b = None
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(D, H * qk, bias=False)
        self.wkv_a = nn.Linear(D, self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, D, bias=False)
        self.decode = "absorbed"

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> q_nope (B, H, T, nope) and q_pe (B, H, T, rope), RoPE-rotated."""
        B, T, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(B, T, self.n_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        return q_nope, apply_rope(q_pe, cos, sin)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> what the cache holds: c (B, T, kv_lora_rank), normed, and the RoPE
        key k_pe (B, T, rope), rotated."""
        c, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        return self.kv_norm(c), apply_rope(k_pe[:, None], cos, sin)[:, 0]

    def _heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """wkv_b split per head: W_uk (H, nope, kv_lora_rank), W_uv (H, v, kv_lora_rank)."""
        w = self.wkv_b.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def expand(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress c (B, S, r), k_pe (B, S, rope) into every head's keys (B, H, S,
        nope + rope) and values (B, H, S, v)."""
        B, S, _ = c.shape
        kv = self.wkv_b(c).view(B, S, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe[:, None].expand(B, self.n_heads, S, self.rope)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def attend_naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
                     k_pe: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The oracle: decompress, then softmax(q k^T * scale + mask) v. q_nope, q_pe:
        (B, H, T, .); c, k_pe: (B, S, .); mask: bool (T, S) (True: may attend) or None (all
        positions). Returns (B, T, H * v)."""
        k, v = self.expand(c, k_pe)
        q = torch.cat([q_nope, q_pe], dim=-1)
        y = nnf.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return y.transpose(1, 2).flatten(2)

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
                        k_pe: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The same result without building K or V (see the module docstring): scores
        (q_nope W_uk^T) . c + q_pe . k_pe, then (softmax . c) W_uv. Arguments as attend_naive."""
        q_abs = self.absorb_query(q_nope)                                    # (B, H, T, r)
        scores = (q_abs @ c[:, None].transpose(-1, -2)
                  + q_pe @ k_pe[:, None].transpose(-1, -2)) * self.scale    # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        # softmax in float32 at least (bfloat16 scores would round the weights coarsely)
        p = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)),
                          dim=-1).to(c.dtype)
        return self.from_latent(p @ c[:, None])              # the weighted latents (B,H,T,r)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (B, H, T, nope) -> q_nope W_uk per head (B, H, T, kv_lora_rank): the query
        in latent space, whose dot product with a cached latent is q_nope . k_nope."""
        return torch.einsum("bhtn,hnr->bhtr", q_nope, self._heads()[0])

    def from_latent(self, latent_out: torch.Tensor) -> torch.Tensor:
        """The weighted sum of latents per head (B, H, T, kv_lora_rank) -> through W_uv per
        head, heads merged: (B, T, H * v), what wo takes."""
        y = torch.einsum("bhtr,hvr->bhtv", latent_out, self._heads()[1])
        return y.transpose(1, 2).flatten(2)

    def forward_masked(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: LatentLayerCache, start: int, mask: torch.Tensor
                       ) -> torch.Tensor:
        """A padded batch (tinygpt.batching.forward_padded): x (B, T, D) is written into the
        dynamic kv_cache at offset `start`, and the T queries (the last T of S = start + T
        positions) attend where `mask` (B, 1, T, S) bool and causality both allow; one token
        decodes as `decode` says, more attend naively. Returns (B, T, D)."""
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")
        T = x.shape[1]
        q_nope, q_pe = self.queries(x, cos, sin)
        c, k_pe = kv_cache.update(*self.latent(x, cos, sin), start)
        S = c.shape[1]
        mask = mask & torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        absorbed = T == 1 and self.decode == "absorbed"
        attend = self.attend_absorbed if absorbed else self.attend_naive
        return self.wo(attend(q_nope, q_pe, c, k_pe, mask))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LatentLayerCache | None = None,
                cache_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D); cos, sin: (T, rope) or (B, T, rope). kv_cache and
        cache_pos as in tinygpt.model.Attention.forward (an int offset of a dynamic cache or
        the positions (T,) of a static one)."""
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")
        T = x.shape[1]
        q_nope, q_pe = self.queries(x, cos, sin)
        c, k_pe = self.latent(x, cos, sin)
        if kv_cache is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        elif isinstance(cache_pos, torch.Tensor):
            c, k_pe, mask = kv_cache.update_static(c, k_pe, cache_pos)
        else:
            c, k_pe = kv_cache.update(c, k_pe, cache_pos)
            S = c.shape[1]               # the T new queries are the last T of S positions
            mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool,
                                                  device=x.device).tril(S - T)
        absorbed = kv_cache is not None and T == 1 and self.decode == "absorbed"
        attend = self.attend_absorbed if absorbed else self.attend_naive
        return self.wo(attend(q_nope, q_pe, c, k_pe, mask))
