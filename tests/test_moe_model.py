"""Day 20's mixture-of-experts and q/k-norm TinyGPT (tinygpt.model): the config's fields and
their errors, the layers built, parameter counts (all and active), init, q/k norm; the fast
paths that must take the plain modules for such a model (the decode step for q/k norm, whose
MoE layers run in its fused step, the engine's runner, the quantized step) giving the
uncached model's tokens, and those that refuse it
(quantization, tensor parallelism, the GGUF writer and reader); checkpoints of the new fields;
an explicit head_dim (heads wider than d_model / n_heads) through every fast path.

Float32 logits are checked against the same model in float64 (check_float32_error): the
cached paths as close to it as the full float32 forward, 4x plus a floor of one float32 step
at the logits' size, as tests/test_kv_cache.py does (measured there: up to 2.1x). Measured
here on the 2-core AMD EPYC with AVX-512 (2026-11-27): the full forward and the cached paths both
1e-7 to 4e-7 from float64 for logits up to 2 (the cached ones at most 1.6x the forward's).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from tests.float64 import float64_twin
from tinygpt.engine import Engine
from tinygpt.generate import generate
from tinygpt.kv_cache import DecodeStep, KVCache, PackFallbackWarning, decode_step, prefill
from tinygpt.model import (
    Block,
    ModelConfig,
    SwiGLU,
    TinyGPT,
    count_active_parameters,
    count_parameters,
)
from tinygpt.moe import MoE, MoEDecode
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error

BASE = dict(vocab_size=53, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40,
            max_seq_len=64)
# Qwen3-MoE-like: softmax router, q/k norm, layer 1 dense
SOFTMAX = ModelConfig(**BASE, n_experts=6, top_k=2, d_expert=16, dense_layers=(1,),
                      qk_norm=True)
# DeepSeek-V3-like: sigmoid groups, a scale, a shared expert
GROUPS = ModelConfig(**BASE, n_experts=8, top_k=2, d_expert=12, router="sigmoid_groups",
                     n_group=4, topk_group=2, routed_scale=2.5, n_shared_experts=1)
QK_ONLY = ModelConfig(**BASE, qk_norm=True)                     # dense, q/k norm
LOGITS_FACTOR, LOGITS_FLOOR = 4.0, 2.4e-7


def make(cfg: ModelConfig, seed: int = 0) -> TinyGPT:
    model = TinyGPT(cfg, seed=seed).eval()
    with torch.no_grad():          # larger logits than the 0.02 init: no argmax near-ties
        model.output.weight.mul_(40)
        for layer in model.layers:    # a router that prefers some experts, and a bias
            ff = layer.feed_forward
            if isinstance(ff, MoE):
                ff.gate.weight.mul_(20)
                if ff.router == "sigmoid_groups":
                    ff.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, ff.n_experts))
    return model


# --------------------------------------------------------------------------------------------
# the config


def test_dense_configs_are_unchanged_and_moe_ones_describe_their_layers():
    dense = ModelConfig(**BASE)
    assert not dense.is_moe and dense.moe_layers == () and dense.fast_path_refusal() is None
    assert [f.name for f in dataclasses.fields(ModelConfig)][:10] == [
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len",
        "rope_base", "norm_eps", "tie_embeddings"]
    assert SOFTMAX.is_moe and SOFTMAX.moe_layers == (0, 2)
    assert [SOFTMAX.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert "mixture-of-experts" in SOFTMAX.fast_path_refusal()
    assert "qk_norm" in QK_ONLY.fast_path_refusal()
    # a list (as JSON gives it back) becomes a sorted tuple: the config stays hashable
    listed = ModelConfig(**BASE, n_experts=4, top_k=1, d_expert=8, dense_layers=[2, 0])
    assert listed.dense_layers == (0, 2) and hash(listed)
    with pytest.raises(ValueError, match=r"i must be a layer index in \[0, n_layers=3\)"):
        SOFTMAX.is_moe_layer(3)


MOE = dict(n_experts=8, top_k=2, d_expert=16)


@pytest.mark.parametrize("changes,match", [
    (dict(top_k=2), r"top_k=2 needs a mixture-of-experts model: set n_experts >= 1"),
    (dict(dense_layers=(0,)), "dense_layers=.*needs a mixture-of-experts"),
    (dict(router="sigmoid_groups"), "router=.*needs a mixture-of-experts"),
    (dict(n_experts=-1), "n_experts must be an integer >= 0"),
    (dict(MOE, top_k=0), r"top_k must be in \[1, n_experts=8\]"),
    (dict(MOE, top_k=9), r"top_k must be in \[1, n_experts=8\]"),
    (dict(MOE, d_expert=0), "d_expert must be >= 1"),
    (dict(MOE, router="topk"), r"router must be one of \('softmax', 'sigmoid_groups'\)"),
    (dict(MOE, n_group=2), "n_group must be 1 with router 'softmax'"),
    (dict(MOE, routed_scale=2.5), "routed_scale must be 1 with router 'softmax'"),
    (dict(MOE, router="sigmoid_groups", n_group=3), "n_group must divide n_experts=8"),
    (dict(MOE, router="sigmoid_groups", n_group=8), "groups of at least 2"),
    (dict(MOE, router="sigmoid_groups", n_group=4, topk_group=5),
     r"topk_group must be in \[1, n_group=4\]"),
    (dict(MOE, top_k=5, router="sigmoid_groups", n_group=4, topk_group=2),
     "keep at least top_k=5 experts eligible"),
    (dict(MOE, router="sigmoid_groups", routed_scale=0.0), "routed_scale must be a finite"),
    (dict(MOE, dense_layers=(3,)), r"dense_layers must be distinct layer indices in \[0, "
                                   r"n_layers=3\)"),
    (dict(MOE, dense_layers=(1, 1)), "dense_layers must be distinct"),
    (dict(MOE, dense_layers=(0, 1, 2)), "no layer would be sparse"),
    (dict(MOE, dense_layers="1"), "dense_layers must be a tuple of layer indices"),
    (dict(MOE, norm_topk_prob=1), "norm_topk_prob must be True or False"),
    (dict(qk_norm="yes"), "qk_norm must be True or False"),
    (dict(MOE, n_shared_experts=-1), "n_shared_experts must be an integer >= 0"),
])
def test_bad_moe_fields_name_the_field_and_the_allowed_values(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**BASE, **changes)


# --------------------------------------------------------------------------------------------
# layers, parameters, init


def test_blocks_build_moe_on_sparse_layers_and_swiglu_on_dense_ones():
    model = TinyGPT(GROUPS, seed=0)
    ff = model.layers[0].feed_forward
    assert isinstance(ff, MoE) and (ff.n_experts, ff.top_k, ff.d_expert) == (8, 2, 12)
    assert (ff.router, ff.n_group, ff.topk_group, ff.scale) == ("sigmoid_groups", 4, 2, 2.5)
    assert ff.shared is not None and ff.shared.w1.weight.shape == (12, 32)
    qwen = TinyGPT(SOFTMAX, seed=0)
    assert [type(b.feed_forward) for b in qwen.layers] == [MoE, SwiGLU, MoE]
    assert qwen.layers[0].feed_forward.renormalize is True
    assert isinstance(Block(ModelConfig(**BASE)).feed_forward, SwiGLU)
    keys = set(qwen.state_dict())
    assert {"layers.0.feed_forward.gate.weight", "layers.0.feed_forward.w1",
            "layers.0.feed_forward.w3", "layers.0.feed_forward.w2",
            "layers.1.feed_forward.w1.weight", "layers.0.attention.q_norm.weight",
            "layers.0.attention.k_norm.weight"} <= keys
    assert qwen.state_dict()["layers.0.feed_forward.w2"].shape == (6, 32, 16)
    assert "layers.0.feed_forward.e_score_correction_bias" in model.state_dict()
    assert "layers.0.attention.q_norm.weight" not in TinyGPT(ModelConfig(**BASE)).state_dict()


@pytest.mark.parametrize("cfg", [ModelConfig(**BASE), SOFTMAX, GROUPS, QK_ONLY,
                                 dataclasses.replace(GROUPS, tie_embeddings=True)],
                         ids=["dense", "softmax", "groups", "qk_only", "tied"])
def test_count_parameters_counts_every_parameter(cfg):
    model = TinyGPT(cfg, seed=0)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    # active: every parameter except the experts a token skips, counted from the modules
    skipped = sum(p.numel() for b in model.layers if isinstance(b.feed_forward, MoE)
                  for p in (b.feed_forward.w1, b.feed_forward.w3, b.feed_forward.w2)) \
        * (1 - cfg.top_k / cfg.n_experts) if cfg.is_moe else 0
    assert count_active_parameters(cfg) == count_parameters(cfg) - round(skipped)


def test_active_parameters_of_mixtral_8x7b_are_its_model_card_figures():
    """Mixtral-8x7B's config.json (the Hub's): 46.7B parameters, 12.9B active per token."""
    from tinygpt.hf_models import config_from_hf

    cfg = config_from_hf({
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
        "sliding_window": None, "tie_word_embeddings": False})
    assert round(count_parameters(cfg) / 1e9, 1) == 46.7
    assert round(count_active_parameters(cfg) / 1e9, 1) == 12.9
    with torch.device("meta"):                     # the formula against the modules
        assert sum(p.numel() for p in TinyGPT(cfg, seed=None).parameters()) == \
            count_parameters(cfg)


def test_init_is_deterministic_and_scales_the_experts_residual_writers():
    a, b = TinyGPT(GROUPS, seed=3), TinyGPT(GROUPS, seed=3)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(a.layers[0].feed_forward.w1, TinyGPT(GROUPS, seed=4)
                           .layers[0].feed_forward.w1)
    big = ModelConfig(**{**BASE, "d_model": 128, "n_heads": 4}, n_experts=16, top_k=2,
                      d_expert=128, router="sigmoid_groups", n_group=4, topk_group=2)
    ff = TinyGPT(big, seed=0).layers[0].feed_forward
    resid = 0.02 / (2 * big.n_layers) ** 0.5
    assert abs(ff.w2.std().item() / resid - 1) < 0.02          # 262,144 draws each
    assert abs(ff.w1.std().item() / 0.02 - 1) < 0.02
    assert abs(ff.gate.weight.std().item() / 0.02 - 1) < 0.05
    assert torch.equal(ff.e_score_correction_bias, torch.zeros(16))
    q_norm = TinyGPT(QK_ONLY, seed=0).layers[0].attention.q_norm
    assert torch.equal(q_norm.weight, torch.ones(QK_ONLY.head_dim))


def test_qk_norm_normalizes_each_head_before_rope():
    from tinygpt.positions import apply_rope, rope_cos_sin

    model = TinyGPT(QK_ONLY, seed=0)
    attn = model.layers[0].attention
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
        attn.k_norm.weight.copy_(torch.linspace(1.5, 0.5, 8))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(8, 5, QK_ONLY.rope_base)

    def reference(attn, x, cos, sin):          # written out: heads, RMS over head_dim, RoPE
        def heads(y, n):
            return y.view(2, 5, n, 8).transpose(1, 2)

        def rms(y, w):
            return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + QK_ONLY.norm_eps) * w

        q = rms(heads(x @ attn.wq.weight.T, 4), attn.q_norm.weight)
        k = rms(heads(x @ attn.wk.weight.T, 2), attn.k_norm.weight)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), heads(x @ attn.wv.weight.T, 2)

    with torch.no_grad():
        got = attn.qkv(x, cos, sin)
        want = reference(attn, x, cos, sin)
        cos64, sin64 = rope_cos_sin(8, 5, QK_ONLY.rope_base, dtype=torch.float64)
        truth = reference(float64_twin(model).layers[0].attention, x.double(), cos64, sin64)
    for name, g, w, t in zip("qkv", got, want, truth, strict=True):
        check_float32_error(f"qkv's {name}", g, w, t, floor=1e-7)
    # and without the norms the heads' scale shows: the norm is not a no-op here. With it each
    # query head's mean square lies between the smallest and largest squared weight (0.25 and
    # 2.25; RoPE keeps it); without it these small heads' lie between 0.0009 and 0.027
    mean_square = got[0].pow(2).mean(-1)
    assert 0.24 < mean_square.min() and mean_square.max() < 2.26
    assert not torch.allclose(got[0], apply_rope(
        (x @ attn.wq.weight.T).view(2, 5, 4, 8).transpose(1, 2), cos, sin))


# --------------------------------------------------------------------------------------------
# the plain path: decode step, engine, quantized step


@pytest.mark.parametrize("cfg", [SOFTMAX, GROUPS, QK_ONLY], ids=["softmax", "groups",
                                                                  "qk_only"])
def test_the_decode_step_matches_the_uncached_model(cfg):
    model = make(cfg)
    cache = KVCache.for_model(model, 1, 40)
    step = DecodeStep(model, cache)
    if cfg.qk_norm:                # the fused step has no q/k norm: the modules run
        assert not step.tiled and "qk_norm=True" in step.tiled_reason
        assert step._weights is None and step._layers is None          # no fused products
    else:                          # MoE layers run in the fused step (tinygpt.moe.MoEDecode)
        assert isinstance(step._weights[0][4], MoEDecode) and step._weights[0][5] is None
        assert (step._layers is not None) == step.tiled        # cpu_kernels.MoEDecodeLayers
    with pytest.warns(PackFallbackWarning, match="packs dense Llama layers"):
        packed = DecodeStep(model, KVCache.for_model(model, 1, 8), pack_weights=True)
    assert not packed.packed and (packed._weights is None) == cfg.qk_norm
    prompt = torch.randint(0, 53, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = [prefill(model, cache, prompt)]
        ids = prompt
        for _ in range(6):
            token = logits[-1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], 1)
            logits.append(step(token))
        full = model(ids)[0, 8:]
        truth = float64_twin(model)(ids)[0, 8:]
    got = torch.cat(logits)
    check_float32_error("the cached MoE steps", got, full, truth, factor=LOGITS_FACTOR,
                        floor=LOGITS_FLOOR)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    assert generate(model, prompt[0].tolist(), params).token_ids == \
        generate(model, prompt[0].tolist(), params, use_cache=False).token_ids
    if cfg.is_moe:
        ff = model.layers[0].feed_forward
        decode_step(model, cache, token)
        assert ff.last_experts.shape == (1, cfg.top_k)        # one token routed, k experts


def test_the_engine_runs_the_plain_products_and_gives_generate_tokens():
    from tinygpt import cpu_gemm

    model = make(GROUPS)
    assert "mixture-of-experts" in cpu_gemm.refusal(model)
    assert "qk_norm" in cpu_gemm.refusal(make(QK_ONLY))
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 53, (18,), generator=g).tolist()
    prompts = [shared + [3, 4], shared + [5], torch.randint(0, 53, (7,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    want = [generate(model, p, params).token_ids for p in prompts]
    for prefix_caching in (False, True):
        engine = Engine(model, prefix_caching=prefix_caching, max_running=2, token_budget=8)
        assert not engine.runner.batched
        assert [r.token_ids for r in engine.generate(prompts, params)] == want
        assert [r.token_ids for r in engine.generate(prompts[:2], params)] == want[:2]


def test_quantization_refuses_moe_and_runs_qk_norm_through_the_modules():
    from tinygpt.quant import QuantizedDecodeStep, quantize_model, torchao_quantize

    with pytest.raises(ValueError, match="quantize_model quantizes the nn.Linear layers of "
                                         "dense blocks; the model has mixture-of-experts"):
        quantize_model(make(SOFTMAX), "int8")
    reference, reason = torchao_quantize(make(GROUPS), "int8")
    assert reference is None and "mixture-of-experts" in reason
    quantized = quantize_model(make(QK_ONLY), "int8")
    step = QuantizedDecodeStep(quantized, KVCache.for_model(quantized, 1, 32))
    assert step._weights is None and "qk_norm" in step.pack_reason and step.kernels == {}
    prompt = torch.randint(0, 53, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert generate(quantized, prompt, params).token_ids == \
        generate(quantized, prompt, params, use_cache=False).token_ids


# --------------------------------------------------------------------------------------------
# what refuses a mixture of experts


def test_tensor_parallelism_refuses_moe_up_front():
    from tinygpt.parallel import shard_model
    from tinygpt.parallel.model import check_tensor_parallel

    with pytest.raises(ValueError, match="tensor parallelism splits dense SwiGLU layers.*"
                                         "expert parallelism"):
        shard_model(make(SOFTMAX), 0, 2)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_tensor_parallel(GROUPS)
    check_tensor_parallel(QK_ONLY)                                  # q/k norm splits by head


def test_tensor_parallel_ranks_apply_q_and_k_norms():
    model = make(QK_ONLY)
    with torch.no_grad():            # norms that are not all ones, so a lost one shows
        for layer in model.layers:
            layer.attention.q_norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
            layer.attention.k_norm.weight.copy_(torch.linspace(2.0, 0.5, 8))
    tensor_parallel_matches_one_process(QK_ONLY, model, "the tensor-parallel logits")


def test_gguf_files_refuse_moe(tmp_path):
    gguf = pytest.importorskip("gguf")
    from tinygpt.bench.llamacpp import write_gguf
    from tinygpt.gguf import config_from_gguf

    for cfg in (SOFTMAX, QK_ONLY):
        with pytest.raises(ValueError, match="write_gguf writes a dense llama-architecture"):
            write_gguf(make(cfg), tmp_path / "x.gguf", "F32")
    # a Mixtral GGUF as llama.cpp writes it: architecture "llama" with an expert count
    path = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 32), (writer.add_feed_forward_length, 40),
                       (writer.add_head_count, 4), (writer.add_expert_count, 8),
                       (writer.add_expert_used_count, 2), (writer.add_vocab_size, 53)):
        add(value)
    writer.add_tensor("token_embd.weight", torch.zeros(53, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.expert_count is 8: a mixture-of-experts"):
        config_from_gguf(path)


# --------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoints_keep_the_new_fields_and_the_router_bias(tmp_path):
    from tinygpt import load_pretrained
    from tinygpt.train import load_checkpoint, save_checkpoint

    _, tokenizer = load_pretrained()
    cfg = dataclasses.replace(GROUPS, vocab_size=tokenizer.vocab_size, qk_norm=True,
                              dense_layers=(2,))
    model = make(cfg)
    save_checkpoint(tmp_path, model, tokenizer)
    back, _ = load_checkpoint(tmp_path)
    assert back.cfg == cfg and back.cfg.dense_layers == (2,)
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert back.layers[0].feed_forward.e_score_correction_bias.abs().sum() > 0
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))


# --------------------------------------------------------------------------------------------
# an explicit head_dim (Qwen3's heads are wider than d_model / n_heads): every fast path runs
# it (they size heads by cfg.head_dim, not d_model), checked against the uncached modules.
# Measured on the 2-core AMD EPYC with AVX-512 (2026-11-27), 8 seeds: the tiled, plain and packed
# steps 1.4e-6 to 3.3e-6 from float64 for logits up to 16, at most 1.33x the full forward's error.

WIDE = ModelConfig(**{**BASE, "d_ff": 48}, head_dim=16)      # 4 heads of 16 over D=32: H*hd = 2D


def cached_against_uncached(model: TinyGPT, what: str, **step_options) -> DecodeStep:
    """Six cached steps after a prefill against the full forward (and float64)."""
    cache = KVCache.for_model(model, 1, 40)
    step = DecodeStep(model, cache, **step_options)
    prompt = torch.randint(0, 53, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, ids = [prefill(model, cache, prompt)], prompt
        for _ in range(6):
            token = logits[-1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], 1)
            logits.append(step(token))
        full, truth = model(ids)[0, 8:], float64_twin(model)(ids)[0, 8:]
    check_float32_error(what, torch.cat(logits), full, truth, factor=LOGITS_FACTOR,
                        floor=LOGITS_FLOOR)
    return step


def test_wide_heads_run_every_decode_step_path():
    from tinygpt import cpu_kernels

    assert WIDE.fast_path_refusal() is None and WIDE.n_heads * WIDE.head_dim == 2 * WIDE.d_model
    model = make(WIDE)
    tiled = cached_against_uncached(model, "the tiled step, head_dim 16")
    if cpu_kernels.available() is None:          # the C layers (cpu_gemv.c's tg_layer) ran
        assert tiled.tiled and tiled._layers is not None
    plain = cached_against_uncached(model, "the plain fused step, head_dim 16", tiled=False)
    assert plain._weights is not None and plain._layers is None
    with warnings.catch_warnings():              # a torch without oneDNN falls back: fine
        warnings.simplefilter("ignore", PackFallbackWarning)
        cached_against_uncached(model, "the packed step, head_dim 16", pack_weights=True)
    q8 = cpu_kernels.q8_0_model(model)
    step = DecodeStep(q8, KVCache.for_model(q8, 1, 8))
    assert step.tiled == (cpu_kernels.available() is None)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    prompt = [3, 14, 15, 9, 2, 6]
    assert generate(q8, prompt, params).token_ids == \
        generate(q8, prompt, params, use_cache=False).token_ids


def test_wide_heads_run_the_engine_and_the_quantized_step():
    from tinygpt import cpu_gemm
    from tinygpt.quant import QuantizedDecodeStep, quantize_model

    model = make(WIDE)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    prompts = [[3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [5, 3, 5], [7]]
    want = [generate(model, p, params, use_cache=False).token_ids for p in prompts]
    engine = Engine(model, max_running=2, token_budget=8)
    assert engine.runner.batched == (cpu_gemm.refusal(model) is None)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    quantized = quantize_model(model, "int8")
    step = QuantizedDecodeStep(quantized, KVCache.for_model(quantized, 1, 32))
    assert step._weights is not None                   # its fused road, not the modules
    assert generate(quantized, prompts[0], params).token_ids == \
        generate(quantized, prompts[0], params, use_cache=False).token_ids


def test_wide_heads_split_over_tensor_parallel_ranks():
    cfg = dataclasses.replace(WIDE, qk_norm=True)
    model = make(cfg)
    tensor_parallel_matches_one_process(cfg, model, "the tensor-parallel logits, head_dim 16")


def test_wide_heads_write_and_read_a_gguf_file(tmp_path):
    pytest.importorskip("gguf")
    from tinygpt.bench.llamacpp import write_gguf
    from tinygpt.gguf import config_from_gguf, load_gguf_model, metadata, open_gguf

    cfg = dataclasses.replace(WIDE, vocab_size=300, tie_embeddings=True)   # the writer's
    model = make(cfg)
    write_gguf(model, tmp_path / "wide.gguf", "F32")
    reader = open_gguf(tmp_path / "wide.gguf")
    assert metadata(reader, "llama.attention.key_length") == 16      # llama.cpp's head width
    assert config_from_gguf(reader) == cfg
    back = load_gguf_model(tmp_path / "wide.gguf")
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def tensor_parallel_matches_one_process(cfg, model, what: str) -> None:
    """Greedy decode over 2 tensor-parallel ranks: the ranks agree, the tokens are batch-1
    generate()'s and the logits as close to float64 as the one-process model's."""
    from tinygpt.parallel import tp_check

    prompts = [[3, 14, 15, 9, 2, 6], [5, 3, 5]]
    out = tp_check((cfg, model.state_dict()), 2, prompts, max_new_tokens=5)
    assert out["ranks_agree"]
    params = SamplingParams(temperature=0, max_new_tokens=5)
    assert out["tokens"] == [generate(model, p, params).token_ids for p in prompts]
    for prompt, got in zip(prompts, out["logits"], strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            check_float32_error(what, got, model(ids)[0], float64_twin(model)(ids)[0],
                                factor=LOGITS_FACTOR, floor=LOGITS_FLOOR)
