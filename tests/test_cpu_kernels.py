"""Tests of tinygpt.cpu_kernels (the tiled CPU products) and of DecodeStep using them by
default. The oracle is F.linear: float32 tiles agree with it to float rounding (summation
order only: each product as close to the float64 product as F.linear's float32 one),
bfloat16 tiles with F.linear on the bfloat16-rounded weights and kernel_input(x) (x, or x
rounded to bfloat16 where the build runs avx512_bf16 dot products: tests/test_cpu_bf16.py
checks both paths); the decode step on tiled weights picks the same greedy tokens as the
model's own forward, and its float32 logits are as close to the float64 model's as the plain
step's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as nnf

from tests.float64 import check_product, float64_twin
from tinygpt import cpu_kernels as ck
from tinygpt.generate import generate
from tinygpt.kv_cache import DecodeStep, KVCache, decode_step, prefill
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error
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
    assert got.shape == (rows, n) and got.dtype == torch.float32
    check_product("TiledLinear(w)(x)", got, x, w)


@pytest.mark.parametrize("k", [1, 33, 128, 576])
def test_float32_rows_loop_gives_the_row_by_row_loops_bits_at_every_row_count(threads, k):
    """The float32 loop that runs every row's sums side by side and the plain one (row by
    row) sum in the same order: the same bits, and a row's result does not depend on how many
    rows share the product (batched decode and speculative decoding's verify pass rely on it:
    their rows must equal batch-1 decode's token for token)."""
    w, x = weights(96, k), weights(ck.MAX_ROWS, k, seed=2)
    tiled = ck.TiledLinear(w)
    alone = torch.cat([tiled(x[r:r + 1])[0] for r in range(ck.MAX_ROWS)])
    before = ck.use_portable(True)
    try:
        portable = [tiled(x[:rows])[0] for rows in range(1, ck.MAX_ROWS + 1)]
    finally:
        ck.use_portable(before)
    for rows in range(1, ck.MAX_ROWS + 1):
        assert torch.equal(tiled(x[:rows])[0], alone[:rows]), rows
        assert torch.equal(portable[rows - 1], alone[:rows]), rows


@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx"])
def test_float32_rows_loop_on_narrower_vectors_keeps_its_bits(flag):
    """The side-by-side loop is written in vectors as wide as the registers (tinygpt/csrc/vec.h),
    each lane summing in the same order: built for AVX2's 8 floats (-mno-avx512f) it gives the
    package build's bits (the same as its own on a CPU without AVX-512), and for SSE's 4
    (-mno-avx, which also leaves out fused multiply-adds, so its sums round twice) its own
    row-by-row loop's, at 1-4 rows; each against the float64 product."""
    library = ck.build(flag)
    lib = library.load()
    if lib is None:
        pytest.skip(library.available())
    w = weights(96, 577)
    tiled, x = ck.TiledLinear(w), weights(ck.MAX_ROWS, 577, seed=3)

    def product(rows: int) -> torch.Tensor:
        y = torch.empty(rows, tiled.n_pad)
        assert lib.tg_gemv(ck.FORMATS["fp32"], tiled.tiled.data_ptr(), x.data_ptr(),
                           y.data_ptr(), rows, tiled.n_pad, tiled.k) == 0
        return y

    fast = [product(rows) for rows in range(1, ck.MAX_ROWS + 1)]
    if flag == "-mno-avx512f":
        for rows in range(1, ck.MAX_ROWS + 1):
            assert torch.equal(fast[rows - 1], tiled(x[:rows])[0]), rows
    lib.tg_use_portable(1)
    try:
        for rows in range(1, ck.MAX_ROWS + 1):
            assert torch.equal(product(rows), fast[rows - 1]), rows
    finally:
        lib.tg_use_portable(0)
    check_product(f"the float32 product built with {flag}", fast[-1], x, w)


def test_tiled_bfloat16_product_is_f_linear_on_rounded_weights(threads):
    """(x itself where the weights are widened, x rounded to bfloat16 where the build runs
    avx512_bf16 dot products: tests/test_cpu_bf16.py checks both paths)"""
    w, x = weights(1024, 320), weights(2, 320, seed=1)
    tiled = ck.TiledLinear(w, fmt="bf16")
    (got,) = tiled(x)
    check_product(f"the bfloat16 tiles' product ({ck.bf16_path()})", got,
                  ck.kernel_input(x, "bf16"), w.bfloat16().float())
    assert tiled.nbytes == w.nbytes // 2


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far x @ w^T can move when x is rounded to 8 bits per block of 32: each value by at
    most half its block's step d, so row r's output i by sum_j |w_ij| * d_r(j) / 2."""
    _, d = ck.quantize_activation(x)
    step = d.repeat_interleave(ck.Q_BLOCK, -1)                             # (M, K)
    return (step / 2) @ w.abs().T


def check_integer_product(tiled: ck.TiledLinear, x: torch.Tensor, w: torch.Tensor) -> None:
    """The Q8_0 / Q4_1 kernel's output on x against its oracles: F.linear on the dequantized
    weights and the 8-bit-rounded x (summation order only: as close to the float64 product as
    F.linear's float32 one), and the float x within the bound the rounding allows; the
    AVX-512 VNNI loop (where the CPU has it) and the portable loop both."""
    (got,) = tiled(x)
    xq = ck.kernel_input(x, tiled.fmt)
    check_product(f"the {tiled.fmt} kernel", got, xq, w)
    assert ((got - nnf.linear(x, w)).abs() <= rounding_bound(x, w) * 1.001 + 1e-6).all()
    before = ck.use_portable(True)
    try:
        check_product(f"the portable {tiled.fmt} loop", tiled(x)[0], xq, w)
    finally:
        ck.use_portable(before)


def test_activation_rounding_is_eight_bits_per_block():
    x = weights(3, 96, seed=1) * torch.linspace(0.1, 10, 96)
    x[1, 32:64] = 0                                                     # a block of zeros
    q, d = ck.quantize_activation(x)
    assert q.dtype == torch.int8 and d.shape == (3, 3) and q.abs().max() == 127
    deq = ck.dequantize_activation(q, d)
    assert ((deq - x).abs() <= d.repeat_interleave(32, -1) / 2 * 1.0001).all()
    assert d[1, 1] == 0 and (q[1, 32:64] == 0).all()
    assert ck.kernel_input(x, "fp32") is x and torch.equal(ck.kernel_input(x, "q4_1"), deq)
    with pytest.raises(ValueError, match="multiple of 32"):
        ck.quantize_activation(x[:, :40])


def test_q8_0_matches_the_gguf_package_and_the_kernel_multiplies_its_values(threads):
    """Our Q8_0 rounding equals llama.cpp's (the gguf package's reference quantizer), halves
    rounded away from zero included, and the kernel on Q8_0 tiles equals F.linear on the
    dequantized weights and the 8-bit x."""
    gguf = pytest.importorskip("gguf")
    w = weights(80, 96) + weights(80, 96, seed=5) ** 3
    q, d = ck.quantize_q8_0(w)
    ours = ck.dequantize_q8_0(q, d)
    kind = gguf.GGMLQuantizationType.Q8_0
    reference = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind)
    assert torch.equal(ours, torch.from_numpy(reference))
    ties = torch.zeros(2, 32)                   # w / d = 127, 0.5, 2.5, -1.5 with d = 1, 1/4
    ties[:, :4] = torch.tensor([[127, 0.5, 2.5, -1.5], [31.75, 0.125, 0.625, -0.375]])
    blocks = torch.from_numpy(gguf.quants.quantize(ties.numpy(), kind))    # (2, 2 + 32)
    assert torch.equal(ck.quantize_q8_0(ties)[0], blocks[:, 2:].view(torch.int8))
    assert ck.quantize_q8_0(ties)[0][:, :4].tolist() == [[127, 1, 3, -2]] * 2
    tiled = ck.TiledLinear(w, fmt="q8_0")
    for rows in (1, 2, 3, 4):
        check_integer_product(tiled, weights(rows, 96, seed=rows), ours)
    assert tiled.nbytes == 80 * 96 + 80 * 3 * 2           # 8 bits + a float16 per 32
    assert torch.equal(ck.dequantize_q8_0(*ck.quantize_q8_0(ours)), ours)   # idempotent
    assert "multiple of 32" in ck.TiledLinear.refusal(weights(16, 40), fmt="q8_0")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_integer_products_on_extreme_values_and_model_widths(threads, fmt):
    """Weights at the ends of their range (+-127, the nibbles 0 and 15), x with a block of
    zeros and blocks whose largest value sits at either end, at SmolLM2's widths (576 and
    1536 columns, a padded last tile): the integer sums cannot overflow or lose a sign."""
    for n, k in ((72, 576), (40, 1536)):
        w, x, dequantized = extreme_case(n, k, 2, fmt)
        check_integer_product(ck.TiledLinear(w, fmt=fmt), x, dequantized)


def extreme_case(n: int, k: int, rows: int, fmt: str):
    """(w, x, w as the format rounds it) with weights at the ends of their range and x with a
    block of zeros, blocks whose largest value sits at either end and a block of ones"""
    w = weights(n, k, seed=2)
    w[0], w[1, ::2], w[1, 1::2], w[2, :32] = 1.0, -1.0, 1.0, torch.linspace(-1, 1, 32)
    x = weights(rows, k, seed=3)
    x[0, :32], x[1, 32:64], x[1, 64], x[-1, 96:128] = 0, -1, 5, 1
    quant = ck.quantize_q8_0 if fmt == "q8_0" else ck.quantize_q4_1
    deq = ck.dequantize_q8_0 if fmt == "q8_0" else ck.dequantize_q4_1
    return w, x, deq(*quant(w))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_integer_products_without_avx512_use_avx2(fmt):
    """Built for a CPU without AVX-512 (-mno-avx512f) the integer sums run on AVX2's byte and
    word multiply-adds where the CPU has AVX2 (int_path()): the same extreme values and
    widths, 1-4 rows, that path and that build's portable loop against the float64 product
    of what they multiply."""
    library = ck.build("-mno-avx512f")
    lib = library.load()
    if lib is None:
        pytest.skip(library.available())
    if ck.int_path(lib) != ck.INT_PATHS[1]:
        pytest.skip(f"this CPU's build without AVX-512 sums with {ck.int_path(lib)}")
    for n, k in ((72, 576), (40, 1536)):
        w, x, dequantized = extreme_case(n, k, ck.MAX_ROWS, fmt)
        tiled = ck.TiledLinear(w, fmt=fmt)
        for portable in (0, 1):
            before = lib.tg_use_portable(portable)
            try:
                y = torch.empty(ck.MAX_ROWS, tiled.n_pad)
                for rows in range(1, ck.MAX_ROWS + 1):
                    assert lib.tg_gemv(ck.FORMATS[fmt], tiled.tiled.data_ptr(), x.data_ptr(),
                                       y.data_ptr(), rows, tiled.n_pad, k) == 0
                    check_product(f"the {fmt} product on {ck.int_path(lib)}, {rows} rows",
                                  y[:rows, :n], ck.kernel_input(x[:rows], fmt), dequantized)
            finally:
                lib.tg_use_portable(before)


def test_q4_1_blocks_run_as_shipped(threads):
    """Q4_1 blocks as a GGUF file stores them (the gguf package's quantizer writes them) are
    read without changing a value, equal our own Q4_1 rounding, and the kernel on them equals
    F.linear on their dequantized weights and the 8-bit x."""
    gguf = pytest.importorskip("gguf")
    w, x = weights(80, 96) + weights(80, 96, seed=5) ** 3, weights(3, 96, seed=1)
    kind = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(w.numpy(), kind)
    parts = ck.q4_1_from_gguf(torch.from_numpy(raw).reshape(-1), (80, 96))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert torch.equal(ck.dequantize_q4_1(*parts), reference)
    assert all(torch.equal(a, b) for a, b in zip(parts, ck.quantize_q4_1(w), strict=True))
    tiled = ck.TiledLinear(w, fmt="q4_1", blocks=[parts])
    check_integer_product(tiled, x, reference)
    assert tiled.nbytes == 80 * 96 // 2 + 80 * 3 * 4      # 4 bits + two float16 per 32
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        ck.q4_1_from_gguf(torch.from_numpy(raw).reshape(-1)[:-1], (80, 96))


def test_stacked_weights_split_like_the_layers_one_by_one():
    q, k, v = weights(64, 96), weights(32, 96, 1), weights(32, 96, 2)
    x = weights(1, 96, seed=3)[None]                                    # (B, 1, K)
    outs = ck.TiledLinear(q, k, v)(x)
    assert [o.shape for o in outs] == [(1, 1, 64), (1, 1, 32), (1, 1, 32)]
    for out, w in zip(outs, (q, k, v), strict=True):
        check_product("a stacked product", out, x, w)


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
    with pytest.raises(ValueError, match=r"in_features >= 1, got \(16, 0\)"):
        ck.TiledLinear(torch.zeros(16, 0))
    with pytest.raises(ValueError, match="in_features >= 1"):
        ck.TiledLinear(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"float32 x \(\.\.\., 8\)"):
        tiled(torch.tensor(1.0))                             # a 0-d x has no last dimension
    with pytest.raises(ValueError, match="tiled must be contiguous float32 CPU tiles"):
        ck.TiledLinear.sharing(torch.zeros(1, 0, 16), [16])


def test_q8_0_tiles_refuse_weights_outside_q8_0s_range():
    """Q8_0 weights are in [-127, 127] (quantize_q8_0 clamps there): the AVX2 kernel negates q
    where x is negative, and int8 has no -(-128), so tile_q8_0 refuses -128, and q that is not
    int8."""
    q, d = ck.quantize_q8_0(weights(16, 64) * 1000)
    assert int(q.min()) == -127 and int(q.max()) == 127
    assert ck.tile_q8_0(q, d).shape == (1, 2, 32 + 512)
    q[3, 7] = -128
    with pytest.raises(ValueError, match=r"q must hold Q8_0 weights in \[-127, 127\]"):
        ck.tile_q8_0(q, d)
    with pytest.raises(TypeError, match="q must be an int8 tensor"):
        ck.tile_q8_0(q.to(torch.int16), d)


def test_q4_1_tiles_refuse_codes_outside_four_bits():
    """Q4_1 codes are 0..15 (quantize_q4_1 clamps there): a larger one would spill into its
    neighbour's nibble and the kernel would no longer multiply dequantize_q4_1's weights, so
    tile_q4_1 and TiledLinear's `blocks` refuse it, and codes that are not uint8."""
    w = weights(16, 64)
    q, d, m = ck.quantize_q4_1(w)
    assert int(q.max()) == 15 and ck.tile_q4_1(q, d, m).shape == (1, 2, 320)
    q[3, 7] = 16
    with pytest.raises(ValueError, match=r"q must hold Q4_1 codes in \[0, 15\] .*got 16"):
        ck.tile_q4_1(q, d, m)
    with pytest.raises(ValueError, match=r"blocks\[1\]\[0\] must hold Q4_1 codes in \[0, 15\]"):
        ck.TiledLinear(w, w, fmt="q4_1", blocks=[ck.quantize_q4_1(w), (q, d, m)])
    with pytest.raises(TypeError, match=r"blocks\[0\]\[0\] must be a uint8 tensor"):
        ck.TiledLinear(w, fmt="q4_1", blocks=[(q.to(torch.int16), d, m)])
    with pytest.raises(ValueError, match=r"d, m \(N, K / 32\)"):
        ck.TiledLinear(w, fmt="q4_1", blocks=[(q.clamp(max=15), d[:, :1], m)])


# --------------------------------------------------------------------------------------------
# the default decode step


# small_model's logits (up to 0.63): two float32 steps there
SMALL_FLOOR = 1e-7


def small_model(vocab: int = 96, heads: tuple[int, int, int] = (4, 2, 16),
                max_seq_len: int = 64) -> TinyGPT:
    """A 2-layer model with (query heads, kv heads, head_dim) = heads."""
    n_heads, n_kv_heads, head_dim = heads
    cfg = ModelConfig(vocab_size=vocab, d_model=n_heads * head_dim, n_layers=2, n_heads=n_heads,
                      n_kv_heads=n_kv_heads, d_ff=160, max_seq_len=max_seq_len)
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
    with torch.inference_mode():
        exact = float64_twin(model)(torch.cat([ids, ids[:, :1]], 1))[:, -1]
    # as close to the float64 model as the plain step, 4x its distance plus SMALL_FLOOR
    # (measured on AMD EPYC with AVX-512 2026-11-27, also with torch's libraries and our kernels
    # built for other CPUs: tiled 5.9e-8 to 7.7e-8, plain 5.4e-8 to 8.3e-8 from float64; the fixed
    # 1e-4 + 1e-4 relative this replaces was far above both). Stale tiles (the weight before
    # the change) are off by 4.3e-2.
    check_float32_error("the tiled step after a weight changed", after,
                        decode_step(model, cache, ids[:, :1]), exact, factor=4,
                        floor=SMALL_FLOOR)
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
    near-ties. Teacher-forced over a story: the tiled step's logits are as close to the same
    bfloat16 weights run in float64 as the plain step's (2x its distance; measured on AMD EPYC with
    AVX-512 2026-11-27: tiled 0.39%, plain 0.98% of the largest logit, the same with torch and our
    kernels limited to AVX2; a fixed 3% of the largest logit held the 1.6% between the two
    steps 1.9x), and the greedy choice agrees at 90% of the positions or more."""
    model, tokenizer = load_pretrained()
    model = model.to(torch.bfloat16)
    exact = float64_twin(model)                   # the same bfloat16 weights, in float64
    ids = torch.tensor([tokenizer.encode("Once upon a time there was a little girl named Lily. "
                                         "She liked to play in the park with her dog.")])
    plain, fast = KVCache.for_model(model), KVCache.for_model(model)
    prefill(model, plain, ids[:, :4])
    prefill(model, fast, ids[:, :4])
    step = DecodeStep(model, fast)
    assert step.tiled
    same, got, want = [], [], []
    for t in range(4, ids.shape[1]):
        want.append(decode_step(model, plain, ids[:, t:t + 1]))
        got.append(step(ids[:, t:t + 1]))
        same.append(bool(got[-1].argmax() == want[-1].argmax()))
    with torch.inference_mode():
        truth = exact(ids)[0, 4:]
    check_float32_error("the bfloat16 tiled step's logits", torch.cat(got), torch.cat(want),
                        truth)
    assert sum(same) >= 0.9 * len(same)


def teacher_forced(model: TinyGPT, text_ids: torch.Tensor, start: int = 4
                   ) -> tuple[float, float]:
    """The tiled step against the plain step (tiled=False) of the same model, fed the same
    tokens: (fraction of positions whose greedy token agrees, largest logit difference over
    the largest logit)."""
    plain, fast = KVCache.for_model(model), KVCache.for_model(model)
    prefill(model, plain, text_ids[:, :start])
    prefill(model, fast, text_ids[:, :start])
    oracle, step = DecodeStep(model, plain, tiled=False), DecodeStep(model, fast)
    assert step.tiled and not oracle.tiled
    same, worst = [], 0.0
    for t in range(start, text_ids.shape[1]):
        want, got = oracle(text_ids[:, t:t + 1]), step(text_ids[:, t:t + 1])
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        same.append(bool(got.argmax() == want.argmax()))
    return sum(same) / len(same), worst


STORY = ("Once upon a time there was a little girl named Lily. She liked to play in the park "
         "with her dog. One day the dog ran after a red ball and Lily ran after the dog.")


def test_a_q8_0_model_decodes_from_q8_0_tiles_and_tracks_its_own_forward():
    """q8_0_model: every linear (the tied head too) holds its Q8_0 values; the decode step
    streams them as Q8_0 tiles and rounds each product's input to 8 bits per block of 32, so
    it tracks the plain step on the same values closely, not exactly: teacher-forced over a
    story the greedy token agrees at 90% of the positions or more and no logit moves by more
    than 6% of the largest (3.0% measured; a wrong block or scale moves them by far more)."""
    model, tokenizer = load_pretrained()
    q8 = ck.q8_0_model(model)
    step = DecodeStep(q8, KVCache.for_model(q8))
    assert step.tiled and step._weights[0][1].tiled.fmt == "q8_0"
    w = model.layers[0].attention.wq.weight
    assert torch.equal(q8.layers[0].attention.wq.weight,
                       ck.dequantize_q8_0(*ck.quantize_q8_0(w)))
    agreement, worst = teacher_forced(q8, torch.tensor([tokenizer.encode(STORY)]))
    assert agreement >= 0.9 and worst <= 0.06


def test_a_q4_1_model_decodes_from_its_blocks_and_tracks_its_own_forward():
    """q4_1_model with blocks handed in (as a GGUF loader would) keeps them as they are; the
    decode step streams them through the Q4_1 kernel (the input rounded to 8 bits per block)
    and tracks the plain step on the same values: agreement at 90% or more, logits within 15%
    of the largest (8.9% measured: the scaled blocks make that layer's outputs larger)."""
    model, tokenizer = load_pretrained()
    wq = model.layers[1].attention.wq.weight
    given = ck.quantize_q4_1(wq * 1.5)          # blocks that are NOT the weight's own rounding
    q4 = ck.q4_1_model(model, {"layers.1.attention.wq.weight": given})
    assert torch.equal(q4.layers[1].attention.wq.weight, ck.dequantize_q4_1(*given))
    step = DecodeStep(q4, KVCache.for_model(q4))
    assert step.tiled and step._weights[0][1].tiled.fmt == "q4_1"
    agreement, worst = teacher_forced(q4, torch.tensor([tokenizer.encode(STORY)]))
    assert agreement >= 0.9 and worst <= 0.15
    with pytest.raises(ValueError, match="no linear"):
        ck.q4_1_model(model, {"nope.weight": given})


def test_decode_agreement_measures_the_decode_path(monkeypatch):
    """The bench's agreement (tinygpt.bench.smollm2.decode_agreement) runs the decode step
    generate() runs: the float32 model agrees with its own forward everywhere, a model with a
    different head does not, and neither does the same model whose decode step alone is
    wrong (the forward and the prefill untouched: only the first new token still agrees)."""
    from tinygpt.bench.smollm2 import decode_agreement

    model, tokenizer = load_pretrained()
    prompts = torch.tensor([tokenizer.encode(STORY)[:8], tokenizer.encode(STORY)[20:28]])
    assert decode_agreement(model, model, prompts, 6) == 1.0
    other = ck.q8_0_model(model)
    with torch.no_grad():
        other.output.weight.copy_(other.output.weight.roll(1, 0))
    assert decode_agreement(model, other, prompts, 6) < 0.5
    step = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, token: step(self, token).roll(1, -1))
    assert decode_agreement(model, model, prompts, 6) < 0.5


