"""Day 14's bench row (tinygpt/bench/speculative.py), run on the quick plan and on a tiny
random model: the row's bookkeeping, not its speed (speed is checked by `python -m tinygpt
bench`, never in a timed unit test)."""

from __future__ import annotations

import pytest

from tinygpt.bench import registry as R
from tinygpt.bench import speculative as row
from tinygpt.bench.plan import bench_plan
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.speculative import expected_tokens_per_pass

TINY = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                   max_seq_len=128)


def test_the_row_is_registered_for_day_14():
    (group,) = R.row_groups(["speculative_greedy"])
    assert group.day == 14 and "tinygpt.bench.speculative" in R.ROW_MODULES


def test_the_quick_row_reports_identical_tokens_and_the_formula():
    ctx = R.BenchContext(plan=bench_plan(quick=True), threads=1, log=lambda line: None)
    (c,) = row.speculative_greedy(ctx)
    d = c.details
    assert c.name == "speculative_greedy" and c.unit == "x" and c.value > 0
    assert d["identical_tokens"], "speculative greedy must reproduce the cached greedy loop"
    assert d["formula_tokens_per_pass"] == pytest.approx(
        expected_tokens_per_pass(d["acceptance_rate"], row.GAMMA))
    assert d["tokens_per_pass"] == pytest.approx(d["new_tokens"] / d["target_passes"])
    assert len(d["per_position_acceptance"]) == row.GAMMA
    assert c.met == (c.value >= row.SPEEDUP_TARGET
                     and d["formula_relative_error"] <= row.FORMULA_TOLERANCE)
    assert "tokens/s" in d["summary"] and (c.reason is None) == c.met


def test_the_comparison_on_a_random_model_keeps_the_tokens_and_names_a_miss():
    model = TinyGPT(TINY, seed=3).eval()
    c = row.speculative_comparison(model, [1, 2, 3, 1, 2, 3, 1, 2], 24, 3, 1)
    assert c.details["identical_tokens"] and c.details["new_tokens"] == 24
    assert c.details["target_passes"] <= 24
    if not c.met:
        assert c.reason
