"""Day 21's multi-head latent attention (tinygpt.mla) and DeepSeek-V3 folders
(tinygpt.hf_deepseek): the attention module against transformers' DeepseekV3Attention (with
and without q_lora_rank, interleaved RoPE or not), a whole random DeepseekV3ForCausalLM with
plain RoPE and with YaRN (logits, greedy tokens), the latent cache's naive and absorbed
decodes against each other and the uncached model, generate() and DecodeStep on it, day 17's
runner and engine on a paged latent pool, a saved folder through load_model, KV bytes per
token and tinygpt.flops, and what is refused.

Tolerances: each float32 result is measured against a float64 run of the same computation
(tinygpt.testing.check_float32_error): ours may be at most FACTOR times as far from it as an
independent float32 run (transformers', or our uncached model, or the naive decode) is, plus
FLOOR. Measured on the 2-core AMD EPYC with AVX-512 (2026-11-27), 8 draws of weights and inputs
each, ours over the reference: attention modules (4 variants, outputs up to ~1, errors 5e-8 to
1.2e-7) at most 1.38; whole models (logits up to 0.63, errors 1.3e-7 to 2.2e-7; 5 more draws with
YaRN) at most 1.08; cached
decode (naive or absorbed) against the uncached model at most 1.13; the runner on a latent
pool (logits up to ~1, errors 1.3e-7 to 2.4e-7) at most 1.24; day 13's padded rows at most
2.05 (a 2-token row: 1.6e-7 against 7.8e-8), beam search's log-probability at most 1.0.
FACTOR = 4 (as day 20's
tests/test_moe_hf.py); a wrong head, a RoPE channel out of order, a lost latent or a wrong
scale is off by the outputs' own size (0.1 to 1).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tinygpt.generate import generate
from tinygpt.kv_cache import DecodeStep, KVCache, prefill
from tinygpt.mla import (
    LatentLayerCache,
    MLAttention,
    kv_bytes_per_token_expanded,
    kv_bytes_per_token_mla,
)
from tinygpt.model import ModelConfig, TinyGPT, count_parameters
from tinygpt.positions import rope_cos_sin
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error

transformers = pytest.importorskip("transformers")

from tests.test_moe_hf import WORDS, hf_greedy, word_tokenizer  # noqa: E402
from tinygpt.hf_deepseek import (  # noqa: E402
    config_from_hf_deepseek,
    from_hf_deepseek,
    mla_from_hf_attention,
)
from tinygpt.hf_models import config_from_hf, from_hf  # noqa: E402

FACTOR, FLOOR = 4.0, 1e-7
MLA = dict(attention="mla", kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16)


def hf_config(**changes):
    """The brief's tiny DeepSeek-V3: hidden 64, 4 heads, latent 32, RoPE key 8, nope 16, v 16,
    8 routed experts in 4 groups (2 chosen), 1 shared expert, the first layer dense."""
    kwargs = dict(vocab_size=len(WORDS), hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                  first_k_dense_replace=1, max_position_embeddings=64,
                  routed_scaling_factor=2.5, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, experts_implementation="eager",
                  attn_implementation="eager")
    kwargs.update(changes)
    return transformers.DeepseekV3Config(**kwargs)


def hf_model(seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config(**changes)).eval()
    with torch.no_grad():               # a router bias that matters (transformers inits 0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    return model


def tiny_cfg(**changes) -> ModelConfig:
    kwargs = dict(vocab_size=len(WORDS), d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                  d_ff=96, max_seq_len=64, n_experts=8, top_k=2, d_expert=32,
                  router="sigmoid_groups", n_group=4, topk_group=2, routed_scale=2.5,
                  n_shared_experts=1, dense_layers=(0,), **MLA)
    kwargs.update(changes)
    return ModelConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# the attention module


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("interleave", [False, True])
def test_mla_attention_equals_transformers(q_lora_rank, interleave):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    config = hf_config(q_lora_rank=q_lora_rank, rope_interleave=interleave)
    torch.manual_seed(1)
    theirs = DeepseekV3Attention(config, 0)
    for p in theirs.parameters():                 # norms too: not all ones
        torch.nn.init.normal_(p, std=0.15)
    ours = mla_from_hf_attention(theirs)
    assert (ours.wq is None) == (q_lora_rank is not None)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(2))
    rotary = DeepseekV3RotaryEmbedding(config)
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = theirs(x, rotary(x, torch.arange(9)[None]), mask)[0]
        cos64, sin64 = rotary(x.double(), torch.arange(9)[None])
        truth = copy.deepcopy(theirs).double()(x.double(), (cos64.double(), sin64.double()),
                                               mask.double())[0]
        got = ours(x, *rope_cos_sin(8, 9, 10000.0))
    check_float32_error("MLAttention", got, want, truth, factor=FACTOR, floor=FLOOR)


def test_absorbed_attention_equals_the_naive_one():
    """Scores and outputs straight from the latents (wkv_b folded into the query and the
    output) against decompressing them, causal and over a longer cache, float64 the truth."""
    attention = MLAttention(tiny_cfg())
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0, 0.2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 64, generator=gen)
    past = torch.randn(2, 7, 32, generator=gen), torch.randn(2, 7, 8, generator=gen)
    cos, sin = rope_cos_sin(8, torch.arange(7, 12), 10000.0)
    twin = copy.deepcopy(attention).double()
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)     # 7 cached positions, 5 new ones
    results = {}
    for model, dtype in ((attention, torch.float32), (twin, torch.float64)):
        with torch.no_grad():
            q = model.queries(x.to(dtype), cos.to(dtype), sin.to(dtype))
            c, k_pe = model.latent(x.to(dtype), cos.to(dtype), sin.to(dtype))
            c = torch.cat([past[0].to(dtype), c], 1)
            k_pe = torch.cat([past[1].to(dtype), k_pe], 1)
            for m in (mask, None):
                results[dtype, m is None] = (model.attend_naive(*q, c, k_pe, m),
                                             model.attend_absorbed(*q, c, k_pe, m))
    for unmasked in (False, True):
        naive, absorbed = results[torch.float32, unmasked]
        truth, truth_absorbed = results[torch.float64, unmasked]
        assert (truth_absorbed - truth).abs().max() < 1e-12 * truth.abs().max()
        check_float32_error(f"absorbed attention (unmasked={unmasked})", absorbed, naive,
                            truth, factor=FACTOR, floor=FLOOR)
    # the mask matters here: a decode that ignored it would be caught
    assert (results[torch.float64, True][0] - results[torch.float64, False][0]).abs().max() > 0.01


# --------------------------------------------------------------------------------------------
# the whole model


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16}


@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_model_equals_transformers_deepseek_v3(yarn):
    """With YaRN (DeepSeek-V3's scaling, here 4x over 16 positions, mscale 0.707 against
    mscale_all_dim 1 as DeepSeek-V2 has it: the tables' attention factor and the scores'
    mscale^2 both differ from 1); the generation runs past the original 16 positions."""
    theirs = hf_model(q_lora_rank=24, **({"rope_parameters": YARN} if yarn else {}))
    ours = from_hf_deepseek(theirs, theirs.config)
    assert ours.cfg == tiny_cfg(q_lora_rank=24, norm_eps=1e-6,
                                rope_scaling={k: v for k, v in YARN.items()
                                              if k != "rope_theta"} if yarn else ())
    mscale = 0.1 * math.log(4.0) + 1
    assert ours.layers[0].attention.scale == pytest.approx(24 ** -0.5 * (mscale ** 2 if yarn
                                                                         else 1))
    assert isinstance(ours.layers[0].attention, MLAttention)
    assert ours.cfg.is_moe_layer(1) and not ours.cfg.is_moe_layer(0)
    assert count_parameters(ours.cfg) == sum(p.numel() for p in ours.parameters()) == \
        sum(p.numel() for p in theirs.parameters())
    ids = torch.randint(0, len(WORDS), (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)
        truth = copy.deepcopy(theirs).double()(ids).logits
    err, ref_err = check_float32_error("TinyGPT from deepseek_v3", got, want, truth,
                                       factor=FACTOR, floor=FLOOR)
    prompt, n = [3, 4, 5, 6, 7], 20
    tokens = hf_greedy(theirs, prompt, n)
    with torch.no_grad():               # no step may be a near-tie at float32's error
        steps = theirs(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    top2 = steps.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 100 * max(err, ref_err)
    greedy = SamplingParams(temperature=0, max_new_tokens=n)
    assert generate(ours, prompt, greedy).token_ids == tokens
    assert generate(ours, prompt, greedy, use_cache=False).token_ids == tokens


# --------------------------------------------------------------------------------------------
# decoding from the latent cache


@pytest.mark.parametrize("decode", ["absorbed", "naive"])
@pytest.mark.parametrize("static", [False, True])
def test_cached_decode_equals_the_uncached_model(decode, static):
    model = TinyGPT(tiny_cfg(q_lora_rank=24), seed=1)
    for layer in model.layers:
        layer.attention.decode = decode
    twin = copy.deepcopy(model).double()
    ids = torch.randint(0, len(WORDS), (2, 12), generator=torch.Generator().manual_seed(4))
    cache = KVCache.for_model(model, 2, 20, static=static)
    layer = cache.layers[0]
    assert isinstance(layer, LatentLayerCache) and not hasattr(layer, "k")
    assert layer.c.shape == (2, 20, 32) and layer.k_pe.shape == (2, 20, 8)
    assert cache.nbytes == 2 * 20 * kv_bytes_per_token_mla(model.cfg, dtype_bytes=4)
    with torch.no_grad():
        full, truth = model(ids)[:, 4:11], twin(ids)[:, 4:11]
        logits = [prefill(model, cache, ids[:, :5])]
        step = DecodeStep(model, cache)
        assert "multi-head latent attention" in step.tiled_reason
        logits += [step(ids[:, t:t + 1]) for t in range(5, 11)]
    assert cache.length == 11
    check_float32_error(f"{decode} decode", torch.stack(logits, 1), full, truth,
                        factor=FACTOR, floor=FLOOR)


def test_the_decode_really_switches():
    """The two decodes round differently: equal logits would mean one path never ran."""
    model = TinyGPT(tiny_cfg(), seed=2)
    ids = torch.randint(0, len(WORDS), (1, 9), generator=torch.Generator().manual_seed(5))
    results = {}
    for decode in ("absorbed", "naive"):
        for layer in model.layers:
            layer.attention.decode = decode
        cache = KVCache.for_model(model, 1, 16)
        with torch.no_grad():
            prefill(model, cache, ids[:, :8])
            results[decode] = DecodeStep(model, cache)(ids[:, 8:])
    assert not torch.equal(results["absorbed"], results["naive"])
    torch.testing.assert_close(results["absorbed"], results["naive"], rtol=0, atol=1e-5)
    model.layers[0].attention.decode = "fast"
    with pytest.raises(ValueError, match=r"decode must be one of \('absorbed', 'naive'\)"):
        model(ids, kv_cache=KVCache.for_model(model, 1, 16))


def test_generate_on_an_mla_model_gives_the_uncached_tokens():
    model = TinyGPT(tiny_cfg(), seed=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=20)
    cached = generate(model, [3, 4, 5], greedy).token_ids
    assert cached == generate(model, [3, 4, 5], greedy, use_cache=False).token_ids
    assert len(set(cached)) > 2                                   # not one token repeated


# --------------------------------------------------------------------------------------------
# folders, bytes, refusals


def test_a_saved_folder_loads_through_load_model(tmp_path):
    from safetensors.torch import load_file

    from tinygpt.loading import load_model

    theirs = hf_model(seed=5)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    word_tokenizer().save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    experts = [k for k in on_disk if ".experts." in k]
    assert experts and all(k.split(".experts.")[1].split(".")[0].isdigit() for k in experts)
    model, tokenizer, _ = load_model(tmp_path)
    assert model.cfg.attention == "mla"
    prompt = tokenizer.encode("the cat sat on the")
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    assert generate(model, prompt, greedy).token_ids == hf_greedy(theirs, prompt, 12)


def sharp_model(seed: int) -> TinyGPT:
    """A random MLA model whose attention matters: its matrices drawn 0.15 wide, so scores
    spread over several units (the default 0.02 leaves softmax nearly uniform)."""
    model = TinyGPT(tiny_cfg(q_lora_rank=24), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for p in layer.attention.parameters():
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return model


def test_runner_logits_on_a_latent_pool_equal_the_model():
    """tinygpt.runner over PagedKVCache(latent=r): prefills of several lengths and decodes
    mixed in one call, blocks of 4, against the uncached model and float64."""
    import random

    from tinygpt.paged import PagedKVCache
    from tinygpt.runner import ModelRunner

    model = sharp_model(8)
    exact = copy.deepcopy(model).double()
    cache = PagedKVCache.for_model(model, num_blocks=40, block_size=4)
    runner = ModelRunner(model, cache)
    rng = random.Random(8)
    seqs = {i: [rng.randrange(len(WORDS)) for _ in range(n)] for i, n in enumerate((3, 17, 9))}
    done = dict.fromkeys(seqs, 0)
    got, want, truth = [], [], []
    for seq_id in seqs:
        cache.add(seq_id)
    while any(done[i] < len(ids) for i, ids in seqs.items()):
        work = []
        decodes = rng.random() < 0.4
        for seq_id, ids in seqs.items():
            n = min(1 if decodes else rng.randint(1, 6), len(ids) - done[seq_id])
            if n:
                cache.reserve(seq_id, n)
                work.append((seq_id, ids[done[seq_id]:done[seq_id] + n], done[seq_id]))
        logits = runner.forward(work)
        for row, (seq_id, chunk, start) in enumerate(work):
            end = start + len(chunk)
            with torch.inference_mode():
                context = torch.tensor([seqs[seq_id][:end]])
                want.append(model(context)[0, -1])
                truth.append(exact(context)[0, -1])
            got.append(logits[row])
            cache.lengths[seq_id] = done[seq_id] = end
    check_float32_error("the runner on a latent pool", torch.stack(got), torch.stack(want),
                        torch.stack(truth), factor=FACTOR, floor=FLOOR)


def test_the_engine_runs_mla_on_a_latent_pool():
    """Day 17's engine: the paged pool holds one latent + RoPE key per token and layer (the
    absorbed decode as multi-query attention); mixed prefills and decodes, a shared prefix
    block and copy-on-write give generate()'s greedy tokens."""
    from tinygpt.engine import Engine
    from tinygpt.paged import PagedKVCache

    model = sharp_model(7)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
               [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 21], [22, 23, 24]]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    want = [generate(model, p, params).token_ids for p in prompts]
    engine = Engine(model, prefix_caching=True, max_running=3)
    pool = engine.cache
    assert pool.latent == 32 and pool.v is pool.k
    assert pool.k.shape[2:] == (1, 16, 32 + 8)          # (blocks, 1 head, block_size, r + rope)
    assert not engine.runner.batched and "latent" in engine.runner.batched_reason
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    hits = engine.scheduler.prefix_hit_tokens
    assert [r.token_ids for r in engine.generate(prompts[:2], params)] == want[:2]
    assert engine.scheduler.prefix_hit_tokens > hits
    with pytest.raises(ValueError, match="latent.*ModelRunner"):
        pool.sequence(0)
    with pytest.raises(ValueError, match="latent must be 0 or kv_lora_rank"):
        PagedKVCache(1, 2, 40, num_blocks=2, latent=32)