# (query heads, kv heads, head_dim): attention.h's paths, the vector ones (head_dim 32, 64,
# 128: groups done in register blocks of 4 heads, 2 at 128, with a remainder) and the plain one
HEAD_SHAPES = [(4, 2, 16), (6, 2, 32), (5, 1, 64), (9, 3, 64), (3, 1, 128), (4, 2, 48)]


def head_id(heads: tuple[int, int, int]) -> str:
    return "{}q{}kv{}d".format(*heads)


@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=head_id)
@pytest.mark.parametrize("batch,cache_batch", [(1, 1), (3, 4)])
def test_layers_in_c_compute_the_plain_step(batch, cache_batch, heads, length=14, size=16):
    """A float32 step runs each layer as one C call (cpu_kernels.DecodeLayers: norms, RoPE,
    the cache write, grouped-query attention, SiLU and the residuals between the products);
    over 12 positions its logits and its cache equal the plain step's (tiled=False) to float
    rounding (as close to the float64 model's as the plain step's), for a batch smaller than
    the cache's too, at every head_dim path of the attention."""
    model = small_model(heads=heads, max_seq_len=max(64, size))
    ids = torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(0))
    plain = KVCache.for_model(model, cache_batch, size)
    fast = KVCache.for_model(model, cache_batch, size)
    first = length - 12 if batch == cache_batch else 0   # otherwise decode from position 0
    if first:
        prefill(model, plain, ids[:, :first])
        prefill(model, fast, ids[:, :first])
    oracle, step = DecodeStep(model, plain, tiled=False), DecodeStep(model, fast)
    assert step._layers is not None and oracle._layers is None
    got, want = [], []
    for t in range(first, length):
        want.append(oracle(ids[:, t:t + 1]))
        got.append(step(ids[:, t:t + 1]))
    exact_model = float64_twin(model)
    exact = KVCache.for_model(exact_model, cache_batch, size)
    with torch.inference_mode():
        truth = exact_model(ids, kv_cache=exact)[:, first:]
    check_float32_error("the C layers' logits", torch.stack(got, 1), torch.stack(want, 1),
                        truth, factor=4, floor=SMALL_FLOOR)
    check_caches(fast, plain, exact, length)
    bf16 = small_model().to(torch.bfloat16)        # (its agreement: the bfloat16 test above)
    assert DecodeStep(bf16, KVCache.for_model(bf16))._layers.cache_bf16 == 1
    with pytest.raises(ValueError, match="positions must be"):
        step._layers(torch.zeros(1, model.cfg.d_model), size)



