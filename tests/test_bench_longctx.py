"""Day 21's bench rows (tinygpt/bench/longctx.py) on tiny shapes: their bookkeeping (the
logits compared, the bytes per token, the blocks held), not their speed (speed is
`python -m tinygpt bench`'s business, never a timed unit test)."""

from __future__ import annotations

import math

import pytest

from tinygpt.bench import longctx as row
from tinygpt.bench import registry as R
from tinygpt.bench.plan import bench_plan
from tinygpt.model import ModelConfig, TinyGPT

TINY_MLA = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                       d_ff=48, max_seq_len=64, attention="mla", kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
TINY_WINDOW = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=48, max_seq_len=128, sliding_window=8)


def quick_ctx() -> R.BenchContext:
    return R.BenchContext(plan=bench_plan(quick=True), threads=1, log=lambda line: None)


def test_the_groups_are_registered_for_day_21():
    groups = R.row_groups(["mla_decode", "window_kv"])
    assert {g.day for g in groups} == {21} and "tinygpt.bench.longctx" in R.ROW_MODULES


def test_the_bench_shapes_are_what_the_rows_say():
    cfg = row.MLA_DECODE_CONFIG
    assert cfg.n_heads >= 32 and cfg.kv_lora_rank >= 256 and cfg.qk_rope_head_dim == 64
    assert cfg.max_seq_len > row.MLA_CONTEXT == 4096
    assert row.WINDOW_CONFIG.sliding_window == row.WINDOW == 256 and row.WINDOW_BLOCK == 16
    assert row.WINDOW_CONFIG.max_seq_len >= row.WINDOW_TOKENS


def test_the_mla_row_compares_absorbed_and_naive_logits():
    model = TinyGPT(TINY_MLA, seed=1).eval()
    c = row.mla_decode_row(quick_ctx(), model, 24, rounds=1, targeted=False)
    d = c.details
    assert d["same_greedy_token"] and d["max_logit_difference"] < 1e-5
    assert d["absorbed_s"] > 0 and d["naive_s"] > 0 and not c.targeted
    assert set(d["layer0_attention_s"]) == {"absorbed", "naive", "decompressed_cache"}
    # the decode mode is restored and the cache left as prefilled
    assert all(layer.attention.decode == "absorbed" for layer in model.layers)


def test_the_mla_bytes_row_equals_the_formula():
    model = TinyGPT(TINY_MLA).eval()
    c = row.mla_bytes_row(model, 32)
    assert c.met and c.details["formula"] == (16 + 8) * 2 * 4
    assert c.details["kv_cache_bytes_per_token"] == c.details["paged_pool_bytes_per_token"] \
        == c.details["formula"]
    assert c.details["expanded_bytes_per_token"] == 4 * (8 + 8 + 8) * 2 * 4


def test_the_window_row_holds_blocks_flat_and_gives_generate_tokens():
    model = TinyGPT(TINY_WINDOW, seed=2).eval()
    c = row.window_row(quick_ctx(), model, window=8, block=4, tokens=72, reference=40,
                       targeted=True)
    d = c.details
    assert c.met and d["tokens_identical"] and d["reference_tokens"] == 40 - row.WINDOW_PROMPT
    assert d["blocks_second_half_max"] == d["blocks_at_window_end"] <= (8 - 1) // 4 + 2
    assert d["blocks_without_window"] == 18


@pytest.mark.parametrize("group", ["mla_decode", "window_kv"])
def test_the_groups_skip_other_devices(group):
    import torch

    ctx = quick_ctx()
    ctx.device = torch.device("meta")
    assert R.row_groups([group])[0].run(ctx) == []


def test_the_sink_rows_compare_past_the_window_with_inside_it():
    class Chars:
        def encode(self, text):
            return [ord(c) % 64 for c in text]

    model = TinyGPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=48, max_seq_len=64), seed=3).eval()
    sinks, alone = row.sink_rows(quick_ctx(), model, Chars(), window=12, tokens=96, start=40,
                                 targeted=False)
    assert (sinks.name, alone.name) == ("sinks_ppl", "window_only_ppl")
    d = sinks.details
    for key in ("ppl_inside_window", "ppl_sinks", "ppl_window_only"):
        assert d[key] == alone.details[key] and math.isfinite(d[key]), key
    assert sinks.value == pytest.approx(d["ppl_sinks"] / d["ppl_inside_window"])
    assert alone.value == pytest.approx(d["ppl_window_only"] / d["ppl_inside_window"])
    assert sinks.met == (sinks.value <= row.SINK_TARGET)
    assert alone.met == (alone.value >= row.WINDOW_ONLY_TARGET)
    assert (sinks.reason is None) == sinks.met and (alone.reason is None) == alone.met
    assert not sinks.targeted and set(d["seconds"]) == {"sinks", "window_only"}
    # a random model has no sinks to lose: the two perplexities differ, neither explodes
    assert d["ppl_sinks"] != d["ppl_window_only"]


def test_the_sink_plan_is_the_targets():
    assert (row.SINKS, row.SINK_WINDOW, row.SINK_TOKENS, row.SINK_FROM) == (4, 1020, 32768,
                                                                          8192)
    assert R.row_groups(["sinks"])[0].day == 21
