"""The grader against student code that attacks the grader itself rather than the tests: output
that nbgrader would read as a score, forged kernel messages, the guard swapped or its secrets
read, hidden tests read back from the kernel, files of the host reached through the sandbox's
runtime folder, submissions built to crash the trusted side (odd metadata, code too deep to
parse, huge errors) and copied graded cells."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode
from nbgrader.utils import determine_grade

from autograder import bad_submissions
from autograder.collect import collect
from autograder.guard import (
    GUARD_FORGET,
    GuardSpec,
    guard_challenge,
    guard_expression,
    guard_install_code,
    read_guard_reply,
)
from autograder.integrity import scan_submission
from autograder.kernel import MAX_ERROR_CHARS, Kernel, error_text, score
from autograder.notebooks import exercises, read, release_path, solution_path
from autograder.reports import MAX_MESSAGE_CHARS, feedback_html
from autograder.sandbox import SandboxKernelManager, SandboxPolicy, sandbox_prefix
from autograder.staging import stage
from tests.test_autograder_term import cli, course_root, need_bwrap

DAY = bad_submissions.DAY


def test_no_output_of_a_test_cell_counts_as_partial_credit():
    # sys.displayhook(2) inside an answer the test calls: stock nbgrader scores the first
    # execute_result as the cell's points and never looks at the error after it
    shown = NotebookNode(output_type="execute_result", execution_count=1, metadata={},
                         data={"text/plain": "2"})
    error = NotebookNode(output_type="error", ename="CheckFailed", evalue="wrong", traceback=[])
    cell = NotebookNode(cell_type="code", source="check()", outputs=[shown, error], metadata={
        "nbgrader": {"grade": True, "solution": False, "points": 2, "grade_id": "t"}})
    assert determine_grade(cell) == (2.0, 2.0)   # the trap
    assert score(cell, [shown, error]) == 0.0
    assert score(cell, [shown]) == 2.0           # shown, not scored: a clean cell keeps its points


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with Kernel(tmp_path_factory.mktemp("kernel")) as started:
        yield started


FORGED_IDLE = """
import sys
d = sys.displayhook
d.session.send(d.pub_socket, "status", {"execution_state": "idle"}, d.parent_header)
print("after the forged idle")
raise ValueError("the test's real failure")
"""


def test_a_forged_idle_status_does_not_end_the_cell(kernel):
    kernel.anomalies.clear()
    outputs = kernel.run(FORGED_IDLE)
    assert error_text(outputs) == "ValueError: the test's real failure"
    assert any("after the forged idle" in o.get("text", "") for o in outputs)
    assert kernel.anomalies == ["a status message said the kernel was idle while a cell ran"]
    kernel.anomalies.clear()
    assert error_text(kernel.run("x = 1")) == "" and kernel.anomalies == []


def test_a_huge_error_is_cut_before_it_is_kept(kernel):
    outputs = kernel.run("raise ValueError('x' * 3_000_000)")
    assert outputs[-1]["ename"] == "ValueError"
    assert MAX_ERROR_CHARS < len(outputs[-1]["evalue"]) < MAX_ERROR_CHARS + 100
    assert "more characters cut by the grader" in outputs[-1]["evalue"]
    assert sum(len(t) for t in outputs[-1]["traceback"]) < 2 * MAX_ERROR_CHARS + 200


SWAP_GUARD = """
import json, sys, types
_m = sys.modules
_g = _m["_tinygpt" + "_guard"]
_seen = _g.check("an old challenge")
_m.update({"_tinygpt" + "_guard": types.SimpleNamespace(check=lambda *a: _seen)})
"""


def _check(kernel, spec):
    challenge = guard_challenge()
    return read_guard_reply(spec, kernel.evaluate(guard_expression(challenge)), "t", challenge)


def test_the_guard_signs_its_answers_and_its_key_and_the_tests_leave_linecache(tmp_path):
    spec = GuardSpec(("math",), (), "k3y" + "x" * 13)
    with Kernel(tmp_path) as kernel:
        assert error_text(kernel.run(guard_install_code(spec))) == ""
        assert _check(kernel, spec) == []
        kernel.run("import math\nmath.sqrt = abs")
        assert [e.detail for e in _check(kernel, spec)] == ["replaced math.sqrt"]
        # a test cell's source (hidden tests) is gone from linecache once the guard forgets it
        kernel.run("HIDDEN_" + "MARKER = 1")
        kernel.evaluate(GUARD_FORGET)
        # (the probe spells both words in pieces: its own source is in linecache too)
        out = kernel.run("import linecache\nprint(sum(''.join(e[2]).count(w) for e in "
                         "linecache.cache.values() if len(e) > 2 for w in ("
                         "'HIDDEN_' + 'MARKER', 'k3y' + 'x' * 13)))")
        assert out[0]["text"].strip() == "0", out
        # a guard replaced through sys.modules, replaying an answer it got: not signed for
        # this challenge
        kernel.run(SWAP_GUARD)
        assert [e.kind for e in _check(kernel, spec)] == ["guard-blocked"]


@pytest.mark.parametrize(("extra", "where", "expected"), [
    # importing a check is not patching it; comparing with a finished function in a cell of
    # one's own is exploring
    ("from tinygpt.testing import check_close\nprint(check_close)", "softmax", []),
    ("from tinygpt.numerics import softmax as finished\nprint(finished([1.0]))", "softmax", []),
    # ... but an answer that then calls it is a reference copy
    ("from tinygpt.numerics import softmax as finished", "softmax",
     ["reference-copy in perplexity: calls finished, which is tinygpt's finished softmax "
      "(tinygpt.numerics)"]),
])
def test_exploring_with_the_package_is_not_tampering(extra, where, expected):
    release, submission = read(release_path(DAY)), read(solution_path(DAY))
    index = next(i for i, c in enumerate(submission.cells)
                 if c.metadata.get("nbgrader", {}).get("grade_id") == where)
    submission.cells.insert(index + 1, nbformat.v4.new_code_cell(extra))
    if expected:
        answer = next(c for c in submission.cells
                      if c.metadata.get("nbgrader", {}).get("grade_id") == "perplexity")
        answer.source += "\n\ndef _mine(x):\n    return finished(x)\n"
    assert [e.text() for e in scan_submission(release, submission)] == expected


def test_an_allowed_fallback_import_is_not_a_reference_copy():
    day = "day04_attention"   # exercise 6 allows tinygpt.attention.repeat_kv and sdpa
    release, submission = read(release_path(day)), read(solution_path(day))
    answer = next(c for c in submission.cells
                  if c.metadata.get("nbgrader", {}).get("grade_id") == "gqa")
    answer.source = "from tinygpt.attention import repeat_kv\n" + answer.source
    assert scan_submission(release, submission) == []
    other = next(c for c in submission.cells
                 if c.metadata.get("nbgrader", {}).get("grade_id") == "heads")
    other.source = "from tinygpt.attention import repeat_kv\n" + other.source
    assert [e.kind for e in scan_submission(release, submission)] == ["reference-copy"]


def _submit(tmp_path: Path, nb) -> Path:
    folder = tmp_path / "student" / DAY
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / f"{DAY}.ipynb"))
    return folder


def _cell(nb, grade_id):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def test_staging_keeps_one_cell_per_grade_id_with_the_released_flags(tmp_path):
    release = read(release_path(DAY))
    nb = read(solution_path(DAY))
    test = _cell(nb, "perplexity_tests")
    nb.cells.insert(nb.cells.index(test) + 1, nbformat.from_dict(json.loads(json.dumps(test))))
    _cell(nb, "softmax").metadata["nbgrader"]["points"] = 5           # an answer given points
    _cell(nb, "softmax").metadata["nbgrader"]["grade"] = True
    invented = nbformat.v4.new_code_cell("pass")
    invented.metadata["nbgrader"] = dict(_cell(nb, "q1_check").metadata["nbgrader"],
                                         grade_id="bonus")
    nb.cells.append(invented)
    _cell(nb, "log_softmax").metadata["nbgrader"]["grade_id"] = ["log_softmax"]   # not a str
    staged = stage(release, _submit(tmp_path, nb), DAY)
    nbformat.validate(staged.notebook)
    ids = [c.metadata["nbgrader"]["grade_id"] for c in staged.notebook.cells
           if c.metadata.get("nbgrader")]
    assert sorted(ids) == sorted(c.metadata["nbgrader"]["grade_id"] for c in release.cells
                                 if c.metadata.get("nbgrader"))
    assert {e.grade_id for e in exercises(staged.notebook)} == \
        {e.grade_id for e in exercises(release)}
    assert _cell(staged.notebook, "softmax").metadata["nbgrader"] == \
        _cell(release, "softmax").metadata["nbgrader"]
    assert staged.status == "repaired"
    notes = " | ".join(staged.notes)
    assert "perplexity_tests: 1 more cell carried its metadata" in notes
    assert staged.tampered == ["softmax: changed its nbgrader grade, points",
                               "a graded cell 'bonus' the release does not have"]


def test_a_damaged_zip_entry_is_reported_and_the_others_imported(tmp_path):
    root, archive = course_root(tmp_path), tmp_path / "lms.zip"
    notebook = solution_path(DAY).read_bytes()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        for student in ("ann", "ben", "cat"):
            z.writestr(f"{student}_day01.ipynb", notebook)
    data = bytearray(archive.read_bytes())
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo("ben_day01.ipynb")
    start = info.header_offset + 30 + len(info.filename) + 100   # inside ben's compressed data
    data[start:start + 20] = bytes(20)
    archive.write_bytes(bytes(data))
    report = collect(archive, root)
    assert sorted(s for s, _, _ in report.imported) == ["ann", "cat"]
    assert "cannot be read from the zip" in dict(report.unmatched)["ben_day01.ipynb"]


def test_a_failure_message_on_the_feedback_page_is_cut():
    nb = read(solution_path(DAY))
    test = _cell(nb, "perplexity_tests")
    test.outputs = [NotebookNode(output_type="error", ename="ValueError",
                                 evalue="leak " * 10_000, traceback=[])]
    page = feedback_html(DAY, "s", nb, {"perplexity_tests": (0.0, 2.0)})
    assert page.count("leak") < MAX_MESSAGE_CHARS // 5 + 10
    assert "more characters cut" in page


def test_the_runtime_folder_is_never_followed_to_another_folder(tmp_path):
    scratch, victim = tmp_path / "scratch", tmp_path / "victim"
    scratch.mkdir()
    victim.mkdir()
    manager = SandboxKernelManager(SandboxPolicy(scratch))
    manager.write_connection_file()
    for name in ("kernel.json", *(f"kernel-ipc-{p}" for p in manager.ports)):
        (victim / name).write_text("the host's")
    (scratch / ".runtime").rename(scratch / ".runtime-moved")
    (scratch / ".runtime").symlink_to(victim)
    manager.cleanup_connection_file()
    manager.cleanup_ipc_files()
    assert len(list(victim.iterdir())) == 1 + len(manager.ports)


def test_the_sandbox_refuses_moving_the_runtime_folder_and_big_files(tmp_path, monkeypatch):
    need_bwrap()
    from autograder import sandbox

    monkeypatch.setattr(sandbox, "MAX_FILE_BYTES", 2**20)
    runtime = tmp_path / ".runtime"
    runtime.mkdir()
    prefix = sandbox_prefix(SandboxPolicy(tmp_path))
    assert any(prefix[i:i + 3] == ["--bind", str(runtime), str(runtime)]
               for i in range(len(prefix)))
    code = ("import os\n"
            "for act in (lambda: os.rename('.runtime', '.moved'),\n"
            "            lambda: open('big', 'wb').write(b'0' * 2 ** 21)):\n"
            "    try:\n        act()\n        print('done')\n"
            "    except OSError as err:\n        print(err.errno)\n")
    done = subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["16", "27"], done.stdout + done.stderr
    assert runtime.is_dir() and (tmp_path / "big").stat().st_size == 2**20


@pytest.mark.slow
def test_a_submission_that_breaks_the_grader_is_one_student_s_error(tmp_path, monkeypatch):
    """Whatever goes wrong while preparing one submission (here: staging raises) ends as that
    student's `error`; the others are graded and recorded as usual."""
    from autograder import grade

    root = course_root(tmp_path)
    cli(root, "release", DAY)
    for student in ("boom", "fine"):
        folder = root / "submitted" / student / DAY
        folder.mkdir(parents=True)
        (folder / f"{DAY}.ipynb").write_bytes(solution_path(DAY).read_bytes())
    real_stage = grade.stage

    def stage_or_fail(release, folder, day):
        if folder.parent.name == "boom":
            raise RecursionError("maximum recursion depth exceeded")
        return real_stage(release, folder, day)

    monkeypatch.setattr(grade, "stage", stage_or_fail)
    results = {r.student: r for r in grade.grade_day(
        DAY, root=root, workers=1, progress=False,
        limits=grade.Limits(cell_timeout=60, total_timeout=300, sandbox=False))}
    assert (results["boom"].status, results["boom"].score) == ("error", 0.0)
    assert "RecursionError" in results["boom"].reason
    assert (results["fine"].status, results["fine"].score) == ("graded", 13.0)
