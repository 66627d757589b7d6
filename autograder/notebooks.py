"""Finding the course's days and the exercises inside a notebook, and linting their metadata.

An *exercise* is an nbgrader answer cell (solution, not graded) followed by its test cell
(graded, locked, with points). Every graded test cell belongs to the answer cell just before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from autograder.settings import RELEASE_DIR, REPO_ROOT, SOURCE_DIR

DAY_PATTERN = re.compile(r"^day(\d\d)_[a-z0-9_]+$")
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION", "### BEGIN HIDDEN TESTS",
                    "### END HIDDEN TESTS")


@dataclass(frozen=True)
class Exercise:
    grade_id: str  # the answer cell's grade_id
    answer_index: int  # cell index of the answer cell
    test_id: str  # the test cell's grade_id
    test_index: int
    points: float


def days(root: Path = REPO_ROOT) -> list[str]:
    """Sorted day ids (`day01_logits`, ...) that have a solution notebook."""
    found = []
    for path in sorted((root / SOURCE_DIR).glob("day*/day*.ipynb")):
        day = path.parent.name
        if DAY_PATTERN.match(day) and path.stem == day:
            found.append(day)
    return found


def solution_path(day: str, root: Path = REPO_ROOT) -> Path:
    return root / SOURCE_DIR / day / f"{day}.ipynb"


def release_path(day: str, root: Path = REPO_ROOT) -> Path:
    return root / RELEASE_DIR / day / f"{day}.ipynb"


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def is_answer(cell) -> bool:
    meta = nbgrader_meta(cell)
    return cell.cell_type == "code" and bool(meta.get("solution")) and not meta.get("grade")


def is_test(cell) -> bool:
    meta = nbgrader_meta(cell)
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def exercises(nb) -> list[Exercise]:
    """The notebook's exercises in order: each answer cell paired with the test cell after it."""
    found, answer = [], None
    for index, cell in enumerate(nb.cells):
        if is_answer(cell):
            answer = (nbgrader_meta(cell)["grade_id"], index)
        elif is_test(cell) and answer is not None:
            meta = nbgrader_meta(cell)
            found.append(Exercise(answer[0], answer[1], meta["grade_id"], index,
                                  float(meta.get("points", 0))))
            answer = None
    return found


def lint(nb, *, released: bool = False) -> list[str]:
    """Return the metadata problems of a notebook (empty when it is sound).

    Checks: unique grade ids; graded cells carry points > 0 and are locked; every answer cell is
    followed, before the next answer cell, by exactly one test cell; every test cell has an answer
    cell before it; a solution notebook marks its answers; a released notebook contains no
    solution or hidden-test text.
    """
    problems, seen = [], set()
    pending_answer = None
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        where = f"cell {index}"
        if meta:
            grade_id = meta.get("grade_id")
            if not grade_id:
                problems.append(f"{where}: nbgrader cell without grade_id")
            elif grade_id in seen:
                problems.append(f"{where}: duplicate grade_id {grade_id!r}")
            seen.add(grade_id)
        if is_test(cell):
            points = meta.get("points")
            if not isinstance(points, int | float) or points <= 0:
                problems.append(f"{where} ({meta.get('grade_id')}): points must be > 0, "
                                f"got {points!r}")
            if not meta.get("locked"):
                problems.append(f"{where} ({meta.get('grade_id')}): test cell is not locked")
            if pending_answer is None:
                problems.append(f"{where} ({meta.get('grade_id')}): test cell without an "
                                "answer cell before it")
            pending_answer = None
        elif is_answer(cell):
            if pending_answer is not None:
                problems.append(f"cell {pending_answer}: answer cell has no test cell after it")
            pending_answer = index
            if not released and "### BEGIN SOLUTION" not in cell.source:
                problems.append(f"{where} ({meta.get('grade_id')}): answer cell without "
                                "### BEGIN SOLUTION")
        if released:
            for marker in SOLUTION_MARKERS:
                if marker in cell.source:
                    problems.append(f"{where}: released notebook contains {marker!r}")
    if pending_answer is not None:
        problems.append(f"cell {pending_answer}: answer cell has no test cell after it")
    return problems