def test_kv_bytes_per_token_of_deepseek_v3():
    cfg = config_from_hf(transformers.DeepseekV3Config().to_dict())
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.n_layers) == (512, 64, 61)
    assert kv_bytes_per_token_mla(cfg) == (512 + 64) * 61 * 2 == 70_272
    assert kv_bytes_per_token_expanded(cfg) == 128 * (192 + 128) * 61 * 2 == 4_997_120
    assert kv_bytes_per_token_mla(cfg, dtype_bytes=1) == 35_136
    with pytest.raises(ValueError, match=r"dtype_bytes must be one of \(1, 2, 4, 8\)"):
        kv_bytes_per_token_mla(cfg, 3)
    with pytest.raises(ValueError, match="attention='mla'"):
        kv_bytes_per_token_mla(tiny_cfg(attention="gqa", kv_lora_rank=0, qk_rope_head_dim=0,
                                        qk_nope_head_dim=0, v_head_dim=0, n_kv_heads=2))


@pytest.mark.parametrize("change,match", [
    (dict(attention="mqa"), r"attention must be one of \('gqa', 'mla'\)"),
    (dict(attention="gqa"), "kv_lora_rank=32 needs multi-head latent attention"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be >= 1"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be a positive even integer"),
    (dict(q_lora_rank=-1), "q_lora_rank must be an integer >= 0"),
    (dict(n_kv_heads=2), "n_kv_heads must equal n_heads"),
    (dict(head_dim=16), "head_dim must be None or qk_rope_head_dim=8"),
    (dict(qk_norm=True), "qk_norm=True"),
    (dict(sliding_window=4), "sliding_window must be 0 with attention='mla'"),
])
def test_bad_mla_configs_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        tiny_cfg(**change)


