"""Tests of tinygpt.positions (day 03): embeddings, sinusoidal encoding, RoPE."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinygpt.positions import (
    apply_rope,
    embedding_lookup,
    embedding_onehot_matmul,
    one_hot,
    rope_cos_sin,
    rope_inv_freq,
    rope_score,
    rope_wavelengths,
    rotate_half,
    sinusoidal_encoding,
)
from tinygpt.testing import check_float32_error

# ------------------------------------------------------------------------------------------
# embeddings


def test_one_hot_hand_example():
    out = one_hot(np.array([2, 0]), 3)
    np.testing.assert_array_equal(out, [[0, 0, 1], [1, 0, 0]])
    assert out.shape == (2, 3)
    t = one_hot(torch.tensor([[1]]), 2)
    assert t.shape == (1, 1, 2) and t.dtype == torch.float32
    assert t.tolist() == [[[0.0, 1.0]]]


def test_embedding_lookup_equals_onehot_matmul_numpy():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(11, 5))
    ids = rng.integers(0, 11, size=(3, 4))
    rows = embedding_lookup(table, ids)
    assert rows.shape == (3, 4, 5)
    np.testing.assert_allclose(embedding_onehot_matmul(table, ids), rows, rtol=0, atol=1e-12)
    # independent reference: a Python loop over rows
    for b in range(3):
        for t in range(4):
            np.testing.assert_array_equal(rows[b, t], table[ids[b, t]])


def test_embedding_lookup_matches_torch_embedding():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(13, 6, generator=gen)
    ids = torch.randint(0, 13, (2, 7), generator=gen)
    ref = torch.nn.functional.embedding(ids, table)
    torch.testing.assert_close(embedding_lookup(table, ids), ref, rtol=0, atol=0)
    torch.testing.assert_close(embedding_onehot_matmul(table, ids), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [embedding_lookup, embedding_onehot_matmul])
def test_embedding_rejects_bad_ids(fn):
    table = np.zeros((4, 2))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        fn(table, np.array([0, 4]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        fn(table, np.array([-1]))
    with pytest.raises(TypeError, match="integer"):
        fn(table, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        fn(np.zeros(4), np.array([0]))


def test_one_hot_rejects_bad_num_classes():
    with pytest.raises(ValueError, match="num_classes"):
        one_hot(np.array([0]), 0)


# ------------------------------------------------------------------------------------------
# sinusoidal encoding


def test_sinusoidal_hand_values():
    pe = sinusoidal_encoding(3, 4)
    assert pe.shape == (3, 4) and pe.dtype == np.float64
    np.testing.assert_allclose(pe[0], [0.0, 1.0, 0.0, 1.0])
    # position 1: frequencies 1 and 10000^(-2/4) = 0.01
    np.testing.assert_allclose(pe[1], [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)])
    np.testing.assert_allclose(pe[2, 2:], [math.sin(0.02), math.cos(0.02)])


def test_sinusoidal_matches_loop_reference():
    T, d, base = 9, 10, 100.0
    pe = sinusoidal_encoding(T, d, base)
    for p in range(T):
        for i in range(d // 2):
            angle = p / base ** (2 * i / d)
            assert pe[p, 2 * i] == pytest.approx(math.sin(angle), abs=1e-12)
            assert pe[p, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-12)


def test_sinusoidal_shift_is_a_rotation():
    """PE[p + k] is a fixed linear map (block rotation, independent of p) of PE[p]."""
    d, k = 8, 5
    pe = sinusoidal_encoding(40, d)
    inv_freq = 10000.0 ** (-np.arange(0, d, 2) / d)
    for p in (0, 7, 30):
        for i, w in enumerate(inv_freq):
            s, c = pe[p, 2 * i], pe[p, 2 * i + 1]
            rot_s = s * math.cos(k * w) + c * math.sin(k * w)
            rot_c = c * math.cos(k * w) - s * math.sin(k * w)
            np.testing.assert_allclose(pe[p + k, 2 * i : 2 * i + 2], [rot_s, rot_c], atol=1e-12)


@pytest.mark.parametrize("args,match", [
    ((0, 4), "seq_len must be a positive integer, got 0"),
    ((4, 3), "d_model must be even, got 3"),
    ((4, 0), "d_model must be a positive integer, got 0"),
    ((2.0, 4), "seq_len must be a positive integer, got 2.0"),
])
def test_sinusoidal_rejects_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        sinusoidal_encoding(*args)


# ------------------------------------------------------------------------------------------
# RoPE


def test_rope_inv_freq_formula():
    inv = rope_inv_freq(8, base=10000.0)
    assert inv.dtype == torch.float32 and inv.shape == (4,)
    np.testing.assert_allclose(inv.numpy(), [1.0, 0.1, 0.01, 0.001], rtol=1e-6)
    wl = rope_wavelengths(8)
    assert wl[0] == pytest.approx(2 * math.pi, rel=1e-6)
    assert wl[-1] == pytest.approx(2 * math.pi * 1000, rel=1e-5)


def test_rope_cos_sin_shapes_and_values():
    cos, sin = rope_cos_sin(4, 3, base=100.0)
    assert cos.shape == sin.shape == (3, 4)
    torch.testing.assert_close(cos[0], torch.ones(4))
    torch.testing.assert_close(sin[0], torch.zeros(4))
    # head_dim 4, base 100: inv_freq = [1, 0.1], repeated: [1, 0.1, 1, 0.1]
    angles = torch.tensor([2.0, 0.2, 2.0, 0.2])
    torch.testing.assert_close(cos[2], angles.cos())
    torch.testing.assert_close(sin[2], angles.sin())
    # int T and explicit arange(T) agree; arbitrary positions pick the right rows
    cos2, sin2 = rope_cos_sin(4, torch.arange(3), base=100.0)
    torch.testing.assert_close(cos2, cos, rtol=0, atol=0)
    cos3, _ = rope_cos_sin(4, torch.tensor([[2, 0]]), base=100.0)
    assert cos3.shape == (1, 2, 4)
    torch.testing.assert_close(cos3[0, 0], cos[2], rtol=0, atol=0)
    assert rope_cos_sin(4, 3, dtype=torch.float64)[0].dtype == torch.float64


def test_rotate_half_hand_example():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="even"):
        rotate_half(torch.zeros(3))


def test_apply_rope_rotates_pairs_by_hand():
    """head_dim 2: RoPE is the 2-D rotation of (x0, x1) by angle pos * 1."""
    x = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).repeat(1, 1, 3, 1)
    cos, sin = rope_cos_sin(2, 3)
    out = apply_rope(x, cos, sin)[0, 0]
    for p in range(3):
        torch.testing.assert_close(out[p], torch.tensor([math.cos(p), math.sin(p)]))


def test_apply_rope_preserves_norm_and_position_zero():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    cos, sin = rope_cos_sin(8, 5, dtype=torch.float64)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0])
    assert not torch.allclose(out[:, :, 1:], x[:, :, 1:])


def test_apply_rope_per_sequence_positions():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 6, generator=gen)
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    cos, sin = rope_cos_sin(6, pos)
    out = apply_rope(x, cos, sin)
    for b in range(2):
        c, s = rope_cos_sin(6, pos[b])
        torch.testing.assert_close(out[b : b + 1], apply_rope(x[b : b + 1], c, s))


def test_rope_score_depends_only_on_offset():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(16, generator=gen, dtype=torch.float64)
    k = torch.randn(16, generator=gen, dtype=torch.float64)
    for m, n in [(5, 2), (9, 9), (3, 7)]:
        ref = rope_score(q, k, m, n)
        for shift in (1, 10, 123):
            assert rope_score(q, k, m + shift, n + shift) == pytest.approx(ref, abs=1e-9)
    # ...and it does change with the offset (so the test above can fail)
    scores = {rope_score(q, k, 4 + off, 4) for off in range(4)}
    assert len({round(s, 6) for s in scores}) == 4
    # offset 0 gives back the plain dot product
    assert rope_score(q, k, 6, 6) == pytest.approx(float(q @ k), abs=1e-9)


def test_rope_relative_offset_full_score_matrix():
    """q.k^T after RoPE at positions p0 + i, p0 + j is the same matrix for every start p0."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64)

    def scores(start):
        cos, sin = rope_cos_sin(8, torch.arange(start, start + 6), dtype=torch.float64)
        return apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2)

    torch.testing.assert_close(scores(0), scores(17))
    torch.testing.assert_close(scores(0), scores(1000))
    # different positions for q and k only (not a common shift) change the scores
    cos, sin = rope_cos_sin(8, 6, dtype=torch.float64)
    cos2, sin2 = rope_cos_sin(8, torch.arange(1, 7), dtype=torch.float64)
    shifted = apply_rope(q, cos2, sin2) @ apply_rope(k, cos, sin).transpose(-1, -2)
    assert not torch.allclose(shifted, scores(0))


