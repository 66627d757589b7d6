"""Build nbgrader notebooks from Python: a maintainer's alternative to clicking through
JupyterLab's "Create Assignment" toolbar. The notebook it writes is the source of truth
(solutions/dayNN_slug/dayNN_slug.ipynb); this module only saves typing metadata by hand.

    cells = [md("# Day 01 ..."), code("import numpy as np"),
             answer("softmax", "def softmax(x):\\n    ### BEGIN SOLUTION\\n ..."),
             tests("softmax_tests", 2, "check_close(...)")]
    write_notebook(cells, "solutions/day01_logits/day01_logits.ipynb")

Tags understood by nbval: "nbval-ignore-output" (timings, widgets), "nbval-skip".
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SCHEMA_VERSION = 3


def _clean(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell (dedented)."""
    return new_markdown_cell(_clean(text))


def code(src: str, *, tags: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    """An ordinary code cell; `tags` for nbval ("nbval-ignore-output", "nbval-skip")."""
    cell = new_code_cell(_clean(src))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def answer(grade_id: str, src: str) -> nbformat.NotebookNode:
    """An autograded answer cell; `src` marks the solution with ### BEGIN/END SOLUTION."""
    cell = new_code_cell(_clean(src))
    cell.metadata["nbgrader"] = {"grade": False, "grade_id": grade_id, "locked": False,
                                 "schema_version": SCHEMA_VERSION, "solution": True,
                                 "task": False}
    return cell


def tests(grade_id: str, points: float, src: str) -> nbformat.NotebookNode:
    """A read-only test cell worth `points`; hidden tests go between
    ### BEGIN HIDDEN TESTS and ### END HIDDEN TESTS."""
    cell = new_code_cell(_clean(src))
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": grade_id, "locked": True,
                                 "points": points, "schema_version": SCHEMA_VERSION,
                                 "solution": False, "task": False}
    return cell


def write_notebook(cells: list, path: str | Path) -> Path:
    """Write `cells` as a Python 3 notebook with stable cell ids; returns the path."""
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python",
                                 "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for index, cell in enumerate(nb.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        cell["id"] = grade_id.replace(" ", "-") if grade_id else f"cell-{index:03d}"
    nbformat.validate(nb)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path
