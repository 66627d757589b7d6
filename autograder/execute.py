"""Executing a sanitized submission in the sandbox: the one untrusted step of grading.

`SandboxExecute` takes the place of nbgrader's `Execute` preprocessor. It runs the notebook's
code cells one by one in a sandboxed kernel (autograder/sandbox.py) with a per-cell timeout,
a total time limit and a memory limit, and, once the kernel has started, never raises: a cell
that hangs, a kernel that dies or a limit that is hit becomes an error output on the cells
concerned (so nbgrader scores them zero) plus a status and a reason in the report file the
trusted side reads. A kernel that fails to start raises.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Bool, Float, Integer, Unicode

from autograder.guard import (
    GUARD_FORGET,
    GuardSpec,
    guard_challenge,
    guard_expression,
    guard_install_code,
    read_guard_reply,
)
from autograder.integrity import Evidence
from autograder.kernel import Kernel, _error, error_text, grading_env
from autograder.notebooks import is_answer, is_test, nbgrader_meta
from autograder.sandbox import DEFAULT_MEMORY_BYTES, SandboxKernelManager, SandboxPolicy
from autograder.warm import KernelRecipe, KernelSupply, StudentKernel

BLOCKED_HINTS = ("Network is unreachable", "Connection refused", "Read-only file system",
                 "Permission denied",
                 "/solutions", "gradebook")


def _label(cell, index: int) -> str:
    return nbgrader_meta(cell).get("grade_id") or f"cell {index}"


def _add(evidence: list[Evidence], found: list[Evidence]) -> None:
    """Append the findings of `found` that `evidence` does not hold yet."""
    for item in found:
        if (item.kind, item.detail) not in {(e.kind, e.detail) for e in evidence}:
            evidence.append(item)


def execute_cells(nb, scratch: Path, *, cell_timeout: float, total_timeout: float,
                  memory_bytes: int = DEFAULT_MEMORY_BYTES, sandbox: bool = True,
                  guard: GuardSpec | None = None, kernel: Kernel | None = None) -> dict:
    """Run `nb`'s code cells in place (outputs filled in); return {"status", "reason",
    "warnings", "evidence"}.

    status: "graded" (ran to the end; failing tests are just failing tests), "timeout",
    "crashed" (the kernel died), "memory-limit" or "blocked" (the sandbox refused something).
    reason: what made the status; warnings: errors in ungraded cells that did not (the tests
    that depend on them fail on their own). An ungraded cell the grader stopped (a timeout, a
    dead kernel, the memory limit) is named as such in the reason ("stopped_cell"), and the
    errors of later ungraded cells are folded into it as follow-on errors: they are the
    grader's limit, not the student's mistakes. "cell_seconds": [label, seconds, "graded" or
    "ungraded"] of every cell run (graded: answer and test cells), for the grading benchmark.
    guard: when given, the integrity guard (autograder/guard.py) is installed before the
    first cell and, before every test cell, restores what student code changed (and after it,
    drops the test's source from the kernel's linecache); "evidence" lists what it found (dicts
    of Evidence), and any kernel messages that broke the protocol (Kernel.anomalies: a forged
    idle status, output for a cell already over) as "forged-messages".
    kernel: this student's kernel, already started in `scratch` (autograder/warm.py; the caller
    closes it); by default one is started here (sandboxed unless `sandbox` is False) and closed.
    """
    if kernel is None:
        manager = SandboxKernelManager(SandboxPolicy(scratch, memory_bytes)) if sandbox else None
        # Grading mode (tinygpt.testing.grading): the sandbox sets it in its clean environment;
        # an unsandboxed kernel gets it here.
        with Kernel(scratch, timeout=cell_timeout, manager=manager,
                    env=None if manager is not None else grading_env()) as started:
            return execute_cells(nb, scratch, cell_timeout=cell_timeout,
                                 total_timeout=total_timeout, guard=guard, kernel=started)
    start, problems, status = time.monotonic(), [], "graded"
    evidence: list[Evidence] = []
    warnings: list[str] = []
    stopped = ""      # an ungraded cell the grader stopped (timeout, crash, memory): its label
    follow_on = 0     # errors of later ungraded cells after it (missing names, dead kernel ...)
    timings: list[list] = []   # [label, seconds, "graded" or "ungraded"] per cell run
    if guard is not None:
        failed = error_text(kernel.run(guard_install_code(guard)))
        if failed:
            problems.append(f"integrity guard not installed: {failed[:160]}")
            guard = None
    count = 0
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if guard is not None and is_test(cell) and not kernel.dead:
            challenge = guard_challenge()
            _add(evidence, read_guard_reply(guard, kernel.evaluate(guard_expression(challenge)),
                                            _label(cell, index), challenge))
        remaining = total_timeout - (time.monotonic() - start)
        if remaining <= 0:
            cell.outputs = [_error("CellNotRun", f"not run: the total time limit of "
                                                 f"{total_timeout:.0f} s was reached")]
            status = "timeout"
            continue
        count += 1
        began = time.monotonic()
        cell.outputs = kernel.run(cell.source, timeout=min(cell_timeout, remaining))
        cell.execution_count = count
        if guard is not None and is_test(cell) and not kernel.dead:
            kernel.evaluate(GUARD_FORGET)   # the test's source leaves the kernel's linecache
        _add(evidence, [Evidence("forged-messages", _label(cell, index), what)
                        for what in kernel.anomalies])
        kernel.anomalies.clear()
        timings.append([_label(cell, index), round(time.monotonic() - began, 3),
                        "graded" if is_test(cell) or is_answer(cell) else "ungraded"])
        for out in cell.outputs:
            if out.get("output_type") != "error" or out.get("ename") in (
                    "CellNotRun", "NotImplementedError"):  # not run / not answered yet
                continue
            text = f"{out.get('ename')}: {str(out.get('evalue') or '')[:160]}"
            if stopped and not is_test(cell):
                follow_on += 1          # a consequence of the stopped cell, not a new fault
                continue
            before = status
            if out.get("ename") == "CellTimeoutError":
                status = "timeout"
            elif out.get("ename") == "DeadKernelError":
                status = "crashed"
            elif out.get("ename") == "MemoryError" and status == "graded":
                status = "memory-limit"
            elif any(h in text for h in BLOCKED_HINTS) and status == "graded":
                status = "blocked"
            grader_stop = out.get("ename") in ("CellTimeoutError", "DeadKernelError",
                                               "MemoryError")
            if status != before and grader_stop and not is_test(cell) \
                    and not is_answer(cell):
                stopped = _label(cell, index)
                problems.append(f"{stopped} (not a graded cell) was stopped by the grader: "
                                f"{text}")
            elif status != before or status != "graded":
                problems.append(f"{_label(cell, index)}: {text}")
            elif not is_test(cell):     # an error outside the tests: not why it scored
                warnings.append(f"{_label(cell, index)}: {text}")
    if kernel.dead and status == "graded":
        status = "crashed"
    if follow_on:
        problems.append(f"{follow_on} later ungraded cell{'s' if follow_on > 1 else ''} failed "
                        f"after {stopped} was stopped (follow-on errors, folded into it)")
    if status == "timeout" and not any("time limit" in p or "Timeout" in p for p in problems):
        problems.append(f"total time limit of {total_timeout:.0f} s reached")
    reason = "; ".join(dict.fromkeys(problems))  # distinct, in order
    return {"status": status, "reason": reason[:1000],
            "warnings": "; ".join(dict.fromkeys(warnings))[:1000],
            "evidence": [dataclasses.asdict(e) for e in evidence], "stopped_cell": stopped,
            "cell_seconds": timings}


class SandboxExecute(NbGraderPreprocessor):
    """nbgrader preprocessor: run the notebook in the sandbox; write a JSON report."""

    cell_timeout = Float(60.0, help="seconds one cell may run").tag(config=True)
    total_timeout = Float(600.0, help="seconds the whole notebook may run").tag(config=True)
    memory_bytes = Integer(DEFAULT_MEMORY_BYTES, help="address-space limit").tag(config=True)
    sandbox = Bool(True, help="run the kernel in bubblewrap (off only for trusted code)").tag(
        config=True)
    files_dir = Unicode("", help="folder whose non-notebook files the kernel gets").tag(
        config=True)
    report_path = Unicode("", help="where to write the JSON report").tag(config=True)
    guard = Unicode("", help="integrity guard spec (GuardSpec JSON); empty: no guard").tag(
        config=True)

    #: Where this student's kernel comes from: set by a serving worker (autograder/worker.py) on
    #: a subclass, for its whole life; None: a kernel is started for the student on the spot.
    kernels: KernelSupply | None = None

    def recipe(self) -> KernelRecipe:
        return KernelRecipe(Path(self.files_dir) if self.files_dir else None,
                            self.cell_timeout, self.memory_bytes, self.sandbox)

    def preprocess(self, nb, resources):
        kernel = self.kernels.take() if self.kernels is not None else StudentKernel(self.recipe())
        try:
            report = execute_cells(nb, kernel.scratch, cell_timeout=self.cell_timeout,
                                   total_timeout=self.total_timeout,
                                   guard=GuardSpec.from_json(self.guard) if self.guard
                                   else None, kernel=kernel.kernel)
        finally:
            kernel.close()
        report["kernel_cpu_s"] = round(kernel.cpu_seconds, 3)
        report["warm_kernel"] = kernel.warmed
        if self.report_path:
            Path(self.report_path).write_text(json.dumps(report))
        return nb, resources


def in_autograde(config, executor: type[SandboxExecute] = SandboxExecute, **traits) -> None:
    """Make `config`'s nbgrader autograde run `executor` where nbgrader runs Execute, with
    `traits` (cell_timeout, total_timeout, memory_bytes, sandbox, files_dir, report_path,
    guard) set on it: how the grader's workers (autograder/worker.py) and the grading proofs
    run a submission."""
    from autograder.settings import autograde_preprocessors

    config.Autograde.autograde_preprocessors = [
        executor if pp.__name__ == "Execute" else pp for pp in autograde_preprocessors()]
    for name, value in traits.items():
        if not SandboxExecute.class_traits(config=True).get(name):
            raise ValueError(f"SandboxExecute has no setting {name!r}")
        setattr(config.SandboxExecute, name, value)
