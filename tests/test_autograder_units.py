"""Fast checks of the grading pieces (the slow end-to-end runs are in test_autograder_term.py)."""

import json
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode
from nbgrader.utils import determine_grade

from autograder import bad_submissions
from autograder.collect import resolve_day
from autograder.grade import Result, summary_table, zero_notebook
from autograder.kernel import score
from autograder.notebooks import exercises, lint, read, release_path
from autograder.preprocessors import stderr_to_stdout
from autograder.staging import stage

DAY = bad_submissions.DAY


def graded_cell(outputs):
    return NotebookNode(cell_type="code", source="check()", outputs=outputs, metadata={
        "nbgrader": {"grade": True, "solution": False, "points": 2, "grade_id": "t"}})


WARNING = NotebookNode(output_type="stream", name="stderr", text="UserWarning: careful\n")
ERROR = NotebookNode(output_type="error", ename="CheckFailed", evalue="wrong", traceback=[])


def test_stock_nbgrader_zeroes_a_warning_and_ours_does_not():
    cell = graded_cell([WARNING])
    assert determine_grade(cell) == (0, 2.0)  # the trap this course fixes
    assert score(cell, [WARNING]) == 2.0
    moved = stderr_to_stdout([WARNING])
    assert moved[0]["name"] == "stdout" and "[stderr] UserWarning" in moved[0]["text"]


def test_errors_still_score_zero():
    assert score(graded_cell([]), [WARNING, ERROR]) == 0.0


@pytest.mark.parametrize("name,status,note", [
    ("renamed", "ok", "renamed"),
    ("deleted-test", "repaired", "perplexity_tests: test cell missing: restored"),
    ("stripped-metadata", "repaired", "matched by its first line"),
    ("corrupt-json", "invalid", "invalid JSON"),
    ("nothing", "missing", "no notebook"),
])
def test_staging_repairs_or_reports(tmp_path, name, status, note):
    case = next(c for c in bad_submissions.CASES if c.student == name)
    folder = tmp_path / name / DAY
    case.build(folder, {})
    staged = stage(read(release_path(DAY)), folder, DAY)
    assert staged.status == status
    assert any(note in n for n in staged.notes), staged.notes
    if staged.notebook is not None:
        got = {e.grade_id for e in exercises(staged.notebook)}
        assert got == {e.grade_id for e in exercises(read(release_path(DAY)))}
        nbformat.validate(staged.notebook)


def test_staging_keeps_a_students_extra_cells(tmp_path):
    nb = read(release_path(DAY))
    nb.cells.insert(3, nbformat.v4.new_code_cell("def helper():\n    return 42"))
    folder = tmp_path / "s" / DAY
    folder.mkdir(parents=True)
    nbformat.write(nb, str(folder / f"{DAY}.ipynb"))
    staged = stage(read(release_path(DAY)), folder, DAY)
    assert staged.status == "ok" and any("def helper" in c.source for c in staged.notebook.cells)


def test_zero_notebook_fails_every_test_cell():
    nb = zero_notebook(read(release_path(DAY)), "invalid", "not JSON")
    assert lint(nb, released=True) == []
    for ex in exercises(nb):
        outputs = nb.cells[ex.test_index].outputs
        assert score(nb.cells[ex.test_index], outputs) == 0.0


def test_resolve_day():
    known = ["day01_logits", "day02_tokenizer"]
    assert resolve_day("day01", known) == "day01_logits"
    assert resolve_day("Day02", known) == "day02_tokenizer"
    assert resolve_day("day02_tokenizer", known) == "day02_tokenizer"
    assert resolve_day("day02_wrong", known) is None
    assert resolve_day("day03", known) is None
    assert resolve_day("homework", known) is None


def test_summary_table_lists_every_student():
    table = summary_table([Result("ann", 13, 13, "graded", ""),
                           Result("ben", 0, 13, "invalid", "not a notebook")])
    lines = table.splitlines()
    assert lines[0].split() == ["student", "score", "max", "status", "reason"]
    assert lines[2].split()[:4] == ["ann", "13", "13", "graded"]
    assert lines[3].startswith("ben") and lines[3].endswith("not a notebook")


