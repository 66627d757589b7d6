"""Turn whatever a student handed in into a notebook nbgrader can grade fairly.

Students rename notebooks, delete or edit test cells, paste their work into a fresh notebook
(losing nbgrader's cell metadata) or hand in a file that is not JSON at all. Staging starts
from the student's notebook (keeping any helper cells they added) and repairs it against the
released version:

- every answer cell is found by its grade_id, or, when metadata was stripped, by its first
  line (the function signature or the "# Set answer_qN" line the release put there);
- every test cell the release has is present after its answer cell (a deleted one is put back;
  an edited one is overwritten later by nbgrader from the gradebook, hidden tests included);
- an answer that cannot be found at all is replaced by the release's empty stub (zero points
  for that exercise, full credit elsewhere).

What could not be taken as it was is listed in `notes`, which end up in the grading report.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from autograder.notebooks import is_answer, is_test, nbgrader_meta


@dataclass
class Staged:
    notebook: NotebookNode | None  # None when there is nothing to grade
    status: str  # "ok", "repaired", "missing" or "invalid"
    notes: list[str] = field(default_factory=list)


def find_notebook(folder: Path, day: str) -> tuple[Path | None, list[str]]:
    """The submitted notebook for `day` in `folder` (accepting one renamed notebook)."""
    if not folder.is_dir():
        return None, ["no submission folder"]
    expected = folder / f"{day}.ipynb"
    if expected.is_file():
        return expected, []
    candidates = sorted(p for p in folder.glob("*.ipynb") if p.is_file())
    if len(candidates) == 1:
        return candidates[0], [f"notebook renamed to {candidates[0].name!r}: graded anyway"]
    if not candidates:
        return None, [f"no notebook in the submission (expected {day}.ipynb)"]
    return None, [f"{len(candidates)} notebooks and none named {day}.ipynb: "
                  f"{[p.name for p in candidates]}"]


def read_submission(path: Path) -> tuple[NotebookNode | None, str]:
    """Parse a submitted notebook; returns (notebook, "") or (None, why it is unreadable)."""
    try:
        text = path.read_text(encoding="utf-8")
        nb = nbformat.reads(text, as_version=4)
    except (UnicodeDecodeError, json.JSONDecodeError, nbformat.reader.NotJSONError) as err:
        return None, f"not a notebook (invalid JSON): {str(err).splitlines()[0][:120]}"
    except Exception as err:  # noqa: BLE001 (any parse failure is the student's file's fault)
        return None, f"not a readable notebook: {type(err).__name__}: {str(err)[:120]}"
    if not isinstance(nb.get("cells"), list):
        return None, "not a notebook: no list of cells"
    return nb, ""


def _first_line(source: str) -> str:
    return next((line.strip() for line in source.splitlines() if line.strip()), "")


def stage(release: NotebookNode, folder: Path, day: str) -> Staged:
    """Repair the submission in `folder` against the released notebook (see module docstring)."""
    path, notes = find_notebook(folder, day)
    if path is None:
        return Staged(None, "missing", notes)
    student, problem = read_submission(path)
    if student is None:
        return Staged(None, "invalid", notes + [problem])

    cells = [c for c in (_clean_cell(c) for c in student.cells) if c is not None]
    by_id = {nbgrader_meta(c).get("grade_id"): c for c in cells if nbgrader_meta(c)}
    repaired = list(notes)
    out: list[NotebookNode] = list(cells)
    anchor = None  # where the last handled answer cell sits in `out`
    for ref in release.cells:
        meta = nbgrader_meta(ref)
        if not (is_answer(ref) or is_test(ref)):
            continue
        grade_id = meta["grade_id"]
        found = by_id.get(grade_id)
        if found is None and is_answer(ref):
            signature = _first_line(ref.source)
            found = next((c for c in out if c.get("cell_type") == "code" and not nbgrader_meta(c)
                          and _first_line(c.get("source", "")) == signature), None)
            if found is not None:
                found.metadata["nbgrader"] = copy.deepcopy(meta)
                repaired.append(f"{grade_id}: cell metadata missing, matched by its first line")
        if found is None and is_test(ref):
            found = next((c for c in out if c.get("cell_type") == "code" and not nbgrader_meta(c)
                          and c.get("source", "").strip() == ref.source.strip()), None)
            if found is not None:
                found.metadata["nbgrader"] = copy.deepcopy(meta)
        if found is None:
            found = copy.deepcopy(ref)
            position = out.index(anchor) + 1 if anchor is not None else len(out)
            out.insert(position, found)
            what = "answer not found: graded as unanswered" if is_answer(ref) else \
                "test cell missing: restored"
            repaired.append(f"{grade_id}: {what}")
        anchor = found
    seen: set[str] = set()
    for index, cell in enumerate(out):  # unique cell ids (nbformat 4.5) before validation
        cell_id = str(cell.get("id") or "")
        if not cell_id or cell_id in seen:
            cell["id"] = f"staged-{index}"
        seen.add(cell["id"])
    nb = nbformat.v4.new_notebook(cells=out, metadata=copy.deepcopy(release.metadata))
    return Staged(nb, "repaired" if len(repaired) > len(notes) else "ok", repaired)


def _clean_cell(cell) -> NotebookNode | None:
    """A valid v4 cell with the student's source and nbgrader metadata, outputs dropped."""
    if not isinstance(cell, dict):
        return None
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else str(source)
    make = {"code": nbformat.v4.new_code_cell, "markdown": nbformat.v4.new_markdown_cell,
            "raw": nbformat.v4.new_raw_cell}.get(cell.get("cell_type"))
    if make is None:
        return None
    clean = make(source)
    metadata = cell.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("nbgrader"), dict):
        clean.metadata["nbgrader"] = copy.deepcopy(metadata["nbgrader"])
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(cell.get("id", ""))):
        clean["id"] = str(cell["id"])
    return clean
