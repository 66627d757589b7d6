"""Day 13: batching. Many sequences per forward pass, so each weight read serves many tokens.

Prompts have different lengths, and a batch is a rectangle. Left padding puts every prompt's
last token in the last column, so one decode step appends one column for all rows:

    row 0   .   .   The cat  sat        mask  0 0 1 1 1      positions  0 0 0 1 2
    row 1   A  big  dog  ran  off             1 1 1 1 1                 0 1 2 3 4

Three things keep each row's result equal to running it alone:
- a key-padding mask: no query attends to a pad (combined with the causal mask; each pad query
  still sees its own position, so its softmax has something to normalise and stays finite);
- position ids that count only real tokens, so RoPE turns row 0's "The" by position 0, as it
  would unpadded (with the pads masked, RoPE's scores depend only on relative offsets, so a
  constant shift would cancel; counting real tokens keeps every position inside the model's
  window, and it is what models with absolute positions need);
- per-row sampling: one seeded generator per request, so a row's draws do not depend on what
  it was batched with.

`generate_batch` runs that loop over day 11's KVCache (one shared write offset; the padding
mask grows by a real column each step) and the model's own layers. A finished row stops
producing output (its extra tokens are dropped) while the others continue.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinygpt.attention import grouped_query_attention, merge_heads
from tinygpt.generate import GenerationResult, find_stop, model_device
from tinygpt.kv_cache import KVCache
from tinygpt.model import TinyGPT
from tinygpt.sampling import SamplingParams, sample_next_token


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ids (B, T) long and a mask (B, T) bool, True on real tokens.
    T is the longest prompt's length."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence | torch.Tensor):
            raise TypeError(f"prompts[{i}] must be a list of token ids, got "
                            f"{type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only: (B, T) bool -> (B, T) long, 0 at each row's first
    real token (pads get 0 too; nothing attends to them)."""
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def attention_mask(key_mask: torch.Tensor, n_queries: int) -> torch.Tensor:
    """(B, 1, T_q, T_k) bool: query i (the last T_q key positions) may see key j when j is a
    real token or j is its own position. The causal part is applied by the attention call."""
    batch, n_keys = key_mask.shape
    own = torch.zeros(n_queries, n_keys, dtype=torch.bool, device=key_mask.device)
    own[torch.arange(n_queries), torch.arange(n_keys - n_queries, n_keys)] = True
    return (key_mask[:, None, None, :] | own[None, None]).expand(batch, 1, n_queries, n_keys)


@torch.inference_mode()
def forward_padded(model: TinyGPT, ids: torch.Tensor, positions: torch.Tensor,
                   key_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The model's layers over a padded batch with a cache: ids, positions (B, T) long;
    key_mask (B, cache.length + T) bool over every cached and new position. Writes the new
    keys and values at cache.length and returns logits (B, T, V)."""
    start = cache.check_step(ids.shape[0], ids.shape[1], ids.device,
                             model.tok_embeddings.weight.dtype)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]       # (B, T, head_dim)
    mask = attention_mask(key_mask, ids.shape[1])
    x = model.tok_embeddings(ids)
    for layer, layer_cache in zip(model.layers, cache.layers, strict=True):
        attn = layer.attention
        q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)
        k, v = layer_cache.update(k, v, start)
        y = grouped_query_attention(q, k, v, causal=True, mask=mask)
        x = x + attn.wo(merge_heads(y))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    cache.advance(ids.shape[1])
    return model.output(model.norm(x))


def _params_per_row(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence) or len(params) != n or not all(
            isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"params must be one SamplingParams or a list of {n} (one per "
                         f"prompt), got {params!r}")
    return list(params)


@torch.inference_mode()
def generate_batch(model: TinyGPT, prompts: Sequence[Sequence[int]],
                   params: SamplingParams | Sequence[SamplingParams], *,
                   eos_id: int | None = None, tokenizer=None) -> list[GenerationResult]:
    """Generate for every prompt in one left-padded batch; returns a GenerationResult per
    prompt, in order. params: one SamplingParams for all or one per prompt (each row stops on
    its own max_new_tokens, eos_id and stop strings; stop strings need `tokenizer`). At
    temperature 0 each row's tokens equal tinygpt.generate.generate's for that prompt alone.
    """
    rows = _params_per_row(params, len(prompts) if isinstance(prompts, Sequence) else 0)
    ids, mask = left_pad(prompts)
    vocab, window = model.cfg.vocab_size, model.cfg.max_seq_len
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ValueError(f"token ids must be in [0, {vocab})")
    steps = max(p.max_new_tokens for p in rows)
    if ids.shape[1] + steps - 1 > window:
        raise ValueError(f"the longest prompt ({ids.shape[1]}) plus max_new_tokens ({steps}) "
                         f"- 1 exceeds max_seq_len={window}")
    if any(p.stop for p in rows) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (decode) to be matched")
    device = model_device(model)
    ids, mask = ids.to(device), mask.to(device)
    generators = [torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None
                  else None for p in rows]
    cache = KVCache.for_model(model, len(rows), max_len=ids.shape[1] + steps)
    logits = forward_padded(model, ids, position_ids(mask), mask, cache)[:, -1]
    next_pos = mask.sum(dim=1)                          # each row's next position (B,)
    prompt_lists = [list(map(int, p)) for p in prompts]
    out: list[list[int]] = [[] for _ in rows]
    reasons: list[str | None] = [None] * len(rows)
    texts: list[str | None] = [None] * len(rows)
    for _ in range(steps):
        tokens = torch.zeros(len(rows), dtype=torch.long, device=device)
        for i, p in enumerate(rows):
            if reasons[i] is not None:
                continue
            generated = torch.tensor([out[i]], dtype=torch.long, device=device)
            prompt_t = torch.tensor([prompt_lists[i]], dtype=torch.long, device=device)
            tokens[i] = sample_next_token(logits[i:i + 1], p, generators[i], prompt_ids=prompt_t,
                                          generated_ids=generated)[0]
            out[i].append(int(tokens[i]))
            reasons[i] = _finished(out[i], p, eos_id, tokenizer, texts, i)
        if all(r is not None for r in reasons):
            break
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool, device=device)], 1)
        logits = forward_padded(model, tokens[:, None], next_pos[:, None], mask, cache)[:, -1]
        next_pos = next_pos + 1
    return [GenerationResult(prompt_lists[i], out[i], reasons[i] or "length",
                             texts[i] if tokenizer is not None else None)
            for i in range(len(rows))]


def _finished(tokens: list[int], params: SamplingParams, eos_id, tokenizer, texts, i
              ) -> str | None:
    """Why a row stops after its newest token (None: it goes on); keeps texts[i] current."""
    if tokenizer is not None:
        body = tokens[:-1] if tokens[-1] == eos_id else tokens
        text = tokenizer.decode(body)
        cut = find_stop(text, params.stop)
        texts[i] = text if cut is None else text[:cut]
        if cut is not None:
            return "stop_string"
    if tokens[-1] == eos_id:
        return "eos"
    if len(tokens) == params.max_new_tokens:
        return "length"
    return None