def test_bad_submission_corpus_has_the_required_kinds():
    kinds = {c.student for c in bad_submissions.CASES} - {"control-full", "control-blank"}
    assert len(kinds) >= 15
    assert Path(bad_submissions.__file__).read_text().count("Case(") >= 17


# ----------------------------------------------------------------------------------------------
# feedback when the student's own code raises, and the instructor's per-exercise views


def test_feedback_for_an_exception_names_the_call_and_the_hint_but_not_the_test_code():
    import tempfile
    from pathlib import Path

    from autograder.kernel import Kernel
    from autograder.reports import explain_error

    test = ("check_close('perplexity([0.5, 0.25])', perplexity(np.array([0.5, 0.25])), 2.0,\n"
            "            hint='perplexity = exp(-mean(log p)).')\n"
            "### BEGIN HIDDEN TESTS\n"
            "secret_input = np.array([0.0, 0.0])\n"
            "got = perplexity(secret_input)\n"
            "check_true(got == 1, f'{got}', hint='certainty gives perplexity 1')\n")
    with tempfile.TemporaryDirectory() as tmp, Kernel(Path(tmp)) as kernel:
        kernel.run("import numpy as np\nfrom tinygpt.testing import check_close, check_true\n"
                   "def perplexity(x):\n    return np.log(x)[5]\n")
        first = explain_error(test, kernel.run(test)[-1])
        kernel.run("def perplexity(x):\n    if x[0] == 0:\n        raise ValueError('zero')\n"
                   "    return 2.0\n")
        second = explain_error(test, kernel.run(test)[-1])
    assert first.startswith("IndexError") and "checking: perplexity([0.5, 0.25])" in first
    assert "Hint: perplexity = exp(-mean(log p))." in first
    assert second.startswith("ValueError: zero") and "perplexity(secret_input)" in second
    assert "Hint: certainty gives perplexity 1" in second and "check_true" not in second
    unanswered = explain_error(test, {"ename": "NotImplementedError", "evalue": ""})
    assert "not answered yet" in unanswered


def test_item_analysis_and_the_by_exercise_summary():
    from autograder.grade import Result, summary_table
    from autograder.reports import format_item_analysis, item_analysis

    rows = [("ann", "d", "softmax", 2.0, 2.0), ("ann", "d", "q1", 0.0, 1.0),
            ("bob", "d", "softmax", 0.0, 2.0), ("bob", "d", "q1", 0.0, 1.0),
            ("bob", "e", "other", 1.0, 1.0)]
    items = {i["exercise"]: i for i in item_analysis(rows, "d")}
    assert items["softmax"]["mean"] == 1.0 and items["softmax"]["full_marks"] == 0.5
    assert items["q1"]["full_marks"] == 0.0 and items["q1"]["students"] == 2
    text = format_item_analysis(list(items.values()), "d")
    assert text.splitlines()[2].startswith("q1")          # hardest first
    table = summary_table([Result("ann", 2, 3, "graded", "", warnings="q1: NameError: x"),
                           Result("bob", 0, 3, "graded", "")], rows, "d")
    header, _, ann, bob = table.splitlines()
    assert header.split()[:6] == ["student", "score", "max", "status", "softmax", "q1"]
    assert ann.split()[4:6] == ["2", "0"] and "warnings: q1: NameError" in ann
    assert bob.split()[4:6] == ["0", "0"]


