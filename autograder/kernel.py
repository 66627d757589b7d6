"""Run a notebook's cells in one Jupyter kernel, swapping answers for known mistakes.

This is how the mistakes corpus is proven quickly: one kernel walks the solution notebook top
to bottom, and at each test cell it first tries every recorded mistake for that exercise
(define the wrong answer, run the test cell, score it exactly as nbgrader would), then restores
the correct answer and runs the test cell for real. One kernel start per day instead of one
nbgrader run per mistake.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from jupyter_client.manager import KernelManager
from nbformat import NotebookNode
from nbformat.v4 import output_from_msg
from nbgrader.utils import determine_grade

from autograder.mistakes import Mistake
from autograder.notebooks import exercises, read
from autograder.preprocessors import graded_outputs
from autograder.settings import CELL_TIMEOUT_S

OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error")


class CellError(RuntimeError):
    """A cell that must run cleanly (not a test cell under a mistake) raised an error."""


MAX_OUTPUT_CHARS = 200_000  # per cell: a student printing gigabytes must not exhaust us
MAX_ERROR_CHARS = 20_000    # of one error's message, and of its traceback
# what no cell sends once it is over (a thread of its own may still print: stream and display
# messages are not suspect)
LATE_SUSPECTS = ("status", "execute_result", "error", "execute_input")
IDLE_SETTLE_S = 1.0  # an idle read before its cell's reply ends the cell after this quiet


class Kernel:
    """A Python kernel; `run(code)` returns the cell's nbformat outputs.

    `manager` defaults to a plain local kernel started in `cwd`; the grader passes a
    SandboxKernelManager. `run` never hangs: a cell past `timeout` seconds is interrupted, and a
    kernel that dies or ignores the interrupt ends with an error output and `self.dead` set.
    """

    def __init__(self, cwd: Path, timeout: float = CELL_TIMEOUT_S,
                 manager: KernelManager | None = None, log: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.timeout = timeout
        self.dead: str = ""  # why the kernel can no longer run cells, once it can't
        self.anomalies: list[str] = []  # messages that broke the protocol (see run); the
        #                                 caller reads and clears them
        self._finished: set[str] = set()   # ids of the cells run so far
        self.manager = manager or KernelManager(kernel_name="python3")
        self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        extra = {"env": env} if env is not None else {}
        self.manager.start_kernel(cwd=str(cwd), stdout=self._log, stderr=self._log, **extra)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float | None = None) -> list[NotebookNode]:
        """Run `code`; return its outputs. The cell is over at the first idle status for it
        (IOPub) read after its execute_reply (shell channel), which the kernel sends first: an
        idle alone can be forged by the cell's own code. (An idle read before the reply ends
        the cell once IOPub has been quiet for IDLE_SETTLE_S after the reply.) A reply with
        status error counts as a failure even when no error output came. What does not fit
        the protocol (more than one idle for a cell, messages for a cell already over) is noted
        in `self.anomalies` for the caller."""
        if self.dead:
            return [_error("CellNotRun", f"not run: {self.dead}")]
        timeout = self.timeout if timeout is None else timeout
        msg_id = self.client.execute(code, store_history=False, allow_stdin=False)
        outputs: list[NotebookNode] = []
        size, deadline, interrupted, truncated = 0, time.monotonic() + timeout, None, False
        reply, idles, last = None, 0, time.monotonic()
        while True:
            now = time.monotonic()
            if now > deadline and interrupted is None:
                self.manager.interrupt_kernel()
                interrupted = now
            if interrupted is not None and now > interrupted + 10:
                self.dead = f"the kernel ignored the interrupt after the {timeout:.0f} s limit"
                outputs.append(_error("CellTimeoutError", self.dead))
                break
            if reply is None:
                reply = self._reply(msg_id)
            try:
                msg = self.client.get_iopub_msg(timeout=0.05 if reply is None else 0.2)
            except queue.Empty:
                if not self.manager.is_alive():
                    self.dead = f"the kernel died ({self._exit_reason()})"
                    outputs.append(_error("DeadKernelError", self.dead))
                    break
                if reply is not None and idles and now - last > IDLE_SETTLE_S:
                    break   # its idle came just before the reply: nothing more is coming
                continue
            last = time.monotonic()
            parent = msg["parent_header"].get("msg_id")
            if parent != msg_id:
                if parent in self._finished and msg["msg_type"] in LATE_SUSPECTS:
                    self._note(f"a {msg['msg_type']} message arrived for a cell already over")
                continue
            kind = msg["msg_type"]
            if kind == "status" and msg["content"].get("execution_state") == "idle":
                idles += 1
                if idles > 1:
                    self._note("a status message said the kernel was idle while a cell ran")
                if reply is None:   # the kernel sends the reply before the idle
                    reply = self._reply(msg_id)
                if reply is not None:
                    break
                continue
            if kind in OUTPUT_TYPES:
                output = _capped(output_from_msg(msg))
                size += _size(output)
                if kind == "error" or size <= MAX_OUTPUT_CHARS:  # never drop an error
                    outputs.append(output)
                elif not truncated:
                    truncated = True
                    outputs.append(NotebookNode(output_type="stream", name="stdout",
                                                text="\n[output truncated by the grader]\n"))
                if kind == "error" and interrupted is not None:
                    outputs.append(_error("CellTimeoutError",
                                          f"the cell ran past the {timeout:.0f} s limit"))
        self._finished.add(msg_id)
        content = reply["content"] if reply is not None else {}
        if content.get("status") == "error" and not any(
                o.get("output_type") == "error" for o in outputs):
            outputs.append(_capped(NotebookNode(
                output_type="error", ename=str(content.get("ename", "Error")),
                evalue=str(content.get("evalue", "")),
                traceback=[str(t) for t in content.get("traceback", [])])))
        return outputs

    def _reply(self, msg_id: str) -> dict | None:
        """The execute_reply for `msg_id` if it has come (other shell messages are dropped)."""
        while True:
            try:
                msg = self.client.shell_channel.get_msg(timeout=0)
            except queue.Empty:
                return None
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg

    def _note(self, what: str) -> None:
        if what not in self.anomalies:
            self.anomalies.append(what)

    def evaluate(self, expression: str, timeout: float = 30.0) -> dict | None:
        """Evaluate `expression` through the execute request's user_expressions (IPython
        evaluates them without input transformers or cell hooks); returns the expression's
        reply ({"status", "data": {"text/plain": repr}, ...}) or None if none came."""
        if self.dead:
            return None
        msg_id = self.client.execute("", silent=True, store_history=False,
                                     user_expressions={"value": expression}, allow_stdin=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_shell_msg(timeout=0.2)
            except queue.Empty:
                if not self.manager.is_alive():
                    return None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"].get("user_expressions", {}).get("value")
        return None

    def _exit_reason(self) -> str:
        process = getattr(self.manager.provisioner, "process", None)
        code = process.poll() if process is not None else None
        if code is None:
            return "no exit status"
        if code < 0 or code > 128:
            number = -code if code < 0 else code - 128
            try:
                return f"killed by {signal.Signals(number).name}"
            except ValueError:
                return f"exit status {code}"
        return f"exit status {code}"

    def close(self) -> None:
        self.client.stop_channels()
        try:
            self.manager.shutdown_kernel(now=True)
        finally:
            if self._log is not subprocess.DEVNULL:
                self._log.close()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else \
        text[:limit] + f"\n[{len(text) - limit} more characters cut by the grader]"


def _capped(output: NotebookNode) -> NotebookNode:
    """An error output with its message and traceback cut to MAX_ERROR_CHARS each."""
    if output.get("output_type") == "error":
        output["evalue"] = _cut(str(output.get("evalue", "")), MAX_ERROR_CHARS)
        kept, left = [], MAX_ERROR_CHARS
        for line in output.get("traceback", []):
            if left <= 0:
                kept.append("[traceback cut by the grader]")
                break
            kept.append(_cut(str(line), left))
            left -= len(kept[-1])
        output["traceback"] = kept
    return output


def _size(output: NotebookNode) -> int:
    """Characters an output holds (text, data, and an error's message and traceback)."""
    return (len(str(output.get("text", ""))) + len(str(output.get("data", "")))
            + len(str(output.get("evalue", ""))) + sum(len(str(t)) for t in
                                                        output.get("traceback", [])))


def _error(name: str, message: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=name, evalue=message, traceback=[])


def score(test_cell: NotebookNode, outputs: list[NotebookNode]) -> float:
    """Points nbgrader would give `test_cell` with these outputs (after StderrToStdout)."""
    cell = NotebookNode(test_cell.copy())
    cell["outputs"] = graded_outputs(outputs)
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
    keeps: bool = False  # a later exercise run with an earlier one's mistake: must keep its points


def run_notebook_with_mistakes(path: Path, mistakes: list[Mistake]) -> list[Trial]:
    """Walk the notebook at `path`; return a Trial per (exercise, mistake) and per exercise.

    A mistake whose `keeps` names later exercises is also put in place at each of their test
    cells: those trials carry keeps=True (the exercise must keep full marks: one mistake, one
    charge). Raises CellError if a cell outside the trials fails: then the notebook itself is
    broken.
    """
    nb = read(path)
    by_test = {ex.test_index: ex for ex in exercises(nb)}
    known = {ex.grade_id for ex in by_test.values()}
    unknown = sorted(({m.grade_id for m in mistakes} | {g for m in mistakes for g in m.keeps})
                     - known)
    if unknown:
        raise ValueError(f"mistakes name exercises that {path.name} does not have: {unknown}; "
                         f"its exercises are {sorted(known)}")
    answers = {ex.grade_id: nb.cells[ex.answer_index].source for ex in by_test.values()}
    trials: list[Trial] = []
    # The kernel runs in grading mode, as the grader's does: ungraded measurements shrink.
    with Kernel(cwd=path.parent, env=grading_env()) as kernel:
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
                for mistake in (m for m in mistakes if exercise.grade_id in m.keeps):
                    kernel.run(mistake.code)
                    outputs = kernel.run(cell.source)
                    trials.append(Trial(exercise.grade_id, mistake, score(cell, outputs),
                                        exercise.points, error_text(outputs), keeps=True))
                    _must_run(kernel, answers[mistake.grade_id],
                              f"restoring answer {mistake.grade_id}")
                outputs = kernel.run(cell.source)
                trials.append(Trial(exercise.grade_id, None, score(cell, outputs),
                                    exercise.points, error_text(outputs)))
            else:
                _must_run(kernel, cell.source, f"cell {index} of {path.name}")
    return trials


def grading_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the notebooks' grading mode on
    (tinygpt.testing.grading() reads it)."""
    from tinygpt.testing import GRADING_VARIABLE

    return {**(os.environ if base is None else base), GRADING_VARIABLE: "1"}


def _must_run(kernel: Kernel, code: str, what: str) -> None:
    error = error_text(kernel.run(code))
    if error:
        raise CellError(f"{what} failed: {error}")
