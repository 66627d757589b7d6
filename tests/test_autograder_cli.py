"""Bad input to `python -m autograder`: one `error:` line naming the option, exit status 2,
before any slow work (no grading, no gradebook written with a typo in it, no file outside the
course). main() runs in this process against a scratch course of one day."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from autograder import grade as grade_module
from autograder.__main__ import main
from autograder.collect import DEFAULT_PATTERN, collect
from autograder.notebooks import release_path, solution_path
from tests.test_autograder_term import DAY, course_root


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Run from a scratch folder, so that a default output path never lands in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def root(tmp_path) -> Path:
    return course_root(tmp_path)


@pytest.fixture
def no_grading(monkeypatch) -> list:
    """grade_day replaced by a stub that records its calls: a test sees whether grading began."""
    calls: list = []
    monkeypatch.setattr(grade_module, "grade_day", lambda *a, **k: calls.append((a, k)) or [])
    return calls


def refused(capsys, *argv: str, naming: str) -> str:
    """Run main(argv); check it exits 2 with one `error:` line that contains `naming`."""
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in err and naming in err, err
    return err


def lms_zip(path: Path, names: list[str]) -> Path:
    notebook = solution_path(DAY).read_bytes()
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, notebook)
    return path


# -- 1, 2: --student of grade ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["grade", "feedback"])
@pytest.mark.parametrize("student", ["../../etc", "", "a/b"])
def test_a_student_id_is_checked_everywhere(capsys, tmp_path, root, no_grading, command, student):
    extra = ["--no-sandbox", "--no-progress"] if command == "grade" else []
    err = refused(capsys, command, DAY, "--root", str(root), "--student", student, *extra,
                  naming=f"--student {student!r} is not a student id")
    assert "letters, digits" in err
    assert not no_grading
    assert not (tmp_path / "etc").exists() and not (root / "feedback").exists()


def test_grade_refuses_a_student_it_does_not_know(capsys, root, no_grading):
    (root / "submitted" / "ann" / DAY).mkdir(parents=True)
    err = refused(capsys, "grade", DAY, "--root", str(root), "--student", "nosuch",
                  "--no-sandbox", naming="--student nosuch")
    assert "known students: ann" in err and not no_grading
    assert not (root / "gradebook.db").exists()   # the typo made no student, nor a gradebook
    assert main(["grade", DAY, "--root", str(root), "--student", "ann", "--no-sandbox",
                 "--no-progress"]) == 0
    assert no_grading[0][1]["students"] == ["ann"]


# -- 3: --student of feedback ------------------------------------------------------------------


@pytest.fixture(scope="module")
def graded_course(tmp_path_factory) -> Path:
    """A released course whose gradebook holds one graded submission, ann's."""
    from nbgrader.api import Gradebook

    root = course_root(tmp_path_factory.mktemp("graded"))
    assert main(["release", DAY, "--root", str(root)]) == 0
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "tinygpt") as gb:
        gb.add_student("ann")
        gb.add_submission(DAY, "ann")
    graded = root / "autograded" / "ann" / DAY / f"{DAY}.ipynb"
    graded.parent.mkdir(parents=True)
    graded.write_bytes(release_path(DAY, root).read_bytes())
    return root


def test_feedback_names_the_students_it_did_not_find(capsys, graded_course):
    err = refused(capsys, "feedback", DAY, "--root", str(graded_course), "--student", "nosuch2",
                  naming="--student nosuch2")
    assert "graded students: ann" in err
    assert main(["feedback", DAY, "--root", str(graded_course), "--student", "ann",
                 "--student", "nosuch2"]) == 0
    out, err = capsys.readouterr()
    assert "warning: --student nosuch2" in err and f"feedback/ann/{DAY}" in out
    assert not (graded_course / "feedback" / "nosuch2").exists()


# -- 4-7: collect's source and --pattern -------------------------------------------------------


@pytest.mark.parametrize("name,content,why", [
    ("missing", None, "does not exist"),
    ("fake.zip", "text, not a zip", "is not a zip file"),
    ("bad.txt", "text", "is neither a folder nor a .zip"),
    ("", None, "the source is empty"),
])
def test_collect_says_why_a_source_is_unusable(capsys, tmp_path, root, name, content, why):
    if content is not None:
        (tmp_path / name).write_text(content)
    source = str(tmp_path / name) if name else ""
    err = refused(capsys, "collect", source, "--root", str(root), naming=why)
    assert err.startswith("error: collect: ")
    assert not (root / "submitted").exists()