@pytest.mark.slow
def test_a_stopped_ungraded_cell_is_named_and_its_follow_on_errors_folded(tmp_path):
    """An ungraded measurement past the cell limit: the reason says the grader stopped that
    cell, later ungraded cells' errors are folded into it (not listed as the student's), the
    test cells still run, and the kernel ran in grading mode."""
    from nbformat.v4 import new_code_cell, new_notebook

    from autograder.execute import execute_cells

    def test_cell(source, grade_id):
        return new_code_cell(source, metadata={"nbgrader": {
            "grade": True, "solution": False, "locked": True, "points": 1,
            "grade_id": grade_id, "schema_version": 3}})

    nb = new_notebook(cells=[
        new_code_cell("from tinygpt.testing import grading\nx = 1"),
        new_code_cell("import time\nresults = {}\ntime.sleep(30)\nresults['a'] = 1"),
        new_code_cell("print(results['a'])"),                    # KeyError: follows from it
        new_code_cell("print(undefined_name)"),                  # NameError: folded too
        test_cell("assert x == 1 and grading()", "x_tests"),
    ])
    report = execute_cells(nb, tmp_path, cell_timeout=2, total_timeout=60, sandbox=False)
    assert report["status"] == "timeout" and report["stopped_cell"] == "cell 1", report
    assert "cell 1 (not a graded cell) was stopped by the grader" in report["reason"], report
    assert "2 later ungraded cells failed after cell 1" in report["reason"], report
    assert "KeyError" not in report["reason"] and "NameError" not in report["reason"], report
    assert not [o for o in nb.cells[4].outputs if o.get("output_type") == "error"], \
        "the test cell should still pass after the stopped cell"


def test_the_review_column_names_grader_limits_and_flags(tmp_path):
    from autograder.grade import RECORD_FILE
    from autograder.reports import review_note

    for day, status, reason in [("day01_logits", "timeout", "cell 46 (not a graded cell) was "
                                 "stopped by the grader"), ("day02_tokenizer", "graded", ""),
                                ("day03_positions", "flagged", "patched-checks")]:
        record = tmp_path / "autograded" / "ann" / day / RECORD_FILE
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"status": status, "reason": reason,
                                      "evidence": reason if status == "flagged" else ""}))
    note = review_note(tmp_path, "ann", ["day01_logits", "day02_tokenizer", "day03_positions"])
    assert "day01_logits: timeout: cell 46 (not a graded cell) was stopped" in note
    assert "day03_positions: patched-checks" in note and "day02" not in note


def test_feedback_leads_with_the_exercise_name():
    from autograder.reports import answer_names, name_the_exercise

    names = answer_names("def can_admit(scheduler, seq, budget_left):\n    return True\n")
    assert names == ["can_admit"]
    assert name_the_exercise("CheckFailed: 2 free blocks: expected False", names).startswith(
        "can_admit: ")
    assert name_the_exercise("can_admit(s, seq, 8) returned True", names) == \
        "can_admit(s, seq, 8) returned True"
    assert answer_names('answer_q2 = "B"\n') == ["answer_q2", "Q2"]


def test_a_kernel_that_never_started_is_graded_again_and_nothing_else_is(monkeypatch, tmp_path):
    """grading.autograde: a kernel that died before it answered (a port another process took)
    ran nothing, so the notebook is autograded again, up to KERNEL_START_TRIES times; any
    other failure is reported at once."""
    import nbgrader.api

    from autograder import grading

    died = {"success": False, "error": "RuntimeError: Kernel died before replying to "
                                       "kernel_info", "log": "Address already in use"}
    other = {"success": False, "error": "NameError: name 'x' is not defined", "log": ""}

    class FakeApi:
        def __init__(self, results):
            self.results, self.calls = list(results), 0
            self.coursedir = type("Dir", (), {"db_url": "sqlite://", "course_id": "c"})

        def autograde(self, *args, **kwargs):
            self.calls += 1
            return self.results.pop(0)

    class FakeGradebook:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def find_submission_notebook(self, *args):
            return type("Nb", (), {"grades": []})

    monkeypatch.setattr(nbgrader.api, "Gradebook", FakeGradebook)
    notebook = tmp_path / "nb.ipynb"
    notebook.write_text("{}")
    for results, calls, ok in (([died, {"success": True}], 2, True),
                               ([died] * grading.KERNEL_START_TRIES, 3, False),
                               ([other, {"success": True}], 1, False)):
        api = FakeApi(results)
        monkeypatch.setattr(grading, "_api", lambda root, api=api: api)
        if ok:
            assert grading.autograde(DAY, tmp_path, {"s": notebook}) == {"s": []}
        else:
            with pytest.raises(grading.GradingError):
                grading.autograde(DAY, tmp_path, {"s": notebook})
        assert api.calls == calls


