"""An instructor's whole term, driven through `python -m autograder`: release, collect (folder
and zip), grade the bad-submission corpus next to control students, export, feedback; then the
same term against a real PostgreSQL server."""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import bad_submissions
from autograder.collect import collect
from autograder.notebooks import solution_path
from autograder.settings import REPO_ROOT

DAY = bad_submissions.DAY
LIMITS = ["--cell-timeout", "10", "--total-timeout", "120", "--memory-gb", "3", "--workers", "2",
          "--no-progress"]


def cli(root: Path, *args: str, db: str | None = None, check: bool = True):
    cmd = [sys.executable, "-m", "autograder", *args, "--root", str(root)]
    if db:
        cmd += ["--db", db]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def course_root(tmp_path: Path) -> Path:
    """A scratch course with day 01 only (the instructor's checkout)."""
    root = tmp_path / "course-root"
    for folder in ("solutions", "course"):
        shutil.copytree(REPO_ROOT / folder / DAY, root / folder / DAY)
    return root


def need_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does): "
                    "the grader refuses to run student code without its sandbox")


class Listener:
    """A TCP server on the host's loopback: a sandboxed connection attempt must never reach it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port, self.connections, self.stop = self.sock.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def test_collect_folder_reports_what_it_cannot_place(tmp_path):
    root, src = course_root(tmp_path), tmp_path / "export"
    (src / "ann" / "day01").mkdir(parents=True)
    shutil.copy(solution_path(DAY), src / "ann" / "day01" / f"{DAY}.ipynb")
    (src / "ben" / "day99_nothing").mkdir(parents=True)
    (src / "ben" / "day99_nothing" / "x.ipynb").write_text("{}")
    (src / "stray.ipynb").write_text("{}")
    with open(src / "ann" / "day01" / "huge.ipynb", "wb") as huge:   # sparse: never read
        huge.truncate(51 * 2**20)
    report = collect(src, root)
    assert report.imported == [("ann", DAY, "ann/day01")]
    assert (root / "submitted" / "ann" / DAY / f"{DAY}.ipynb").exists()
    assert not (root / "submitted" / "ann" / DAY / "huge.ipynb").exists()
    assert (root / "submitted" / "ann" / DAY / "timestamp.txt").exists()
    reasons = dict(report.unmatched)
    assert "not a day of this course" in reasons["ben/day99_nothing"]
    assert "expected <student>/<day>/<file>" in reasons["stray.ipynb"]
    assert reasons["ann/day01/huge.ipynb"] == "larger than 50 MiB"


def test_collect_zip_as_an_lms_exports_it(tmp_path):
    root, archive = course_root(tmp_path), tmp_path / "lms.zip"
    notebook = solution_path(DAY).read_bytes()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(zipfile.ZipInfo("export/ann_day01_logits.ipynb", (2026, 11, 2, 9, 0, 0)),
                   notebook)
        z.writestr(zipfile.ZipInfo("export/ben-day01.ipynb", (2026, 11, 2, 9, 0, 0)), notebook)
        z.writestr(zipfile.ZipInfo("export/ben_day01_v2.ipynb", (2026, 11, 3, 9, 0, 0)), notebook)
        z.writestr("export/readme.txt", "hello")
        z.writestr("export/carl_homework.ipynb", notebook)
        z.writestr("export/dan_day42.ipynb", notebook)
        z.writestr("../../escape_day01.ipynb", notebook)
    report = collect(archive, root)
    assert sorted((s, d) for s, d, _ in report.imported) == [
        ("ann", DAY), ("ben", DAY), ("escape", DAY)]
    reasons = dict(report.unmatched)
    assert reasons["export/readme.txt"] == "not a notebook"
    assert "does not match the pattern" in reasons["export/carl_homework.ipynb"]
    assert "not a day of this course" in reasons["export/dan_day42.ipynb"]
    assert "a later file for ben" in reasons["export/ben-day01.ipynb"]
    assert (root / "submitted" / "escape" / DAY / f"{DAY}.ipynb").exists()
    assert not (tmp_path.parent / "escape_day01.ipynb").exists()
    stamp = (root / "submitted" / "ben" / DAY / "timestamp.txt").read_text()
    assert stamp.startswith("2026-11-03 09:00:00")


@pytest.mark.slow
def test_the_bad_submission_corpus_is_graded_as_specified(tmp_path):
    need_bwrap()
    root, listener = course_root(tmp_path), Listener()
    try:
        cases = bad_submissions.build(tmp_path / "export", root=root, port=listener.port)
        cli(root, "release", DAY)
        cli(root, "collect", str(tmp_path / "export"))
        cli(root, "grade", DAY, *LIMITS, "--json", str(tmp_path / "results.json"))
    finally:
        listener.close()
    got = {r["student"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    wrong = [f"{c.student}: expected {c.status} {c.score:g}, got {got[c.student]['status']} "
             f"{got[c.student]['score']:g} ({got[c.student]['reason']})"
             for c in cases if (got[c.student]["status"], got[c.student]["score"])
             != (c.status, c.score)]
    assert not wrong, "\n".join(wrong)
    assert listener.connections == 0, "a sandboxed submission reached a host server"
    # an error in an answer cell is a warning beside the status, not the status's reason
    assert got["sys-exit"]["reason"] == "" and "SystemExit" in got["sys-exit"]["warnings"]
    assert not (REPO_ROOT / "tinygpt" / "hacked.py").exists()

    # the gradebook holds exactly one consistent result per student
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "tinygpt") as gb:
        assert sorted(s.id for s in gb.students) == sorted(c.student for c in cases)
        for case in cases:
            submissions = [s for s in gb.find_student(case.student).submissions]
            assert len(submissions) == 1
            assert float(submissions[0].score) == case.score

    # grading again changes nothing and runs no student code; --force regrades
    again = cli(root, "grade", DAY, *LIMITS).stdout
    assert again.count("unchanged") == len(cases), again
    forced = cli(root, "grade", DAY, *LIMITS, "--student", "control-full", "--force").stdout
    assert "control-full" in forced and " 13 " in forced and "unchanged" not in forced

    # export: a row per student, a column per day, a total
    cli(root, "export", str(tmp_path / "grades.csv"))
    rows = list(csv.reader(open(tmp_path / "grades.csv")))
    assert rows[0] == ["student", DAY, "total", "review"]
    assert rows[1] == ["(max)", "13", "13", ""]
    assert {r[0]: float(r[-2]) for r in rows[2:]} == {c.student: c.score for c in cases}
    review = {r[0]: r[-1] for r in rows[2:]}
    honest = {"control-full", "control-blank", "infinite-loop", "memory-bomb", "sys-exit",
              "edited-test", "deleted-test", "stripped-metadata", "renamed", "corrupt-json",
              "nothing", "huge-output", "stderr-warning"}
    limited = {"infinite-loop": "timeout", "memory-bomb": "memory-limit"}
    flagged = [s for s in honest - set(limited) if review[s]]
    assert not flagged, f"an honest (if broken) submission was flagged: {flagged}"
    for student, limit in limited.items():    # a grader limit is listed as what it is
        assert review[student].startswith(f"{DAY}: {limit}: "), review[student]
    for attack in ("reads-solutions", "reads-gradebook"):     # listed for review, with why
        assert review[attack].startswith(f"{DAY}: reads-tests"), review[attack]

    # the per-exercise export: a row per student, day and exercise, summing to the day's score
    by_exercise = list(csv.reader(open(tmp_path / "grades-by-exercise.csv")))
    assert by_exercise[0] == ["student", "day", "exercise", "score", "max_score"]
    per_student: dict[str, float] = {}
    for student, day, _, score, _ in by_exercise[1:]:
        assert day == DAY
        per_student[student] = per_student.get(student, 0.0) + float(score)
    assert per_student == {c.student: c.score for c in cases}
    exercises = {row[2] for row in by_exercise[1:]}
    assert {"softmax", "perplexity", "q1"} <= exercises, exercises
    assert ["edited-test", DAY, "perplexity", "0", "2"] in by_exercise
    table = cli(root, "grade", DAY, *LIMITS, "--by-exercise").stdout
    assert "perplexity" in table.splitlines()[0] and "log_softmax" in table.splitlines()[0]

    # feedback: messages yes, hidden tests no; and the day's item analysis
    printed = cli(root, "feedback", DAY).stdout
    assert f"item analysis, {DAY}" in printed and "full marks" in printed
    page = (root / "feedback" / "edited-test" / DAY / f"{DAY}.html").read_text()
    assert "perplexity" in page and "failed" in page and "CheckFailed" in page
    solution = nbformat.read(str(solution_path(DAY)), as_version=4)
    hidden = [line.strip() for c in solution.cells if "### BEGIN HIDDEN TESTS" in c.source
              for line in c.source.split("### BEGIN HIDDEN TESTS")[1].splitlines()
              if len(line.strip()) > 30]
    leaked = [line for line in hidden if line in page]
    assert hidden and not leaked, f"hidden test code in feedback: {leaked[:3]}"


def postgres_binaries() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@pytest.mark.slow
def test_term_against_postgresql(tmp_path):
    need_bwrap()
    bindir = postgres_binaries()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql; .ci/run does)")
    # PostgreSQL refuses to run as root, and pytest's tmp folders are private to root: give
    # the server a folder of its own that the postgres user owns.
    pg_home = Path(tempfile.mkdtemp(prefix="tinygpt-pg-"))
    data, sockets = pg_home / "data", pg_home / "sock"
    sockets.mkdir()
    as_postgres = []
    if os.geteuid() == 0:
        for path in (pg_home, sockets):
            shutil.chown(path, "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_postgres, str(bindir / "initdb"), "-D", str(data), "-A", "trust",
                    "-U", "tinygpt"], check=True, capture_output=True)
    subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l",
                    str(pg_home / "pg.log"), "-o", f"-k {sockets} -c listen_addresses=''",
                    "start"], check=True, capture_output=True)
    try:
        subprocess.run([str(bindir / "createdb"), "-h", str(sockets), "-U", "tinygpt",
                        "gradebook"], check=True, capture_output=True)
        db = f"postgresql+psycopg2://tinygpt@/gradebook?host={sockets}"
        root = course_root(tmp_path)
        export = tmp_path / "export"
        for case in bad_submissions.CASES:
            if case.student in ("control-full", "corrupt-json"):
                case.build(export / case.student / DAY, {})
        cli(root, "release", DAY, db=db)
        cli(root, "collect", str(export))  # collect writes submitted/, not the gradebook
        cli(root, "grade", DAY, *LIMITS, "--json", str(tmp_path / "r.json"), db=db)
        scores = {r["student"]: r["score"] for r in json.loads((tmp_path / "r.json").read_text())}
        assert scores == {"control-full": 13.0, "corrupt-json": 0.0}
        cli(root, "export", str(tmp_path / "grades.csv"), db=db)
        assert "control-full,13,13" in (tmp_path / "grades.csv").read_text()
        assert not (root / "gradebook.db").exists(), "--db was ignored: SQLite was used"
    finally:
        subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast",
                        "stop"], capture_output=True)
        shutil.rmtree(pg_home, ignore_errors=True)
