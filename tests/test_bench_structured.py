"""Day 19's hostile-requests bench row (tinygpt.bench.structured.hostile_stall): the gap
arithmetic by hand, the verdict and its reason on made-up timings, and the row's real run on
the course's own model (every stream whole, every hostile request a 4xx or a 200, never a
5xx). Its timing target lives in the bench, not here."""

from __future__ import annotations

import contextlib

import pytest

from tinygpt.bench import structured as S


def test_largest_gap_by_hand_names_what_was_in_flight():
    streams = [[0.0, 0.05, 0.10, 0.40, 0.45],      # 0.30 s between 0.10 and 0.40
               [1.0, 1.5]]                          # its first token is a prefill: 0.5 is a gap
    hostile = [("early", 0.0, 0.05), ("enum", 0.2, 0.3), ("late", 0.5, 0.6)]
    assert S.largest_gap(streams, hostile) == (pytest.approx(0.5), None)
    gap, during = S.largest_gap([streams[0]], hostile)
    assert gap == pytest.approx(0.30) and during == "enum"
    gap, during = S.largest_gap([streams[0]], [*hostile, ("regex", 0.35, 0.9),
                                               ("enum", 0.39, 0.41)])
    assert during == "enum; regex"                  # each name once
    assert S.largest_gap([[1.0]], hostile) == (0.0, None)


def fake_run(gap: float, statuses: dict, tokens: int):
    """_streams_and_hostile's result: two streams, one with a `gap` between tokens 2 and 3
    while the enum request was in flight."""
    def run(url, plan, hostile):
        times = [0.01 * i for i in range(tokens)]
        stalled = times[:3] + [t + gap for t in times[3:]]
        answers = [(name, 0.015, 0.02 + gap, statuses.get(name, 400), None)
                   for name, _ in S.hostile_bodies(0)] if hostile else []
        return {"streams": [times, stalled if hostile else times], "answers": answers}

    async def coroutine(url, plan, hostile):
        return run(url, plan, hostile)
    return coroutine


def test_the_row_is_met_only_under_the_target_with_no_5xx_and_every_token(monkeypatch):
    monkeypatch.setattr(S, "serving", lambda *a, **k: contextlib.nullcontext("url"))
    plan = S.StallPlan(2, 20, 1)
    monkeypatch.setattr(S, "_streams_and_hostile", fake_run(0.25, {}, 20))
    row = S.hostile_stall(None, None, plan)
    assert not row.met and row.value == pytest.approx(260) and row.unit == "ms"
    assert "260 ms gap" in row.reason and "a 10,000-value enum" in row.reason
    assert "the streams alone: 10 ms" in row.reason
    monkeypatch.setattr(S, "_streams_and_hostile", fake_run(0.02, {}, 20))
    row = S.hostile_stall(None, None, plan)
    assert row.met and row.reason is None and row.value == pytest.approx(30)
    monkeypatch.setattr(S, "_streams_and_hostile",
                        fake_run(0.02, {"a catastrophic regex": 500}, 20))
    row = S.hostile_stall(None, None, plan)
    assert not row.met and "5xx" in row.reason and "catastrophic" in row.reason
    monkeypatch.setattr(S, "_streams_and_hostile", fake_run(0.02, {}, 12))
    row = S.hostile_stall(None, None, plan)
    assert not row.met and "cut short" in row.reason


def test_the_row_runs_the_server_on_the_course_model():
    from tinygpt import load_pretrained

    model, tokenizer = load_pretrained()
    plan = S.StallPlan(streams=2, tokens=12, rounds=1, every_s=0.1)
    row = S.hostile_stall(model.eval(), tokenizer, plan)
    answers = {a["name"]: a for a in row.details["answers"]}
    assert list(answers) != [] and set(answers) == {name for name, _ in S.hostile_bodies(0)}
    assert row.details["tokens_per_stream"] == [12, 12]
    assert all(a["status"] in (200, 400) for a in answers.values()), answers
    deep = answers["nesting 300 deep (our limit 200)"]
    assert deep["status"] == 400 and deep["param"] == "structured_outputs.json"
    assert answers["a 10,000-value enum"]["status"] == 200          # bounded, and served
    for name, answer in answers.items():       # a 400 names the field, but for broken JSON
        assert answer["status"] == 200 or answer["param"] is not None or "5,000 deep" in name
    assert row.met == (row.value <= 100 and row.reason is None)
    assert row.details["baseline_gap_ms"] > 0
