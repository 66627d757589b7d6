"""Turn whatever a student handed in into a notebook nbgrader can grade fairly.

Students rename notebooks, delete or edit test cells, paste their work into a fresh notebook
(losing nbgrader's cell metadata) or hand in a file that is not JSON at all. Staging starts
from the student's notebook (keeping any helper cells they added) and repairs it against the
released version:

- every answer cell is found by its grade_id, or, when metadata was stripped, by its first
  line (the function signature or the "# Set answer_qN" line the release put there);
- every test cell the release has is present after its answer cell (a deleted one is put back;
  one moved elsewhere, above its answer or below another exercise, is moved back directly after
  its answer cell; an edited one is overwritten later by nbgrader from the gradebook, hidden
  tests included);
- an answer that cannot be found at all is replaced by the release's empty stub (zero points
  for that exercise, full credit elsewhere);
- nbgrader metadata is the release's: one cell per released grade_id keeps it (copies that
  Jupyter made when a graded cell was copied and pasted run as ordinary cells), its flags and
  points are put back as released, and metadata with a grade_id the release does not have (or
  one that is not a string) is removed. Copies are an honest accident; changed flags or points
  and invented graded cells are tampering, listed in `tampered` as well.

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
    tampered: list[str] = field(default_factory=list)  # nbgrader metadata changed on purpose


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
    repaired, tampered = list(notes), []
    by_id = _released_metadata(release, cells, repaired, tampered)
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
            position = _position(out, anchor) + 1 if anchor is not None else len(out)
            out.insert(position, found)
            what = "answer not found: graded as unanswered" if is_answer(ref) else \
                "test cell missing: restored"
            repaired.append(f"{grade_id}: {what}")
        elif is_test(ref) and anchor is not None and _misplaced(out, anchor, found):
            del out[_position(out, found)]
            out.insert(_position(out, anchor) + 1, found)
            repaired.append(f"{grade_id}: test cell was moved away from "
                            f"{nbgrader_meta(anchor)['grade_id']}: put back after it")
        anchor = found
    seen: set[str] = set()
    for index, cell in enumerate(out):  # unique cell ids (nbformat 4.5) before validation
        cell_id = str(cell.get("id") or "")
        if not cell_id or cell_id in seen:
            cell["id"] = f"staged-{index}"
        seen.add(cell["id"])
    nb = nbformat.v4.new_notebook(cells=out, metadata=copy.deepcopy(release.metadata))
    return Staged(nb, "repaired" if len(repaired) > len(notes) else "ok", repaired, tampered)


def _misplaced(out: list[NotebookNode], anchor: NotebookNode, test: NotebookNode) -> bool:
    """Whether `test` is not where the release has it: after `anchor` (the graded cell the
    release puts before it) with no other graded cell between them. Cells of the student's own
    between the two do not count: they stay where they are."""
    start, end = _position(out, anchor), _position(out, test)
    return end < start or any(is_answer(c) or is_test(c) for c in out[start + 1:end])


def _position(out: list[NotebookNode], cell: NotebookNode) -> int:
    """Where `cell` itself is in `out` (list.index would stop at an equal copy)."""
    return next(i for i, c in enumerate(out) if c is cell)


FLAGS = ("grade", "solution", "locked", "points", "task")


def _released_metadata(release: NotebookNode, cells: list[NotebookNode], repaired: list[str],
                       tampered: list[str]) -> dict[str, NotebookNode]:
    """Make the nbgrader metadata of `cells` the release's (see the module docstring); returns
    grade_id -> the cell that keeps it. What was changed goes to `repaired`, and what cannot be
    an accident to `tampered` too."""
    released = {nbgrader_meta(c)["grade_id"]: c for c in release.cells
                if isinstance(nbgrader_meta(c).get("grade_id"), str)}
    by_id: dict[str, NotebookNode] = {}
    copies: dict[str, int] = {}
    for cell in cells:
        meta = nbgrader_meta(cell)
        if not meta:
            continue
        grade_id = meta.get("grade_id")
        ref = released.get(grade_id)
        if ref is None or grade_id in by_id or cell.cell_type != ref.cell_type:
            del cell.metadata["nbgrader"]
            if ref is None:
                repaired.append(f"{grade_id}: not a cell of the release: its nbgrader "
                                f"metadata was removed")
                if meta.get("grade") or meta.get("points"):
                    tampered.append(f"a graded cell {grade_id!r} the release does not have")
            else:
                copies[grade_id] = copies.get(grade_id, 0) + 1
            continue
        by_id[grade_id] = cell
        changed = [k for k in FLAGS if meta.get(k) != nbgrader_meta(ref).get(k)]
        if changed:
            repaired.append(f"{grade_id}: nbgrader metadata ({', '.join(changed)}) restored "
                            f"from the release")
            tampered.append(f"{grade_id}: changed its nbgrader {', '.join(changed)}")
        cell.metadata["nbgrader"] = copy.deepcopy(nbgrader_meta(ref))
    for grade_id, count in copies.items():
        repaired.append(f"{grade_id}: {count} more cell{'s' if count > 1 else ''} carried its "
                        f"metadata (copied and pasted?): the first kept it, the others run as "
                        f"ordinary cells")
    return by_id


def _clean_cell(cell) -> NotebookNode | None:
    """A valid v4 cell with the student's source and nbgrader metadata (only when it has a
    grade_id that is a string), outputs dropped."""
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
    if isinstance(metadata, dict) and isinstance(metadata.get("nbgrader"), dict) \
            and isinstance(metadata["nbgrader"].get("grade_id"), str) \
            and metadata["nbgrader"]["grade_id"]:     # a grade_id that is not a string is junk
        clean.metadata["nbgrader"] = copy.deepcopy(metadata["nbgrader"])
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(cell.get("id", ""))):
        clean["id"] = str(cell["id"])
    return clean
