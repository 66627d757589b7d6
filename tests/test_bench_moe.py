"""Day 20's bench rows (tinygpt/bench/moe.py) on tiny shapes: their bookkeeping, the published
configs' counts and the bytes they charge, not their speed (speed is `python -m tinygpt bench`'s
business, never a timed unit test)."""

from __future__ import annotations

import pytest
import torch

from tinygpt import moe as M
from tinygpt.bench import moe as row
from tinygpt.bench import registry as R
from tinygpt.bench.plan import bench_plan
from tinygpt.model import ModelConfig, TinyGPT

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                   max_seq_len=64, n_experts=8, top_k=2, d_expert=16, dense_layers=(1,),
                   n_shared_experts=1)


def quick_ctx() -> R.BenchContext:
    return R.BenchContext(plan=bench_plan(quick=True), threads=1, log=lambda line: None)


def test_the_groups_are_registered_for_day_20():
    groups = R.row_groups(["moe_dispatch", "moe_decode", "moe_routing"])
    assert {g.day for g in groups} == {20} and "tinygpt.bench.moe" in R.ROW_MODULES


def test_published_configs_count_the_parameters_their_model_cards_state():
    for name, c in row.PUBLISHED.items():
        n = row.published_parameters(c)
        assert n["total"] / 1e9 == pytest.approx(row.PUBLISHED_TOTALS[name], rel=2e-3), name
    # activated (the cards count the embedding row's table too): 37B, 3.3B, 12.9B
    for name, active in (("DeepSeek-V3", 37), ("Qwen3-30B-A3B", 3.3), ("Mixtral-8x7B", 12.9)):
        c, n = row.PUBLISHED[name], row.published_parameters(row.PUBLISHED[name])
        embedding = c["vocab_size"] * c["hidden_size"]
        got = n["dense"] + embedding + n["moe_layers"] * c["num_experts_per_tok"] * n["expert"]
        assert got / 1e9 == pytest.approx(active, rel=0.02), name


def test_published_parameters_match_our_own_count_for_a_gqa_config():
    c = dict(row.PUBLISHED["Mixtral-8x7B"], hidden_size=64, num_hidden_layers=3,
             moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)
    cfg = ModelConfig(vocab_size=100, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                      d_ff=32, max_seq_len=16, n_experts=4, top_k=2, d_expert=24)
    assert row.published_parameters(c)["total"] == sum(
        p.numel() for p in TinyGPT(cfg).parameters())


def test_the_routing_widget_states_the_deepseek_figures():
    (c,) = row.moe_routing_rows(quick_ctx())
    ds = c.details["models"]["DeepSeek-V3"]["per_batch"]
    assert [round(ds[b]["distinct"], 1) for b in ("1", "4")] == [8.0, 30.5]
    assert [round(ds[b]["distinct"]) for b in ("16", "64")] == [102, 222]
    assert c.value == pytest.approx(ds["64"]["bytes"] / ds["1"]["bytes"]) and not c.targeted
    mixtral = c.details["models"]["Mixtral-8x7B"]
    # 8 experts top-2, all touched at large B: 2 B k / E = B / 2 flops per weight, and an
    # H100's bf16 ridge (989.4 TFLOP/s over 3.35 TB/s) is 295 flops per byte, 590 per weight
    assert mixtral["critical_batch_h100"] == pytest.approx(2 * 2 * 989.4 / 3.35, abs=1)


def test_model_bytes_by_hand():
    model = TinyGPT(TINY).eval()
    info = row.model_bytes(model)
    moe = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, M.MoE)]
    assert info["moe_layers"] == 2 and info["n_experts"] == 8 and info["top_k"] == 2
    assert info["expert"] == 3 * 16 * 32 * 4
    total = sum(p.nbytes for p in model.parameters())
    experts = sum(ff.w1.nbytes + ff.w2.nbytes + ff.w3.nbytes for ff in moe)
    assert info["dense"] == total - experts - model.tok_embeddings.weight.nbytes
    assert info["kv_per_position"] == 2 * 3 * 2 * 8 * 4
    # tinygpt.flops counts the same batch-1 step, and the embedding row besides
    from tinygpt import flops
    assert flops.decode_step_bytes(TINY, 1, 10, "fp32") == info["dense"] + 2 * 2 * info[
        "expert"] + 10 * info["kv_per_position"] + TINY.d_model * 4


def test_a_dispatch_row_on_a_small_shape():
    c = row.dispatch_row(4, 2, 32, 8, 0, rounds=1, targeted=False)
    d = c.details
    assert c.name == "moe_dispatch_4x2" and c.value == pytest.approx(d["loop_s"] / d["dispatch_s"])
    assert d["round_ratios"] == [c.value]
    assert d["error_vs_float64"] <= 4 * d["loop_error_vs_float64"] + 1e-6
    assert d["loop_weight_bytes"] == 8 * 2 * 3 * 32 * 1024 * 4
    assert c.met == (c.value >= row.DISPATCH_TARGET) and (c.reason is None) == c.met


def test_the_decode_rows_on_a_tiny_model():
    ctx = quick_ctx()
    model = ctx.build(TINY)
    products = row.products_row(model, 2, 1, 0)
    assert set(products.details["gb_per_s"]) == {"torch F.linear per slice",
                                                 "torch fused gate+up", "tiled (cpu_kernels)"}
    c = row.decode_bytes_row(ctx, model, steps=2, targeted=False)
    per = c.details["per_batch"]
    assert per["1"]["relative_error"] == 0, "at batch 1 a step reads exactly k experts a layer"
    assert per["1"]["distinct_per_layer"] == 2
    assert all(r["distinct_per_layer"] <= 8 for r in per.values())
    assert c.value == max(abs(r["relative_error"]) for r in per.values())
    bandwidth = row.decode_bandwidth_row(ctx, model, targeted=False)
    assert bandwidth.details["experts_run_per_layer"] == [2, 2]
    info = row.model_bytes(model)
    assert bandwidth.details["bytes_per_token"] == info["dense"] + 2 * 2 * info["expert"] \
        + (8 + 4) * info["kv_per_position"]


def test_stacked_products_equal_the_plain_ones():
    w1, w3 = torch.randn(6, 5), torch.randn(6, 5)
    x = torch.randn(2, 5)
    for got, want in zip(row.StackedProducts(w1, w3)(x), M.PlainProducts(w1, w3)(x),
                         strict=True):
        assert torch.allclose(got, want, atol=1e-6)
