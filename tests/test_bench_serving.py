"""The serve_speed rows (tinygpt/bench/serving.py): their statistics, and one small run of the
whole group on the course's shipped model (the real figures come from `python -m tinygpt bench
--only serve_speed` on SmolLM2; no timed unit test). llama.cpp is hidden here so the run takes
the path every machine without the optional extra takes."""

from __future__ import annotations

import re
import sys

import pytest

from tinygpt.bench import registry as R
from tinygpt.bench import serving


def test_the_group_is_registered_for_day_17():
    [group] = R.row_groups(["serve_speed"])
    assert group.day == 17 and "tinygpt.bench.serving" in R.ROW_MODULES


def test_a_decode_rate_counts_the_tokens_after_the_first():
    assert serving.decode_rate([10.0, 10.5, 11.0, 12.0]) == pytest.approx(3 / 2.0)
    for bad in ([1.0], [2.0, 1.0], [1.0, 1.0]):
        with pytest.raises(ValueError, match="two or more increasing stamps"):
            serving.decode_rate(bad)


def test_the_one_stream_rows_take_the_median_of_each_rounds_own_ratio(monkeypatch):
    """Scripted rates whose medians' ratios (20 / 30 and 20 / 25) are not the medians of the
    rounds' own ratios (0.9, 0.9, 0.5 and 1.0, 1.0, 0.8): the rows take the latter, and the
    order of the contenders rotates from round to round."""
    order: list[str] = []
    script = {"generate": iter([30.0, 10.0, 40.0]), "served": iter([27.0, 9.0, 20.0]),
              "llama": iter([27.0, 9.0, 25.0])}

    def take(name, result):
        order.append(name)
        return result(next(script[name]))

    monkeypatch.setattr(serving, "generate_rate", lambda *a: take("generate", float))
    monkeypatch.setattr(serving, "served_rate", lambda *a: take("served", lambda r: (r, "x")))
    monkeypatch.setattr(serving, "llama_rate", lambda *a: take("llama", lambda r: (r, [])))
    ctx = R.BenchContext(threads=1, log=lambda line: None)
    one, llama = serving._one_stream(ctx, None, "url", "m", [1], "x", 8, 3, (object(), None))
    assert order == ["generate", "served", "llama", "served", "llama", "generate",
                     "llama", "generate", "served"]
    assert one.value == pytest.approx(0.9) and llama.value == pytest.approx(1.0)
    assert one.details["served_rate"] / one.details["generate_rate"] == pytest.approx(2 / 3)
    assert not one.met and "median of 3 rounds' ratios" in one.reason and llama.met


def test_the_several_stream_rows_take_the_median_of_each_rounds_own_ratio(monkeypatch):
    """The same statistic for 2 streams of 4 tokens: throughputs 8 / t for scripted seconds
    whose medians' ratio (8/4 over 8/3: 0.75) is not the median of the rounds' own ratios
    (1.0, 0.5, 1.0): the row takes the latter; who goes first alternates; a text that differs
    from the expected one fails the row."""
    from tinygpt.bench import llamacpp, load

    order: list[str] = []
    seconds = {"served": iter([2.0, 6.0, 4.0]), "llama": iter([2.0, 3.0, 4.0])}
    served_texts = iter([["a", "b"], ["a", "b"], ["a", "c"]])
    monkeypatch.setattr(llamacpp, "llama_batched", lambda *a: (
        order.append("llama") or (next(seconds["llama"]), [])))
    monkeypatch.setattr(load, "run_concurrent_streams", lambda *a, **k: (
        order.append("served") or (next(seconds["served"]), next(served_texts))))
    ctx = R.BenchContext(threads=1, log=lambda line: None)
    row = serving._streams(ctx, "url", "m", [[1], [2]], ["a", "b"], 4, 3, (None, "path"))
    assert order == ["llama", "served", "served", "llama", "llama", "served"]
    assert row.value == pytest.approx(1.0) and row.details["llama_tokens_per_s"] == 8 / 3
    assert "median of 3 rounds' ratios" in row.details["summary"]
    assert not row.met and "differs from batch-1" in row.reason