@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 48)], ids=head_id)
def test_layers_in_c_attend_over_a_long_context(heads):
    """The same at positions 500 to 511 of a 512-position cache: the scores of hundreds of
    keys (some softmax weights under e^-87, taken as 0) summed in attention.h's order, as close
    to the float64 model's as the plain step's."""
    test_layers_in_c_compute_the_plain_step(1, 1, heads, length=512, size=512)

def check_caches(fast: KVCache, plain: KVCache, exact: KVCache, length: int) -> None:
    """`fast`'s keys and values of positions 0 .. length - 1 as close to the float64 cache's
    (`exact`) as `plain`'s, 4x their distance plus one float32 step at their size (up to
    0.63), and nothing written past them. The logits' checks likewise (SMALL_FLOOR). Measured
    on AMD EPYC with AVX-512 2026-11-27, also with torch's libraries and our kernels built for other
    CPUs: the C layers' logits and caches 8.7e-8 to 2.0e-7 from float64, the plain step's 6.0e-8
    to 2.0e-7 (the fixed 1e-5 + 1e-4 relative this replaces was far above both). A key one
    position off moves the logits by about 1e-2, 50000x more."""
    for name in ("k", "v"):
        got, want, truth = (torch.stack([getattr(layer, name) for layer in cache.layers])
                            for cache in (fast, plain, exact))
        check_float32_error(f"the C layers' cached {name}", got[..., :length, :],
                            want[..., :length, :], truth[..., :length, :], factor=4, floor=6e-8)
        assert torch.equal(got[..., length:, :], want[..., length:, :])


