"""Padded batches (tinygpt/batching.py) against batch-1 generate: left padding, the key-padding
mask, position ids counting real tokens, per-row stopping and per-row seeded sampling; and the
wrong variants (no padding mask, positions counted from the padded start) that must differ."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinygpt import load_pretrained
from tinygpt.batching import (
    attention_mask,
    forward_padded,
    generate_batch,
    left_pad,
    position_ids,
)
from tinygpt.generate import generate
from tinygpt.kv_cache import KVCache
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams

CFG = ModelConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                  max_seq_len=128)


def prompts_of(lengths, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_left_padding_masks_and_positions():
    ids, mask = left_pad([[5, 6], [1, 2, 3, 4]], pad_id=0)
    assert ids.tolist() == [[0, 0, 5, 6], [1, 2, 3, 4]]
    assert mask.tolist() == [[False, False, True, True], [True] * 4]
    assert position_ids(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    allowed = attention_mask(mask, 4)[0, 0]
    assert allowed[0].tolist() == [True, False, True, True]     # a pad query sees itself
    assert allowed[3].tolist() == [False, False, True, True]    # real queries: no pads


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_greedy_rows_equal_batch_one_generate(n_kv_heads):
    model = TinyGPT(dataclasses.replace(CFG, n_kv_heads=n_kv_heads), seed=1).eval()
    prompts = prompts_of([3, 17, 1, 9, 12])
    params = SamplingParams(temperature=0, max_new_tokens=20)
    got = generate_batch(model, prompts, params)
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == generate(model, prompt, params).token_ids
        assert result.prompt_ids == prompt and result.stop_reason == "length"


def test_rows_stop_on_their_own():
    model, tokenizer = load_pretrained()
    eos = tokenizer.special_tokens["<|endoftext|>"]
    prompts = [tokenizer.encode(s) for s in ("The cat sat on the", "Once upon a time", "A")]
    params = [SamplingParams(temperature=0, max_new_tokens=40),
              SamplingParams(temperature=0, max_new_tokens=3),
              SamplingParams(temperature=0, max_new_tokens=40, stop=("was",))]
    got = generate_batch(model, prompts, params, eos_id=eos, tokenizer=tokenizer)
    for prompt, p, result in zip(prompts, params, got, strict=True):
        want = generate(model, prompt, p, eos_id=eos, tokenizer=tokenizer)
        assert (result.token_ids, result.stop_reason, result.text) == (
            want.token_ids, want.stop_reason, want.text)
    assert got[0].stop_reason == "eos" and got[2].stop_reason == "stop_string"
    assert len(got[1].token_ids) <= 3


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch_mates():
    model = TinyGPT(CFG, seed=2).eval()
    mine = prompts_of([6])[0]
    p = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=15, seed=42)
    alone = generate_batch(model, [mine], p)[0].token_ids
    crowd = generate_batch(model, [prompts_of([11], seed=5)[0], mine, prompts_of([2])[0]],
                           [SamplingParams(temperature=0.7, max_new_tokens=15, seed=1), p,
                            SamplingParams(temperature=0, max_new_tokens=15)])
    assert crowd[1].token_ids == alone


def test_without_the_padding_mask_or_with_right_padding_a_short_row_goes_wrong():
    model, tokenizer = load_pretrained()            # trained: it cares what it attends to
    prompts = [tokenizer.encode("The cat"), tokenizer.encode("Once upon a time there was a dog")]
    ids, mask = left_pad(prompts)
    with torch.inference_mode():
        alone = model(torch.tensor([prompts[0]]))[0, -1]

    def last_logits(key_mask, positions):
        cache = KVCache.for_model(model, 2, max_len=ids.shape[1])
        return forward_padded(model, ids, positions, key_mask, cache)[0, -1]

    torch.testing.assert_close(last_logits(mask, position_ids(mask)), alone, rtol=1e-4,
                               atol=1e-4)
    assert not torch.allclose(last_logits(torch.ones_like(mask), position_ids(mask)), alone,
                              atol=1e-2), "attending to the pads must change the result"
    # RoPE sees only relative offsets: shifting a masked row's positions changes nothing
    torch.testing.assert_close(last_logits(mask, torch.arange(ids.shape[1]).expand_as(ids)),
                               alone, rtol=1e-4, atol=1e-4)

    # right padding, positions = column: the next token lands after the pads, a gap in RoPE
    short, width = prompts[0], ids.shape[1]
    right = torch.tensor([short + [0] * (width - len(short))])
    right_mask = torch.tensor([[True] * len(short) + [False] * (width - len(short))])
    token = int(torch.argmax(alone))
    with torch.inference_mode():
        want = model(torch.tensor([short + [token]]))[0, -1]
        cache = KVCache.for_model(model, 1, max_len=width + 1)
        forward_padded(model, right, torch.arange(width)[None], right_mask, cache)
        gap = forward_padded(model, torch.tensor([[token]]), torch.tensor([[width]]),
                             torch.cat([right_mask, torch.ones(1, 1, dtype=torch.bool)], 1),
                             cache)[0, -1]
    assert not torch.allclose(gap, want, atol=1e-2)


def test_bad_input_is_named():
    model = TinyGPT(CFG, seed=0).eval()
    p = SamplingParams(temperature=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty list"):
        generate_batch(model, [], p)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        generate_batch(model, [[1], []], p)
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        generate_batch(model, ["text"], p)
    with pytest.raises(ValueError, match="one per"):
        generate_batch(model, [[1], [2]], [p])
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_batch(model, [[1] * 126], SamplingParams(temperature=0, max_new_tokens=4))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        generate_batch(model, [[1, 97]], p)
    with pytest.raises(ValueError, match="tokenizer"):
        generate_batch(model, [[1]], SamplingParams(max_new_tokens=2, stop=("x",)))