def test_rope_matches_transformers_llama():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )
    from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

    head_dim, theta = 16, 500.0
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": theta})
    rotary = LlamaRotaryEmbedding(config)
    position_ids = torch.tensor([[0, 3, 4, 9, 31], [1, 2, 3, 4, 5]])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 5, head_dim, generator=gen)
    k = torch.randn(2, 2, 5, head_dim, generator=gen)
    hf_cos, hf_sin = rotary(q, position_ids)                       # (B, T, head_dim)
    cos, sin = rope_cos_sin(head_dim, position_ids, base=theta)
    # the same float32 operations as transformers' (theta ** (2i / d) inverted, one rounded
    # product per angle, torch's cos and sin): equal up to an ulp (6e-8), though both are 1.1e-6
    # from the float64 angles (the float32 angle of position 31 is that far off; measured on
    # AMD EPYC with AVX-512 2026-11-27)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-7)
    torch.testing.assert_close(rotate_half(q), hf_rotate_half(q), rtol=0, atol=0)
    # the rotations against the float64 formula, angle = position * theta ** (-2i / d): ours
    # within 2x transformers' distance from it (both 1.9e-6 for |q| up to 3.4, measured on AMD
    # EPYC 2026-11-27, where the old fixed 1e-6 + 1e-6 relative left about 2x); pairing
    # interleaved coordinates instead of halves, or a wrong sign, is off by |q|
    inv64 = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = position_ids[..., None].double() * inv64
    angles = torch.cat([angles, angles], -1)
    q64, k64 = apply_rotary_pos_emb(q.double(), k.double(), angles.cos(), angles.sin())
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    check_float32_error("apply_rope(q, cos, sin)", apply_rope(q, cos, sin), hf_q, q64,
                        floor=1e-7)
    check_float32_error("apply_rope(k, cos, sin)", apply_rope(k, cos, sin), hf_k, k64,
                        floor=1e-7)
    # the shared (T, head_dim) form equals HF's for a single row of positions
    cos1, sin1 = rope_cos_sin(head_dim, position_ids[0], base=theta)
    hf_q1, _ = apply_rotary_pos_emb(q[:1], k[:1], hf_cos[:1], hf_sin[:1])
    check_float32_error("apply_rope(q[:1], cos, sin) with (T, head_dim) cos and sin",
                        apply_rope(q[:1], cos1, sin1), hf_q1, q64[:1], floor=1e-7)


def test_rope_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(5, 3)
    with pytest.raises(ValueError, match="base"):
        rope_cos_sin(4, 3, base=0.5)
    with pytest.raises(ValueError, match=">= 0"):
        rope_cos_sin(4, torch.tensor([0, -1]))
    with pytest.raises(TypeError, match="integer"):
        rope_cos_sin(4, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError):
        rope_cos_sin(4, [0, 1])
    cos, sin = rope_cos_sin(4, 3)
    with pytest.raises(ValueError, match="B, H, T, head_dim"):
        apply_rope(torch.zeros(3, 4), cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(torch.zeros(1, 1, 2, 4), cos, sin)          # T mismatch
    with pytest.raises(ValueError, match="pos_q"):
        rope_score(torch.zeros(4), torch.zeros(4), -1, 0)
