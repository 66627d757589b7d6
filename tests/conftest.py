"""Shared fixtures: nbgrader runs per day are expensive, so each happens once per session."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from autograder.grading import CellGrade, autograde, execution_report, generate_release
from autograder.notebooks import days, release_path, solution_path
from autograder.settings import REPO_ROOT, ensure_venv_on_path

ensure_venv_on_path()
os.environ.setdefault("MPLBACKEND", "Agg")
# torch.compile's on-disk cache is one folder per user in /tmp by default, shared by every run
# whatever kernels torch picks (ATEN_CPU_CAPABILITY) and whatever compiler builds the package's
# C kernels (CC): a run under other settings reused another's entries and compiled tokens went
# wrong. The suite keeps one cache per setting (the compiled-path tests then read their own).
SETTINGS = "-".join(re.sub(r"\W", "_", os.environ.get(name, "default"))
                    for name in ("ATEN_CPU_CAPABILITY", "CC"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(
    Path(tempfile.gettempdir()) / f"tinygpt-inductor-{os.getuid()}" / SETTINGS))
sys.path.insert(0, str(REPO_ROOT))

DAYS = days()

# A submission that is correct but writes to stderr before every cell (a warning from student
# code): nbgrader alone would give its test cells zero; the course's grading must not.
NOISY_PRELUDE = (
    "import warnings as _w\n"
    "_w.simplefilter('always')\n"
    "get_ipython().events.register('pre_run_cell', lambda *_: _w.warn('noise from student "
    "code', UserWarning))\n"
)


@dataclass
class DayGrading:
    release: Path  # the student notebook nbgrader generated from solutions/
    grades: dict[str, list[CellGrade]]  # student id -> graded cells
    reports: dict[str, dict]  # student id -> SandboxExecute's report (status, evidence ...)


def noisy_copy(day: str, target: Path) -> Path:
    nb = nbformat.read(str(solution_path(day)), as_version=4)
    first = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution"))
    first.source = NOISY_PRELUDE + first.source
    nbformat.write(nb, str(target))
    return target


@pytest.fixture(scope="session")
def released_days(tmp_path_factory):
    """day -> the student notebook nbgrader generates from solutions/, in a course root of its
    own (generated on first use). Tests that only compare the release use this, not
    graded_days: pytest-xdist may run them on another worker, which must not autograde again."""
    cache: dict[str, Path] = {}

    def get(day: str) -> Path:
        if day not in cache:
            cache[day] = generate_release(day, tmp_path_factory.mktemp(f"nbgrader-{day}"))
        return cache[day]

    return get


@pytest.fixture(scope="session")
def graded_days(released_days):
    """day -> DayGrading, computed on first use: autograde, in the released day's course root,
    the solution ('solution'), the untouched student version ('blank') and, for the first day,
    a correct but noisy submission ('noisy'), each run as the instructor's grader runs it (in
    the sandbox, with the integrity guard: `autograde(guarded=True)`)."""
    cache: dict[str, DayGrading] = {}

    def get(day: str) -> DayGrading:
        if day not in cache:
            release = released_days(day)
            root = release.parents[2]           # the course root: root/course/<day>/<day>.ipynb
            assert release_path(day, root) == release
            blank = root / "blank.ipynb"
            shutil.copy(release, blank)
            submissions = {"solution": solution_path(day), "blank": blank}
            if day == DAYS[0]:
                submissions["noisy"] = noisy_copy(day, root / "noisy.ipynb")
            grades = autograde(day, root, submissions, guarded=True)
            cache[day] = DayGrading(release, grades,
                                    {s: execution_report(root, s) for s in submissions})
        return cache[day]

    return get