def test_the_quick_plan_and_other_devices_skip_the_group():
    import torch

    logged: list[str] = []
    quick = R.BenchContext(plan=R.bench_plan(quick=True), log=logged.append)
    assert serving.serve_speed(quick) == [] and "full plan only" in logged[-1]
    gpu = R.BenchContext(device=torch.device("meta"), log=logged.append)
    assert serving.serve_speed(gpu) == [] and "for the CPU" in logged[-1]


def test_the_rows_on_the_shipped_model_without_llama_cpp(monkeypatch):
    """One stream, 2 streams, 2 streams of long prompts and the chat: the served texts are
    batch-1 generate()'s, the one-stream row is a ratio over generate(), the 2-stream rows (no
    llama.cpp to divide by) print the served throughput as information, and the chat row its
    rate."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)         # import llama_cpp fails
    monkeypatch.setattr(serving, "LONG_TOKENS", 4)
    logged: list[str] = []
    ctx = R.BenchContext(threads=1, log=logged.append)
    rows = serving.serve_speed_rows(ctx, "tinygpt", tokens=8, rounds=1, streams=(2,),
                                    long_prompt=150)
    assert [r.name for r in rows] == ["serve_stream_1", "serve_streams_2",
                                      "serve_streams_long_2", "chat_stream_1"]
    one, two, long, chat = rows
    assert re.search(r"after prompts of 15\d-15\d tokens", long.description), long.description
    assert all(r.details["identical_text"] for r in (one, two, long))
    assert not long.targeted and long.value > 0
    assert one.value == pytest.approx(one.details["served_rate"] / one.details["generate_rate"])
    assert one.targeted and not two.targeted and not chat.targeted
    assert two.value == two.details["served_tokens_per_s"] > 0 and two.met
    assert chat.details["chat_rate"] > 0
    assert chat.met == (chat.value >= serving.STREAM_TARGET)     # printed as it is, not counted
    assert len(chat.details["rounds"]["chat"]) == len(chat.details["rounds"]["generate"]) == 1
    assert chat.value == pytest.approx(chat.details["rounds"]["chat"][0]
                                       / chat.details["rounds"]["generate"][0])
    assert chat.met or "rounds' ratios" in chat.reason
    assert any("llama.cpp not measured" in line for line in logged)
    # the targeted llama.cpp row did not run: on record, and counted as a miss
    assert "llama.cpp not measured" in ctx.skipped["serve_stream_1_llamacpp"]
    assert ctx.missed == {"serve_stream_1_llamacpp"}


def test_the_chat_row_runs_the_chat_as_a_user_does(monkeypatch):
    """chat_rate runs `python -m tinygpt chat` as a process of its own, in the environment the
    user gave the bench (without the settings the bench added for itself), and reads the rate
    from its stats line; a chat that prints no stats is an error naming its exit status."""
    seen = {}

    class Done:
        returncode, stderr = 0, ""
        stdout = "> A story.\n[12 tokens: prompt 3.0 ms, then 41.5 tokens/s)\n"

    def run(args, **kwargs):
        seen.update(args=args, **kwargs)
        return Done

    monkeypatch.setattr(serving.subprocess, "run", run)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("TINYGPT_ENV_ADDED", "OMP_WAIT_POLICY")
    assert serving.chat_rate("smollm2", 16, 2) == 41.5
    assert seen["args"][:4] == [sys.executable, "-m", "tinygpt", "chat"]
    assert "--stats" in seen["args"] and seen["args"][seen["args"].index("--threads") + 1] == "2"
    assert "OMP_WAIT_POLICY" not in seen["env"] and "TINYGPT_ENV_ADDED" not in seen["env"]
    Done.returncode, Done.stdout = 1, "no model"
    with pytest.raises(RuntimeError, match="exit 1"):
        serving.chat_rate("smollm2", 16, 2)
