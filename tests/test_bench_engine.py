"""Day 17's bench rows (tinygpt/bench/engine.py) on the quick plan: the rows' bookkeeping and
the identical-tokens checks, not their speed (speed is checked by `python -m tinygpt bench`,
never in a timed unit test)."""

from __future__ import annotations

import pytest

from tinygpt.bench import engine as rows
from tinygpt.bench import registry as R
from tinygpt.bench.load import running_server
from tinygpt.bench.plan import bench_plan


def quick_ctx():
    return R.BenchContext(plan=bench_plan(quick=True), threads=1, log=lambda line: None)


def test_the_rows_are_registered_for_day_17():
    groups = R.row_groups(["engine", "serve_goodput"])
    assert [g.day for g in groups] == [17, 17] and "tinygpt.bench.engine" in R.ROW_MODULES


def test_requests_are_seeded_cuts_of_story_text():
    from tinygpt.train import load_pretrained
    _, tok = load_pretrained()
    a, b = rows.serving_requests(tok, 8, 3), rows.serving_requests(tok, 8, 3)
    assert a == b and all(16 <= len(p) <= 96 for p in a)
    assert rows.serving_requests(tok, 8, 4) != a


@pytest.mark.slow
def test_the_engine_rows_compare_identical_tokens():
    pytest.importorskip("transformers")
    serial, hf = rows.engine_rows(quick_ctx())
    assert serial.name == "engine_vs_serial" and hf.name == "engine_vs_hf_cb"
    assert serial.details["identical_tokens"], "the engine must reproduce the batch-1 loop"
    assert hf.details["identical_tokens"], "transformers' continuous batching disagrees"
    assert serial.value > 0 and serial.target == rows.SERIAL_TARGET
    assert hf.target == rows.HF_TARGET
    assert serial.details["tokens"] == 16 * 32


def test_a_server_that_cannot_start_is_reported():
    with pytest.raises(RuntimeError, match="did not start"):
        with running_server("--max-running", "0", timeout=30):
            pass
