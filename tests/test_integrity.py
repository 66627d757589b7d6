"""Grading integrity (autograder/integrity.py): the static scan, the in-kernel guard, and the
cheating corpus (autograder/cheats.py), each case graded by stock nbgrader (full marks: the
corpus is honest) and by ours (prevented or flagged, as stated). Honest solutions of every day
are never flagged."""

from __future__ import annotations

import csv
import hashlib
import hmac
import json
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest

from autograder import cheats
from autograder.grading import autograde, generate_release
from autograder.guard import GuardSpec, guard_install_code, read_guard_reply
from autograder.integrity import scan_source, scan_submission
from autograder.notebooks import release_path, solution_path
from autograder.settings import REPO_ROOT
from tests.conftest import DAYS
from tests.test_autograder_term import LIMITS, cli, need_bwrap

ALIASES = {"np": "numpy", "torch": "torch", "tinygpt": "tinygpt", "ref": "tinygpt.numerics"}
PROTECTED = {"check_close", "check_true", "np", "torch"}


def kinds(source: str, exercise_names: frozenset = frozenset({"softmax"})) -> set[str]:
    return {kind for kind, _ in scan_source(source, aliases=ALIASES, protected=PROTECTED,
                                            exercise_names=set(exercise_names))}


@pytest.mark.parametrize(("source", "kind"), [
    ("def check_close(*a, **k):\n    pass", "patched-checks"),
    ("check_true = print", "patched-checks"),
    ("np = None", "patched-checks"),
    ("np.allclose = lambda *a, **k: True", "patched-module"),
    ("torch.Tensor.__eq__ = lambda a, b: True", "patched-module"),
    ("setattr(np, 'isclose', max)", "patched-module"),
    ("get_ipython().input_transformers_cleanup.append(f)", "ipython-hooks"),
    ("ip.events.register('pre_run_cell', f)", "ipython-hooks"),
    ("ip.set_custom_exc((Exception,), f)", "ipython-hooks"),
    ("import sys\nsys.settrace(f)", "introspection"),
    ("frame = sys._getframe(1).f_locals", "introspection"),
    ("import inspect", "introspection"),
    ("import builtins\nbuiltins.len = max", "patched-builtins"),
    ("__builtins__['abs'] = max", "patched-builtins"),
    ("exec(code)", "dynamic-code"),
    ("m = __import__('numpy')", "dynamic-code"),
    ("print(_ih[-1])", "reads-tests"),
    ("print(In[3])", "reads-tests"),
    ("open('day01_logits.ipynb').read()", "reads-tests"),
    ("class A:\n    def __eq__(self, other):\n        return True", "comparison-override"),
    ("from tinygpt.numerics import softmax", "reference-copy"),
    ("softmax = ref.softmax", "reference-copy"),
    # the kernel's display hook (an execute_result read as partial credit) and its messaging
    # (a forged idle status ends the cell early)
    ("import sys\nsys.displayhook(2)", "ipython-hooks"),
    ("d.session.send(d.pub_socket, 'status', {}, d.parent_header)", "ipython-hooks"),
    # the guard swapped through sys.modules, or its key read from its closure
    ("import sys\n_m = sys.modules", "patched-module"),
    ("import sys\nsys.modules.update(x)", "patched-module"),
    ("import sys\nsys.modules['x'] = y", "patched-module"),
    ("from sys import modules", "patched-module"),
    ("g = m['_tinygpt' + '_guard']", "guard-tampering"),
    ("key = check.__closure__[0].cell_contents", "introspection"),
    # every cell run so far (hidden tests included) read from linecache
    ("import traceback\nprint(traceback.linecache.cache)", "reads-tests"),
    # a check rebound by an import, and code the scan cannot parse
    ("from tinygpt.testing import check_close as check_true", "patched-checks"),
    pytest.param("x = a" + ".b" * 200_000, "unreadable-code", id="too-deep-to-parse"),
    pytest.param("-" * 200_000 + "1", "unreadable-code", id="too-large-to-parse"),
])
def test_the_static_scan_finds_each_means_of_tampering(source, kind):
    assert kind in kinds(source), f"{source!r}: expected {kind}, found {kinds(source)}"


