"""Fast checks of the grading pieces (the slow end-to-end runs are in test_autograder_term.py)."""

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