def test_generate_samples_on_one_torch_thread_between_tiled_steps(monkeypatch):
    """The tiled products split each product over the cores with their own threads; a
    two-thread torch operation between two steps (the sampling's argmax) wakes an OpenMP team
    that keeps spinning beside them. generate() holds torch at one thread for each decoded
    token's step and sampling, not for the prefill (torch's own multi-row products), and gives
    the caller's setting back."""
    import tinygpt.generate as G

    model = small_model()
    seen, sample = [], G.sample_next_token

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return sample(*args, **kwargs)

    monkeypatch.setattr(G, "sample_next_token", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generate(model, [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=5))
        assert seen == [2, 1, 1, 1, 1], "prefill on the caller's threads, then one"
        assert torch.get_num_threads() == 2
        seen.clear()
        plain = small_model()
        plain.fused_decode = False            # no tiled step: torch keeps its threads
        generate(plain, [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3))
        assert seen == [2, 2, 2]
    finally:
        torch.set_num_threads(before)


def test_extend_runs_several_positions_of_one_sequence_as_the_forward_does():
    """DecodeStep.extend (speculative decoding's verify pass): r new tokens of one sequence
    through the C layers, up to MAX_ROWS positions per call, each attending causally to the
    positions before it. Logits and cache equal the model's own forward on the same cache to
    float rounding for r = 1 .. 9 (groups of 4, 4 and 1 included), and the cache length
    advances by r."""
    model = small_model()
    ids = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(3))
    plain, fast = KVCache.for_model(model, 1), KVCache.for_model(model, 1)
    prefill(model, plain, ids[:, :5])
    prefill(model, fast, ids[:, :5])
    step = DecodeStep(model, fast)
    assert step._layers is not None
    pos, got, want = 5, [], []
    for r in range(1, 10):
        with torch.inference_mode():
            want.append(model(ids[:, pos:pos + r], kv_cache=plain)[0])
        got.append(step.extend(ids[:, pos:pos + r]))
        pos += r
        assert fast.length == plain.length == pos
    exact_model = float64_twin(model)
    exact = KVCache.for_model(exact_model, 1)
    with torch.inference_mode():
        truth = exact_model(ids[:, :pos], kv_cache=exact)[0]
    check_float32_error("extend's logits", torch.cat(got), torch.cat(want), truth[5:],
                        factor=4, floor=SMALL_FLOOR)
    check_caches(fast, plain, exact, pos)
    plain_step = DecodeStep(model, KVCache.for_model(model, 1), tiled=False)
    assert plain_step._layers is None
    with torch.inference_mode():
        forward = model(ids[:, :3])[0]
    check_float32_error("the plain step's extend", plain_step.extend(ids[:, :3]), forward,
                        truth[:3], factor=4, floor=SMALL_FLOOR)   # the model's forward on a cache
    with pytest.raises(ValueError, match="shape \\(1, r\\)"):
        step.extend(ids[:, :0])
    with pytest.raises(ValueError, match="KV cache is full"):
        step.extend(torch.zeros(1, 64, dtype=torch.long))


