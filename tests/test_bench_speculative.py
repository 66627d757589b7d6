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


def test_the_comparison_on_a_random_model_keeps_the_tokens_and_names_a_miss(monkeypatch):
    monkeypatch.setattr(row, "SPEEDUP_TARGET", float("inf"))      # a speedup always misses
    model = TinyGPT(TINY, seed=3).eval()
    c = row.speculative_comparison(model, [1, 2, 3, 1, 2, 3, 1, 2], 24, 3, 1)
    d = c.details
    assert d["identical_tokens"] and d["new_tokens"] == 24
    # each target pass keeps its accepted drafts plus one token of its own
    accepted = sum(n * rate for n, rate in zip(d["proposed_per_position"],
                                                d["per_position_acceptance"], strict=True))
    assert d["target_passes"] + round(accepted) == 24
    assert not c.met and c.target == float("inf")
    assert c.reason.startswith(f"speedup {c.value:.2f}x below infx with ")