@pytest.mark.parametrize("source", [
    "import numpy as np\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()",
    "from tinygpt.numerics import log_softmax\nvalue = log_softmax(x)",  # an earlier day's
    "class RMSNorm(torch.nn.Module):\n    def forward(self, x):\n        return x",
    "answer_q1 = 'B'",
    "%matplotlib inline\nx = 1",
    "def f(:",          # a syntax error fails on its own
    "from tinygpt.testing import check_close",    # importing a check is no patch
    "import sys\nprint('torch' in sys.modules, sys.modules.get('numpy'))",  # reading it
])
def test_ordinary_code_is_not_suspect(source):
    assert kinds(source) == set()


@pytest.mark.parametrize("day", DAYS)
def test_no_honest_solution_is_flagged_by_the_static_scan(day):
    solution = nbformat.read(str(solution_path(day)), as_version=4)
    release = nbformat.read(str(release_path(day)), as_version=4)
    found = scan_submission(release, solution)
    assert not found, f"{day}: an honest solution was flagged: {[e.text() for e in found]}"


@pytest.mark.slow
@pytest.mark.parametrize("day", DAYS)
def test_the_guard_never_flags_an_honest_solution(day, graded_days):
    """Every day's solution, graded as the instructor's grader runs it (sandboxed where
    bubblewrap exists, with the guard: the graded_days fixture): it runs to the end, every
    test cell passes (full marks, test_grading_proofs.py) and the guard reports nothing."""
    report = graded_days(day).reports["solution"]
    assert report["status"] == "graded", report
    assert report["evidence"] == [], f"{day}: the guard flagged an honest solution: " \
                                     f"{report['evidence']}"
    lost = [g.grade_id for g in graded_days(day).grades["solution"] if g.score != g.max_score]
    assert not lost, f"{day}: test cells failed under the guard: {lost}"


def _signed(key: str, challenge: str, evidence: list) -> dict:
    proof = hmac.new(key.encode(), f"{challenge}:{json.dumps(evidence)}".encode(),
                     hashlib.sha256).hexdigest()
    return {"status": "ok", "data": {"text/plain": repr(json.dumps(
        {"proof": proof, "evidence": evidence}))}}


def test_a_blocked_or_forged_guard_answer_is_evidence():
    spec = GuardSpec(("math",), (), "abc123")
    assert read_guard_reply(spec, None, "t", "c1")[0].kind == "guard-blocked"
    assert read_guard_reply(spec, {"status": "error"}, "t", "c1")[0].kind == "guard-blocked"
    found = [["patched-module", "replaced numpy.allclose"]]
    honest = _signed("abc123", "c1", found)
    assert [e.text() for e in read_guard_reply(spec, honest, "t", "c1")] == [
        "patched-module in t: replaced numpy.allclose"]
    # a guessed key, an answer replayed for another challenge, evidence dropped after signing
    forged = [_signed("guess", "c1", []), honest, _signed("abc123", "c1", [])]
    forged[2]["data"]["text/plain"] = honest["data"]["text/plain"].replace(
        json.dumps(found)[1:-1], "")
    for reply, challenge in zip(forged, ["c1", "c2", "c1"], strict=True):
        got = read_guard_reply(spec, reply, "t", challenge)
        assert [e.kind for e in got] == ["guard-blocked"], got
        assert got[0].detail.startswith("the grader's integrity")
    assert "'abc123'" in guard_install_code(spec)