@pytest.mark.parametrize("rows", [3, 9])
def test_layers_on_a_paged_pool_give_the_plain_cache_bits(rows):
    """DecodeLayers.paged (the engine's pool: blocks of 4 positions in any order, each row its
    own sequence and position) computes what the plain cache's step computes, bit for bit: each
    of 3 sequences at its own position against a batch-1 plain cache holding the same keys and
    values, x and the written rows equal; and the arguments are checked. 9 rows (more than
    MAX_ROWS: cpu_gemm.c's register-blocked products, the attention split over the pool) give
    every row the bits it gets alone too; bfloat16 layers take at most MAX_ROWS."""
    model = small_model()
    cfg, size = model.cfg, 4
    gen = torch.Generator().manual_seed(3)
    step = DecodeStep(model, KVCache.for_model(model, 1, 16))
    layers = step._layers.keep[0]
    shape = (cfg.n_kv_heads, size, cfg.head_dim)
    pools = [KVCache.for_model(model, 1, 16).layers[0] for _ in range(cfg.n_layers)]
    for layer in pools:                  # 40 blocks of 4 positions in place of (1, Hkv, 16, hd)
        layer.k, layer.v = (torch.randn(40, *shape, generator=gen) for _ in range(2))
    paged = ck.DecodeLayers(layers, pools, model.rope_cos, step._sin_signed, cfg.n_heads,
                            cfg.n_kv_heads, cfg.norm_eps, block_size=size)
    assert paged.max_rows is None                       # float32: any number of rows
    tables = torch.randperm(40, generator=gen)[:4 * rows].view(rows, 4).contiguous()
    positions = torch.tensor([13, 2, 7, 15, 0, 9, 4, 11, 6][:rows])
    x = torch.randn(rows, cfg.d_model, generator=gen)
    want = []
    for b in range(rows):                # the plain cache: the same keys, in position order
        plain = KVCache.for_model(model, 1, 16)
        for layer, pool in zip(plain.layers, pools, strict=True):
            for name in ("k", "v"):
                blocks = getattr(pool, name)[tables[b]]                  # (4, Hkv, bs, hd)
                getattr(layer, name)[0] = blocks.transpose(0, 1).reshape(cfg.n_kv_heads, 16, -1)
        row = x[b:b + 1].clone()
        ck.DecodeLayers(layers, plain.layers, model.rope_cos, step._sin_signed, cfg.n_heads,
                        cfg.n_kv_heads, cfg.norm_eps)(row, int(positions[b]))
        want.append((row, plain))
    paged.paged(x, positions, tables)
    for b, (row, plain) in enumerate(want):
        assert torch.equal(x[b:b + 1], row), b
        p = int(positions[b])
        block, offset = int(tables[b, p // size]), p % size
        for layer, pool in zip(plain.layers, pools, strict=True):
            assert torch.equal(pool.k[block, :, offset], layer.k[0, :, p])
            assert torch.equal(pool.v[block, :, offset], layer.v[0, :, p])
    with pytest.raises(ValueError, match="positions must be in"):
        paged.paged(x, torch.tensor([16] + [0] * (rows - 1)), tables)
    with pytest.raises(ValueError, match="tables must name blocks in"):
        paged.paged(x, positions, tables + 20)
    with pytest.raises(ValueError, match="positions must be a contiguous int64"):
        paged.paged(x, positions[:-1], tables)
    with pytest.raises(ValueError, match="paged pool: call paged"):
        paged(x, 0)
    with pytest.raises(ValueError, match="plain cache: call them with"):
        step._layers.paged(x[:1], positions[:1], tables[:1])
    with pytest.raises(ValueError, match="block_size must be the pool's block size 4"):
        ck.DecodeLayers(layers, pools, model.rope_cos, step._sin_signed, cfg.n_heads,
                        cfg.n_kv_heads, cfg.norm_eps, block_size=8)
    bf16 = small_model().to(torch.bfloat16)
    wide = DecodeStep(bf16, KVCache.for_model(bf16, ck.MAX_ROWS + 1, 16))._layers
    with pytest.raises(ValueError, match=f"1 <= B <= {ck.MAX_ROWS}, got"):
        wide(torch.zeros(ck.MAX_ROWS + 1, cfg.d_model), 0)


def test_a_tiled_linear_shares_existing_tiles_without_copying():
    """TiledLinear.sharing reads tiles that exist (the engine's batched products' own): the same
    outputs as its own tiles of the same weights, the same memory, and a clear error for tiles
    that do not fit the sizes."""
    w1, w2 = weights(40, 64, 1), weights(24, 64, 2)
    own = ck.TiledLinear(w1, w2)
    shared = ck.TiledLinear.sharing(own.tiled, [40, 24])
    assert shared.tiled.data_ptr() == own.tiled.data_ptr()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(shared(x), own(x), strict=True))
    with pytest.raises(ValueError, match="tiled must be contiguous float32 CPU tiles"):
        ck.TiledLinear.sharing(own.tiled, [40, 40])
    with pytest.raises(ValueError, match="tiled must be contiguous float32 CPU tiles"):
        ck.TiledLinear.sharing(own.tiled.bfloat16(), [40, 24])


def test_the_final_norm_and_head_in_the_call_give_the_plain_steps_logits():
    """With final_norm and head the C call returns the logits: as close to the float64 model's
    as the plain step's (tiled=False) over 10 positions; a head without the norm, or of another
    format, is refused with the reason."""
    model = small_model()
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    fast, plain = KVCache.for_model(model, 1, 16), KVCache.for_model(model, 1, 16)
    step, oracle = DecodeStep(model, fast), DecodeStep(model, plain, tiled=False)
    assert step._layers.head is not None and step._layers.final_norm is not None
    got = torch.stack([step(ids[:, t:t + 1]) for t in range(10)], 1)
    want = torch.stack([oracle(ids[:, t:t + 1]) for t in range(10)], 1)
    exact_model = float64_twin(model)
    with torch.inference_mode():
        truth = exact_model(ids, kv_cache=KVCache.for_model(exact_model, 1, 16))
    check_float32_error("the C call's logits", got, want, truth, factor=4, floor=SMALL_FLOOR)
    layers, cache = step._layers.keep
    args = (layers, cache, model.rope_cos, step._sin_signed, 4, 2, 1e-5)
    with pytest.raises(ValueError, match="needs final_norm"):
        ck.DecodeLayers(*args, head=step._layers.head)
    with pytest.raises(ValueError, match="head must be one TiledLinear of the layers' format"):
        ck.DecodeLayers(*args, final_norm=model.norm.weight,
                        head=ck.TiledLinear(model.output.weight, fmt="bf16"))


def test_layers_refuse_shapes_that_do_not_fit():
    """The C layers read and write where the shapes say, without a bound of their own: x of
    another width than the model's, heads that do not fit qkv and wo, kv heads that do not
    divide the heads, and a cache of other kv heads are refused (the argument named) before a
    call reaches them."""
    model = small_model()                            # 4 heads, 2 kv heads of 16: width 64
    step = DecodeStep(model, KVCache.for_model(model, 1, 16))
    layers, cache = step._layers.keep
    args = (layers, cache, model.rope_cos, step._sin_signed)
    with pytest.raises(ValueError, match=r"x must be contiguous float32 \(B, 64\)"):
        step._layers(torch.zeros(1, 65), 0)
    with pytest.raises(ValueError, match=r"layers\[0\]: qkv must stack \(8, 2, 2\) heads"):
        ck.DecodeLayers(*args, 8, 2, 1e-5)
    with pytest.raises(ValueError, match="heads must be a positive multiple of kv_heads"):
        ck.DecodeLayers(*args, 4, 3, 1e-5)
    with pytest.raises(TypeError, match="heads and kv_heads must be ints"):
        ck.DecodeLayers(*args, 4.0, 2, 1e-5)
    wide = [SimpleNamespace(k=torch.zeros(1, 4, 16, 16), v=torch.zeros(1, 4, 16, 16))
            for _ in cache]
    with pytest.raises(ValueError, match=r"cache_layers\[0\] must hold .k and .v"):
        ck.DecodeLayers(layers, wide, model.rope_cos, step._sin_signed, 4, 2, 1e-5)


def test_a_nan_written_to_a_bfloat16_cache_stays_a_nan():
    """A bfloat16 cache's rows are rounded from float32 as x is for the bfloat16 dot products
    (float_to_bf16), NaN included: a row of x holding the NaN 0x7fffffff, whose payload the
    rounding (add 0x7fff, shift) would carry into the sign bit (-0.0), makes every key and
    value its position writes NaN in both layers; the other row's stay numbers."""
    model = small_model()
    cfg = model.cfg
    step = DecodeStep(model, KVCache.for_model(model, 2, 16))
    shape = (2, cfg.n_kv_heads, 16, cfg.head_dim)
    cache = [SimpleNamespace(k=torch.zeros(shape, dtype=torch.bfloat16),
                             v=torch.zeros(shape, dtype=torch.bfloat16)) for _ in range(2)]
    layers = ck.DecodeLayers(step._layers.keep[0], cache, model.rope_cos, step._sin_signed,
                             cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
    assert layers.cache_bf16 == 1
    x = torch.randn(2, cfg.d_model, generator=torch.Generator().manual_seed(0))
    x[1, 5] = torch.tensor(0x7fffffff, dtype=torch.int32).view(torch.float32)
    layers(x, 3)
    for layer in cache:
        for t in (layer.k, layer.v):
            assert t[1, :, 3].isnan().all() and not t[0, :, 3].isnan().any()