@pytest.mark.parametrize("pattern,why", [
    ("(", "is not a regular expression"),
    (r"(?P<student>\w+)", "lacks the named group(s) day"),
    (r"(?P<day>day\d\d)", "lacks the named group(s) student"),
    ("", "--pattern is empty"),
])
def test_collect_checks_the_pattern_first(capsys, tmp_path, root, pattern, why):
    archive = lms_zip(tmp_path / "good.zip", ["ann_day01.ipynb"])
    err = refused(capsys, "collect", str(archive), "--root", str(root), "--pattern", pattern,
                  naming=why)
    assert "--pattern" in err
    assert not (root / "submitted").exists()


def test_collect_refuses_a_pattern_it_would_not_use(capsys, tmp_path, root):
    (tmp_path / "export").mkdir()
    refused(capsys, "collect", str(tmp_path / "export"), "--root", str(root), "--pattern",
            DEFAULT_PATTERN, naming="--pattern applies to a .zip source only")


def test_collect_names_the_pattern_it_used(tmp_path, root):
    archive = lms_zip(tmp_path / "lms.zip", ["ann_day01.ipynb", "someone-else.ipynb"])
    mine = r"^(?P<student>[a-z]+)_(?P<day>day\d\d)\.ipynb$"
    reasons = dict(collect(archive, root, mine).unmatched)
    assert reasons["someone-else.ipynb"] == f"file name does not match the pattern {mine!r}"
    reasons = dict(collect(archive, root).unmatched)
    assert reasons["someone-else.ipynb"].endswith("<student>_<dayNN>...ipynb")


# -- 8: --root ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["days"], ["release"], ["execute"], ["mutants"],
                                     ["collect", "."], ["grade", DAY], ["export", "g.csv"],
                                     ["feedback", DAY]])
@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_root_must_hold_a_course(capsys, tmp_path, no_grading, command, kind):
    bad = tmp_path / "bad-root"
    if kind == "file":
        bad.write_text("not a folder")
    elif kind == "empty":
        bad.mkdir()
    refused(capsys, *command, "--root", str(bad), naming=f"--root {bad}")
    assert not no_grading and not Path("g.csv").exists()


# -- 9: --db -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["export", "g.csv"], ["feedback", DAY], ["grade", DAY],
                                     ["release", DAY]])
@pytest.mark.parametrize("db,why", [
    ("nonsense", "is not a database URL"),
    ("sqlite:////proc/x/db.sqlite", "folder /proc/x does not exist"),
    ("", "--db is empty"),
    ("nosuchdialect://host/db", "cannot open the gradebook"),
])
def test_db_is_checked_before_any_work(capsys, root, no_grading, command, db, why):
    refused(capsys, *command, "--root", str(root), "--db", db, naming=why)
    assert not no_grading and not (root / "gradebook.db").exists()
    assert not Path("g.csv").exists()


@pytest.mark.parametrize("command", [["days"], ["execute", DAY], ["collect", "x.zip"],
                                     ["mutants", DAY]])
@pytest.mark.parametrize("first", [False, True])
def test_db_is_refused_where_no_gradebook_is_used(capsys, root, command, first):
    # Accepted there, it was silently ignored: an instructor would think it chose the gradebook.
    # Before the positional argument, its URL was taken for that argument and the message
    # blamed another word ("unrecognized arguments: --db x.zip").
    db = ["--db", "sqlite:////tmp/other.db"]
    argv = [command[0], *db, *command[1:]] if first else [*command, *db]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--root", str(root)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"error: --db: {command[0]} uses no gradebook; only release, grade, export, " \
           "feedback take --db" in err, err


