"""The course's notebooks are consistent: metadata, day naming, course/ == nbgrader(solutions/)."""

import ast
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
def test_course_matches_nbgrader_output(day, released_days):
    generated = json.loads(released_days(day).read_text())
    committed = json.loads(release_path(day).read_text())
    assert committed == generated, (
        f"course/{day} is not what nbgrader generates from solutions/; {FIX}")


def _widget_creations(tree) -> list:
    """Calls that create an ipywidget (widgets.X(...), interact(...)) or a tqdm bar (tqdm.auto
    shows one as a widget in a notebook)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id == "widgets":
            found.append(node)
        elif isinstance(func, ast.Name) and func.id in ("interact", "interactive", "tqdm"):
            found.append(node)
    return found


def _under_grading_else(tree, call) -> bool:
    """Is `call` inside the else branch of an `if grading():` (or a tqdm disabled while
    grading)?"""
    if isinstance(call.func, ast.Name) and call.func.id == "tqdm":
        return any(k.arg == "disable" and "grading()" in ast.unparse(k.value)
                   for k in call.keywords)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "grading()":
            if any(call is inner for branch in node.orelse for inner in ast.walk(branch)):
                return True
    return False


def _parse_cell(source: str) -> ast.Module:
    """A code cell's syntax tree, its IPython magic and shell lines (%, !) read as `pass`;
    raises SyntaxError if what is left is not Python."""
    lines = [line[:len(line) - len(line.lstrip())] + "pass"
             if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return ast.parse("\n".join(lines))


def test_a_cell_with_a_magic_is_still_checked():
    tree = _parse_cell("%matplotlib inline\nslider = widgets.IntSlider()\n")
    assert [ast.unparse(c) for c in _widget_creations(tree)] == ["widgets.IntSlider()"]
    tree = _parse_cell("if grading():\n    print(1)\nelse:\n    !pip list\n    interact(f)\n")
    assert all(_under_grading_else(tree, c) for c in _widget_creations(tree))
    with pytest.raises(SyntaxError):
        _parse_cell("%matplotlib inline\nx = = 1\n")


@pytest.mark.parametrize("day", DAYS)
def test_no_widget_is_created_while_grading(day):
    """A widget created in a headless run can stall nbclient until the cell times out (nbclient
    issue #312): while grading (tinygpt.testing.grading()), no cell may create one."""
    offending = []
    for index, cell in enumerate(read(solution_path(day)).cells):
        if cell.cell_type != "code":
            continue
        try:
            tree = _parse_cell(cell.source)
        except SyntaxError as err:
            pytest.fail(f"{day}: cell {index} is not Python once its magics are removed: {err}")
        offending += [f"cell {index}: {ast.unparse(c)[:60]}" for c in _widget_creations(tree)
                      if not _under_grading_else(tree, c)]
    assert not offending, (f"{day}: widgets created while grading (put them under `if "
                           f"grading(): print(why) else: ...`): {offending}")