def test_new_gradebooks_carry_the_revision_alembic_prints(tmp_path):
    """settings.alembic_head stands in for nbgrader's `alembic heads` subprocess: it must give
    the revision that command prints, and a gradebook made under the course's config carries
    it in its alembic_version table."""
    import sqlite3
    import subprocess

    import nbgrader.api
    from nbgrader.dbutil import _temp_alembic_ini

    from autograder.settings import alembic_head, ensure_venv_on_path, nbgrader_config

    ensure_venv_on_path()
    with _temp_alembic_ini(f"sqlite:///{tmp_path / 'unused.db'}") as ini:
        printed = subprocess.check_output(["alembic", "-c", ini, "heads"], text=True).split()[0]
    assert alembic_head() == printed

    nbgrader_config(tmp_path)
    assert nbgrader.api.get_alembic_version is alembic_head
    with nbgrader.api.Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}", "tinygpt"):
        pass
    with sqlite3.connect(tmp_path / "gradebook.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(printed,)]


@pytest.mark.parametrize("argv,message", [
    (["grade", DAY, "--workers", "0"], "argument --workers: must be an int >= 1, got '0'"),
    (["grade", DAY, "--workers", "-3"], "argument --workers: must be an int >= 1"),
    (["grade", DAY, "--cell-timeout", "0"], "argument --cell-timeout: must be a finite number > 0"),
    (["grade", DAY, "--total-timeout", "-5"], "argument --total-timeout: must be a finite number"),
    (["grade", DAY, "--memory-gb", "nan"], "argument --memory-gb: must be a finite number > 0"),
    (["mutants", "--sample", "0"], "argument --sample: must be an int >= 1, got '0'"),
    (["mutants", "--sample", "-2"], "argument --sample: must be an int >= 1"),
])
def test_the_command_line_refuses_bad_numbers_by_option(argv, message, capsys):
    from autograder.__main__ import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_command_line_takes_good_numbers():
    from autograder.__main__ import build_parser

    args = build_parser().parse_args(["grade", DAY, "--workers", "2", "--cell-timeout", "0.5",
                                      "--total-timeout", "30", "--memory-gb", "1.5"])
    assert (args.workers, args.cell_timeout, args.total_timeout, args.memory_gb) == \
        (2, 0.5, 30.0, 1.5)
    assert build_parser().parse_args(["mutants", "--sample", "1"]).sample == 1


def test_bench_grading_refuses_per_day_below_one(capsys):
    from autograder import bench_grading

    with pytest.raises(SystemExit):
        bench_grading.main(["--per-day", "0", "--students", "0"])
    assert "--per-day must be >= 1, got 0" in capsys.readouterr().err


def test_grade_day_refuses_a_bad_worker_count():
    from autograder.grade import grade_day

    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"workers must be >= 1 .*got {bad}"):
            grade_day(DAY, workers=bad)
    with pytest.raises(TypeError, match="workers must be an int"):
        grade_day(DAY, workers=2.0)


def test_mutants_run_in_grading_mode_on_roots_solution(monkeypatch, tmp_path):
    """run_day and _replay start their kernels in grading mode, as the grader's run, in the
    solution folder of `root`; sample reads root's notebook too."""
    import shutil

    from autograder import mutants
    from autograder.notebooks import solution_path
    from tinygpt.testing import GRADING_VARIABLE

    started = []

    class Refused(Exception):
        pass

    class FakeKernel:
        def __init__(self, cwd, **kwargs):
            started.append((Path(cwd), kwargs.get("env") or {}))
            raise Refused

    monkeypatch.setattr(mutants, "Kernel", FakeKernel)
    copy = solution_path(DAY, tmp_path)
    copy.parent.mkdir(parents=True)
    shutil.copy(solution_path(DAY), copy)
    with pytest.raises(Refused):
        mutants.run_day(DAY, [], root=tmp_path)
    with pytest.raises(Refused):
        mutants._replay(copy, read(copy), 0)
    assert [(cwd, env.get(GRADING_VARIABLE)) for cwd, env in started] == \
        [(copy.parent, "1"), (copy.parent, "1")]
    assert mutants.sample(DAY, 3, root=tmp_path) == mutants.sample(DAY, 3)
    with pytest.raises(FileNotFoundError):
        mutants.sample(DAY, 3, root=tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="sample_size must be an int >= 1"):
        mutants.main([DAY], sample_size=0)
