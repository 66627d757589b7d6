"""Grading with serving workers and kernels started ahead (autograder/warm.py, worker.py): every
student still gets a kernel of their own, a dead warm kernel is never charged to a student, a
killed student ends with one result and the next grades normally, and the grades are those of
the plain per-student process (`grade --cold`) on the mistakes corpus of day 01."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from autograder import mistakes
from autograder.grade import Limits, grade_day
from autograder.notebooks import nbgrader_meta, solution_path
from autograder.settings import REPO_ROOT
from autograder.warm import (
    KernelRecipe,
    KernelSupply,
    StudentKernel,
    process_tree_cpu_seconds,
    scratch_prefix,
)
from autograder.worker import ServingWorker

DAY = "day01_logits"
SANDBOX = shutil.which("bwrap") is not None   # sandboxed where CI has bubblewrap
# A cell a student adds: it reports whether anything of an earlier student is visible (a file
# in the working folder, a name in the namespace), then leaves both behind for the next one.
PROBE = ("import os\n"
         "print('PROBE', os.path.exists('left-by-a-student'), 'left_by_a_student' in dir(), "
         "os.getcwd())\n"
         "open('left-by-a-student', 'w').write('x')\n"
         "left_by_a_student = 1\n")


def _recipe(**kw) -> KernelRecipe:
    return KernelRecipe(REPO_ROOT / "course" / DAY, cell_timeout=30.0, sandbox=SANDBOX,
                        preload=("import math", "from tinygpt import testing"), **kw)


def _printed(kernel: StudentKernel, code: str) -> str:
    return "".join(o.get("text", "") for o in kernel.kernel.run(code)
                   if o.get("output_type") == "stream")


@pytest.mark.slow
def test_each_take_is_a_new_kernel_and_the_warm_up_leaves_no_trace():
    supply = KernelSupply(_recipe())
    supply.prepare()
    taken = []
    try:
        for _ in range(3):
            kernel = supply.take()
            assert kernel.warmed, "the kernel was not warmed ahead"
            out = _printed(kernel, PROBE + "print(sorted(k for k in get_ipython().user_ns "
                                           "if not k.startswith('_')))")
            assert "PROBE False False" in out, out        # nothing of the previous student
            # the preload imported modules but bound no name in the student's namespace
            assert "'math'" not in out and "'testing'" not in out, out
            assert "'tinygpt.testing'" in _printed(
                kernel, "import sys\nprint([m for m in sys.modules if m == 'tinygpt.testing'])")
            taken.append((kernel.pid(), kernel.scratch))
            kernel.close()
            assert not kernel.scratch.exists(), "a student's scratch folder outlived them"
            assert kernel.cpu_seconds > 0
    finally:
        supply.close()
    assert len({pid for pid, _ in taken}) == 3 and len({s for _, s in taken}) == 3, taken
    assert supply.handed_out == 3 and supply.replaced == 0


@pytest.mark.slow
def test_a_warm_kernel_that_died_is_replaced_before_its_student_comes():
    supply = KernelSupply(_recipe())
    supply.prepare()
    try:
        dead = supply._next.result()      # the kernel warmed for the next student
        os.kill(dead.pid(), signal.SIGKILL)   # bwrap (or the kernel): the kernel dies with it
        deadline = time.monotonic() + 20
        while dead.kernel.manager.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        kernel = supply.take()
        try:
            assert supply.replaced == 1
            assert kernel is not dead and kernel.pid() != dead.pid()
            assert "PROBE False False" in _printed(kernel, PROBE)   # a working, fresh kernel
        finally:
            kernel.close()
    finally:
        supply.close()


def test_process_tree_cpu_counts_children():
    start = process_tree_cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert process_tree_cpu_seconds(os.getpid()) >= start + 0.25
    assert process_tree_cpu_seconds(2**22 + 12345) == 0.0     # no such process


def _course(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    for folder in ("solutions", "course"):
        shutil.copytree(REPO_ROOT / folder / DAY, root / folder / DAY)
    return root


def _submit(root: Path, student: str, nb) -> None:
    folder = root / "submitted" / student / DAY
    folder.mkdir(parents=True)
    nbformat.write(nb, str(folder / f"{DAY}.ipynb"))


def _with(extra: str, after: str | None = "softmax"):
    """The solution with a cell `extra` added after the answer cell `after` (None: first)."""
    nb = nbformat.read(str(solution_path(DAY)), as_version=4)
    index = -1 if after is None else next(
        i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == after)
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(extra))
    return nb


def _limits(**kw) -> Limits:
    return Limits(**{"cell_timeout": 30.0, "total_timeout": 120.0, "memory_bytes": 3 * 2**30,
                     "sandbox": SANDBOX, **kw})


@pytest.mark.slow
def test_killed_students_get_one_result_and_the_next_grades_normally(tmp_path, monkeypatch):
    """One worker, three students in turn, the second killing its own kernel: every student
    ends with exactly one result; the others score full marks, each in a kernel warmed ahead
    that saw nothing of an earlier student. Then a job that overruns (its kernel ignores the
    interrupt): the grader kills the worker process, the student's result is `timeout`, and the
    next student is graded normally by a new worker."""
    from autograder import grade

    root = _course(tmp_path, "course")
    for student in ("a1", "a3"):
        _submit(root, student, _with(PROBE))
    _submit(root, "a2", _with("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"))
    results = grade_day(DAY, root=root, workers=1, force=True, limits=_limits(),
                        progress=False)
    assert [r.student for r in results] == ["a1", "a2", "a3"]
    by = {r.student: r for r in results}
    assert by["a2"].status == "crashed" and by["a2"].score < by["a2"].max_score, by["a2"]
    folders = set()
    for student in ("a1", "a3"):
        assert (by[student].status, by[student].score) == ("graded", by[student].max_score), \
            by[student]
        executed = nbformat.read(str(root / ".grading" / DAY / "workers" / student /
                                     "autograded" / student / DAY / f"{DAY}.ipynb"), 4)
        probe = next(o.text for c in executed.cells if c.cell_type == "code"
                     and c.source == PROBE for o in c.outputs if o.get("name") == "stdout")
        assert probe.startswith("PROBE False False"), (student, probe)
        folders.add(probe.split()[-1])
        report = json.loads((root / ".grading" / DAY / "workers" / student /
                             "report.json").read_text())
        assert report["warm_kernel"], (student, report)
    assert len(folders) == 2, folders       # two students, two working folders

    # the worker itself killed: a serving worker given a job that overruns, then another job
    work = tmp_path / "work"
    for student, extra in (("hang", "import time\ntime.sleep(60)"), ("next", "x = 1")):
        target = work / student / "submitted" / student / DAY
        target.mkdir(parents=True)
        nbformat.write(_with(extra, after=None), str(target / f"{DAY}.ipynb"))
        shutil.copy(root / ".grading" / DAY / "template" / "gradebook.db", work / student)
    cmd = [sys.executable, "-m", "autograder.worker", "serve", DAY,
           *grade._worker_options(_limits(), REPO_ROOT / "course" / DAY, None)]
    worker = ServingWorker(cmd, work / "worker.log")
    try:
        worker.wait_ready()
        first = worker.proc.pid
        # the trusted side's deadline (total time + grace) passes long before the kernel's own
        monkeypatch.setattr(grade, "WORKER_GRACE_S", 4.0)
        hang = grade._run_served(worker, work / "hang", DAY, "hang", _limits(total_timeout=1.0),
                                 more=True)
        assert hang[:2] == (None, "timeout") and "killed after the time limit" in hang[2], hang
        assert worker.proc.poll() is not None           # the worker process was killed
        assert not list(Path(tempfile.gettempdir()).glob(scratch_prefix(first) + "*"))
        monkeypatch.setattr(grade, "WORKER_GRACE_S", 120.0)
        nb, status, *_ = grade._run_served(worker, work / "next", DAY, "next", _limits(), False)
        assert status == "graded" and nb is not None
        assert worker.proc.pid != first and worker.started == 2
    finally:
        worker.close()


@pytest.mark.slow
def test_grades_equal_the_per_student_process_on_the_mistakes_corpus(tmp_path):
    """Day 01's whole mistakes corpus, packed into as few submissions as one mistake per
    exercise allows: graded by serving workers and by a process per student (`grade --cold`),
    every cell's score, every status and reason agree."""
    from nbgrader.api import Gradebook

    corpus = mistakes.for_day(DAY)
    by_exercise: dict[str, list] = {}
    for mistake in corpus:
        by_exercise.setdefault(mistake.grade_id, []).append(mistake)
    n = max(len(v) for v in by_exercise.values())
    grades = {}
    for name, warm in (("warm", True), ("cold", False)):
        root = _course(tmp_path, name)
        for i in range(n):
            nb = nbformat.read(str(solution_path(DAY)), as_version=4)
            for cell in nb.cells:
                wrong = by_exercise.get(nbgrader_meta(cell).get("grade_id"), [])
                if i < len(wrong):
                    cell.source = wrong[i].code
            _submit(root, f"mistakes{i}", nb)
        results = grade_day(DAY, root=root, workers=2, force=True, limits=_limits(warm=warm),
                            progress=False)
        cells = {}
        with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "tinygpt") as gb:
            for r in results:
                nb = gb.find_submission_notebook(DAY, DAY, r.student)
                cells[r.student] = sorted((g.name, float(g.score)) for g in nb.grades)
        grades[name] = ({r.student: (r.score, r.status, r.reason) for r in results}, cells,
                        {r.student: r.max_score for r in results})
    assert grades["warm"][:2] == grades["cold"][:2]
    totals, _, most = grades["warm"]
    assert len(totals) == n and all(status == "graded" for _, status, _ in totals.values())
    assert all(score < most[s] for s, (score, _, _) in totals.items()), totals  # not vacuous


def test_the_bench_names_the_slowest_cells_where_a_day_misses():
    from autograder.bench_grading import miss_reason

    quiet = {"seconds_per_submission": 6.4, "cpu_seconds_per_submission": 7.9, "cells_s": 5.8,
             "graded_cells_s": 3.1, "load_average_1min": 1.2,
             "slowest_cells": [{"cell": "cell 42", "kind": "ungraded", "seconds": 1.4},
                               {"cell": "finish_tests", "kind": "graded", "seconds": 0.9}]}
    reason = miss_reason(quiet)
    assert reason.startswith("6.4 s > 5 s (7.9 CPU s)"), reason
    assert "cells alone take 5.8 s (graded cells 3.1 s)" in reason
    assert "cell 42 (ungraded) 1.4 s, finish_tests (graded) 0.9 s" in reason
    assert "load average 1.2" in reason
