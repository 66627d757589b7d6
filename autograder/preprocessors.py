"""Our one change to nbgrader's autograding pipeline.

nbgrader 0.9 gives a test cell zero points when *anything* reaches stderr, so a correct answer
that happens to emit a warning (a NumPy RuntimeWarning, a deprecation notice) would lose its
points. Failures are `error` outputs, which this leaves alone; stderr text is moved to stdout
(prefixed, so the feedback still shows it) before grades are computed.
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


class StderrToStdout(NbGraderPreprocessor):
    """Move stderr output of graded cells to stdout so that warnings do not cost points."""

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            cell.outputs = stderr_to_stdout(cell.outputs)
        return cell, resources
