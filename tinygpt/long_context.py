"""Day 21: KV memory for long context: bytes per token by layout, attention sinks, fp8 KV.

At long context the KV cache, not the weights, decides how many requests fit. This module
holds the day's pieces that are not a new kind of attention (those are tinygpt.mla, the
sliding-window layers of tinygpt.model with tinygpt.rolling and the paged cache's
drop_out_of_window, and the RoPE scaling types of tinygpt.positions):

    KVLayout, LAYOUTS      a model's cache shape (layers, KV heads x head_dim or an MLA
                           latent, windowed layers) and four published ones
    kv_bytes(layout, context, dtype_bytes=2)
                           one sequence's cache at `context` tokens: a full layer holds
                           them all, a windowed one min(context, window)
    long_text(tokenizer, n_tokens)
                           n_tokens of the course's synthetic stories (a text as long as wanted)
    streaming_nll(model, ids, *, window, sinks=0)
                           teacher-forced next-token losses under StreamingLLM's cache: the
                           first `sinks` tokens plus the last `window`, positions assigned
                           inside the cache; chunked (many queries per pass)
    StreamingLM            the model under that cache, a chunk of tokens per forward call
    streaming_generate     generation past the context with sinks + window
    streaming_logits_loop, streaming_nll_loop
                           one token at a time with an explicit cache: the oracle
    quantize_kv_fp8, dequantize_kv_fp8
                           keys or values in float8 e4m3 with one float32 scale per head

Bytes per token and layer, dtype_bytes each (bf16: 2):

    MHA / GQA / MQA    2 x n_kv_heads x head_dim     (MHA: as many KV heads as query heads,
                                                      MQA: one; GQA: a few)
    MLA                kv_lora_rank + qk_rope_head_dim (one latent and one RoPE key per token,
                                                      whatever the number of heads)

Llama-3-8B (32 layers, 8 KV heads of 128): 131,072 B per token in bf16; DeepSeek-V3 (61
layers, 512 + 64): 70,272 B; Gemma 3 27B (62 layers, 16 KV heads of 128, five local layers of
window 1,024 per global one): 507,904 B per token up to 1,024 tokens, where its 52 local
layers stop growing; past that only its 10 global layers grow, by 81,920 B per token.

Attention sinks (StreamingLLM, Xiao et al. 2023). Evicting the oldest tokens of a cache (a
window) breaks a model trained on full attention once its first tokens leave: softmax must put
its weight somewhere, trained models park most of it on the first tokens (whatever they are),
and without them the weight spreads over tokens it was never meant for. Keeping the first few
(4) tokens beside the window restores the behaviour. StreamingLLM numbers positions inside the
cache, not in the text: with S sinks and a window of W, the query at text position t sees

    the sinks 0 .. S-1            at RoPE distance min(t, S + W - 1) - s from the query
    the window max(S, t-W+1) .. t at distance t - j (its text distance)

(RoPE scores depend only on the distance, so the window keeps its text distances; the sinks sit
right before the window's oldest key once the cache is full). window=None is full attention.
`streaming_nll` computes each chunk of queries against two blocks of keys, the sinks (query
rotated at its cache position) and the window (query and keys rotated at their text positions
minus a common offset), and takes one softmax over both: exactly the per-token cache of
`streaming_nll_loop`, many times faster.

fp8 KV. float8 e4m3 (torch.float8_e4m3fn) keeps 3 mantissa bits and a range of +-448, so values
are divided by a scale first: here one float32 scale per (batch, head), the head's largest
|value| over its tokens and channels / 448. Its error is relative to each value (about 2^-4 at
worst, like any 3-bit mantissa, for |value| >= 2^-6 x scale, e4m3's normal range; below it
the step is a fixed 2^-9 x scale) where day 15's int8 (one scale per token, tinygpt.quant.
quantize_kv) has an absolute error step of amax / 127 per token. torch's cast saturates at 448
on the CPU, so a value beyond the scale's range would be clamped silently; the scale here always
covers the data it was computed from, and `quantize_kv_fp8` with a given (calibrated) scale
raises when the data exceed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf

from tinygpt.attention import merge_heads, split_heads
from tinygpt.positions import apply_rope

FP8_MAX = 448.0                          # torch.finfo(torch.float8_e4m3fn).max


# --------------------------------------------------------------------------------------------
# bytes per token by layout


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache shape.

    n_layers; n_kv_heads and head_dim for MHA / GQA / MQA layers (2 x n_kv_heads x head_dim
    numbers per token and layer); latent > 0 for MLA (kv_lora_rank + qk_rope_head_dim numbers
    per token and layer, n_kv_heads and head_dim unused); local_layers of the n_layers hold only
    the last `window` tokens (hybrid local/global; 0 with window None: every layer is global).
    A window and local_layers come together: one without the other is refused.
    """

    name: str
    n_layers: int
    n_kv_heads: int = 0
    head_dim: int = 0
    latent: int = 0
    window: int | None = None
    local_layers: int = 0

    def __post_init__(self) -> None:
        for field in ("n_layers", "n_kv_heads", "head_dim", "latent", "local_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be at least 1, got {self.n_layers}")
        if (self.latent > 0) == (self.n_kv_heads > 0 and self.head_dim > 0):
            raise ValueError("give either latent > 0 (MLA) or n_kv_heads and head_dim > 0, "
                             f"not both or neither: {self}")
        if self.local_layers > self.n_layers:
            raise ValueError(f"local_layers ({self.local_layers}) cannot exceed n_layers "
                             f"({self.n_layers})")
        if self.window is None:
            if self.local_layers:
                raise ValueError("local_layers > 0 needs a window")
        elif isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be None or an integer >= 1, got {self.window!r}")
        elif not self.local_layers:
            raise ValueError(f"window {self.window} needs local_layers >= 1 (the layers it "
                             "applies to); with local_layers 0 give window None")

    @property
    def numbers_per_layer(self) -> int:
        """Cached numbers per token in one layer."""
        return self.latent if self.latent else 2 * self.n_kv_heads * self.head_dim


