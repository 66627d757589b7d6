"""What a whole class brings to the grader: two grade runs at once, students who moved a test
cell or submitted nothing, submissions collected twice, a clone whose venv is another
checkout's."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import grade
from autograder.collect import collect
from autograder.notebooks import nbgrader_meta, read, release_path, solution_path
from autograder.reports import (
    format_item_analysis,
    graded_students,
    item_analysis,
    write_feedback,
)
from autograder.staging import stage
from tests.test_autograder_term import DAY, course_root

# -- two grade runs at once --------------------------------------------------------------------


def test_a_second_grade_run_is_refused_before_it_touches_anything(tmp_path):
    root = course_root(tmp_path)
    (root / "submitted" / "ann" / DAY).mkdir(parents=True)
    with grade.grading_lock(root.resolve(), "day03_positions"):
        with pytest.raises(grade.GradingBusy, match=rf"another grade of day03_positions is "
                                                    rf"running \(pid {os.getpid()}\)"):
            grade.grade_day(DAY, root=root, workers=1, progress=False,
                            limits=grade.Limits(sandbox=False))
    assert not (root / "gradebook.db").exists()
    assert not (root / ".grading" / DAY).exists() and not (root / "autograded").exists()


LOCK_AND_DIE = """
import os, sys
from pathlib import Path
from autograder.grade import grading_lock
grading_lock(Path(sys.argv[1]), "day01_logits").__enter__()
os.kill(os.getpid(), 9)
"""


def test_a_run_that_dies_leaves_no_lock(tmp_path):
    root = course_root(tmp_path).resolve()
    done = subprocess.run([sys.executable, "-c", LOCK_AND_DIE, str(root)], timeout=120)
    assert done.returncode == -9
    with grade.grading_lock(root, DAY):   # free again
        pass


# -- a test cell dragged away from its answer --------------------------------------------------


def _ids(nb) -> list[str]:
    return [nbgrader_meta(c).get("grade_id", f"<{c.source[:12]}>") for c in nb.cells
            if nbgrader_meta(c) or c.source.startswith("def helper")]


def _submit(tmp_path: Path, nb) -> Path:
    folder = tmp_path / "student" / DAY
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / f"{DAY}.ipynb"))
    return folder


def _index(nb, grade_id: str) -> int:
    return next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == grade_id)


def test_a_test_cell_above_its_answer_is_put_back_after_it(tmp_path):
    release = read(release_path(DAY))
    nb = read(solution_path(DAY))
    test = nb.cells.pop(_index(nb, "softmax_tests"))
    nb.cells.insert(_index(nb, "softmax"), test)                 # dragged above its answer
    later = nb.cells.pop(_index(nb, "log_softmax_tests"))
    nb.cells.insert(_index(nb, "temperature_tests") + 1, later)  # below the next exercise
    staged = stage(release, _submit(tmp_path, nb), DAY)
    assert _ids(staged.notebook) == _ids(release)
    assert staged.status == "repaired"
    notes = " | ".join(staged.notes)
    assert "softmax_tests: test cell was moved away from softmax: put back after it" in notes
    assert "log_softmax_tests: test cell was moved away from log_softmax" in notes


def test_a_students_cell_between_answer_and_test_stays_there(tmp_path):
    release = read(release_path(DAY))
    nb = read(solution_path(DAY))
    nb.cells.insert(_index(nb, "softmax") + 1, nbformat.v4.new_code_cell("def helper(): pass"))
    staged = stage(release, _submit(tmp_path, nb), DAY)
    assert staged.status == "ok", staged.notes
    ids = _ids(staged.notebook)
    assert ids[ids.index("softmax"):ids.index("softmax") + 3] == [
        "softmax", "<def helper()>", "softmax_tests"]


# -- students in the gradebook who did not submit the day --------------------------------------


@pytest.fixture(scope="module")
def class_with_a_non_submitter(tmp_path_factory) -> Path:
    """A released day: ann graded, zed in the gradebook and graded `missing`."""
    from nbgrader.api import Gradebook

    from autograder.__main__ import main

    root = course_root(tmp_path_factory.mktemp("class"))
    assert main(["release", DAY, "--root", str(root)]) == 0
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "tinygpt") as gb:
        for student, status in (("ann", "graded"), ("zed", "missing")):
            gb.add_student(student)
            gb.add_submission(DAY, student)
            graded = root / "autograded" / student / DAY / f"{DAY}.ipynb"
            graded.parent.mkdir(parents=True)
            graded.write_bytes(release_path(DAY, root).read_bytes())
            (graded.parent / grade.RECORD_FILE).write_text(f'{{"status": "{status}"}}')
    return root


def test_no_feedback_page_claims_an_answer_nobody_handed_in(class_with_a_non_submitter, capsys):
    from autograder.__main__ import main

    root = class_with_a_non_submitter
    assert graded_students(DAY, root) == ["ann"]
    assert write_feedback(DAY, root) == [root / "feedback" / "ann" / DAY / f"{DAY}.html"]
    assert not (root / "feedback" / "zed").exists()
    assert main(["feedback", DAY, "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"no feedback for 1 student(s) of the gradebook without a submission of {DAY}: " \
           f"zed" in out
    assert "(1 student of the gradebook did not submit it: not counted)" in out


def test_item_analysis_counts_the_submissions_only():
    rows = [("ann", "d", "softmax", 2.0, 2.0), ("zed", "d", "softmax", 0.0, 2.0)]
    [item] = item_analysis(rows, "d", ["ann"])
    assert (item["students"], item["mean"], item["full_marks"]) == (1, 2.0, 1.0)
    assert item_analysis(rows, "d")[0]["students"] == 2
    assert "did not submit" not in format_item_analysis([item], "d")
    with pytest.raises(TypeError, match="students must be a collection"):
        item_analysis(rows, "d", "ann")
    with pytest.raises(ValueError, match="not_submitted must be an int >= 0"):
        format_item_analysis([item], "d", -1)


# -- collecting twice --------------------------------------------------------------------------


def _folder_export(tmp_path: Path, student: str, when: float) -> Path:
    source = tmp_path / "export"
    day = source / student / "day01"
    day.mkdir(parents=True)
    notebook = day / f"{DAY}.ipynb"
    notebook.write_bytes(solution_path(DAY).read_bytes())
    os.utime(notebook, (when, when))
    return source


def test_an_older_submission_never_replaces_a_newer_one(tmp_path):
    root = course_root(tmp_path)
    newer = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    collect(_folder_export(tmp_path, "ann", newer.timestamp()), root)
    stamp = root / "submitted" / "ann" / DAY / "timestamp.txt"
    assert stamp.read_text().startswith("2026-11-29 12:00:00")
    archive = tmp_path / "old.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(zipfile.ZipInfo("ann_day01.ipynb", (2020, 1, 1, 0, 0, 0)), b"{}")
    report = collect(archive, root)
    assert report.imported == []
    why = dict(report.unmatched)["ann_day01.ipynb"]
    assert why.startswith("older (2020-01-01 00:00:00") and "already collected" in why
    assert stamp.read_text().startswith("2026-11-29 12:00:00")
    assert (root / "submitted" / "ann" / DAY / f"{DAY}.ipynb").read_bytes() == \
        solution_path(DAY).read_bytes()
    with zipfile.ZipFile(archive, "w") as z:       # a later one replaces it
        z.writestr(zipfile.ZipInfo("ann_day01.ipynb", (2026, 11, 30, 0, 0, 0)), b"{}")
    assert [s for s, _, _ in collect(archive, root).imported] == ["ann"]
    assert stamp.read_text().startswith("2026-11-30 00:00:00")


def test_an_empty_folder_is_dated_when_it_was_collected(tmp_path):
    root, source = course_root(tmp_path), tmp_path / "export"
    (source / "ann" / "day01").mkdir(parents=True)
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    assert [s for s, _, _ in collect(source, root).imported] == ["ann"]
    text = (root / "submitted" / "ann" / DAY / "timestamp.txt").read_text()
    stamped = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=dt.UTC)
    assert stamped >= before


def test_a_student_id_is_refused_for_the_same_reason_from_a_folder_or_a_zip(tmp_path):
    root, source = course_root(tmp_path), tmp_path / "export"
    (source / "José" / "day01").mkdir(parents=True)
    (source / "José" / "day01" / f"{DAY}.ipynb").write_text("{}")
    from_folder = dict(collect(source, root).unmatched)["José/day01"]
    archive = tmp_path / "lms.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("José_day01.ipynb", b"{}")
    from_zip = dict(collect(archive, root).unmatched)["José_day01.ipynb"]
    assert from_folder == from_zip
    assert from_zip.startswith("'José' is not a usable student id (1 to 64 letters")


# -- a clone whose .venv links to another checkout's venv --------------------------------------


CLONE_KERNEL = """
import subprocess, sys
from pathlib import Path
from autograder.sandbox import SandboxPolicy, sandbox_prefix
cmd = sandbox_prefix(SandboxPolicy(Path(sys.argv[1]))) + [
    sys.executable, "-c", "import tinygpt; print(tinygpt.__file__)"]
done = subprocess.run(cmd, capture_output=True, text=True)
print(done.stdout.strip() or done.stderr.strip())
"""


def test_the_sandboxed_kernel_imports_the_tinygpt_the_grader_imports(tmp_path):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap): no sandbox here")
    clone = tmp_path / "clone"
    (clone / "tinygpt").mkdir(parents=True)
    (clone / "tinygpt" / "__init__.py").write_text("WHERE = 'the clone'\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # Run from the clone: its own tinygpt comes first for the grader, while the editable
    # install points elsewhere.
    done = subprocess.run([sys.executable, "-c", CLONE_KERNEL, str(scratch)], cwd=clone,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("/tinygpt/__init__.py"), done.stdout + done.stderr
    assert Path(done.stdout.strip()).parent.name == "tinygpt"
    assert str(clone) in done.stdout, done.stdout + done.stderr
