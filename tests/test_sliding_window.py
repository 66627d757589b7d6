"""Day 21: sliding-window attention (ModelConfig.sliding_window / full_attention_layers,
tinygpt.attention.sliding_window_mask, Attention's windowed forward).

The mask's convention (a query at t sees keys t - W + 1 .. t, transformers' Mistral), the
windowed model against a plain oracle (every layer written out with a mask built key by key),
day 11's caches (dynamic and static) and generate() against the uncached windowed model,
hybrid local / global layers, the rolling cache, the engine (masks, blocks dropped out of the
window), the refusals of the paths that cannot honour a window, and random Hugging Face
Mistral, Mixtral and Qwen3-MoE (use_sliding_window) models with a window shorter than prompt
+ generation against transformers (logits, greedy tokens, a Mistral folder via load_model).

Tolerance of the logits against transformers: as tests/test_rope_scaling.py, ours at most
FACTOR times as far from transformers' float64 run as transformers' float32 run, plus FLOOR.
Measured on the 2-core AMD EPYC with AVX-512 (2026-11-27), 5 weight draws each (logits up to 0.77,
errors 1.4e-7 to 2.6e-7): ours over theirs 1.00 against Mistral's eager attention, Mixtral and
Qwen3-MoE (the same float32 sums), at most 1.20 against Mistral's sdpa. A window one key
wider moves the logits by more than 1e-3 (checked below); so does the mask off by one.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tinygpt.attention import causal_mask_bool, repeat_kv, sliding_window_mask
from tinygpt.generate import generate
from tinygpt.kv_cache import DecodeStep, KVCache
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error

FACTOR, FLOOR = 4.0, 1e-7
BASE = dict(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64,
            max_seq_len=48)


def test_the_mask_is_mistrals_convention():
    for t_q, t_k, w in [(6, 6, 3), (2, 9, 4), (1, 7, 3), (5, 5, 1), (4, 4, 10)]:
        got = sliding_window_mask(t_q, t_k, w)
        want = torch.tensor([[0 <= (i + t_k - t_q) - j < w for j in range(t_k)]
                             for i in range(t_q)])
        assert torch.equal(got, want), (t_q, t_k, w)
    assert torch.equal(sliding_window_mask(5, 7, 7), causal_mask_bool(5, 7))
    assert sliding_window_mask(1, 9, 4).tolist() == [[False] * 5 + [True] * 4]
    with pytest.raises(ValueError, match="window must be a positive integer"):
        sliding_window_mask(3, 3, 0)
    with pytest.raises(ValueError, match="t_k .* must be >= t_q"):
        sliding_window_mask(4, 3, 2)


@pytest.mark.parametrize("change,match", [
    (dict(sliding_window=-1), "sliding_window must be an integer >= 0"),
    (dict(sliding_window=2.5), "sliding_window must be an integer"),
    (dict(full_attention_layers=(1,)), "needs sliding_window >= 1"),
    (dict(sliding_window=4, full_attention_layers=(3,)), r"in \[0, n_layers=3\)"),
    (dict(sliding_window=4, full_attention_layers=(1, 1)), "distinct"),
    (dict(sliding_window=4, full_attention_layers="1"), "tuple of layer indices"),
])
def test_bad_windows_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**BASE, **change)


def oracle(model: TinyGPT, ids: torch.Tensor) -> torch.Tensor:
    """The model written out layer by layer: full attention scores, then the window's mask
    built key by key from cfg.layer_window, softmax and the rest of the block."""
    cfg, T = model.cfg, ids.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.tok_embeddings(ids)
    for i, layer in enumerate(model.layers):
        attn, w = layer.attention, cfg.layer_window(i) or T + 1
        q, k, v = attn.qkv(layer.attention_norm(x), cos, sin)
        k, v = repeat_kv(k, cfg.n_rep), repeat_kv(v, cfg.n_rep)
        scores = q @ k.transpose(-2, -1) / math.sqrt(cfg.head_dim)
        allowed = torch.tensor([[j <= t and t - j < w for j in range(T)] for t in range(T)])
        y = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
        x = x + attn.wo(y.transpose(1, 2).reshape(ids.shape[0], T, -1))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(model.norm(x))


@pytest.fixture(scope="module")
def windowed():
    cfg = ModelConfig(**BASE, sliding_window=5, full_attention_layers=(1,))
    return TinyGPT(cfg, seed=3).eval()


IDS = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_the_windowed_model_equals_the_oracle_and_differs_from_full_attention(windowed):
    cfg = windowed.cfg
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    assert [layer.attention.window for layer in windowed.layers] == [5, None, 5]
    got = windowed(IDS)
    torch.testing.assert_close(got, oracle(windowed, IDS), rtol=0, atol=2e-6)
    # the window matters: full attention, every layer windowed, or W off by one all differ
    for change in (dict(sliding_window=0, full_attention_layers=()),
                   dict(full_attention_layers=()), dict(sliding_window=4),
                   dict(sliding_window=6)):
        other = copy.deepcopy(windowed)
        other.cfg = ModelConfig(**{**BASE, "sliding_window": 5, "full_attention_layers": (1,),
                                   **change})
        for i, layer in enumerate(other.layers):
            layer.attention.window = other.cfg.layer_window(i)
        torch.testing.assert_close(other(IDS), oracle(other, IDS), rtol=0, atol=2e-6)
        assert (other(IDS) - got).abs().max() > 1e-3, change
    # positions before the window closes are untouched by it
    full = copy.deepcopy(windowed)
    for layer in full.layers:
        layer.attention.window = None
    torch.testing.assert_close(full(IDS[:, :5]), got[:, :5], rtol=0, atol=1e-6)


@torch.no_grad()
def test_both_caches_and_generate_equal_the_uncached_windowed_model(windowed):
    want = windowed(IDS)
    cache = KVCache.for_model(windowed, 2)
    parts = [windowed(IDS[:, :12], kv_cache=cache)]
    parts += [windowed(IDS[:, t:t + 1], kv_cache=cache) for t in range(12, 20)]
    parts.append(windowed(IDS[:, 20:], kv_cache=cache))       # several new tokens at once
    torch.testing.assert_close(torch.cat(parts, 1), want, rtol=0, atol=1e-5)
    static = KVCache.for_model(windowed, 2, static=True)
    parts = [windowed(IDS[:, :7], input_pos=torch.arange(7), kv_cache=static)]
    parts += [windowed(IDS[:, t:t + 1], input_pos=torch.tensor([t]), kv_cache=static)
              for t in range(7, 30)]
    torch.testing.assert_close(torch.cat(parts, 1), want, rtol=0, atol=1e-5)
    # the decode step runs the modules (its fused kernels read whole caches), same logits
    cache = KVCache.for_model(windowed, 1)
    step = DecodeStep(windowed, cache)
    assert not step.tiled and "sliding-window" in step.tiled_reason
    windowed(IDS[:1, :10], kv_cache=cache)
    torch.testing.assert_close(step(IDS[:1, 10:11]), want[0, 10][None], rtol=0, atol=1e-5)
    # generate (the cached loop) gives the uncached loop's greedy tokens
    params = SamplingParams(temperature=0, max_new_tokens=25)
    prompt = IDS[0, :8].tolist()
    cached = generate(windowed, prompt, params).token_ids
    assert cached == generate(windowed, prompt, params, use_cache=False).token_ids
    assert len(cached) == 25                                  # far past the window of 5


@torch.no_grad()
def test_a_rolling_cache_holds_only_the_window_and_gives_the_same_logits(windowed):
    from tinygpt.kv_cache import LayerKVCache
    from tinygpt.rolling import RollingLayerCache

    want = windowed(IDS)
    cache = KVCache.for_model(windowed, 2, rolling=True, slack=2)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [RollingLayerCache, LayerKVCache, RollingLayerCache]
    per_slot = 2 * 2 * 2 * 8 * 4            # k and v, batch 2, 2 KV heads, head_dim 8, float32
    assert cache.nbytes == per_slot * (48 + 2 * (5 + 2))      # one full layer, two rings of 7
    parts = [windowed(IDS[:, :12], kv_cache=cache)]         # a prefill longer than the ring
    parts += [windowed(IDS[:, t:t + 1], kv_cache=cache) for t in range(12, 20)]
    parts.append(windowed(IDS[:, 20:23], kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), want[:, :23], rtol=0, atol=1e-5)
    # speculative decoding's rollback: back by slack + 1 = 3 is safe, by 4 is refused
    cache.length = 20
    torch.testing.assert_close(windowed(IDS[:, 20:30], kv_cache=cache), want[:, 20:],
                               rtol=0, atol=1e-5)
    cache.length = 26
    with pytest.raises(ValueError, match="cannot go back to position 26.*slack \\+ 1 = 3"):
        windowed(IDS[:, 26:27], kv_cache=cache)
    cache.reset()                                           # from 0 again: all fine
    torch.testing.assert_close(windowed(IDS[:, :9], kv_cache=cache), want[:, :9], rtol=0,
                               atol=1e-5)
    with pytest.raises(ValueError, match="rolling=True needs a dynamic cache"):
        KVCache.for_model(windowed, rolling=True, static=True)
    with pytest.raises(ValueError, match="rolling=True needs a model with a sliding window"):
        KVCache.for_model(TinyGPT(ModelConfig(**BASE)), rolling=True)
    with pytest.raises(ValueError, match="rolling must be True or False"):
        KVCache.for_model(windowed, rolling="yes")
    with pytest.raises(ValueError, match="slack must be an integer >= 0"):
        KVCache.for_model(windowed, rolling=True, slack=-1)


def test_the_engine_masks_windows_and_gives_generate_tokens(windowed):
    from tinygpt.engine import Engine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 20, 9, 30)]
    params = SamplingParams(temperature=0, max_new_tokens=15)
    want = [generate(windowed, p, params).token_ids for p in prompts]
    engine = Engine(windowed, None, max_running=3, token_budget=16, block_size=4)
    assert not engine.runner.batched and "sliding-window" in engine.runner.batched_reason
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    full = copy.deepcopy(windowed)              # the engine's tokens depend on the window
    for layer in full.layers:
        layer.attention.window = None
    assert [generate(full, p, params).token_ids for p in prompts] != want


def test_the_paged_cache_frees_blocks_that_left_every_window():
    from tinygpt.engine import Engine
    from tinygpt.paged import DROPPED, PagedKVCache

    cache = PagedKVCache(1, 1, 4, num_blocks=12, block_size=4, window=6)
    cache.add("a")
    cache.reserve("a", 21)
    cache.lengths["a"] = 20                   # the next query (position 20) reads 15 .. 20
    assert cache.drop_out_of_window("a") == 3 and cache.tables["a"][:4] == [DROPPED] * 3 + [3]
    cache.lengths["a"] = 21                   # position 21 reads 16 .. 21: block 3 goes too
    assert cache.drop_out_of_window("a") == 1 and cache.tables["a"][:5] == [DROPPED] * 4 + [4]
    assert cache.drop_out_of_window("a") == 0 and cache.allocator.num_free == 12 - 2
    cache.fork("a", "b")
    cache.check()
    cache.free("a")
    cache.free("b")
    cache.check()
    assert cache.allocator.num_free == 12
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        PagedKVCache(1, 1, 4, num_blocks=2, window=-1)
    # the engine: every layer windowed, so blocks are dropped; the same tokens as generate
    cfg = ModelConfig(**{**BASE, "n_layers": 2, "max_seq_len": 96}, sliding_window=6)
    model = TinyGPT(cfg, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 20, 9, 30)]
    params = SamplingParams(temperature=0, max_new_tokens=40)
    want = [generate(model, p, params).token_ids for p in prompts]
    for prefix_caching in (False, True):
        engine = Engine(model, None, max_running=3, token_budget=16, block_size=4,
                        prefix_caching=prefix_caching)
        pool = engine.runner.cache
        assert pool.window == 6
        held: dict = {}
        complete = engine.scheduler.complete

        def counted(items, complete=complete, pool=pool, held=held):
            complete(items)
            pool.check()
            for item in items:
                if item.n == 1 and item.seq.id in pool.tables:       # a decode step
                    live = sum(b != DROPPED for b in pool.tables[item.seq.id])
                    held[item.seq.id] = max(held.get(item.seq.id, 0), live)

        engine.scheduler.complete = counted
        assert [r.token_ids for r in engine.generate(prompts, params)] == want
        # (W - 1) / block_size blocks of keys still read, plus the newest: 2 or 3 of 4, where
        # the longest sequence (30 + 40 positions) would otherwise hold 18
        assert held and max(held.values()) <= (6 - 1) // 4 + 2
    # a hybrid model's global layers read every key: nothing is dropped
    hybrid = TinyGPT(ModelConfig(**BASE, sliding_window=6, full_attention_layers=(1,)))
    assert PagedKVCache.for_model(hybrid, num_blocks=4).window == 0


def test_paths_that_cannot_honour_a_window_refuse_it(windowed):
    from tinygpt.batching import forward_padded
    from tinygpt.engine import Engine

    cfg = windowed.cfg
    assert "sliding-window" in cfg.fast_path_refusal()
    assert cfg.positions_refusal() == cfg.fast_path_refusal()
    dynamic = TinyGPT(ModelConfig(**BASE, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}))
    with pytest.raises(ValueError, match="runner reads the model's fixed RoPE tables.*dynamic"):
        Engine(dynamic, None)
    with pytest.raises(ValueError, match="forward_padded.*sliding_window=5"):
        forward_padded(windowed, IDS[:, :4], torch.arange(4).expand(2, 4),
                       torch.ones(2, 4, dtype=torch.bool), KVCache.for_model(windowed, 2))
    assert ModelConfig(**BASE).positions_refusal() is None


# --------------------------------------------------------------------------------------------
# Hugging Face Mistral and Mixtral with a window


def hf_mistral(attn: str = "eager", seed: int = 0, **changes):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(**{**dict(
        vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, sliding_window=6, rms_norm_eps=1e-6,
        attn_implementation=attn, bos_token_id=None, eos_token_id=None, pad_token_id=None),
        **changes})
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM(config).eval()


def hf_mixtral(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=50, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, sliding_window=6,
        attn_implementation="eager", experts_implementation="eager", bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).eval()


def hf_qwen3_moe(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=50, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=6, attn_implementation="eager",
        experts_implementation="eager", bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("build", [lambda: hf_mistral("eager"), lambda: hf_mistral("sdpa"),
                                   hf_mixtral, hf_qwen3_moe],
                         ids=["mistral-eager", "mistral-sdpa", "mixtral", "qwen3_moe"])
def test_windowed_hf_models_give_transformers_logits_and_greedy_tokens(build):
    from tinygpt.hf_models import from_hf

    hf = build()
    ours = from_hf(hf, hf.config)
    assert ours.cfg.sliding_window == 6 and ours.cfg.max_seq_len == 64
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
        truth = copy.deepcopy(hf).double()(ids).logits
    err, _ = check_float32_error(f"TinyGPT from {hf.config.model_type} with a window", got, want,
                                 truth, factor=FACTOR, floor=FLOOR)
    wider = copy.deepcopy(ours)                   # one key more per query: far off
    for layer in wider.layers:
        layer.attention.window = 7
    with torch.no_grad():
        assert (wider(ids) - want).abs().max() > 1e-3
    prompt = ids[0, :10].tolist()                 # 10 + 14 > the window of 6
    params = SamplingParams(temperature=0, max_new_tokens=14)
    assert generate(ours, prompt, params).token_ids == hf_greedy(hf, prompt, 14)


def test_a_mistral_folder_loads_and_generates_transformers_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tinygpt.hf_models import config_from_hf
    from tinygpt.loading import load_model

    hf = hf_mistral("sdpa", seed=2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0").save_pretrained(
        tmp_path)
    model, tokenizer, info = load_model(tmp_path)
    assert model.cfg == config_from_hf(hf.config) and model.cfg.sliding_window == 6
    prompt = tokenizer.encode("w3 w7 w9 w11 w4 w4 w8 w20 w31")
    params = SamplingParams(temperature=0, max_new_tokens=16)
    assert generate(model, prompt, params).token_ids == hf_greedy(hf, prompt, 16)
    # a window no shorter than the context hides nothing: no window, the fast paths stay open
    assert config_from_hf(hf_mistral(sliding_window=64).config).sliding_window == 0
    assert config_from_hf(hf_mistral(sliding_window=None).config).sliding_window == 0


def test_the_windowed_cache_size_matches_a_rolling_cache_and_mistral_7b():
    from tinygpt import flops
    from tinygpt.rolling import windowed_kv_cache_bytes

    cfg = ModelConfig(**BASE, sliding_window=5, full_attention_layers=(1,))
    model = TinyGPT(cfg)
    rolling = KVCache.for_model(model, 2, rolling=True)
    assert windowed_kv_cache_bytes(cfg, 48, 2, "fp32") == rolling.nbytes     # max_len 48
    assert windowed_kv_cache_bytes(cfg, 3, 2, "fp32") == flops.kv_cache_bytes(cfg, 3, 2, "fp32")
    plain = ModelConfig(**BASE)
    assert windowed_kv_cache_bytes(plain, 40, 3) == flops.kv_cache_bytes(plain, 40, 3, "bf16")
    mistral = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          d_ff=14336, max_seq_len=32768, rope_base=1e6, sliding_window=4096)
    assert windowed_kv_cache_bytes(mistral, 32768, 1) == 536_870_912          # 0.54 GB
    assert flops.kv_cache_bytes(mistral, 32768, 1, "bf16") == 8 * 536_870_912
    with pytest.raises(ValueError, match="dtype"):
        windowed_kv_cache_bytes(cfg, 4, 1, "fp8")