# Published shapes (each model's config.json); the MHA and MQA rows are Llama-3-8B's shape with
# 32 KV heads (one per query head) or one, to compare layouts on one model.
LAYOUTS = {
    "llama-3-8b (GQA)": KVLayout("llama-3-8b (GQA)", 32, n_kv_heads=8, head_dim=128),
    "llama-3-8b as MHA": KVLayout("llama-3-8b as MHA", 32, n_kv_heads=32, head_dim=128),
    "llama-3-8b as MQA": KVLayout("llama-3-8b as MQA", 32, n_kv_heads=1, head_dim=128),
    "llama-2-70b (GQA)": KVLayout("llama-2-70b (GQA)", 80, n_kv_heads=8, head_dim=128),
    "deepseek-v3 (MLA)": KVLayout("deepseek-v3 (MLA)", 61, latent=512 + 64),
    "gemma-3-27b (5 local : 1 global)": KVLayout("gemma-3-27b (5 local : 1 global)", 62,
                                                 n_kv_heads=16, head_dim=128, window=1024,
                                                 local_layers=52),
}


def kv_bytes(layout: KVLayout, context: int, dtype_bytes: int = 2) -> int:
    """Bytes of one sequence's KV cache at `context` tokens: global layers hold every token,
    local layers min(context, window)."""
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
    for name, value, low in (("context", context, 0), ("dtype_bytes", dtype_bytes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    held = (layout.n_layers - layout.local_layers) * context
    if layout.local_layers:
        held += layout.local_layers * min(context, layout.window)
    return held * layout.numbers_per_layer * dtype_bytes


# --------------------------------------------------------------------------------------------
# a long text


def long_text(tokenizer, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """(n_tokens,) int64 ids: the course's synthetic stories (tinygpt.corpus), as many as it
    takes, tokenized by `tokenizer` (anything with encode(text) -> list of ids) and cut."""
    from tinygpt.corpus import generate_corpus

    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2:
        raise ValueError(f"n_tokens must be an integer >= 2, got {n_tokens!r}")
    stories = max(1, n_tokens // 8)
    while True:
        ids = tokenizer.encode(generate_corpus(stories, seed))
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
        stories *= 2


# --------------------------------------------------------------------------------------------
# attention sinks


def _check_ids(ids: torch.Tensor, minimum: int = 2) -> None:
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype != torch.long:
        raise ValueError("ids must be a 1-D int64 tensor of token ids")
    if ids.numel() < minimum:
        raise ValueError(f"ids must hold at least {minimum} tokens, got {ids.numel()}")


def _check_streaming(model, window: int | None, sinks: int) -> None:
    from tinygpt.model import TinyGPT

    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a tinygpt TinyGPT, got {type(model).__name__}")
    cfg = model.cfg
    if cfg.attention != "gqa" or cfg.sliding_window:
        raise ValueError("streaming evaluation runs models of plain grouped-query attention "
                         "(cfg.attention 'gqa', no sliding_window of their own)")
    if dict(cfg.rope_scaling).get("rope_type") == "dynamic":
        raise ValueError("dynamic RoPE scaling changes the frequencies with the length: not "
                         "supported by streaming evaluation")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}")
    if window is None:
        if sinks:
            raise ValueError("sinks need a window (window=None is full attention)")
    elif isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None (full attention) or an integer >= 1, "
                         f"got {window!r}")


def _visible(t: torch.Tensor, lo: torch.Tensor, n_keys: int, first: int) -> torch.Tensor:
    """(T_q, n_keys) bool: key index first + j is visible to query t when lo <= it <= t."""
    keys = first + torch.arange(n_keys, device=t.device)
    return (keys[None, :] >= lo[:, None]) & (keys[None, :] <= t[:, None])


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _unrotated_qkv(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's queries (1, H, T, d), keys and values (1, H_kv, T, d) of x (1, T, D), q and k
    normalized per head when the model does that (Qwen3) but not rotated: the cache rotates
    them at the positions it gives them."""
    att = block.attention
    h = block.attention_norm(x)
    q = split_heads(att.wq(h), att.n_heads)
    k = split_heads(att.wk(h), att.n_kv_heads)
    if att.q_norm is not None:
        q, k = att.q_norm(q), att.k_norm(k)
    return q, k, split_heads(att.wv(h), att.n_kv_heads)


def _finish_block(block, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The rest of Block.forward once attention gave y (1, H, T, d): output projection,
    residual, feed-forward, residual."""
    h = x + block.attention.wo(merge_heads(y))
    return h + block.feed_forward(block.ffn_norm(h))


def _attend(q_parts, k_parts, v_parts, masks, n_rep: int) -> torch.Tensor:
    """One softmax over several key blocks, each scored with its own rotation of the queries.
    q_parts[i] (1, H, T, d); k_parts[i], v_parts[i] (1, H_kv, n_i, d); masks[i] (T, n_i)."""
    scale = 1.0 / math.sqrt(q_parts[0].shape[-1])
    scores = [torch.matmul(q, k.repeat_interleave(n_rep, 1).transpose(-1, -2)) * scale
              for q, k in zip(q_parts, k_parts, strict=True)]
    scores = torch.cat([s.masked_fill(~m, float("-inf"))
                        for s, m in zip(scores, masks, strict=True)], -1)
    probs = torch.softmax(scores, dim=-1)
    values = torch.cat([v.repeat_interleave(n_rep, 1) for v in v_parts], 2)
    return torch.matmul(probs, values)


class StreamingLM:
    """A TinyGPT run under StreamingLLM's cache, a chunk of tokens at a time.

    StreamingLM(model, window=W, sinks=S) keeps, per layer, the first S tokens' keys and
    values and the last W ones' (window=None: every token), un-rotated; `forward(ids)` runs the
    next T tokens (positions length .. length + T - 1 of the stream) and returns their logits
    (T, vocab), each query seeing the sinks at their cache distance and the window at its text
    distance (module docstring). Memory: S + W + T keys per layer, however long the stream.
    `streaming_nll` and `streaming_generate` are built on it; `streaming_nll_loop` is its
    oracle.
    """

    def __init__(self, model, *, window: int | None, sinks: int = 0) -> None:
        _check_streaming(model, window, sinks)
        self.model, self.window, self.sinks = model, window, sinks
        cfg = model.cfg
        self.device = model.tok_embeddings.weight.device
        empty = torch.empty(1, cfg.n_kv_heads, 0, cfg.head_dim, device=self.device,
                            dtype=model.tok_embeddings.weight.dtype)
        n = len(model.layers)
        self.sink_k, self.sink_v = [empty] * n, [empty] * n     # the sinks, un-rotated
        self.keep_k, self.keep_v = [empty] * n, [empty] * n     # window keys kept_from ..
        self.kept_from, self.length = sinks, 0

    def positions_needed(self, n_new: int) -> int:
        """RoPE table rows a forward of n_new tokens uses (at most)."""
        if self.window is None:
            return self.length + n_new
        return max(self.sinks + self.window, self.window + n_new - 1)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64, the stream's next tokens -> logits (T, vocab), in the model's dtype
        promoted to at least float32."""
        if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype != torch.long \
                or ids.numel() == 0:
            raise ValueError("ids must be a non-empty 1-D int64 tensor of token ids")
        model, sinks = self.model, self.sinks
        if self.positions_needed(ids.numel()) > model.cfg.max_seq_len:
            raise ValueError(f"a forward of {ids.numel()} tokens here uses "
                             f"{self.positions_needed(ids.numel())} RoPE positions, past the "
                             f"model's max_seq_len {model.cfg.max_seq_len} (full attention "
                             f"cannot stream past it: give a window, or fewer tokens per call)")
        a, b = self.length, self.length + ids.numel()
        horizon = b + 1 if self.window is None else self.window      # None: every key
        cos_table, sin_table = model.rope_cos, model.rope_sin
        n_rep = model.cfg.n_heads // model.cfg.n_kv_heads
        t = torch.arange(a, b, device=self.device)
        lo = torch.clamp(t - horizon + 1, min=sinks)        # the window's oldest visible key
        first = min(max(sinks, a - horizon + 1), b)         # oldest window key read here
        offset = min(first, a)                              # rotate at position - offset >= 0
        sink_pos = torch.clamp(t, max=sinks + horizon - 1)  # a query's position for the sinks
        wpos = torch.arange(first, b, device=self.device) - offset
        keep_from = max(sinks, b - horizon + 1, first)      # the next call's oldest window key
        past_sinks = max(sinks - a, 0)                      # this call's rows that are sinks
        x = model.tok_embeddings(ids.to(self.device))[None]
        for layer, block in enumerate(model.layers):
            q, k, v = _unrotated_qkv(block, x)
            if past_sinks:
                self.sink_k[layer] = torch.cat([self.sink_k[layer], k[:, :, :past_sinks]], 2)
                self.sink_v[layer] = torch.cat([self.sink_v[layer], v[:, :, :past_sinks]], 2)
            k_win = torch.cat([self.keep_k[layer], k[:, :, past_sinks:]], 2)
            v_win = torch.cat([self.keep_v[layer], v[:, :, past_sinks:]], 2)
            drop = first - self.kept_from                   # keys no query here reads
            k_win, v_win = k_win[:, :, drop:], v_win[:, :, drop:]
            q_parts = [apply_rope(q, cos_table[t - offset], sin_table[t - offset])]
            k_parts = [apply_rope(k_win, cos_table[wpos], sin_table[wpos])]
            v_parts, masks = [v_win], [_visible(t, lo, b - first, first)]
            n_s = self.sink_k[layer].shape[2]
            if n_s:
                spos = torch.arange(n_s, device=self.device)
                q_parts.append(apply_rope(q, cos_table[sink_pos], sin_table[sink_pos]))
                k_parts.append(apply_rope(self.sink_k[layer], cos_table[spos], sin_table[spos]))
                v_parts.append(self.sink_v[layer])
                masks.append(spos[None, :] <= t[:, None])
            y = _attend(q_parts, k_parts, v_parts, masks, n_rep)
            x = _finish_block(block, x, y)
            self.keep_k[layer] = k_win[:, :, keep_from - first:]
            self.keep_v[layer] = v_win[:, :, keep_from - first:]
        self.kept_from, self.length = keep_from, b
        return _at_least_float32(model.output(model.norm(x))[0])


def streaming_nll(model, ids: torch.Tensor, *, window: int | None, sinks: int = 0,
                  chunk: int = 256) -> torch.Tensor:
    """Teacher-forced next-token losses of `ids` (T,) under a StreamingLLM cache.

    Returns (T - 1,) float32 (float64 for a float64 model): entry t is -log p(ids[t+1] | what
    the cache holds at t), natural log. The cache holds the first `sinks` tokens and the last
    `window` ones (window=None: every token, plain causal attention; sinks=0: window only);
    positions are numbered inside the cache (module docstring). Queries go `chunk` at a time
    through StreamingLM.forward; the result does not depend on `chunk` beyond float rounding.
    The model runs in its own dtype (float32 for SmolLM2).
    """
    _check_ids(ids)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    lm = StreamingLM(model, window=window, sinks=sinks)
    n = ids.numel()
    need = n - 1 if window is None else lm.positions_needed(min(chunk, n - 1))
    if need > model.cfg.max_seq_len:
        raise ValueError(f"the cache spans {need} positions (the text's length, or less: "
                         f"max(sinks + window, window + chunk - 1)), past the model's "
                         f"max_seq_len {model.cfg.max_seq_len}")
    losses = []
    for a in range(0, n - 1, chunk):
        b = min(a + chunk, n - 1)
        logits = lm.forward(ids[a:b])
        losses.append(nnf.cross_entropy(logits, ids[a + 1:b + 1].to(logits.device),
                                        reduction="none"))
    return torch.cat(losses).cpu()


def streaming_generate(model, prompt_ids, params, *, window: int, sinks: int = 4,
                       eos_id: int | None = None, chunk: int = 256,
                       generator: torch.Generator | None = None) -> list[int]:
    """Generate past the model's context with StreamingLLM's cache (sinks + window): the
    prompt in chunks, then one token per step, sampled with tinygpt.sampling (params: a
    SamplingParams; penalties are not applied). Returns the new ids (a final EOS included).
    Memory stays at sinks + window keys per layer however many tokens it generates; with a
    window at least the prompt plus the new tokens it is generate()'s greedy output."""
    from tinygpt.sampling import SamplingParams, sample_next_token

    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if window is None:
        raise ValueError("streaming_generate needs a window (an integer >= 1)")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    _check_ids(prompt, minimum=1)
    lm = StreamingLM(model, window=window, sinks=sinks)
    step = max(1, min(chunk, model.cfg.max_seq_len - window + 1))
    for a in range(0, prompt.numel(), step):
        logits = lm.forward(prompt[a:a + step])
    new: list[int] = []
    while len(new) < params.max_new_tokens:
        token = int(sample_next_token(logits[-1:], params, generator)[0])
        new.append(token)
        if token == eos_id:
            break
        logits = lm.forward(torch.tensor([token]))
    return new


@torch.no_grad()
def streaming_logits_loop(model, ids: torch.Tensor, *, window: int | None,
                          sinks: int = 0) -> torch.Tensor:
    """Logits (T, vocab) of every position of `ids` under StreamingLLM's cache, one token at a
    time, the plain way: an explicit cache of un-rotated keys (the sinks, then the window; the
    oldest non-sink key evicted when it is full), every key and the query rotated at their
    index in the cache on every step. The oracle of StreamingLM, O(T x cache)."""
    _check_ids(ids)
    _check_streaming(model, window, sinks)
    cfg, n = model.cfg, ids.numel()
    if (n if window is None else sinks + window) > cfg.max_seq_len:
        raise ValueError(f"the cache spans more than the model's max_seq_len {cfg.max_seq_len}")
    capacity = n if window is None else sinks + window
    n_rep = cfg.n_heads // cfg.n_kv_heads
    cos_table, sin_table = model.rope_cos, model.rope_sin
    cache_k = [[] for _ in model.layers]           # per layer: (H_kv, d) un-rotated, in order
    cache_v = [[] for _ in model.layers]
    rows = []
    for t in range(n):
        x = model.tok_embeddings(ids[t:t + 1])[None]
        for layer, block in enumerate(model.layers):
            q, k, v = _unrotated_qkv(block, x)
            if len(cache_k[layer]) == capacity:            # evict the oldest non-sink token
                del cache_k[layer][sinks], cache_v[layer][sinks]
            cache_k[layer].append(k[0, :, 0])
            cache_v[layer].append(v[0, :, 0])
            size = len(cache_k[layer])
            pos = torch.arange(size)
            k_all = apply_rope(torch.stack(cache_k[layer], 1)[None], cos_table[pos], sin_table[pos])
            q_rot = apply_rope(q, cos_table[size - 1:size], sin_table[size - 1:size])
            y = _attend([q_rot], [k_all], [torch.stack(cache_v[layer], 1)[None]],
                        [torch.ones(1, size, dtype=torch.bool)], n_rep)
            x = _finish_block(block, x, y)
        rows.append(_at_least_float32(model.output(model.norm(x))[0]))
    return torch.cat(rows)


def streaming_nll_loop(model, ids: torch.Tensor, *, window: int | None,
                       sinks: int = 0) -> torch.Tensor:
    """streaming_nll from streaming_logits_loop: the oracle of the chunked evaluation."""
    logits = streaming_logits_loop(model, ids, window=window, sinks=sinks)
    return nnf.cross_entropy(logits[:-1], ids[1:], reduction="none")


def perplexity(nll: torch.Tensor, start: int = 0, stop: int | None = None) -> float:
    """exp of the mean of nll[start:stop] (losses from streaming_nll: entry t predicts t+1)."""
    part = nll[start:stop]
    if part.numel() == 0:
        raise ValueError(f"no losses in [{start}, {stop}) of {nll.numel()}")
    return math.exp(part.double().mean().item())


# --------------------------------------------------------------------------------------------
# fp8 (e4m3) KV with one scale per head


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, T, d) float -> (x_q float8_e4m3fn (B, H, T, d), scale float32 (B, H, 1, 1)).

    scale None: each head's max |x| over its tokens and channels / 448 (a head of zeros gets
    scale 1). A given scale (B, H, 1, 1), e.g. calibrated on earlier tokens, must cover x:
    ValueError when some |x| / scale exceeds 448 (torch's cast would saturate it silently)."""
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or not x.is_floating_point():
        raise ValueError("x must be a floating (B, H, T, head_dim) tensor")
    if scale is None:
        amax = x.detach().abs().amax(dim=(2, 3), keepdim=True).float()
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    else:
        if scale.shape != (x.shape[0], x.shape[1], 1, 1):
            raise ValueError(f"scale must have shape {(x.shape[0], x.shape[1], 1, 1)}, got "
                             f"{tuple(scale.shape)}")
        worst = (x.float().abs() / scale).amax().item()
        if not worst <= FP8_MAX:
            raise ValueError(f"x exceeds the scale's range: max |x| / scale = {worst:.4g} > "
                             f"{FP8_MAX:g} (calibrate the scale on data at least this large)")
    x_q = (x.float() / scale).to(torch.float8_e4m3fn)
    return x_q, scale.float()


def dequantize_kv_fp8(x_q: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_kv_fp8, up to its rounding: x_q * scale in `dtype`."""
    if x_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_q must be float8_e4m3fn, got {x_q.dtype}")
    return (x_q.float() * scale).to(dtype)


def kv_bytes_per_token_quantized(n_layers: int, n_kv_heads: int, head_dim: int, kind: str,
                                 context: int) -> float:
    """Bytes per token of a GQA cache at `context` tokens, scales included: "bf16" (2 B per
    number), "int8" (1 B plus a float32 scale per token and head, day 15) or "fp8" (1 B plus a
    float32 scale per head, paid once per sequence and spread over its tokens)."""
    kinds = ("bf16", "int8", "fp8")
    if kind not in kinds:
        raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be an integer >= 1, got {context!r}")
    numbers = 2 * n_layers * n_kv_heads * head_dim           # keys and values
    if kind == "bf16":
        return 2.0 * numbers
    if kind == "int8":
        return numbers + 2 * n_layers * n_kv_heads * 4
    return numbers + 2 * n_layers * n_kv_heads * 4 / context
