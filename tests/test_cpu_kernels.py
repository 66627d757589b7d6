"""Tests of tinygpt.cpu_kernels (the tiled CPU products) and of DecodeStep using them by
default. The oracle is F.linear: float32 tiles agree with it to float rounding (summation
order only), bfloat16 tiles with F.linear on the bfloat16-rounded weights; the decode step on
tiled weights picks the same greedy tokens as the model's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as nnf

from tinygpt import cpu_kernels as ck
from tinygpt.generate import generate
from tinygpt.kv_cache import DecodeStep, KVCache, decode_step, prefill
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams
from tinygpt.train import load_pretrained

pytestmark = pytest.mark.skipif(ck.available() is not None, reason=str(ck.available()))


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = ck.set_threads(request.param)
    yield request.param
    ck.set_threads(before)


@pytest.mark.parametrize("n,k", [(16, 1), (48, 33), (408, 128), (960, 576), (4096, 64)])
@pytest.mark.parametrize("rows", [1, 3])
def test_tiled_float32_product_equals_f_linear(threads, n, k, rows):
    w, x = weights(n, k), weights(rows, k, seed=1)
    (got,) = ck.TiledLinear(w)(x)
    want = nnf.linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * k)


def test_tiled_bfloat16_product_is_f_linear_on_rounded_weights(threads):
    w, x = weights(1024, 320), weights(2, 320, seed=1)
    tiled = ck.TiledLinear(w, fmt="bf16")
    (got,) = tiled(x)
    torch.testing.assert_close(got, nnf.linear(x, w.bfloat16().float()), rtol=1e-5, atol=1e-5)
    assert tiled.nbytes == w.nbytes // 2


def test_q8_0_matches_the_gguf_package_and_the_kernel_multiplies_its_values(threads):
    """Our Q8_0 rounding equals llama.cpp's (the gguf package's reference quantizer), and the
    kernel on Q8_0 tiles equals F.linear on the dequantized weights (summation order only)."""
    gguf = pytest.importorskip("gguf")
    w, x = weights(80, 96) + weights(80, 96, seed=5) ** 3, weights(3, 96, seed=1)
    q, d = ck.quantize_q8_0(w)
    ours = ck.dequantize_q8_0(q, d)
    kind = gguf.GGMLQuantizationType.Q8_0
    reference = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind)
    assert torch.equal(ours, torch.from_numpy(reference))
    tiled = ck.TiledLinear(w, fmt="q8_0")
    torch.testing.assert_close(tiled(x)[0], nnf.linear(x, ours), rtol=1e-5, atol=1e-5)
    assert tiled.nbytes == 80 * 96 + 80 * 3 * 2           # 8 bits + a float16 per 32
    assert torch.equal(ck.dequantize_q8_0(*ck.quantize_q8_0(ours)), ours)   # idempotent
    assert "multiple of 32" in ck.TiledLinear.refusal(weights(16, 40), fmt="q8_0")


def test_q4_1_blocks_run_as_shipped(threads):
    """Q4_1 blocks as a GGUF file stores them (the gguf package's quantizer writes them) are
    read without changing a value, equal our own Q4_1 rounding, and the kernel on them equals
    F.linear on their dequantized weights."""
    gguf = pytest.importorskip("gguf")
    w, x = weights(80, 96) + weights(80, 96, seed=5) ** 3, weights(3, 96, seed=1)
    kind = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(w.numpy(), kind)
    parts = ck.q4_1_from_gguf(torch.from_numpy(raw).reshape(-1), (80, 96))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert torch.equal(ck.dequantize_q4_1(*parts), reference)
    assert all(torch.equal(a, b) for a, b in zip(parts, ck.quantize_q4_1(w), strict=True))
    tiled = ck.TiledLinear(w, fmt="q4_1", blocks=[parts])
    torch.testing.assert_close(tiled(x)[0], nnf.linear(x, reference), rtol=1e-5, atol=1e-5)
    assert tiled.nbytes == 80 * 96 // 2 + 80 * 3 * 4      # 4 bits + two float16 per 32
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        ck.q4_1_from_gguf(torch.from_numpy(raw).reshape(-1)[:-1], (80, 96))


def test_stacked_weights_split_like_the_layers_one_by_one():
    q, k, v = weights(64, 96), weights(32, 96, 1), weights(32, 96, 2)
    x = weights(1, 96, seed=3)[None]                                    # (B, 1, K)
    outs = ck.TiledLinear(q, k, v)(x)
    assert [o.shape for o in outs] == [(1, 1, 64), (1, 1, 32), (1, 1, 32)]
    for out, w in zip(outs, (q, k, v), strict=True):
        torch.testing.assert_close(out, nnf.linear(x, w), rtol=1e-5, atol=1e-5)


def test_products_work_in_a_forked_child():
    """The pool's threads do not survive fork(); a child starts its own and gets the same
    products (no hang waiting on the parent's helpers)."""
    import multiprocessing

    w, x = weights(960, 576), weights(1, 576, seed=1)
    tiled = ck.TiledLinear(w)
    want = tiled(x)[0]
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        got = pool.apply_async(_product_in_child, (tiled.tiled, x, 960, 576)).get(timeout=60)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _product_in_child(tiles: torch.Tensor, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    y = torch.empty(1, n)
    ck.load().tg_gemv(0, tiles.data_ptr(), x.data_ptr(), y.data_ptr(), 1, n, k)
    return y


def test_bad_shapes_and_inputs_are_refused():
    assert ck.TiledLinear.refusal(weights(40, 8)) is None
    assert "in_features" in ck.TiledLinear.refusal(weights(16, 8), weights(16, 9))
    with pytest.raises(ValueError, match="floating point"):
        ck.TiledLinear(torch.ones(16, 8, dtype=torch.long))
    tiled = ck.TiledLinear(weights(16, 8))
    with pytest.raises(ValueError, match="at most 4 rows"):
        tiled(weights(5, 8))
    with pytest.raises(ValueError, match="float32"):
        tiled(weights(1, 8).double())
    with pytest.raises(ValueError, match="threads"):
        ck.set_threads(0)
    with pytest.raises(ValueError, match="fmt must be one of"):
        ck.TiledLinear(weights(16, 8), fmt="int3")


# --------------------------------------------------------------------------------------------
# the default decode step


def small_model(vocab: int = 96) -> TinyGPT:
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=160, max_seq_len=64)
    return TinyGPT(cfg, seed=0).eval()


def test_decode_step_tiles_by_default_and_keeps_the_plain_path():
    model = small_model()
    assert DecodeStep(model, KVCache.for_model(model)).tiled
    plain = DecodeStep(model, KVCache.for_model(model), tiled=False)
    assert not plain.tiled and "tiled=False" in plain.tiled_reason
    assert not DecodeStep(model, KVCache.for_model(model, static=True)).tiled
    assert DecodeStep(small_model().to(torch.bfloat16),
                      KVCache.for_model(small_model().to(torch.bfloat16))).tiled
    half = small_model().half()
    step = DecodeStep(half, KVCache.for_model(half))
    assert not step.tiled and "bfloat16" in step.tiled_reason
    with pytest.raises(TypeError, match="tiled must be True or False"):
        DecodeStep(model, KVCache.for_model(model), tiled=1)


def test_tiled_weights_follow_changes_to_the_model():
    """The tiled copy is cached per model and rebuilt when a weight changes in place."""
    model = small_model()
    ids = torch.tensor([[1, 2, 3]])

    def logits() -> torch.Tensor:
        cache = KVCache.for_model(model)
        prefill(model, cache, ids)
        step = DecodeStep(model, cache)
        assert step.tiled
        return step(ids[:, :1])

    before = logits()
    with torch.no_grad():
        model.layers[0].feed_forward.w2.weight.mul_(3)
    after = logits()
    cache = KVCache.for_model(model)
    prefill(model, cache, ids)
    torch.testing.assert_close(after, decode_step(model, cache, ids[:, :1]), rtol=1e-4,
                               atol=1e-4)
    assert not torch.allclose(before, after)


def test_generate_on_tiled_products_picks_the_plain_greedy_tokens(threads):
    """The shipped checkpoint, three prompts, 24 greedy tokens each: generate() (tiled by
    default) equals the model's own forward on a KV cache, token for token."""
    model, tokenizer = load_pretrained()
    new = 24
    params = SamplingParams(temperature=0.0, max_new_tokens=new)
    for text in ("Once upon a time", "The little dog", "Tom and Lily went"):
        prompt = tokenizer.encode(text)
        cache = KVCache.for_model(model, 1, len(prompt) + new)
        logits, want = prefill(model, cache, torch.tensor([prompt])), []
        for _ in range(new):
            token = logits.argmax(-1, keepdim=True)
            want.append(int(token))
            logits = decode_step(model, cache, token)
        assert generate(model, prompt, params).token_ids == want


def test_a_bfloat16_model_on_tiled_products_tracks_its_own_forward():
    """With the whole model in bfloat16 the tiled products read the same bfloat16 weights and
    sum in float32, as torch's do, but every activation is rounded to bfloat16 after each
    operation, so a different summation order can move a logit by a bfloat16 step and flip
    near-ties. Teacher-forced over a story: the logits stay within 3% of their largest (the
    plain fused step, tiled=False, differs from the module forward by 2.3% here too), and
    the greedy choice agrees at 90% of the positions or more."""
    model, tokenizer = load_pretrained()
    model = model.to(torch.bfloat16)
    ids = torch.tensor([tokenizer.encode("Once upon a time there was a little girl named Lily. "
                                         "She liked to play in the park with her dog.")])
    plain, fast = KVCache.for_model(model), KVCache.for_model(model)
    prefill(model, plain, ids[:, :4])
    prefill(model, fast, ids[:, :4])
    step = DecodeStep(model, fast)
    assert step.tiled
    same = []
    for t in range(4, ids.shape[1]):
        want, got = decode_step(model, plain, ids[:, t:t + 1]), step(ids[:, t:t + 1])
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        same.append(bool(got.argmax() == want.argmax()))
    assert sum(same) >= 0.9 * len(same)


def test_a_q8_0_model_decodes_its_own_greedy_tokens_from_q8_0_tiles():
    """q8_0_model: every linear (the tied head too) holds its Q8_0 values; generate() streams
    them as Q8_0 tiles and picks the greedy tokens of the copy's own forward."""
    model, tokenizer = load_pretrained()
    q8 = ck.q8_0_model(model)
    step = DecodeStep(q8, KVCache.for_model(q8))
    assert step.tiled and step._weights[0][1].tiled.fmt == "q8_0"
    w = model.layers[0].attention.wq.weight
    assert torch.equal(q8.layers[0].attention.wq.weight,
                       ck.dequantize_q8_0(*ck.quantize_q8_0(w)))
    new = 24
    prompt = tokenizer.encode("Once upon a time")
    cache = KVCache.for_model(q8, 1, len(prompt) + new)
    logits, want = prefill(q8, cache, torch.tensor([prompt])), []
    for _ in range(new):
        token = logits.argmax(-1, keepdim=True)
        want.append(int(token))
        logits = decode_step(q8, cache, token)
    assert generate(q8, prompt, SamplingParams(temperature=0.0, max_new_tokens=new)
                    ).token_ids == want


def test_a_q4_1_model_decodes_its_own_greedy_tokens_from_its_blocks():
    """q4_1_model with blocks handed in (as a GGUF loader would) keeps them as they are;
    generate() streams them through the Q4_1 kernel and picks the greedy tokens of the copy's
    own forward on the same values."""
    model, tokenizer = load_pretrained()
    wq = model.layers[1].attention.wq.weight
    given = ck.quantize_q4_1(wq * 1.5)          # blocks that are NOT the weight's own rounding
    q4 = ck.q4_1_model(model, {"layers.1.attention.wq.weight": given})
    assert torch.equal(q4.layers[1].attention.wq.weight, ck.dequantize_q4_1(*given))
    step = DecodeStep(q4, KVCache.for_model(q4))
    assert step.tiled and step._weights[0][1].tiled.fmt == "q4_1"
    new = 24
    prompt = tokenizer.encode("Once upon a time")
    cache = KVCache.for_model(q4, 1, len(prompt) + new)
    logits, want = prefill(q4, cache, torch.tensor([prompt])), []
    for _ in range(new):
        token = logits.argmax(-1, keepdim=True)
        want.append(int(token))
        logits = decode_step(q4, cache, token)
    assert generate(q4, prompt, SamplingParams(temperature=0.0, max_new_tokens=new)
                    ).token_ids == want
    with pytest.raises(ValueError, match="no linear"):
        ck.q4_1_model(model, {"nope.weight": given})