@pytest.mark.parametrize("command", [["export", "g.csv"], ["feedback", DAY], ["grade", DAY]])
def test_a_db_that_does_not_exist_is_not_created(capsys, tmp_path, root, no_grading, command):
    typo = tmp_path / "typo.db"
    extra = ["--no-sandbox"] if command[0] == "grade" else []
    err = refused(capsys, *command, "--root", str(root), "--db", f"sqlite:///{typo}", *extra,
                  naming=f"no gradebook at {typo}; run release first")
    assert "--db sqlite:///" in err
    assert not typo.exists() and not no_grading and not Path("g.csv").exists()


@pytest.mark.parametrize("command", [["export", "g.csv"], ["feedback", DAY]])
def test_export_and_feedback_need_a_released_gradebook(capsys, root, command):
    refused(capsys, *command, "--root", str(root),
            naming=f"no gradebook at {root / 'gradebook.db'}; run release first")
    assert not (root / "gradebook.db").exists() and not Path("g.csv").exists()


def test_feedback_of_a_day_nobody_was_graded_on_is_an_error(capsys, root):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "tinygpt") as gb:
        gb.add_assignment(DAY)
    refused(capsys, "feedback", DAY, "--root", str(root),
            naming=f"nobody has a graded submission of {DAY}: run grade {DAY} first")
    assert not (root / "feedback").exists()


def test_grade_of_a_day_nobody_submitted_needs_force(capsys, root, no_grading):
    refused(capsys, "grade", DAY, "--root", str(root), "--no-sandbox",
            naming=f"nobody submitted {DAY}")
    assert not no_grading and not (root / "gradebook.db").exists()
    assert main(["grade", DAY, "--root", str(root), "--no-sandbox", "--force",
                 "--no-progress"]) == 0
    assert len(no_grading) == 1


def test_a_second_grade_run_is_one_error_line(capsys, root):
    from autograder.grade import grading_lock

    (root / "submitted" / "ann" / DAY).mkdir(parents=True)
    with grading_lock(root.resolve(), DAY):
        refused(capsys, "grade", DAY, "--root", str(root), "--no-sandbox", "--no-progress",
                naming=f"another grade of {DAY} is running (pid {os.getpid()})")
    assert not (root / "autograded").exists() and not (root / ".grading" / DAY).exists()


def test_a_gradebook_that_fails_later_is_one_error_line(capsys, tmp_path, root):
    broken = tmp_path / "broken.db"
    broken.write_text("this is not an SQLite database " * 100)
    rc = main(["export", "g.csv", "--root", str(root), "--db", f"sqlite:///{broken}"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: the gradebook") and "\n" not in err, err


# -- 10, 11: output files ----------------------------------------------------------------------


@pytest.mark.parametrize("target,why", [("nofolder/g.csv", "folder nofolder does not exist"),
                                        (".", "is a folder"), ("", "is empty")])
def test_export_checks_its_csv_path(capsys, root, target, why):
    err = refused(capsys, "export", target, "--root", str(root), naming=why)
    assert "export CSV" in err
    assert not (root / "gradebook.db").exists()


@pytest.mark.parametrize("target,why", [("nofolder/r.json", "folder nofolder does not exist"),
                                        (".", "is a folder"), ("", "is empty")])
def test_grade_checks_its_json_path_before_grading(capsys, root, no_grading, target, why):
    err = refused(capsys, "grade", DAY, "--root", str(root), "--json", target, "--no-sandbox",
                  naming=why)
    assert "--json" in err
    assert not no_grading


# -- 12: days and --memory-gb ------------------------------------------------------------------


@pytest.mark.parametrize("command", [["grade", "nosuchday"], ["feedback", "nosuchday"],
                                     ["release", DAY, "nosuchday"], ["mutants", "nosuchday"]])
def test_an_unknown_day_is_an_error_listing_the_days(capsys, root, command):
    refused(capsys, *command, "--root", str(root),
            naming=f"unknown day(s) nosuchday; the course has {DAY}")


@pytest.mark.parametrize("extra,why", [
    (["--memory-gb", "1e-9"], "--memory-gb 1e-09 is too small for a kernel to start"),
    (["--memory-gb", "0.5"], "give a number >= 1"),
    (["--memory-gb", "3", "--no-sandbox"], "--memory-gb applies in the sandbox only"),
])
def test_memory_gb_is_bounded(capsys, root, no_grading, extra, why):
    refused(capsys, "grade", DAY, "--root", str(root), *extra, naming=why)
    assert not no_grading