def test_mla_fields_leave_other_configs_alone():
    dense = ModelConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8,
                        max_seq_len=8)
    assert dense.attention == "gqa" and dense.kv_lora_rank == 0 and dense.head_dim == 8
    assert tiny_cfg().head_dim == 8 and "latent" in tiny_cfg().fast_path_refusal()


@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}),
     "longrope"),
    (dict(num_key_value_heads=2), "num_key_value_heads must equal"),
    (dict(attention_bias=True), "bias"),
    (dict(hidden_act="gelu"), "silu"),
    # a TypeError from float(None), and 0 read as "one per head", before
    (dict(rms_norm_eps=None), "rms_norm_eps must be a finite number > 0, got None"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be None or an int >= 1"),
])
def test_deepseek_configs_we_cannot_run_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf_deepseek({**hf_config().to_dict(), **change})


def test_missing_and_extra_weights_are_named():
    theirs = hf_model(seed=6)
    state = dict(theirs.state_dict())
    del state["model.layers.1.self_attn.kv_b_proj.weight"]
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="missing keys.*kv_b_proj.*unexpected keys.*k_proj"):
        from_hf(state, theirs.config)
    state = dict(theirs.state_dict())
    state["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 32)
    with pytest.raises(ValueError, match="kv_b_proj.weight has shape"):
        from_hf(state, theirs.config)
    with pytest.raises(TypeError, match="DeepseekV3Attention"):
        mla_from_hf_attention(torch.nn.Linear(2, 2))


def test_tied_embeddings_need_an_equal_lm_head():
    """As from_hf_llama and from_hf_moe: with tie_word_embeddings an lm_head.weight is
    optional, and refused when it differs from the embedding."""
    theirs = hf_model(seed=6, tie_word_embeddings=True)
    state = dict(theirs.state_dict())
    model = from_hf_deepseek(state, theirs.config)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, state["model.embed_tokens.weight"])
    del state["lm_head.weight"]
    assert torch.equal(from_hf_deepseek(state, theirs.config).output.weight,
                       model.output.weight)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings is True but lm_head.weight "
                                         "differs"):
        from_hf_deepseek(state, theirs.config)