@pytest.mark.slow
def test_the_cheating_corpus_fools_stock_nbgrader_but_not_ours(tmp_path):
    need_bwrap()
    cases = cheats.build(tmp_path / "export")
    assert len({c.student for c in cases}) == len(cases) >= 8
    days = sorted({c.day for c in cases})

    # 1. nbgrader's own autograde gives every case full marks: the corpus is honest
    for day in days:
        work = Path(tempfile.mkdtemp(dir=tmp_path, prefix=f"stock-{day}-"))
        generate_release(day, work)
        mine = [c for c in cases if c.day == day]
        grades = autograde(day, work, {c.student: tmp_path / "export" / c.student / day /
                                       f"{day}.ipynb" for c in mine})
        short = {c.student: sum(g.score for g in grades[c.student]) for c in mine
                 if sum(g.score for g in grades[c.student]) != c.full}
        assert not short, f"stock nbgrader already caught these cases (so they prove " \
                          f"nothing): {short}"

    # 2. our grader prevents or flags every one of them, with the stated evidence
    root = tmp_path / "course-root"
    for day in days:
        for folder in ("solutions", "course"):
            shutil.copytree(REPO_ROOT / folder / day, root / folder / day)
    cli(root, "release", *days)
    cli(root, "collect", str(tmp_path / "export"))
    got = {}
    for day in days:
        results = tmp_path / f"results-{day}.json"
        table = cli(root, "grade", day, *LIMITS, "--json", str(results)).stdout
        assert "flagged" in table and "evidence: " in table, table
        ours = {c.student for c in cases if c.day == day}     # others show up as missing
        got.update({r["student"]: r for r in json.loads(results.read_text())
                    if r["student"] in ours})
    wrong = []
    for case in cases:
        result = got[case.student]
        missing = [k for k in case.evidence if f"{k} in " not in result["evidence"]]
        if result["status"] != "flagged" or result["score"] != case.score or missing:
            wrong.append(f"{case.student}: expected flagged {case.score:g} with {case.evidence}, "
                         f"got {result['status']} {result['score']:g} ({result['evidence']})")
    assert not wrong, "\n".join(wrong)

    # the instructor sees them: a review column in the export, a box in the feedback
    cli(root, "export", str(tmp_path / "grades.csv"))
    rows = list(csv.reader(open(tmp_path / "grades.csv")))
    assert rows[0][-1] == "review"
    review = {r[0]: r[-1] for r in rows[2:]}
    unlisted = [c.student for c in cases if not review[c.student].startswith(f"{c.day}: ")]
    assert not unlisted, f"flagged but not listed for review in the export: {unlisted}"
    cli(root, "feedback", cheats.DAY)
    page = (root / "feedback" / "rebinds-checks" / cheats.DAY / f"{cheats.DAY}.html").read_text()
    assert "Flagged for review" in page and "patched-checks" in page


def test_calling_a_visible_test_s_reference_is_flagged():
    # the reference runs in the same kernel: an answer that only calls it passed the value
    # checks, and nothing noticed; a helper cell in between changes nothing
    day = "day21_long_context"
    release = nbformat.read(str(release_path(day)), as_version=4)
    submission = nbformat.read(str(solution_path(day)), as_version=4)
    index, cell = next((i, c) for i, c in enumerate(submission.cells)
                       if c.metadata.get("nbgrader", {}).get("grade_id") == "absorbed_decode")
    cell.source = ("def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):\n"
                   "    return helper(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale)")
    submission.cells.insert(index, nbformat.v4.new_code_cell(
        "def helper(*args):\n    return naive_decode(*args)"))
    found = [e.text() for e in scan_submission(release, submission)]
    assert found == ["reference-copy in absorbed_decode: calls helper, which calls naive_decode, "
                     "which a test cell defines (the tests' own)"], found
    # a cell of the student's own comparing their answer with the reference is not flagged
    submission.cells[index].source = "print(naive_decode(*inputs) - absorbed_decode(*inputs))"
    cell.source = "def absorbed_decode(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):\n    return 0"
    assert scan_submission(release, submission) == []


@pytest.mark.parametrize("day", DAYS)
def test_no_mistake_of_the_corpus_is_flagged(day):
    """The mistakes corpus is hundreds of honest wrong answers of the kind students write:
    none of them may look like tampering."""
    from autograder import mistakes

    release = nbformat.read(str(release_path(day)), as_version=4)
    submission = nbformat.read(str(solution_path(day)), as_version=4)
    cells = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in submission.cells}
    flagged = []
    for mistake in mistakes.for_day(day):
        cell = cells[mistake.grade_id]
        answer, cell.source = cell.source, mistake.code
        flagged += [f"{mistake.name}: {e.text()}" for e in scan_submission(release, submission)]
        cell.source = answer
    assert not flagged, f"{day}: honest mistakes flagged as tampering: {flagged[:5]}"
