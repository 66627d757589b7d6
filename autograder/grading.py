"""nbgrader's generate -> autograde flow: the release in place, the checks in a scratch course.

`release` is what `make release` runs (`python -m autograder release`): it regenerates course/
in place and records the assignment in the gradebook. `generate_release` runs the same nbgrader
step in a scratch course (the drift check and the grader use it); `autograde` grades a set of
submitted notebooks of one day and reads every cell's score back from the gradebook.
`generate_release` and `autograde` work in a scratch copy, so a check never touches the
repository's own folders.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from autograder.notebooks import release_path, solution_path
from autograder.settings import (
    REPO_ROOT,
    SOURCE_DIR,
    ensure_venv_on_path,
    nbgrader_config,
)


class GradingError(RuntimeError):
    """nbgrader reported a failure; the message carries its log."""


def _api(root: Path, db_url: str | None = None, sandbox_execute: dict | None = None):
    """nbgrader's API on the course root `root`; `sandbox_execute`: in_autograde's arguments
    (autograder/execute.py: the executor class, default SandboxExecute, and its settings), which
    then runs the notebooks autograde executes in place of nbgrader's Execute."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    ensure_venv_on_path()
    config = nbgrader_config(root, db_url)
    if sandbox_execute is not None:
        from autograder.execute import in_autograde

        in_autograde(config, **sandbox_execute)
    return NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)


# A kernel that dies before it answers has run nothing: its notebook is graded again. (The
# usual cause: jupyter_client picks free ports, and another process, such as a test's server
# on its own free port, binds one of them before the kernel does: "Address already in use".)
KERNEL_START_TRIES = 3


def _kernel_did_not_start(result: dict) -> bool:
    text = f"{result.get('error', '')}\n{result.get('log', '')}"
    return "Kernel died before replying to kernel_info" in text


def _check(result: dict, what: str) -> None:
    if not result.get("success"):
        raise GradingError(f"nbgrader {what} failed:\n{result.get('error', '')}\n"
                           f"{result.get('log', '')}")


def generate_release(day: str, workdir: Path, source_root: Path = REPO_ROOT) -> Path:
    """Copy day's solutions into `workdir`, run nbgrader generate_assignment there, and return
    the generated student notebook's path. `workdir` becomes a course root with a gradebook."""
    src = source_root / SOURCE_DIR / day
    shutil.copytree(src, workdir / SOURCE_DIR / day, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    _check(_api(workdir).generate_assignment(day, force=True, create=True),
           f"generate_assignment {day}")
    return release_path(day, workdir)


def release(day: str, root: Path = REPO_ROOT, db_url: str | None = None) -> Path:
    """Regenerate course/<day>/ from solutions/<day>/ and record the assignment (its cells,
    points and hidden tests) in the gradebook at `db_url` (default root/gradebook.db)."""
    _check(_api(root, db_url).generate_assignment(day, force=True, create=True),
           f"generate_assignment {day}")
    return release_path(day, root)


@dataclass(frozen=True)
class CellGrade:
    grade_id: str
    score: float
    max_score: float


def autograde(day: str, workdir: Path, submissions: dict[str, Path], *,
              guarded: bool = False) -> dict[str, list[CellGrade]]:
    """Autograde `submissions` (student id -> notebook) of `day` in the course root `workdir`
    (already holding the generated assignment). Returns each student's graded cells.

    guarded: run each notebook as `python -m autograder grade` does, in SandboxExecute (in
    bubblewrap where it is installed) with the day's integrity guard, in place of nbgrader's
    own Execute; its report (status, reason, evidence) is written to
    workdir/reports/<student>.json (read it with `execution_report`)."""
    from nbgrader.api import Gradebook

    from autograder.guard import guard_spec
    from autograder.notebooks import read
    from tinygpt.testing import GRADING_VARIABLE

    api = _api(workdir)
    sandboxed = None
    if guarded:
        (workdir / "reports").mkdir(exist_ok=True)
        release = release_path(day, workdir)
        sandboxed = dict(cell_timeout=300.0, total_timeout=1200.0,
                         sandbox=shutil.which("bwrap") is not None, files_dir=str(release.parent),
                         guard=guard_spec(read(release)).to_json())

    saved = os.environ.get(GRADING_VARIABLE)
    # nbgrader's kernels inherit this process's environment: they run in grading mode (nbgrader
    # also sets NBGRADER_EXECUTION, which tinygpt.testing.grading() reads as well).
    os.environ[GRADING_VARIABLE] = "1"
    try:
        for student, notebook in submissions.items():
            target = workdir / "submitted" / student / day
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(notebook, target / f"{day}.ipynb")
            mine = api if sandboxed is None else _api(workdir, sandbox_execute={
                **sandboxed, "report_path": str(execution_report_path(workdir, student))})
            for _ in range(KERNEL_START_TRIES):
                result = mine.autograde(day, student, force=True, create=True)
                if result.get("success") or not _kernel_did_not_start(result):
                    break
            _check(result, f"autograde {day} {student}")
    finally:
        if saved is None:
            os.environ.pop(GRADING_VARIABLE, None)
        else:
            os.environ[GRADING_VARIABLE] = saved
    grades = {}
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        for student in submissions:
            nb = gb.find_submission_notebook(day, day, student)
            grades[student] = sorted(
                (CellGrade(g.name, float(g.score), float(g.max_score)) for g in nb.grades),
                key=lambda g: g.grade_id)
    return grades


def execution_report_path(workdir: Path, student: str) -> Path:
    return workdir / "reports" / f"{student}.json"


def execution_report(workdir: Path, student: str) -> dict:
    """The SandboxExecute report of `student`'s notebook from `autograde(..., guarded=True)`."""
    return json.loads(execution_report_path(workdir, student).read_text())


def execute_solution(day: str, root: Path = REPO_ROOT) -> Path:
    """Run solutions/<day>/<day>.ipynb top to bottom in place, saving its outputs."""
    import nbformat
    from nbclient import NotebookClient

    path = solution_path(day, root)
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata.pop("widgets", None)  # random model ids: noise in every diff, no use offline
    nbformat.write(nb, str(path))
    return path
