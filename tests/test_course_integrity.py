"""The course's notebooks are consistent: metadata, day naming, course/ == nbgrader(solutions/)."""

import json
import re

import pytest

from autograder.notebooks import days, exercises, lint, read, release_path, solution_path
from autograder.settings import REPO_ROOT
from tests.conftest import DAYS

FIX = "run `make release` and commit course/"


def test_there_are_days():
    assert DAYS, "no solutions/dayNN_slug/dayNN_slug.ipynb found"
    assert DAYS[0].startswith("day01_")


def test_day_folders_are_consistent():
    sol = {p.name for p in (REPO_ROOT / "solutions").iterdir() if p.is_dir()}
    rel = {p.name for p in (REPO_ROOT / "course").iterdir() if p.is_dir()}
    assert sol == set(days()), f"solutions/ folders without a notebook: {sol - set(days())}"
    assert rel == sol, f"course/ and solutions/ differ in days: {sorted(rel ^ sol)}; {FIX}"


@pytest.mark.parametrize("day", DAYS)
def test_solution_metadata_lint(day):
    nb = read(solution_path(day))
    assert lint(nb) == []
    graded = exercises(nb)
    assert len([e for e in graded if not re.fullmatch(r"q\d+", e.grade_id)]) >= 4, (
        f"{day}: at least 4 graded exercises besides self-check questions")
    assert any(re.fullmatch(r"q\d+", e.grade_id) for e in graded), f"{day}: no self-check question"
    hidden = [c for c in nb.cells if "### BEGIN HIDDEN TESTS" in c.source]
    assert hidden, f"{day}: no hidden tests"


@pytest.mark.parametrize("day", DAYS)
def test_released_notebook_has_no_solutions(day):
    assert lint(read(release_path(day)), released=True) == []


@pytest.mark.parametrize("day", DAYS)
def test_solution_outputs_are_saved_and_clean(day):
    nb = read(solution_path(day))
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), (
        f"{day}: solution notebook has unexecuted cells: run `python -m autograder execute {day}`")
    errors = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{day}: saved outputs contain errors in cells {errors}"


@pytest.mark.slow
@pytest.mark.parametrize("day", DAYS)
def test_course_matches_nbgrader_output(day, graded_days):
    generated = json.loads(graded_days(day).release.read_text())
    committed = json.loads(release_path(day).read_text())
    assert committed == generated, (
        f"course/{day} is not what nbgrader generates from solutions/; {FIX}")
