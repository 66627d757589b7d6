"""Our one change to nbgrader's autograding pipeline: how a graded test cell's outputs count.

nbgrader 0.9 gives a test cell zero points when *anything* reaches stderr, so a correct answer
that happens to emit a warning (a NumPy RuntimeWarning, a deprecation notice) would lose its
points. Failures are `error` outputs, which this leaves alone; stderr text is moved to stdout
(prefixed, so the feedback still shows it) before grades are computed.

nbgrader also reads a test cell's first `execute_result` as partial credit (a number it scores
before looking at any later error). No test of this course uses partial credit, and student
code can emit an execute_result from inside a test (`sys.displayhook(2)` in an answer the test
calls), so every execute_result of a graded test cell is turned into display_data: it is still
shown, but it can no longer stand for a score.
"""

from __future__ import annotations

from nbformat import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

STDERR_PREFIX = "[stderr] "


def stderr_to_stdout(outputs: list) -> list:
    """Return `outputs` with every stderr stream turned into a stdout stream (prefixed)."""
    moved = []
    for out in outputs:
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            text = out.get("text", "")
            lines = text.splitlines(keepends=True)
            out = NotebookNode(dict(out))
            out["name"] = "stdout"
            out["text"] = "".join(STDERR_PREFIX + line for line in lines)
        moved.append(out)
    return moved


def no_partial_credit(outputs: list) -> list:
    """Return `outputs` with every execute_result turned into display_data (same data)."""
    shown = []
    for out in outputs:
        if out.get("output_type") == "execute_result":
            out = NotebookNode(output_type="display_data", data=out.get("data", {}),
                               metadata=out.get("metadata", {}))
        shown.append(out)
    return shown


def graded_outputs(outputs: list) -> list:
    """A test cell's outputs as they are scored: stderr moved to stdout, no partial credit."""
    return no_partial_credit(stderr_to_stdout(outputs))


class StderrToStdout(NbGraderPreprocessor):
    """Before graded cells are scored: move their stderr output to stdout, so that warnings
    do not cost points, and turn their execute_results into display_data, so that no output
    reads as partial credit (see the module docstring)."""

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            cell.outputs = graded_outputs(cell.outputs)
        return cell, resources
