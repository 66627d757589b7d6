"""A notebook cell that stops at an answer the student has not written yet says which one
(tinygpt.testing, imported by every notebook, adds the line under IPython's traceback), in a
real kernel; graded runs keep IPython's own handling."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    "from tinygpt.testing import check_close",
    "def softmax(x):\n    raise NotImplementedError()",
    "import numpy as np\nnp.array([softmax(1)])",          # a demo cell calling the stub
    "class RMSNorm:\n    def forward(self, x):\n        raise NotImplementedError()\n"
    "RMSNorm().forward(1)",
    "answer = 1\nraise NotImplementedError()",              # a stub at a cell's top level
    "raise NotImplementedError('not a stub: it has a message')",
    "import numbers\nnumbers.Complex.__abs__(1)",   # a bare one, raised by a library
    "raise ValueError('x')",
]


def last_lines(monkeypatch, grading: str) -> list[str]:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    monkeypatch.setenv("TINYGPT_GRADING", grading)          # the kernel inherits it
    NotebookClient(nb, kernel_name="python3", allow_errors=True, timeout=120).execute()
    lines = []
    for cell in nb.cells[2:]:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert len(errors) == 1, (cell.source, cell.outputs)   # still an error: Run All stops
        lines.append(errors[0]["traceback"][-1])
    return lines


@pytest.mark.slow
def test_a_cell_stopped_by_an_unwritten_answer_names_it(monkeypatch):
    lines = last_lines(monkeypatch, "0")
    assert lines[0] == ("\nsoftmax() is not written yet: its answer cell still says `raise "
                        "NotImplementedError()`. Write it, run that cell, then run this one "
                        "again.")
    assert lines[1].startswith("\nRMSNorm.forward() is not written yet")
    assert lines[2].startswith("\nThis answer is not written yet: replace `raise")
    for line in lines[3:]:                                  # other errors: IPython's own
        assert "not written yet" not in line, line


@pytest.mark.slow
def test_graded_runs_keep_ipython_s_own_tracebacks(monkeypatch):
    assert not any("not written yet" in line for line in last_lines(monkeypatch, "1"))
