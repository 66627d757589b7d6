"""What `python -m tinygpt bench` claims: a verdict that matches its figures, no target judged
by the quick plan, skips on record, the machine by name, a bandwidth roof the decode cannot
beat, the slow tail of tokens/s, and a table whose columns fit their contents."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from tinygpt import bench as B
from tinygpt.bench import harness as H
from tinygpt.bench import parallel
from tinygpt.bench import report as rep
from tinygpt.bench.cli import strict_failure
from tinygpt.bench.moe import routing_widget_row
from tinygpt.bench.run import QUICK_NOT_JUDGED

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16

processor\t: 1
model name\t: a second processor, never read
"""


def agrees(c: dict) -> bool:
    """A printed verdict agrees with the row's figures: "met" only on a targeted row whose
    value satisfies its target; an untargeted row shows no verdict."""
    printed = rep.verdict(c)
    if not c["targeted"]:
        return not printed.startswith(("met", "NOT MET"))
    if printed == "met":
        return rep._met_by_value(c)
    return printed.startswith("NOT MET: ") and bool(c["reason"])


def row(name="toy_rate", value=2.0, target=1.0, direction=">=", unit="x", met=True,
        reason=None, targeted=True, **details) -> B.Comparison:
    return B.Comparison(name, "a toy row", value, target, direction, unit, met, reason,
                        dict(details), targeted=targeted)


def toy_report(monkeypatch, plan_name: str, *groups) -> dict:
    """run_bench over toy row groups (name, fn) registered for this test only."""
    for name, fn in groups:
        monkeypatch.setitem(B.registry._GROUPS, name, B.registry.RowGroup(name, 99, fn))
    plan = B.bench_plan(quick=plan_name == "quick")
    report, _ = B.run_bench(plan, threads=1, log=lambda line: None,
                            only=[name for name, _ in groups])
    return json.loads(json.dumps(report))


# ----------------------------------------------------------------------------------------------
# the bandwidth roof


def test_a_share_above_the_measured_roof_is_not_met():
    step = {"bytes_per_step": 1e9, "step_s": 0.1}                  # 10 GB/s achieved
    c = B.compare_bandwidth(step, copy_bandwidth=6e9, read_bandwidth=7e9, target=0.5)
    assert c.value == pytest.approx(10 / 7) and not c.met
    assert H.ROOF_UNRELIABLE in c.reason and c.details["judged_against"] == "read"
    inside = B.compare_bandwidth(step, copy_bandwidth=16e9, read_bandwidth=12e9, target=0.5)
    assert inside.met and inside.value == pytest.approx(10 / 16)


def test_the_median_round_share_is_judged_against_the_higher_roof():
    # 3 bytes per token in 1 s; the copy roof alone would give shares above 100%
    judged = H.median_round_share(3.0, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [5.0, 10.0, 8.0],
                                  target=0.35)
    assert judged["round_shares"] == pytest.approx([0.6, 0.3, 0.375])
    assert judged["round"] == 2 and judged["share"] == pytest.approx(0.375)
    assert judged["judged_against"] == "read" and judged["reason"] is None
    above = H.median_round_share(3.0, [1.0], [2.0], [1.0], target=0.5)
    assert above["share"] == pytest.approx(1.5) and H.ROOF_UNRELIABLE in above["reason"]


# ----------------------------------------------------------------------------------------------
# verdicts


def test_an_untargeted_row_prints_no_verdict():
    for c in (row(targeted=False), row(value=0.43, met=False, reason="0.43x: slower",
                                       targeted=False)):
        printed = rep.verdict(dataclasses.asdict(c))
        assert printed.startswith("info") and "met" not in printed.lower().split(":")[0]
    quick = row(targeted=False, not_judged=QUICK_NOT_JUDGED)
    assert rep.verdict(dataclasses.asdict(quick)) == QUICK_NOT_JUDGED


