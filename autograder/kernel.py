"""Run a notebook's cells in one Jupyter kernel, swapping answers for known mistakes.

This is how the mistakes corpus is proven quickly: one kernel walks the solution notebook top
to bottom, and at each test cell it first tries every recorded mistake for that exercise
(define the wrong answer, run the test cell, score it exactly as nbgrader would), then restores
the correct answer and runs the test cell for real. One kernel start per day instead of one
nbgrader run per mistake.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from pathlib import Path

from jupyter_client.manager import KernelManager
from nbformat import NotebookNode
from nbformat.v4 import output_from_msg
from nbgrader.utils import determine_grade

from autograder.mistakes import Mistake
from autograder.notebooks import exercises, read
from autograder.preprocessors import stderr_to_stdout
from autograder.settings import CELL_TIMEOUT_S

OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error")


class CellError(RuntimeError):
    """A cell that must run cleanly (not a test cell under a mistake) raised an error."""


class Kernel:
    """A Python kernel started in `cwd`; `run(code)` returns the cell's nbformat outputs."""

    def __init__(self, cwd: Path, timeout: float = CELL_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str) -> list[NotebookNode]:
        outputs: list[NotebookNode] = []

        def keep(msg: dict) -> None:
            if msg["msg_type"] in OUTPUT_TYPES:
                outputs.append(output_from_msg(msg))

        try:
            self.client.execute_interactive(code, output_hook=keep, timeout=self.timeout,
                                            store_history=False)
        except (TimeoutError, queue.Empty):
            self.manager.interrupt_kernel()
            outputs.append(NotebookNode(output_type="error", ename="CellTimeoutError",
                                        evalue=f"no reply within {self.timeout} s",
                                        traceback=[]))
        return outputs

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score(test_cell: NotebookNode, outputs: list[NotebookNode]) -> float:
    """Points nbgrader would give `test_cell` with these outputs (after StderrToStdout)."""
    cell = NotebookNode(test_cell.copy())
    cell["outputs"] = stderr_to_stdout(outputs)
    points, _ = determine_grade(cell)
    return float(points)


def error_text(outputs: list[NotebookNode]) -> str:
    """The last error of a cell as 'Name: message', or '' when it ran cleanly."""
    errors = [o for o in outputs if o.get("output_type") == "error"]
    return f"{errors[-1]['ename']}: {errors[-1]['evalue']}" if errors else ""


@dataclass(frozen=True)
class Trial:
    """One test-cell run: with the correct answer (mistake is None) or with a mistake."""

    grade_id: str
    mistake: Mistake | None
    score: float
    max_points: float
    error: str


def run_notebook_with_mistakes(path: Path, mistakes: list[Mistake]) -> list[Trial]:
    """Walk the notebook at `path`; return a Trial per (exercise, mistake) and per exercise.

    Raises CellError if a cell outside the trials fails: then the notebook itself is broken.
    """
    nb = read(path)
    by_test = {ex.test_index: ex for ex in exercises(nb)}
    known = {ex.grade_id for ex in by_test.values()}
    unknown = sorted({m.grade_id for m in mistakes} - known)
    if unknown:
        raise ValueError(f"mistakes name exercises that {path.name} does not have: {unknown}; "
                         f"its exercises are {sorted(known)}")
    trials: list[Trial] = []
    with Kernel(cwd=path.parent) as kernel:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            exercise = by_test.get(index)
            if exercise is not None:
                answer = nb.cells[exercise.answer_index].source
                for mistake in (m for m in mistakes if m.grade_id == exercise.grade_id):
                    kernel.run(mistake.code)
                    outputs = kernel.run(cell.source)
                    trials.append(Trial(exercise.grade_id, mistake, score(cell, outputs),
                                        exercise.points, error_text(outputs)))
                    _must_run(kernel, answer, f"restoring answer {exercise.grade_id}")
                outputs = kernel.run(cell.source)
                trials.append(Trial(exercise.grade_id, None, score(cell, outputs),
                                    exercise.points, error_text(outputs)))
            else:
                _must_run(kernel, cell.source, f"cell {index} of {path.name}")
    return trials


def _must_run(kernel: Kernel, code: str, what: str) -> None:
    error = error_text(kernel.run(code))
    if error:
        raise CellError(f"{what} failed: {error}")