def test_flops_and_bytes_count_the_latent_model():
    """tinygpt.flops on an MLA config: parameters as built, the cache's real bytes, and a
    prefill's FLOPs as torch's FlopCounterMode counts them (dense feed-forwards: exact)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tinygpt import flops as F

    for cfg in (tiny_cfg(q_lora_rank=24), tiny_cfg()):
        built = sum(p.numel() for p in TinyGPT(cfg, seed=None).parameters())
        assert F.param_count(cfg) == count_parameters(cfg) == built
        assert F.kv_cache_bytes(cfg, 1, 1, "bf16") == kv_bytes_per_token_mla(cfg) \
            == 2 * (32 + 8) * 2
        assert KVCache.for_model(TinyGPT(cfg), 3, 10).nbytes == F.kv_cache_bytes(cfg, 10, 3,
                                                                                 "fp32")
    dense = ModelConfig(vocab_size=len(WORDS), d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                        d_ff=96, max_seq_len=64, q_lora_rank=24, **MLA)
    model = TinyGPT(dense)
    ids = torch.randint(0, len(WORDS), (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == F.prefill_flops(dense, 2, 7)
    # a score and a weighted value per key and head: 2 (16 + 8) + 2 * 16 per layer
    assert F.attention_flops_per_token(dense, 5) == 2 * 4 * 2 * (16 + 8 + 16) * 5


def test_batched_generation_and_beam_search_on_mla():
    """Day 13's padded batches over a latent cache: each row's greedy tokens equal generate()'s
    for that prompt alone (prompts of different lengths, rows finishing early), and the padded
    forward's logits equal the uncached model's for every real token."""
    from tinygpt.batching import BatchedKVCache, beam_search, generate_batch, left_pad

    model = sharp_model(9)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    params = [SamplingParams(temperature=0, max_new_tokens=n) for n in (8, 5, 8)]
    want = [generate(model, p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in generate_batch(model, prompts, params)] == want
    ids, mask = left_pad(prompts)
    batch = BatchedKVCache(model, 3, 16)
    with torch.no_grad():
        logits = batch.forward(ids, mask)
        exact = copy.deepcopy(model).double()
        for row, prompt in enumerate(prompts):
            got = logits[row, mask[row]]
            check_float32_error(f"padded row {row}", got, model(torch.tensor([prompt]))[0],
                                exact(torch.tensor([prompt]))[0], factor=FACTOR, floor=FLOOR)
    batch.reorder([2, 0])
    assert batch.cache.layers[0].c.shape[0] == 2
    # beam search reorders the latent rows every step: its best beam's log-probability
    # equals the uncached model's for those tokens
    prompt = prompts[0]
    best = beam_search(model, prompt, 3, 6)
    tokens = torch.tensor(best.token_ids)
    sums = []
    for m in (model, exact):
        with torch.no_grad():
            logits = m(torch.tensor([prompt + best.token_ids]))[0, len(prompt) - 1:-1]
        sums.append(torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].sum())
    assert best.hypotheses[0].token_ids == best.token_ids
    check_float32_error("beam search's log-probability", torch.tensor(best.hypotheses[0].log_prob),
                        sums[0], sums[1], factor=FACTOR, floor=FLOOR)


def test_checkpoints_and_speculative_decoding_on_mla(tmp_path):
    """A TinyGPT checkpoint keeps the MLA fields and weights; speculative decoding (the
    cache's multi-token verify pass and its rollback) gives the target's greedy tokens."""
    import dataclasses

    from tinygpt import load_pretrained
    from tinygpt.speculative import PromptLookupDrafter, speculative_generate
    from tinygpt.train import load_checkpoint, save_checkpoint

    _, tokenizer = load_pretrained()
    cfg = dataclasses.replace(tiny_cfg(q_lora_rank=24), vocab_size=tokenizer.vocab_size)
    model = TinyGPT(cfg, seed=10)
    save_checkpoint(tmp_path, model, tokenizer)
    back, _ = load_checkpoint(tmp_path)
    assert back.cfg == cfg and isinstance(back.layers[1].attention, MLAttention)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]          # repeats: the drafter proposes often
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    result = speculative_generate(model, PromptLookupDrafter(), prompt, greedy, gamma=3)
    assert result.token_ids == generate(model, prompt, greedy).token_ids
    stats = result.stats                  # drafts were verified, some rejected (rolled back)
    assert sum(stats.proposed) > 0 and sum(stats.accepted) < sum(stats.proposed)


def test_paths_written_for_llama_attention_refuse_mla():
    from tinygpt.bench.llamacpp import write_gguf
    from tinygpt.parallel.model import check_tensor_parallel
    from tinygpt.quant import quantize_model

    model = TinyGPT(tiny_cfg(n_experts=0, top_k=0, d_expert=0, router="softmax", n_group=1,
                             topk_group=1, routed_scale=1.0, n_shared_experts=0,
                             dense_layers=()))
    with pytest.raises(ValueError, match="tensor parallelism.*multi-head latent attention"):
        check_tensor_parallel(model.cfg)
    with pytest.raises(ValueError, match="quantize_model.*multi-head latent attention"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="write_gguf.*multi-head latent attention"):
        write_gguf(model, None, "F32")
