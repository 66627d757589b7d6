"""Tests of tinygpt.attention (day 04): masks, SDPA in NumPy and torch, heads, GQA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinygpt.attention import (
    attention_weights,
    causal_mask,
    causal_mask_bool,
    grouped_query_attention,
    merge_heads,
    repeat_kv,
    scaled_dot_product_attention,
    sdpa_numpy,
    split_heads,
)

INF = float("-inf")


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------------
# masks


def test_causal_mask_hand_values():
    m = causal_mask(3)
    assert m.shape == (3, 3) and m.dtype == torch.float32
    assert m.tolist() == [[0, INF, INF], [0, 0, INF], [0, 0, 0]]
    assert causal_mask_bool(3).tolist() == [[True, False, False], [True, True, False],
                                            [True, True, True]]
    assert causal_mask(1).tolist() == [[0.0]]
    assert causal_mask(2, dtype=torch.float64).dtype == torch.float64


def test_causal_mask_with_query_offset_is_bottom_right():
    # 2 queries that are the last 2 of 4 positions: they sit at positions 2 and 3
    assert causal_mask(2, 4).tolist() == [[0, 0, 0, INF], [0, 0, 0, 0]]
    assert causal_mask_bool(1, 5).tolist() == [[True] * 5]      # one decode step sees everything
    # the rectangle is exactly the last rows of the square mask
    for t_q, t_k in [(1, 6), (3, 6), (6, 6)]:
        torch.testing.assert_close(causal_mask(t_q, t_k), causal_mask(t_k)[t_k - t_q :])
        # query i sits at absolute position i + t_k - t_q and sees keys up to there
        ref = [[j <= i + t_k - t_q for j in range(t_k)] for i in range(t_q)]
        assert causal_mask_bool(t_q, t_k).tolist() == ref


@pytest.mark.parametrize("args", [(0,), (3, 2), (2.0,), (2, 0), (True,)])
def test_causal_mask_rejects_bad_lengths(args):
    with pytest.raises(ValueError, match="t_"):
        causal_mask(*args)


# ------------------------------------------------------------------------------------------
# NumPy SDPA


def test_sdpa_numpy_hand_example():
    # one query, two keys with equal scores -> average of the two values
    q = np.array([[1.0, 0.0]])
    k = np.array([[0.0, 1.0], [0.0, -1.0]])
    v = np.array([[2.0, 4.0], [4.0, 8.0]])
    np.testing.assert_allclose(sdpa_numpy(q, k, v), [[3.0, 6.0]])
    # keys differing by score 2*sqrt(2)/sqrt(2) = 2: weights softmax([2, 0])... check by hand
    q = np.array([[math.sqrt(2), 0.0]])
    k = np.array([[2.0, 0.0], [0.0, 0.0]])
    w = np.exp([2.0, 0.0]) / np.exp([2.0, 0.0]).sum()
    np.testing.assert_allclose(sdpa_numpy(q, k, v), [w @ v])


def test_sdpa_numpy_matches_torch_sdpa():
    q, k, v = randn(2, 3, 5, 4, seed=1), randn(2, 3, 5, 4, seed=2), randn(2, 3, 5, 6, seed=3)
    ref = F.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(sdpa_numpy(q.numpy(), k.numpy(), v.numpy()), ref.numpy(),
                               rtol=1e-10, atol=1e-12)
    ref_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = sdpa_numpy(q.numpy(), k.numpy(), v.numpy(), mask=causal_mask(5).numpy())
    np.testing.assert_allclose(out, ref_causal.numpy(), rtol=1e-10, atol=1e-12)
    out_bool = sdpa_numpy(q.numpy(), k.numpy(), v.numpy(), mask=causal_mask_bool(5).numpy())
    np.testing.assert_allclose(out_bool, ref_causal.numpy(), rtol=1e-10, atol=1e-12)


def test_sdpa_numpy_is_stable_for_large_scores():
    q = np.array([[1000.0, 0.0]])
    k = np.array([[1000.0, 0.0], [0.0, 0.0]])
    v = np.array([[1.0], [2.0]])
    out = sdpa_numpy(q, k, v)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, [[1.0]])


def test_sdpa_numpy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="last dimension"):
        sdpa_numpy(np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="T_k"):
        sdpa_numpy(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((3, 3)))


# ------------------------------------------------------------------------------------------
# torch SDPA


def test_attention_weights_properties():
    q, k = randn(1, 2, 4, 8, seed=4), randn(1, 2, 4, 8, seed=5)
    w = attention_weights(q, k)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 4, dtype=torch.float64))
    assert torch.all(w.triu(diagonal=1) == 0)
    assert torch.all(w[..., causal_mask_bool(4)] > 0)
    assert w[0, 0, 0, 0] == 1.0                          # the first position only sees itself
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + causal_mask(4, dtype=q.dtype),
                        dim=-1)
    torch.testing.assert_close(w, ref)


def test_attention_weights_keep_float64_and_upcast_half():
    """float64 inputs keep float64 accuracy (a float32 softmax would be ~1e-8 off; day 04's
    exercise 6 compares at atol 1e-10), and half precision still runs its softmax in float32."""
    q, k = randn(2, 3, 5, 8, seed=40), randn(2, 3, 5, 8, seed=41)
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + causal_mask(5, dtype=q.dtype),
                        dim=-1)
    w = attention_weights(q, k)
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, ref, rtol=0, atol=1e-12)
    h = attention_weights(q.to(torch.bfloat16), k.to(torch.bfloat16))
    assert h.dtype == torch.bfloat16
    want = torch.softmax((q.to(torch.bfloat16) @ k.to(torch.bfloat16).transpose(-1, -2)).float()
                         / math.sqrt(8) + causal_mask(5), dim=-1)
    torch.testing.assert_close(h.float(), want, rtol=0, atol=1e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_torch(causal):
    q, k, v = randn(2, 3, 6, 8, seed=6), randn(2, 3, 6, 8, seed=7), randn(2, 3, 6, 5, seed=8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, causal=causal), ref)


def test_sdpa_with_masks_and_scale_matches_torch():
    q, k, v = randn(2, 2, 4, 8, seed=9), randn(2, 2, 7, 8, seed=10), randn(2, 2, 7, 8, seed=11)
    keep = torch.rand(2, 1, 4, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True                                  # no fully masked row
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.5)
    out = scaled_dot_product_attention(q, k, v, causal=False, mask=keep, scale=0.5)
    torch.testing.assert_close(out, ref)
    additive = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, INF)
    out_add = scaled_dot_product_attention(q, k, v, causal=False, mask=additive, scale=0.5)
    torch.testing.assert_close(out_add, ref)
    # causal and a padding mask together = their logical AND
    pad = torch.ones(7, dtype=torch.bool)
    pad[:2] = False
    both = causal_mask_bool(4, 7) & pad
    ref_both = F.scaled_dot_product_attention(q, k, v, attn_mask=both)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, causal=True, mask=pad),
                               ref_both)


def test_sdpa_last_queries_equal_full_attention_rows():
    """The KV-cache situation: the last t_q queries against all keys = the last rows of full
    causal attention. (torch's is_causal aligns top-left here, so it cannot be the reference.)"""
    q, k, v = randn(1, 2, 9, 4, seed=12), randn(1, 2, 9, 4, seed=13), randn(1, 2, 9, 4, seed=14)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for t_q in (1, 3, 9):
        out = scaled_dot_product_attention(q[:, :, -t_q:], k, v, causal=True)
        torch.testing.assert_close(out, full[:, :, -t_q:])
    # one decode step after a 8-token prefix: the last token attends to all 9 keys
    last = scaled_dot_product_attention(q[:, :, -1:], k, v, causal=True)
    torch.testing.assert_close(last, F.scaled_dot_product_attention(q[:, :, -1:], k, v))


def test_sdpa_keeps_low_precision_dtype():
    q = randn(1, 1, 3, 4, seed=15, dtype=torch.float32).to(torch.bfloat16)
    out = scaled_dot_product_attention(q, q, q)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    # bfloat16 rounding, not float32 summation order: 2.8e-3 from the float32 (and float64)
    # result, as torch's own bfloat16 SDPA, on AMD EPYC with AVX-512 2026-11-27 under every
    # simulated CPU setting (half a bfloat16 step at |out| = 2.5 is 7.8e-3); a missing 1/sqrt(d) is
    # off by 0.24, a missing causal mask by 0.84
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_sdpa_rejects_mismatched_shapes():
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="grouped_query_attention"):
        scaled_dot_product_attention(q, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="head_dim"):
        scaled_dot_product_attention(q, torch.zeros(1, 4, 3, 4), torch.zeros(1, 4, 3, 4))
    with pytest.raises(ValueError, match="v must"):
        scaled_dot_product_attention(q, q, torch.zeros(1, 4, 2, 8))
    with pytest.raises(ValueError, match="t_k"):                 # more queries than keys
        scaled_dot_product_attention(q, q[:, :, :2], q[:, :, :2])
    with pytest.raises(TypeError, match="mask"):
        scaled_dot_product_attention(q, q, q, mask=torch.zeros(3, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------
# heads


def test_split_heads_layout_and_merge_roundtrip():
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    h = split_heads(x, 4)
    assert h.shape == (2, 4, 3, 2)
    for head in range(4):
        torch.testing.assert_close(h[:, head], x[:, :, 2 * head : 2 * head + 2])
    torch.testing.assert_close(merge_heads(h), x)
    with pytest.raises(ValueError, match="divisible"):
        split_heads(x, 3)
    with pytest.raises(ValueError, match="B, T, D"):
        split_heads(x[0], 2)
    with pytest.raises(ValueError, match="B, H, T, d"):
        merge_heads(x)


def test_repeat_kv_head_mapping():
    x = randn(2, 3, 4, 5, seed=16)
    out = repeat_kv(x, 2)
    assert out.shape == (2, 6, 4, 5)
    torch.testing.assert_close(out, torch.repeat_interleave(x, 2, dim=1))
    for h in range(6):
        torch.testing.assert_close(out[:, h], x[:, h // 2])
    assert repeat_kv(x, 1) is x
    with pytest.raises(ValueError, match="n_rep"):
        repeat_kv(x, 0)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_gqa_matches_torch_enable_gqa(n_heads, n_kv_heads):
    q = randn(2, n_heads, 5, 8, seed=17)
    k, v = randn(2, n_kv_heads, 5, 8, seed=18), randn(2, n_kv_heads, 5, 8, seed=19)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = grouped_query_attention(q, k, v)
    torch.testing.assert_close(out, ref)
    # and against the manual reference: every query head with its own kv head
    n_rep = n_heads // n_kv_heads
    for h in range(n_heads):
        manual = F.scaled_dot_product_attention(q[:, h], k[:, h // n_rep], v[:, h // n_rep],
                                                is_causal=True)
        torch.testing.assert_close(out[:, h], manual)


def test_gqa_with_query_offset():
    q = randn(1, 4, 7, 8, seed=20)
    k, v = randn(1, 2, 7, 8, seed=21), randn(1, 2, 7, 8, seed=22)
    full = grouped_query_attention(q, k, v)
    torch.testing.assert_close(grouped_query_attention(q[:, :, -2:], k, v), full[:, :, -2:])


def test_gqa_rejects_bad_heads():
    with pytest.raises(ValueError, match="divide"):
        grouped_query_attention(torch.zeros(1, 4, 2, 8), torch.zeros(1, 3, 2, 8),
                                torch.zeros(1, 3, 2, 8))
    with pytest.raises(ValueError, match="same number of heads"):
        grouped_query_attention(torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8),
                                torch.zeros(1, 1, 2, 8))
    with pytest.raises(ValueError, match="B, H, T, d"):
        grouped_query_attention(torch.zeros(4, 2, 8), torch.zeros(2, 2, 8),
                                torch.zeros(2, 2, 8))
