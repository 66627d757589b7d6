"""Tests of tinygpt.model (day 05): RMSNorm, SwiGLU, attention, block, TinyGPT, HF Llama bridge."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tinygpt.model import (
    Attention,
    Block,
    ModelConfig,
    RMSNorm,
    SwiGLU,
    TinyGPT,
    config_from_hf,
    config_to_hf,
    count_parameters,
    from_hf_llama,
    hf_llama_key_map,
    to_hf_llama,
)
from tinygpt.positions import apply_rope, rope_cos_sin
from tinygpt.testing import check_float32_error

CFG = ModelConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=24, rope_base=500.0, norm_eps=1e-6)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def ids(B, T, V=CFG.vocab_size, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------
# building blocks


def test_rmsnorm_matches_torch_rms_norm():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(8, seed=1))
    x = randn(2, 3, 8, seed=2)
    ref = F.rms_norm(x, (8,), weight=norm.weight, eps=1e-6)
    torch.testing.assert_close(norm(x), ref)
    # by hand: a constant vector c normalizes to c / sqrt(c^2 + eps) ~ sign(c)
    plain = RMSNorm(4, eps=1e-5)
    out = plain(torch.full((4,), -3.0))
    torch.testing.assert_close(out, torch.full((4,), -3.0 / (9.0 + 1e-5) ** 0.5))


def test_rmsnorm_computes_in_float32_like_llama():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    del transformers
    ours, theirs = RMSNorm(16, eps=1e-6), LlamaRMSNorm(16, eps=1e-6)
    w = randn(16, seed=3).to(torch.bfloat16)
    ours.to(torch.bfloat16)
    theirs.to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    x = (randn(4, 16, seed=4) * 100).to(torch.bfloat16)
    out = ours(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, theirs(x))


def test_swiglu_matches_manual_formula():
    mlp = SwiGLU(8, 20)
    x = randn(2, 5, 8, seed=5)
    w1, w2, w3 = mlp.w1.weight, mlp.w2.weight, mlp.w3.weight
    assert w1.shape == w3.shape == (20, 8) and w2.shape == (8, 20)
    gate = x @ w1.T
    ref = (gate * torch.sigmoid(gate) * (x @ w3.T)) @ w2.T
    torch.testing.assert_close(mlp(x), ref)
    assert all(m.bias is None for m in (mlp.w1, mlp.w2, mlp.w3))


def test_attention_module_matches_torch_sdpa_with_gqa():
    torch.manual_seed(0)
    attn = Attention(CFG)
    assert attn.wq.weight.shape == (32, 32) and attn.wk.weight.shape == (16, 32)
    x = randn(2, 7, 32, seed=6)
    cos, sin = rope_cos_sin(CFG.head_dim, 7, CFG.rope_base)
    q, k, v = attn.qkv(x, cos, sin)
    assert q.shape == (2, 4, 7, 8) and k.shape == v.shape == (2, 2, 7, 8)
    # reference written independently: reshape by hand, torch's SDPA with enable_gqa
    def reference(attn, x, cos, sin):
        def heads(t, n):
            return t.reshape(2, 7, n, 8).permute(0, 2, 1, 3)
        q_ref = apply_rope(heads(x @ attn.wq.weight.T, 4), cos, sin)
        k_ref = apply_rope(heads(x @ attn.wk.weight.T, 2), cos, sin)
        v_ref = heads(x @ attn.wv.weight.T, 2)
        y = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=True, enable_gqa=True)
        return y.permute(0, 2, 1, 3).reshape(2, 7, 32) @ attn.wo.weight.T
    # two float32 computations: ours within 2x the reference's distance from the reference in
    # float64 (measured on AMD EPYC with AVX-512 2026-11-27: both 1.2e-7 for outputs up to 0.7,
    # where the old fixed 1e-6 absolute left an 8x margin); a wrong head mapping is off by the
    # outputs' size
    cos64, sin64 = rope_cos_sin(CFG.head_dim, 7, CFG.rope_base, dtype=torch.float64)
    truth = reference(copy.deepcopy(attn).double(), x.double(), cos64, sin64)
    check_float32_error("Attention", attn(x, cos, sin), reference(attn, x, cos, sin), truth,
                        floor=1e-7)


def test_block_is_pre_norm_residual():
    torch.manual_seed(0)
    block = Block(CFG)
    x = randn(1, 5, 32, seed=7)
    cos, sin = rope_cos_sin(CFG.head_dim, 5, CFG.rope_base)
    h = x + block.attention(block.attention_norm(x), cos, sin)
    ref = h + block.feed_forward(block.ffn_norm(h))
    torch.testing.assert_close(block(x, cos, sin), ref)
    with torch.no_grad():                     # zero the residual writers: the block is identity
        block.attention.wo.weight.zero_()
        block.feed_forward.w2.weight.zero_()
    torch.testing.assert_close(block(x, cos, sin), x)


# ------------------------------------------------------------------------------------------
# parameters and init


def test_count_parameters_hand_value():
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=12,
                      max_seq_len=4)
    # attention 8*8 + 2*8*4 + 8*8 = 192, mlp 3*8*12 = 288, norms 16 -> 496 per layer
    # embeddings 80 + layer 496 + final norm 8 + head 80 = 664
    assert count_parameters(cfg) == 664
    assert count_parameters(dataclasses.replace(cfg, tie_embeddings=True)) == 584


def test_count_parameters_llama3_8b():
    cfg = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      d_ff=14336, max_seq_len=8192, rope_base=500000.0)
    assert count_parameters(cfg) == 8_030_261_248


@pytest.mark.parametrize("cfg", [
    CFG,
    dataclasses.replace(CFG, tie_embeddings=True),
    dataclasses.replace(CFG, n_kv_heads=4, n_layers=3),
    dataclasses.replace(CFG, n_kv_heads=1, tie_embeddings=True),
])
def test_count_parameters_matches_module(cfg):
    model = TinyGPT(cfg, seed=None)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_init_is_deterministic_and_scaled():
    a, b, c = TinyGPT(CFG, seed=1), TinyGPT(CFG, seed=1), TinyGPT(CFG, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
        else:
            assert torch.all(pa == 1), name
    emb = a.tok_embeddings.weight
    assert 0.015 < emb.std().item() < 0.025
    assert a.layers[0].attention.wo.weight.std() < 0.6 * a.layers[0].attention.wq.weight.std()
    # the global RNG does not change the seeded init
    torch.manual_seed(123)
    assert torch.equal(TinyGPT(CFG, seed=1).output.weight, a.output.weight)


def test_weight_tying_shares_storage():
    model = TinyGPT(dataclasses.replace(CFG, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = TinyGPT(CFG)
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


# ------------------------------------------------------------------------------------------
# forward


def test_forward_shape_and_causality():
    model = TinyGPT(CFG, seed=0)
    x = ids(2, 9)
    logits = model(x)
    assert logits.shape == (2, 9, CFG.vocab_size) and logits.dtype == torch.float32
    # changing token 6 leaves logits at positions 0..5 unchanged and changes later ones
    y = x.clone()
    y[:, 6] = (y[:, 6] + 1) % CFG.vocab_size
    logits_y = model(y)
    torch.testing.assert_close(logits_y[:, :6], logits[:, :6], rtol=0, atol=0)
    assert not torch.allclose(logits_y[:, 6:], logits[:, 6:])
    # batch rows are independent (float32 rounding of another batch shape only: both 5.5e-8 from
    # the float64 model for logits up to 0.36, measured on AMD EPYC with AVX-512 2026-11-27, 18x
    # below atol)
    torch.testing.assert_close(model(x[1:]), logits[1:], rtol=1e-5, atol=1e-6)


def test_forward_input_pos():
    model = TinyGPT(CFG, seed=0)
    x = ids(1, 6, seed=1)
    ref = model(x)
    torch.testing.assert_close(model(x, input_pos=torch.arange(6)), ref, rtol=0, atol=0)
    # RoPE is relative: shifting every position by the same amount leaves the logits unchanged
    # (each 4.7e-8 from the float64 model, measured on AMD EPYC with AVX-512 2026-11-27; spacing 2
    # below moves them by 5e-4)
    torch.testing.assert_close(model(x, input_pos=torch.arange(6) + 11), ref,
                               rtol=1e-4, atol=1e-5)
    # ...but a different spacing does change them, so input_pos really reaches RoPE
    assert not torch.allclose(model(x, input_pos=torch.arange(6) * 2), ref, atol=1e-4)
    # the prefix of a longer sequence equals the short forward (7.4e-8 and 4.7e-8 from float64)
    longer = torch.cat([x, ids(1, 3, seed=2)], dim=1)
    torch.testing.assert_close(model(longer)[:, :6], ref, rtol=1e-5, atol=1e-6)


def test_forward_per_sequence_positions():
    model = TinyGPT(CFG, seed=0)
    x = ids(2, 5, seed=3)
    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 2, 4, 6, 8]])
    out = model(x, input_pos=pos)
    # float32 rounding only: at most 6.4e-8 from the float64 model (AMD EPYC with AVX-512
    # 2026-11-27)
    for b in range(2):
        torch.testing.assert_close(out[b : b + 1], model(x[b : b + 1], input_pos=pos[b]),
                                   rtol=1e-5, atol=1e-6)


def test_forward_bfloat16():
    """bfloat16 logits are as close to transformers' LlamaForCausalLM in float64 (the same
    bfloat16 weights) as that model run in bfloat16 is. Weights are drawn 0.1 wide (norms
    1 +- 0.1) so that every block counts: for 5 draws (AMD EPYC with AVX-512, 2026-11-29) the errors
    were 0.012 to 0.018 against transformers' 0.014 to 0.022 (ratios 0.78 to 1.03, logits up to
    2.5), while dropping the feed-forward blocks moved the logits by 1.2 to 1.7."""
    pytest.importorskip("transformers")
    model = TinyGPT(CFG, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1 if p.ndim == 1 else 0) + 0.1 * torch.randn(p.shape, generator=gen))
    model = model.to(torch.bfloat16)
    x = ids(2, 12)
    with torch.no_grad():
        logits = model(x)
        assert logits.dtype == torch.bfloat16
        hf = to_hf_llama(model, "eager")                  # bfloat16 too
        theirs, truth = hf(x).logits, hf_float64(hf)(x).logits
    check_float32_error("TinyGPT in bfloat16", logits, theirs, truth, factor=4.0, floor=1e-3)


def test_forward_rejects_bad_input():
    model = TinyGPT(CFG, seed=0)
    with pytest.raises(TypeError, match="idx"):
        model(torch.zeros(1, 3))
    with pytest.raises(TypeError, match="idx"):
        model([[1, 2]])
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="vocab_size=37"):
        model(torch.tensor([[1, 37]]))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="max_seq_len=24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="input_pos"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.arange(4))
    with pytest.raises(ValueError, match="input_pos"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.arange(3) + 22)
    with pytest.raises(TypeError, match="input_pos"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.arange(3.0))
    with pytest.raises(TypeError, match="cfg"):
        TinyGPT({"vocab_size": 3})


# ------------------------------------------------------------------------------------------
# Hugging Face Llama


# Our float32 logits against transformers' float32 logits: both are measured against
# transformers' model in float64, and ours may be at most 3x as far from it as theirs (+1e-6).
# Measured on AMD EPYC with AVX-512 2026-11-27: both 2e-6 to 5.5e-6 for logits up to 8 (a fixed 1e-5
# left a 2x margin, and another CPU's kernels sum in another order); ours/theirs 0.7 to 1.8 over 72
# seeded models. A transposed weight, a wrong head split or a wrong RoPE pairing is off by whole
# logits.
HF_FACTOR, HF_FLOOR = 3.0, 1e-6


def hf_float64(hf_model):
    """A float64 copy of a transformers model: the truth both float32 models are measured by."""
    return copy.deepcopy(hf_model).double()


def make_hf_llama(n_kv_heads: int, tie: bool, seed: int = 0, **changes):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{**dict(
        vocab_size=41, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        tie_word_embeddings=tie, attn_implementation="eager"), **changes})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():          # large random weights so that every mapping error shows up
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model, config


@pytest.mark.parametrize("n_kv_heads,tie", [(4, False), (2, False), (4, True), (1, True)])
def test_from_hf_llama_logits_match(n_kv_heads, tie):
    hf_model, config = make_hf_llama(n_kv_heads, tie)
    model = from_hf_llama(hf_model.state_dict(), config)
    cfg = model.cfg
    assert (cfg.n_kv_heads, cfg.tie_embeddings, cfg.rope_base, cfg.norm_eps) == (
        n_kv_heads, tie, 300.0, 1e-6)
    x = ids(2, 13, V=41, seed=4)
    positions = torch.tensor([[3, 4, 5, 6, 7]])
    exact = hf_float64(hf_model)
    with torch.no_grad():
        ref = hf_model(x).logits
        ref_pos = hf_model(x[:1, :5], position_ids=positions).logits
        truth, truth_pos = exact(x).logits, exact(x[:1, :5], position_ids=positions).logits
        out = model(x)
        out_pos = model(x[:1, :5], input_pos=torch.tensor([3, 4, 5, 6, 7]))
    assert ref.abs().max() > 1.0                        # the comparison is not trivially small
    check_float32_error("from_hf_llama's logits", out, ref, truth, factor=HF_FACTOR,
                        floor=HF_FLOOR)
    check_float32_error("from_hf_llama's logits at positions 3..7", out_pos, ref_pos, truth_pos,
                        factor=HF_FACTOR, floor=HF_FLOOR)
    assert sum(p.numel() for p in hf_model.parameters()) == count_parameters(cfg)


@pytest.mark.parametrize("n_kv_heads,tie", [(2, False), (4, True)])
def test_to_hf_llama_roundtrip(n_kv_heads, tie):
    cfg = dataclasses.replace(CFG, n_kv_heads=n_kv_heads, tie_embeddings=tie)
    model = TinyGPT(cfg, seed=3)
    with torch.no_grad():                              # logits of order 1, not 0.01
        for p in model.parameters():
            p.mul_(3.0)
    hf_model = to_hf_llama(model, attn_implementation="eager")
    assert not hf_model.training
    assert hf_model.config.tie_word_embeddings == tie
    assert config_from_hf(hf_model.config) == cfg
    x = ids(2, 10, seed=5)
    with torch.no_grad():
        ref, out, truth = hf_model(x).logits, model(x), hf_float64(hf_model)(x).logits
    assert ref.abs().max() > 1.0
    check_float32_error("to_hf_llama's model against ours", out, ref, truth, factor=HF_FACTOR,
                        floor=HF_FLOOR)
    back = from_hf_llama(hf_model, hf_model.config)
    for (name, p), q in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------------------------------
# an explicit head_dim (day 20): Qwen3's heads are wider than d_model / n_heads

WIDE = dataclasses.replace(CFG, head_dim=16)            # 4 heads of 16 over d_model 32


def test_head_dim_is_derived_unless_given():
    assert CFG.head_dim == 8 and dataclasses.asdict(CFG)["head_dim"] == 8
    assert dataclasses.replace(CFG, head_dim=8) == CFG      # the derived width, given: same
    assert WIDE.head_dim == 16 and WIDE != CFG and hash(WIDE) != hash(CFG)
    # replace keeps the stored width; head_dim=None derives it again
    assert dataclasses.replace(CFG, d_model=64).head_dim == 8
    assert dataclasses.replace(CFG, d_model=64, head_dim=None).head_dim == 16
    # a config.json written before the field existed loads with the derived width
    old = {k: v for k, v in dataclasses.asdict(CFG).items() if k != "head_dim"}
    assert ModelConfig(**old) == CFG
    # with head_dim given, d_model need not be a multiple of n_heads
    assert ModelConfig(**{**old, "d_model": 30, "head_dim": 8}).head_dim == 8


@pytest.mark.parametrize("changes,match", [
    ({"head_dim": 7}, r"head_dim must be None \(d_model // n_heads\) or a positive even "
                      r"integer .*got 7"),
    ({"head_dim": 0}, "head_dim must be None .*got 0"),
    ({"head_dim": True}, "head_dim must be None .*got True"),
    ({"head_dim": 16.0}, "head_dim must be None .*got 16.0"),
    ({"d_model": 30}, r"d_model \(30\) must be divisible by n_heads \(4\), or give head_dim"),
    ({"d_model": 20}, "head_dim = d_model / n_heads must be even for RoPE, got 5"),
])
def test_bad_head_dims_name_the_field_and_the_allowed_values(changes, match):
    derived = {k: v for k, v in dataclasses.asdict(CFG).items() if k != "head_dim"}
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**derived, **changes})


@pytest.mark.parametrize("changes,match", [
    # a "gqa" config's multi-head latent attention fields are checked too (all must be 0)
    ({"qk_nope_head_dim": -3}, "qk_nope_head_dim must be an integer >= 0, got -3"),
    ({"v_head_dim": "x"}, "v_head_dim must be an integer >= 0, got 'x'"),
    ({"qk_rope_head_dim": 8}, "qk_rope_head_dim=8 needs multi-head latent attention"),
    ({"v_head_dim": 16}, "v_head_dim=16 needs multi-head latent attention"),
    ({"rope_base": 1.0}, r"rope_base must be a finite number > 1 \(RoPE's theta\), got 1.0"),
    ({"rope_base": 0.5}, "rope_base must be a finite number > 1 .*got 0.5"),
    ({"rope_base": "1e4"}, "rope_base must be a finite number > 1 .*got '1e4'"),
    ({"rope_base": True}, "rope_base must be a finite number > 1 .*got True"),
    ({"rope_base": math.inf}, "rope_base must be a finite number > 1 .*got inf"),
    # an infinite or non-numeric eps, and truthy strings for flags, were taken before
    ({"norm_eps": math.inf}, "norm_eps must be a finite number > 0, got inf"),
    ({"norm_eps": True}, "norm_eps must be a finite number > 0, got True"),
    ({"norm_eps": "1e-5"}, "norm_eps must be a finite number > 0, got '1e-5'"),
    ({"tie_embeddings": "false"}, "tie_embeddings must be True or False, got 'false'"),
    ({"qk_norm": 1}, "qk_norm must be True or False, got 1"),
])
def test_bad_config_fields_name_the_field_and_the_allowed_values(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **changes)
    assert dataclasses.replace(CFG, rope_base=1.5).rope_base == 1.5


def test_wide_heads_map_d_model_to_h_times_head_dim_and_back():
    model = TinyGPT(WIDE, seed=0)
    attn = model.layers[0].attention
    assert (attn.wq.weight.shape, attn.wk.weight.shape, attn.wv.weight.shape,
            attn.wo.weight.shape) == ((64, 32), (32, 32), (32, 32), (32, 64))
    assert model.rope_cos.shape == (24, 16)
    assert count_parameters(WIDE) == sum(p.numel() for p in model.parameters())
    assert model(ids(2, 7)).shape == (2, 7, 37)


def test_checkpoints_keep_head_dim_and_older_ones_derive_it(tmp_path):
    import json

    from tinygpt import load_pretrained
    from tinygpt.train import load_checkpoint, save_checkpoint

    shipped, tokenizer = load_pretrained()          # its config.json predates the field
    assert shipped.cfg.head_dim == shipped.cfg.d_model // shipped.cfg.n_heads
    cfg = dataclasses.replace(WIDE, vocab_size=tokenizer.vocab_size)
    model = TinyGPT(cfg, seed=1)
    save_checkpoint(tmp_path, model, tokenizer)
    written = json.loads((tmp_path / "config.json").read_text())["model_config"]
    assert written["head_dim"] == 16
    back, _ = load_checkpoint(tmp_path)
    assert back.cfg == cfg
    x = ids(1, 9, V=cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


# Measured on the 2-core AMD EPYC with AVX-512 (2026-11-27) for these wide-head models (head_dim 16,
# 12 and 4 over d_model 32, 72 seeded models): ours and transformers' float32 logits are equally
# far from float64 (ratio 1.0; 3.5e-6 to 1.3e-5 for logits up to 8), inside HF_FACTOR above.
@pytest.mark.parametrize("n_kv_heads,tie,head_dim", [(2, False, 16), (1, True, 12)])
def test_a_llama_with_an_explicit_head_dim_matches_transformers(n_kv_heads, tie, head_dim):
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    hf_model, config = make_hf_llama(n_kv_heads, tie, seed=1, head_dim=head_dim)
    model = from_hf_llama(hf_model.state_dict(), config)
    assert model.cfg.head_dim == head_dim != 32 // 4
    x = ids(2, 13, V=41, seed=4)
    with torch.no_grad():
        ref, out, truth = hf_model(x).logits, model(x), hf_float64(hf_model)(x).logits
    assert ref.abs().max() > 1.0
    err, ref_err = check_float32_error(f"from_hf_llama's logits, head_dim {head_dim}", out, ref,
                                       truth, factor=HF_FACTOR, floor=HF_FLOOR)
    prompt, n = [3, 1, 4, 1, 5], 12
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        steps = hf_model(theirs[None]).logits[0, len(prompt) - 1:-1]
    top2 = steps.topk(2, dim=-1).values          # no step is a near-tie at float32's error
    assert (top2[:, 0] - top2[:, 1]).min() > 100 * max(err, ref_err)
    params = SamplingParams(temperature=0, max_new_tokens=n)
    assert generate(model, prompt, params).token_ids == theirs[len(prompt):].tolist()
    back = to_hf_llama(model, attn_implementation="eager")           # and back again
    assert back.config.head_dim == head_dim and config_from_hf(back.config) == model.cfg
    theirs_state = back.state_dict()
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, theirs_state[name]), name


def test_config_from_hf_dict_and_rope_variants():
    base = dict(model_type="llama", vocab_size=41, hidden_size=32, intermediate_size=56,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=32, rms_norm_eps=1e-5, hidden_act="silu")
    # a transformers 4 style config.json: top-level rope_theta, rope_scaling null
    cfg = config_from_hf({**base, "rope_theta": 500000, "rope_scaling": None,
                          "tie_word_embeddings": True})
    assert cfg == ModelConfig(vocab_size=41, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              d_ff=56, max_seq_len=32, rope_base=500000.0, norm_eps=1e-5,
                              tie_embeddings=True)
    # transformers 5 style
    cfg5 = config_from_hf({**base, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 123.0}})
    assert cfg5.rope_base == 123.0 and cfg5.tie_embeddings is False
    assert config_from_hf({k: v for k, v in base.items() if k != "num_key_value_heads"}
                          ).n_kv_heads == 4
    # a LlamaConfig object built by transformers from rope_theta
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(**{k: v for k, v in base.items() if k != "model_type"},
                                  rope_theta=777.0)
    assert config_from_hf(hf).rope_base == 777.0
    assert config_to_hf(cfg).rope_parameters["rope_theta"] == 500000.0


@pytest.mark.parametrize("change,match", [
    # day 21 loads linear / dynamic / yarn / llama3 (tests/test_rope_scaling.py); not these
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_theta": 5e5},
     "'llama3' needs the keys.*low_freq_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}},
     "longrope"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ({"head_dim": 15}, "head_dim must be None .* positive even integer"),  # 16 loads: test below
    ({"hidden_act": "gelu"}, "silu"),
    ({"attention_bias": True}, "bias"),
    ({"mlp_bias": True}, "bias"),
    ({"model_type": "gpt2"}, "model_type"),
])
def test_config_from_hf_rejects_unsupported(change, match):
    base = dict(model_type="llama", vocab_size=41, hidden_size=32, intermediate_size=56,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    with pytest.raises(ValueError, match=match):
        config_from_hf({**base, **change})
    with pytest.raises(ValueError, match="vocab_size"):
        config_from_hf({k: v for k, v in base.items() if k != "vocab_size"})


def test_from_hf_llama_rejects_bad_state_dict():
    hf_model, config = make_hf_llama(2, tie=False)
    sd = dict(hf_model.state_dict())
    missing = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing keys.*lm_head"):
        from_hf_llama(missing, config)
    with pytest.raises(ValueError, match="unexpected keys.*extra"):
        from_hf_llama({**sd, "extra.weight": torch.zeros(1)}, config)
    bad = {**sd, "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)}
    with pytest.raises(ValueError, match="k_proj.*shape"):
        from_hf_llama(bad, config)
    with pytest.raises(TypeError, match="state_dict"):
        from_hf_llama([1, 2], config)
    # tied config whose lm_head disagrees with the embedding
    tied_model, tied_config = make_hf_llama(2, tie=True)
    tied_sd = {**tied_model.state_dict(), "lm_head.weight": torch.zeros(41, 32)}
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        from_hf_llama(tied_sd, tied_config)
    # a tied checkpoint saved without lm_head (as safetensors does) still loads
    no_head = {k: v for k, v in tied_model.state_dict().items() if k != "lm_head.weight"}
    assert from_hf_llama(no_head, tied_config).cfg.tie_embeddings


def test_hf_key_map_covers_state_dict():
    for cfg in (CFG, dataclasses.replace(CFG, tie_embeddings=True)):
        assert set(hf_llama_key_map(cfg)) == set(TinyGPT(cfg, seed=None).state_dict())


# ----------------------------------------------------------------------------------------------
# building inside a device context (torch.device("cuda") used to fail: a CPU generator was
# paired with tensors created on the context's device)


def test_init_draws_on_the_cpu_whatever_the_device_context(monkeypatch):
    devices = []
    real_randn = torch.randn

    def spy(*args, **kwargs):
        devices.append(torch.device(kwargs.get("device") or torch.get_default_device()))
        return real_randn(*args, **kwargs)

    monkeypatch.setattr(torch, "randn", spy)
    with torch.device("meta"):
        meta = TinyGPT(CFG, seed=0)
    assert devices and all(d.type == "cpu" for d in devices), devices
    assert meta.output.weight.device.type == "meta"


def test_a_cpu_device_context_builds_the_same_weights():
    with torch.device("cpu"):
        inside = TinyGPT(CFG, seed=3)
    outside = TinyGPT(CFG, seed=3)
    for (name, a), b in zip(inside.state_dict().items(), outside.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_building_inside_a_cuda_device_context():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: building under torch.device('cuda') needs a GPU")
    with torch.device("cuda"):
        model = TinyGPT(CFG, seed=3)
    reference = TinyGPT(CFG, seed=3)
    assert model.output.weight.device.type == "cuda"
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(),
                            strict=True):
        assert torch.equal(a.cpu(), b), name