def test_rows_with_another_criterion_print_it(monkeypatch):
    widget = routing_widget_row()
    assert widget.met == (widget.value >= widget.target)
    assert agrees(dataclasses.asdict(widget))
    # tp_decode: the value printed is the cost model's error, judged <= the tolerance
    for predicted, ok in ((0.012, True), (0.02, False)):
        fake = types.SimpleNamespace(
            predicted_step_seconds=predicted, tp_step_seconds=0.01, one_step_seconds=0.008,
            speedup=0.8, tokens_identical=True, comm_seconds=0.001, comm_share=0.1,
            comm_calls=5, predicted_comm_seconds=0.001,
            link=types.SimpleNamespace(latency=1e-3, bandwidth=1e9))
        monkeypatch.setattr(parallel.parallel, "measure_tp_decode", lambda *a, f=fake, **k: f)
        c = parallel.tp_row("tp_decode", "toy", "shipped", 2, 4)
        assert c.met == ok and c.direction == "<=" and c.unit == "relative error"
        assert c.value == pytest.approx(abs(predicted / 0.01 - 1))
        assert c.details["speedup"] == 0.8
        assert agrees(dataclasses.asdict(c) | {"targeted": True})


# ----------------------------------------------------------------------------------------------
# the quick plan and skips


def test_the_quick_plan_judges_nothing(monkeypatch):
    report = toy_report(monkeypatch, "quick", ("toy", lambda ctx: [row(), row(
        "toy_slow", 0.5, met=False, reason="0.50x is below the 1x target")]))
    assert all(not c["targeted"] and c["details"]["not_judged"] == QUICK_NOT_JUDGED
               for c in report["comparisons"])
    assert report["all_targets_met"] is None and not strict_failure(report)
    text = B.format_table(report)
    assert "judges no target" in text and "  met" not in text and "NOT MET" not in text
    assert all(agrees(c) for c in report["comparisons"])


def test_a_skipped_group_is_on_record_and_not_a_pass(monkeypatch):
    report = toy_report(monkeypatch, "full", ("toy_gpu", lambda ctx: ctx.skip(
        "toy_gpu", "these rows need a GPU")))
    assert report["comparisons"] == [] and report["skipped"] == {
        "toy_gpu": "these rows need a GPU"}
    assert report["all_targets_met"] is None and strict_failure(report)
    text = B.format_table(report)
    assert "skipped (did not run):\n  toy_gpu: these rows need a GPU" in text
    assert "nothing was judged" in text

    def met_but_one_skipped(ctx):
        ctx.skip("toy_llama", "the optional package is missing", targeted=True)
        return [row()]

    report = toy_report(monkeypatch, "full", ("toy", met_but_one_skipped))
    assert report["all_targets_met"] is False and strict_failure(report)
    assert "counted as not met" in report["skipped"]["toy_llama"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the group runs on a GPU")
def test_the_cuda_group_on_a_cpu_leaves_a_trace(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert B.main(["--only", "captured_decode", "--strict", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "captured_decode: CUDA graphs need a GPU" in printed
    written = json.loads(out.read_text())
    assert "captured_decode" in written["skipped"] and written["all_targets_met"] is None


# ----------------------------------------------------------------------------------------------
# the machine and the table


def test_the_machine_is_named():
    cpu = H.cpu_model(CPUINFO)
    assert cpu == {"name": "AMD EPYC 9B14", "family": "25", "model": "17",
                   "isa": ["avx2", "fma", "avx512f", "avx512_bf16"]}
    assert H.cpu_model("")["isa"] == []
    assert set(H.machine_info(1)["cpu"]) == {"name", "family", "model", "isa"}


def test_the_table_names_the_machine_sizes_its_columns_and_prints_the_tiled_note(monkeypatch):
    step = {"bytes_per_step": 1e8, "step_s": 0.1, "packed": False, "compile_note": None,
            "pack_note": None, "tiled_note": "the tiled kernels need x86-64"}
    rows = [B.compare_bandwidth(step, 2e9, 1e9),
            row("serve_streams_2", 162.5, 0.0, unit="tokens/s", targeted=False),
            row("a_much_longer_row_name_than_the_column_was", 1.5)]
    report = toy_report(monkeypatch, "full", ("toy", lambda ctx: rows))
    report["machine"]["cpu"] = H.cpu_model(CPUINFO)
    text = B.format_table(report)
    assert "machine: AMD EPYC 9B14 (family 25, model 17); ISA: avx2, fma, avx512f" in text
    assert "note: the tiled kernels need x86-64" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("comparison"))
    table = lines[header + 2:header + 2 + len(rows)]
    assert "162.5 tokens/s  >= 0 tokens/s  info" in table[1]
    column = lines[header].index("result")                  # every result starts under it
    for line, c in zip(table, report["comparisons"], strict=True):
        assert line[column - 2:] == "  " + rep.verdict(c) and agrees(c)
