"""Day 21's tinygpt.long_context: KV bytes by layout, StreamingLLM's sinks, fp8 KV.

The chunked streaming evaluation is checked against its plain oracle (one token at a time, an
explicit cache whose keys are rotated at their index in the cache every step), against the
model's own forward (full attention) and against a sliding-window model (window only), each
measured against a float64 run of the oracle (tinygpt.testing.check_float32_error)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tinygpt import long_context as LC
from tinygpt.kv_cache import kv_bytes_per_token
from tinygpt.mla import kv_bytes_per_token_mla
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.quant import quantize_kv
from tinygpt.testing import check_float32_error

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=128)
IDS = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model():
    return TinyGPT(CFG, seed=1).eval()


@pytest.fixture(scope="module")
def model64(model):
    m = TinyGPT(CFG, seed=None)
    m.load_state_dict(model.state_dict())
    return m.double().eval()


def plain_losses(m, ids):
    with torch.no_grad():
        return F.cross_entropy(m(ids[None])[0, :-1], ids[1:], reduction="none")


# --------------------------------------------------------------------------------------------
# KV bytes by layout


def test_published_layouts_give_their_bytes_per_token():
    L = LC.LAYOUTS
    assert LC.kv_bytes(L["llama-3-8b (GQA)"], 1) == 131_072
    assert LC.kv_bytes(L["llama-3-8b as MHA"], 1) == 4 * 131_072
    assert LC.kv_bytes(L["llama-3-8b as MQA"], 1) == 131_072 // 8
    assert LC.kv_bytes(L["llama-2-70b (GQA)"], 1) == 327_680
    assert LC.kv_bytes(L["deepseek-v3 (MLA)"], 1) == 70_272
    gemma = L["gemma-3-27b (5 local : 1 global)"]
    per_layer = 2 * 16 * 128 * 2
    assert LC.kv_bytes(gemma, 1024) == 62 * 1024 * per_layer
    assert LC.kv_bytes(gemma, 131_072) == (10 * 131_072 + 52 * 1024) * per_layer
    assert LC.kv_bytes(L["deepseek-v3 (MLA)"], 131_072, dtype_bytes=1) == 131_072 * 576 * 61


def test_kv_bytes_agrees_with_day_11_and_mla_calculators():
    llama = ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_seq_len=64)
    layout = LC.KVLayout("x", 3, n_kv_heads=2, head_dim=16)
    assert LC.kv_bytes(layout, 1) == kv_bytes_per_token(llama, "bf16")
    mla = ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=4,
                      d_ff=128, max_seq_len=64, attention="mla", kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    assert LC.kv_bytes(LC.KVLayout("m", 3, latent=40), 1) == kv_bytes_per_token_mla(mla, 2)


def test_windowed_layers_stop_growing_at_the_window():
    layout = LC.KVLayout("w", 4, n_kv_heads=1, head_dim=8, window=16, local_layers=3)
    grows = [LC.kv_bytes(layout, n) - LC.kv_bytes(layout, n - 1) for n in (2, 16, 17, 500)]
    assert grows == [4 * 32, 4 * 32, 32, 32]


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_layers=0, n_kv_heads=1, head_dim=8), "n_layers"),
    (dict(n_layers=2), "either latent"),
    (dict(n_layers=2, n_kv_heads=1, head_dim=8, latent=4), "either latent"),
    (dict(n_layers=2, latent=4, local_layers=1), "needs a window"),
    (dict(n_layers=2, latent=4, window=8, local_layers=3), "cannot exceed"),
    (dict(n_layers=2, latent=4, window=0), "window must be"),
    (dict(n_layers=2, latent=4, window=8), "window 8 needs local_layers >= 1"),
    (dict(n_layers=2, n_kv_heads=1, head_dim=8, window=8, local_layers=0), "needs local_layers"),
    (dict(n_layers=2, latent=-1), "latent"),
])
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LC.KVLayout("bad", **kwargs)


def test_kv_bytes_refuses_bad_arguments():
    layout = LC.LAYOUTS["deepseek-v3 (MLA)"]
    with pytest.raises(ValueError, match="context"):
        LC.kv_bytes(layout, -1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        LC.kv_bytes(layout, 8, dtype_bytes=0)
    with pytest.raises(TypeError, match="KVLayout"):
        LC.kv_bytes({"n_layers": 2}, 8)


# --------------------------------------------------------------------------------------------
# attention sinks


@pytest.mark.parametrize("window, sinks, chunk", [
    (8, 0, 5), (8, 2, 5), (8, 4, 1), (8, 4, 3), (5, 4, 16), (16, 3, 64), (3, 1, 2), (40, 4, 7)])
def test_chunked_streaming_equals_the_token_by_token_cache(model, model64, window, sinks,
                                                           chunk):
    got = LC.streaming_nll(model, IDS, window=window, sinks=sinks, chunk=chunk)
    ref = LC.streaming_nll_loop(model, IDS, window=window, sinks=sinks)
    truth = LC.streaming_nll_loop(model64, IDS, window=window, sinks=sinks)
    assert got.shape == (IDS.numel() - 1,) and got.dtype == torch.float32
    check_float32_error(f"streaming_nll(window={window}, sinks={sinks}, chunk={chunk})", got,
                        ref, truth, factor=4.0, floor=1e-6)


def test_full_attention_is_the_models_forward(model, model64):
    got = LC.streaming_nll(model, IDS, window=None, chunk=7)
    check_float32_error("streaming_nll(window=None)", got, plain_losses(model, IDS),
                        plain_losses(model64, IDS), factor=4.0, floor=1e-6)
    # a window longer than the text evicts nothing: full attention too
    longer = LC.streaming_nll(model, IDS, window=64, sinks=4, chunk=16)
    check_float32_error("a window past the text", longer, got,
                        plain_losses(model64, IDS), factor=4.0, floor=1e-6)


def test_window_only_is_a_sliding_window_model(model, model64):
    windowed = TinyGPT(dataclasses.replace(CFG, sliding_window=8), seed=None)
    windowed.load_state_dict(model.state_dict())
    got = LC.streaming_nll(model, IDS, window=8, sinks=0, chunk=6)
    truth = LC.streaming_nll_loop(model64, IDS, window=8)
    check_float32_error("window only against a sliding_window model", got,
                        plain_losses(windowed.eval(), IDS), truth, factor=4.0, floor=1e-6)


def test_sinks_change_the_losses_only_after_the_cache_fills(model):
    window, sinks = 8, 4
    with_sinks = LC.streaming_nll(model, IDS, window=window, sinks=sinks)
    alone = LC.streaming_nll(model, IDS, window=window + sinks)
    full = LC.streaming_nll(model, IDS, window=None)
    fill = window + sinks - 1                   # entry t predicts t + 1 from t + 1 tokens
    assert torch.allclose(with_sinks[:fill], full[:fill], atol=1e-5)
    assert torch.allclose(alone[:fill], full[:fill], atol=1e-5)
    assert (with_sinks[fill:] - alone[fill:]).abs().max() > 1e-3
    # the sinks sit right before the window: their keys rotated at their text positions
    # (a wrong distance) give other losses
    assert (with_sinks[fill:] - full[fill:]).abs().max() > 1e-3


def test_the_streaming_memory_does_not_grow_with_the_text(model, monkeypatch):
    sizes = []
    real = LC._attend

    def spy(q_parts, k_parts, v_parts, masks, n_rep):
        sizes.append(sum(k.shape[2] for k in k_parts))
        return real(q_parts, k_parts, v_parts, masks, n_rep)

    monkeypatch.setattr(LC, "_attend", spy)
    LC.streaming_nll(model, IDS, window=6, sinks=2, chunk=4)
    assert max(sizes) <= 2 + 6 + 4 - 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=None, sinks=2), "sinks need a window"),
    (dict(window=0), "window must be None"),
    (dict(window=8, sinks=-1), "sinks must be"),
    (dict(window=8, chunk=0), "chunk must be"),
])
def test_streaming_refuses_bad_arguments(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LC.streaming_nll(model, IDS, **kwargs)


@pytest.mark.parametrize("window, chunk", [(None, 256), (120, 16), (8, 125)])
def test_streaming_refuses_positions_past_the_rope_table(model, window, chunk):
    long_ids = torch.zeros(200, dtype=torch.long)           # CFG.max_seq_len is 128
    with pytest.raises(ValueError, match="max_seq_len 128"):
        LC.streaming_nll(model, long_ids, window=window, chunk=chunk)
    LC.streaming_nll(model, long_ids, window=100, sinks=4, chunk=28)    # 128 positions: fine


def test_streaming_refuses_models_it_does_not_run(model):
    with pytest.raises(ValueError, match="1-D int64"):
        LC.streaming_nll(model, IDS.float(), window=8)
    with pytest.raises(ValueError, match="at least 2"):
        LC.streaming_nll(model, IDS[:1], window=8)
    windowed = TinyGPT(dataclasses.replace(CFG, sliding_window=8))
    with pytest.raises(ValueError, match="sliding_window"):
        LC.streaming_nll(windowed, IDS, window=8)
    with pytest.raises(TypeError, match="TinyGPT"):
        LC.streaming_nll(torch.nn.Linear(2, 2), IDS, window=8)
    # dynamic RoPE changes its frequencies with the length: refused; a fixed scaling runs
    dynamic = TinyGPT(dataclasses.replace(CFG, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="dynamic RoPE"):
        LC.streaming_nll(dynamic, IDS, window=8)
    linear = TinyGPT(dataclasses.replace(CFG, rope_scaling={"rope_type": "linear",
                                                            "factor": 2.0}))
    assert torch.isfinite(LC.streaming_nll(linear, IDS, window=8)).all()


def test_perplexity_and_long_text():
    assert LC.perplexity(torch.tensor([0.0, math.log(4.0)]), 1) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no losses"):
        LC.perplexity(torch.zeros(3), 3)

    class Chars:
        def encode(self, text):
            return [ord(c) % 64 for c in text]

    ids = LC.long_text(Chars(), 5000, seed=3)
    assert ids.shape == (5000,) and ids.dtype == torch.long
    assert torch.equal(ids, LC.long_text(Chars(), 5000, seed=3))
    with pytest.raises(ValueError, match="n_tokens"):
        LC.long_text(Chars(), 1)


# --------------------------------------------------------------------------------------------
# fp8 KV


def test_fp8_round_trip_error_is_relative_with_one_scale_per_head():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 40, 16, generator=gen) * torch.tensor([0.1, 1.0, 30.0])[:, None, None]
    q, scale = LC.quantize_kv_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 1, 1)
    assert torch.allclose(scale, x.abs().amax(dim=(2, 3), keepdim=True) / 448)
    back = LC.dequantize_kv_fp8(q, scale)
    # e4m3 rounds to 3 mantissa bits (relative 2^-4 at worst); below 2^-6 it is subnormal,
    # with steps of 2^-9 (an absolute 2^-10 x scale)
    bound = x.abs() * 2 ** -4 + scale * 2 ** -10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert (back.abs().amax(dim=(2, 3)) == x.abs().amax(dim=(2, 3))).all()   # amax exact


def test_fp8_scales_are_per_head_and_beat_int8_on_small_values():
    x = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(6))
    x[0, 0, 0, 0] = 40.0                               # one outlier in head 0's token 0
    back = LC.dequantize_kv_fp8(*LC.quantize_kv_fp8(x))
    # head 1 keeps its own scale: its error is that of a head without the outlier
    alone = LC.dequantize_kv_fp8(*LC.quantize_kv_fp8(x[:, 1:]))
    assert torch.equal(back[:, 1:], alone)
    # int8 with one scale per token puts the outlier's step on its token: small values of
    # that token lose more under int8 than under fp8's relative rounding
    q8, s8 = quantize_kv(x)
    int8_err = (q8.float() * s8 - x)[0, 0, 0, 1:].abs().mean()
    fp8_err = (back - x)[0, 0, 0, 1:].abs().mean()
    assert fp8_err < int8_err


def test_fp8_with_a_calibrated_scale_refuses_data_beyond_it():
    x = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(7))
    _, scale = LC.quantize_kv_fp8(x)
    q, same = LC.quantize_kv_fp8(x * 0.5, scale)
    assert torch.equal(same, scale)
    with pytest.raises(ValueError, match="exceeds the scale"):
        LC.quantize_kv_fp8(x * 2, scale)
    with pytest.raises(ValueError, match="scale must have shape"):
        LC.quantize_kv_fp8(x, scale[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        LC.dequantize_kv_fp8(x, scale)
    with pytest.raises(ValueError, match="floating"):
        LC.quantize_kv_fp8(torch.ones(2, 3, dtype=torch.float32))
    zeros, zscale = LC.quantize_kv_fp8(torch.zeros(1, 1, 2, 2))
    assert zscale.item() == 1.0 and not zeros.float().any()


def test_quantized_bytes_per_token():
    args = (30, 3, 64)                                  # SmolLM2's layers, KV heads, head_dim
    numbers = 2 * 30 * 3 * 64
    assert LC.kv_bytes_per_token_quantized(*args, "bf16", 100) == 2 * numbers
    assert LC.kv_bytes_per_token_quantized(*args, "int8", 100) == numbers + 2 * 30 * 3 * 4
    assert LC.kv_bytes_per_token_quantized(*args, "fp8", 100) == numbers + 2 * 30 * 3 * 4 / 100
    with pytest.raises(ValueError, match="kind"):
        LC.kv_bytes_per_token_quantized(*args, "fp4", 100)
    with pytest.raises(ValueError, match="context"):
        LC.kv_bytes_per_token_quantized(*args, "fp8", 0)


# --------------------------------------------------------------------------------------------
# generating with sinks


def test_streaming_generate_past_the_context_follows_the_oracle(model):
    from tinygpt.sampling import SamplingParams

    prompt = IDS[:20]
    window, sinks = 10, 4
    params = SamplingParams(temperature=0.0, max_new_tokens=150)    # 170 > CFG's 128 positions
    new = LC.streaming_generate(model, prompt, params, window=window, sinks=sinks, chunk=8)
    assert len(new) == 150
    logits = LC.streaming_logits_loop(model, torch.cat([prompt, torch.tensor(new[:-1])]),
                                      window=window, sinks=sinks)[prompt.numel() - 1:]
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4          # near ties may go either way in float32
    assert clear.float().mean() > 0.9
    assert (logits.argmax(-1) == torch.tensor(new))[clear].all()


def test_streaming_generate_with_a_long_window_is_generate(model):
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    want = generate(model, IDS[:17].tolist(), params).token_ids
    assert LC.streaming_generate(model, IDS[:17].tolist(), params, window=64, sinks=4,
                                 chunk=5) == want
    sampled = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
    first = LC.streaming_generate(model, IDS[:9], sampled, window=6, sinks=2)
    assert first == LC.streaming_generate(model, IDS[:9], sampled, window=6, sinks=2)
    stop = LC.streaming_generate(model, IDS[:17].tolist(), params, window=64, eos_id=want[5])
    assert stop == want[:want.index(want[5]) + 1]


def test_streaming_lm_holds_sinks_plus_window_keys(model):
    lm = LC.StreamingLM(model, window=6, sinks=2)
    for a in range(0, 48, 5):
        lm.forward(IDS[a:a + 5])
        held = lm.keep_k[0].shape[2] + lm.sink_k[0].shape[2]
        assert held <= 2 + 6 - 1 and lm.length == min(a + 5, 50)
    full = LC.StreamingLM(model, window=None)
    full.forward(IDS.repeat(3)[:120])
    with pytest.raises(ValueError, match="max_seq_len 128"):
        full.forward(IDS[:9])                      # 129 positions: no window to stream with


def test_streaming_generate_refuses_bad_arguments(model):
    from tinygpt.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=3)
    with pytest.raises(ValueError, match="needs a window"):
        LC.streaming_generate(model, IDS[:4], params, window=None)
    with pytest.raises(TypeError, match="SamplingParams"):
        LC.streaming_generate(model, IDS[:4], {"max_new_tokens": 3}, window=8)
    with pytest.raises(ValueError, match="at least 1"):
        LC.streaming_generate(model, [], params, window=8)
    with pytest.raises(ValueError, match="non-empty"):
        LC.StreamingLM(model, window=8).forward(torch.tensor([], dtype=torch.long))
