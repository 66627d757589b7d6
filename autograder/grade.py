"""Grade every pending submission of one day: the instructor's `python -m autograder grade`.

Three steps, so that untrusted code runs in parallel while the gradebook stays consistent:

1. stage (trusted, here): repair each submission against the released notebook
   (autograder/staging.py); a missing or unreadable submission gets a zero notebook at once;
2. execute (untrusted, in parallel): per student, a private scratch course with a private copy
   of the assignment's gradebook; nbgrader restores the test cells (hidden tests included) and
   SandboxExecute runs the notebook in bubblewrap with per-cell and total time limits and a
   memory limit, in a kernel of the student's own. `--workers` serving worker processes
   (`python -m autograder.worker serve`) take the students in turn; each imports nbgrader once
   and starts the next student's kernel while the current one runs (autograder/warm.py), so a
   submission costs about its own cells' time. A worker that overruns is killed, with its
   kernels, and replaced. `--cold`: one worker process per student instead, each starting its
   kernel on demand (the plain path the default is tested against);
3. record (trusted, here, one student at a time, as soon as each one's execution ends):
   nbgrader's own SaveAutoGrades scores the executed notebook into the instructor's gradebook
   (SQLite by default, or --db).

One run at a time per course folder (grading_lock): a second `grade` while one runs is refused
before it touches anything, since both would write the same gradebook and work folders.

A submission that makes staging or the static scan fail (any exception) ends as `error` with
the reason; the others are graded as usual.

Every student ends with exactly one submission in the gradebook and one line in the summary:
student, score, max, status (graded / repaired / flagged / timeout / crashed / memory-limit /
blocked / missing / invalid / error / unchanged) and the reason. `flagged`: the submission ran,
but showed signs of tampering with the tests (autograder/integrity.py); the evidence is in the
result, the summary and the feedback, for manual review.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from autograder.grading import GradingError, _api, _check, generate_release
from autograder.guard import guard_spec
from autograder.integrity import FLAGGED, Evidence, scan_submission, summarize
from autograder.kernel import _error
from autograder.notebooks import is_test, read, solution_path
from autograder.preflight import check_imports, import_statements
from autograder.preprocessors import StderrToStdout
from autograder.sandbox import DEFAULT_MEMORY_BYTES
from autograder.settings import RELEASE_DIR, REPO_ROOT, ensure_venv_on_path
from autograder.staging import Staged, stage
from autograder.worker import ServingWorker, WorkerDied

RECORD_FILE = ".tinygpt-grading.json"  # in autograded/<student>/<day>/: what was graded, how
# A student's execution step may take this long past the notebook's total time limit (nbgrader's
# own steps, a kernel that ignores its interrupt) before its worker process is killed.
WORKER_GRACE_S = 120.0


class GradingBusy(GradingError):
    """Another `grade` run holds the course folder: this one was refused before touching
    anything."""


@contextlib.contextmanager
def grading_lock(root: Path, day: str):
    """Hold an exclusive lock on the course folder `root` for one grade run of `day`, or raise
    GradingBusy naming the run that holds it. One run per course folder, not per day: runs
    share its gradebook (two days graded at once still race there, both adding the same new
    student) and, with different --db, its work folders .grading/<day>. The lock is an flock
    on .grading/grade.lock, so a run that dies releases it with its process."""
    folder = root / ".grading"
    folder.mkdir(exist_ok=True)
    with open(folder / "grade.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().split()
            who = f"grade of {holder[1]} is running (pid {holder[0]})" if len(holder) == 2 \
                else "grade is running"
            raise GradingBusy(f"another {who} in {root}; wait for it to finish (nothing was "
                              "graded)") from None
        handle.truncate(0)   # "a+": the write below lands at the end, now the start
        handle.write(f"{os.getpid()} {day}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class Result:
    student: str
    score: float
    max_score: float
    status: str
    reason: str
    evidence: str = ""  # signs of tampering found (autograder/integrity.py), for review
    warnings: str = ""  # errors in ungraded cells: worth a look, but not why the status is what
    #                     it is (a failing test cell is just a failing test)
    seconds: float = 0.0  # wall time of this submission's execution step (its job in a worker)
    cpu_seconds: float = 0.0  # CPU time (user + system) the worker spent on it, plus its
    #                           kernel's processes over their whole life (warm-up included)


@dataclass
class Limits:
    cell_timeout: float = 60.0
    total_timeout: float = 600.0
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    sandbox: bool = True
    integrity: bool = True  # the guard and the static scan (off only to measure their cost)
    warm: bool = True  # serving workers with kernels started ahead (autograder/warm.py); off:
    #                    a process per student starting its kernel on demand (`grade --cold`)


def fingerprint(folder: Path) -> str:
    """A hash of everything a student submitted for a day (names and contents)."""
    digest = hashlib.sha256()
    if folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(folder)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def zero_notebook(template, status: str, reason: str):
    """`template` with every test cell failing: how a submission we cannot run is scored."""
    nb = nbformat.from_dict(json.loads(json.dumps(template)))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [_error("NotGraded", f"{status}: {reason}")] if is_test(cell) else []
    return nb


def students_for(day: str, root: Path, api) -> list[str]:
    """Everyone with a submission folder for `day` plus everyone in the gradebook."""
    from nbgrader.api import Gradebook

    found = {p.parent.name for p in (root / "submitted").glob(f"*/{day}") if p.is_dir()}
    url = api.coursedir.db_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return sorted(found)    # no gradebook yet, so nobody in it (opening one would make it)
    with Gradebook(url, api.coursedir.course_id) as gb:
        found |= {s.id for s in gb.students}
    return sorted(found)


def _wait_with_usage(proc: subprocess.Popen, timeout: float) -> float | None:
    """Wait for `proc` (at most `timeout` s); return the CPU seconds (user + system) it and the
    children it waited for used, or None when it is still running."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _worker_options(limits: Limits, files: Path, guard: Path | None) -> list[str]:
    """The options both forms of `python -m autograder.worker` take."""
    options = ["--cell-timeout", str(limits.cell_timeout), "--total-timeout",
               str(limits.total_timeout), "--memory", str(limits.memory_bytes), "--files",
               str(files)]
    if guard is not None:
        options += ["--guard", str(guard)]
    if not limits.sandbox:
        options.append("--no-sandbox")
    return options


def _outcome(work: Path, day: str, student: str, ok: bool, seconds: tuple[float, float],
             log: Path) -> tuple:
    """What one student's execution step left in `work`: (notebook or None, status, reason,
    runtime evidence as a list of Evidence, warnings, (wall seconds, CPU seconds)); the CPU
    seconds of the worker are `seconds[1]`, its kernel's are added from the report."""
    executed = work / "autograded" / student / day / f"{day}.ipynb"
    report_path = work / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    seconds = (seconds[0], seconds[1] + float(report.get("kernel_cpu_s", 0.0)))
    evidence = [Evidence(**e) for e in report.get("evidence", [])]
    if not ok or not executed.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        return (None, "error", report.get("reason") or f"grader error: {' '.join(tail)[:300]}",
                evidence, report.get("warnings", ""), seconds)
    return (read(executed), report.get("status", "graded"), report.get("reason", ""), evidence,
            report.get("warnings", ""), seconds)


def _killed(limits: Limits, seconds: float) -> tuple:
    return (None, "timeout", f"killed after the time limit ({limits.total_timeout:.0f} s)", [],
            "", (seconds, 0.0))


def _run_worker(work: Path, day: str, student: str, limits: Limits, files: Path,
                guard: Path | None = None) -> tuple:
    """The plain path (`grade --cold`): execute one student's notebook in a process of its own
    that starts a kernel on demand; returns what _outcome does."""
    cmd = [sys.executable, "-m", "autograder.worker", str(work), day, student,
           *_worker_options(limits, files, guard)]
    started = time.monotonic()
    log_path = work / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        cpu = _wait_with_usage(proc, limits.total_timeout + WORKER_GRACE_S)
        if cpu is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return _killed(limits, time.monotonic() - started)
    return _outcome(work, day, student, proc.returncode == 0,
                    (time.monotonic() - started, cpu), log_path)


def _run_served(worker: ServingWorker, work: Path, day: str, student: str, limits: Limits,
                more: bool) -> tuple:
    """Execute one student's notebook in a serving worker (autograder/worker.py), whose kernel
    for this student was started while the previous one ran; returns what _outcome does. A job
    past the time limit kills the worker (the next student gets a new one). The seconds count
    from the moment the worker takes the job (not its own start: one per run, not per student).
    """
    started = time.monotonic()
    try:
        worker.wait_ready()
        started = time.monotonic()
        reply = worker.grade(work, student, more, limits.total_timeout + WORKER_GRACE_S)
    except WorkerDied as err:
        tail = worker.log.read_text(errors="replace").strip().splitlines()[-1:] \
            if worker.log.exists() else []
        return (None, "error", f"grader error: {err}: {' '.join(tail)[:300]}", [], "",
                (time.monotonic() - started, 0.0))
    if reply is None:
        return _killed(limits, time.monotonic() - started)
    return _outcome(work, day, student, bool(reply.get("ok")),
                    (time.monotonic() - started, float(reply.get("cpu_s", 0.0))), worker.log)


def grade_day(day: str, *, root: Path = REPO_ROOT, db_url: str | None = None,
              students: list[str] | None = None, workers: int | None = None,
              force: bool = False, limits: Limits | None = None,
              progress: bool = True) -> list[Result]:
    """Grade `day` for `students` (default: everyone, see students_for); see module docstring.
    workers: parallel students, >= 1 (default None: the core count)."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"workers must be an int >= 1 or None, got {workers!r}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (or None: the core count), got {workers}")
    ensure_venv_on_path()
    root = Path(root).resolve()
    api = _api(root, db_url)
    with grading_lock(root, day):
        return _grade_locked(day, root, api, db_url, students, workers, force,
                             limits or Limits(), progress)


def _grade_locked(day: str, root: Path, api, db_url: str | None, students: list[str] | None,
                  workers: int | None, force: bool, limits: Limits,
                  progress: bool) -> list[Result]:
    """grade_day's work, the course folder's lock held: the work folder .grading/<day> is this
    run's alone."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        try:
            gb.find_assignment(day)
        except MissingEntry:
            _check(api.generate_assignment(day, force=True, create=True),
                   f"generate_assignment {day}")
    students = students if students is not None else students_for(day, root, api)

    work = root / ".grading" / day
    shutil.rmtree(work, ignore_errors=True)
    template = generate_release(day, work / "template", source_root=root)
    release_nb = read(template)
    source_nb = read(solution_path(day, root))
    files = root / RELEASE_DIR / day
    spec = guard_spec(release_nb) if limits.integrity else None   # autograder/guard.py
    guard = work / "guard.json" if spec is not None else None
    if guard is not None:
        guard.write_text(spec.to_json())

    results: dict[str, Result] = {}
    outcomes: dict[str, tuple] = {}  # student -> (notebook, status, reason, evidence, warnings,
    #                                  seconds)
    jobs: dict[str, tuple] = {}
    for student in students:
        folder = root / "submitted" / student / day
        record = root / "autograded" / student / day / RECORD_FILE
        print_ = fingerprint(folder)
        if not force and record.exists():
            previous = json.loads(record.read_text())
            if previous.get("fingerprint") == print_:
                results[student] = Result(student, previous["score"], previous["max_score"],
                                          "unchanged", previous["status"])
                continue
        try:
            job = _prepare(student, folder, day, work, release_nb, source_nb, limits)
        except Exception as err:  # noqa: BLE001 (one student's submission stays theirs)
            shutil.rmtree(work / "workers" / student, ignore_errors=True)
            reason = f"grader error while preparing the submission: {type(err).__name__}: " \
                     f"{str(err)[:200]}"
            outcomes[student] = (zero_notebook(release_nb, "error", reason), "error", reason,
                                 [], "", (0.0, 0.0))
            continue
        if isinstance(job, Staged):   # nothing to run
            notes = "; ".join(job.notes)
            outcomes[student] = (zero_notebook(release_nb, job.status, notes), job.status,
                                 notes, [], "", (0.0, 0.0))
        else:
            jobs[student] = job

    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
    serving: queue.Queue[ServingWorker] = queue.Queue()
    if limits.warm and jobs:
        # One serving worker per slot, started now: it imports nbgrader and warms its first
        # kernel (imports only, no student code) while the preflight below runs.
        preload = work / "preload.json"
        preload.write_text(json.dumps(import_statements(release_nb) + [
            f"import {m}" for m in (spec.modules if spec is not None else ())]))
        cmd = [sys.executable, "-m", "autograder.worker", "serve", day,
               *_worker_options(limits, files, guard), "--preload", str(preload)]
        for slot in range(workers):
            worker = ServingWorker(cmd, work / f"worker-{slot}.log")
            worker.start()
            serving.put(worker)
    try:
        # Before anyone is graded: the kernel must import what the notebook imports (a broken
        # environment would score the whole class 0 with status `graded`). Raises
        # PreflightError.
        check_imports(release_nb, files=files, sandbox=limits.sandbox,
                      memory_bytes=limits.memory_bytes)
        record = recorder(day, root, db_url, work)
        _execute(jobs, day, limits, files, guard, serving, workers, progress,
                 lambda student, outcome: results.__setitem__(student, record(student, outcome)))
    finally:
        while not serving.empty():
            serving.get().close()

    record_grades(day, root, db_url, work, outcomes, results)
    return [results[s] for s in students]


def _prepare(student: str, folder: Path, day: str, work: Path, release_nb, source_nb,
             limits: Limits) -> tuple | Staged:
    """Stage one student's submission and lay out their private scratch course; returns the
    job (scratch root, Staged, notes, static evidence), or the Staged when there is nothing to
    run (missing or invalid)."""
    staged = stage(release_nb, folder, day)
    if staged.notebook is None:
        return staged
    wroot = work / "workers" / student
    target = wroot / "submitted" / student / day
    target.mkdir(parents=True)
    nbformat.write(staged.notebook, str(target / f"{day}.ipynb"))
    if (folder / "timestamp.txt").exists():
        shutil.copy(folder / "timestamp.txt", target / "timestamp.txt")
    shutil.copy(work / "template" / "gradebook.db", wroot / "gradebook.db")
    evidence = [Evidence("tampered-metadata", "the notebook", what) for what in staged.tampered]
    return (wroot, staged, "; ".join(staged.notes), evidence + (scan_submission(
        release_nb, staged.notebook, source_nb) if limits.integrity else []))


def _execute(jobs: dict, day: str, limits: Limits, files: Path, guard: Path | None,
             serving: queue.Queue, workers: int, progress: bool,
             done_with: Callable[[str, tuple], None]) -> None:
    """Step 2 for every job, `workers` at a time: in a serving worker taken from `serving`
    (each grades its students in turn), or with limits.warm off in a process per student.
    Each student's outcome (notebook, status, reason, evidence, warnings, seconds) goes to
    `done_with` as soon as they are done (it records them: no executed notebook waits in
    memory for the others)."""
    left = [len(jobs)]
    lock = threading.Lock()

    def run(student: str) -> tuple:
        wroot = jobs[student][0]
        if not limits.warm:
            return _run_worker(wroot, day, student, limits, files, guard)
        worker = serving.get()
        try:
            with lock:
                left[0] -= 1
                more = left[0] > 0     # another student is waiting: warm a kernel for them
            return _run_served(worker, wroot, day, student, limits, more)
        finally:
            serving.put(worker)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run, student): student for student in jobs}
        done = as_completed(futures)
        if progress and futures:
            from tqdm import tqdm

            done = tqdm(done, total=len(futures), desc=f"grading {day}", unit="student",
                        file=sys.stderr)
        for future in done:
            student = futures[future]
            _, staged, notes, evidence = jobs[student]
            try:
                nb, status, reason, found, warnings, seconds = future.result()
            except Exception as err:  # noqa: BLE001 (one student's failure stays theirs)
                nb, status, reason = None, "error", f"grader error: {type(err).__name__}: {err}"
                found, warnings, seconds = [], "", (0.0, 0.0)
            evidence = evidence + found
            if status == "graded" and staged.status == "repaired":
                status = "repaired"
            reason = "; ".join(r for r in (notes, reason) if r)
            if nb is None:
                nb = zero_notebook(staged.notebook, status, reason)
            if evidence and status in ("graded", "repaired"):
                status = FLAGGED
            done_with(student, (nb, status, reason, evidence, warnings, seconds))


def record_grades(day: str, root: Path, db_url: str | None, work: Path, outcomes: dict,
                  results: dict) -> None:
    """Step 3 for the students in `outcomes` (student -> outcome, see recorder)."""
    if outcomes:
        record = recorder(day, root, db_url, work)
        for student, outcome in outcomes.items():
            results[student] = record(student, outcome)


def recorder(day: str, root: Path, db_url: str | None, work: Path) -> Callable[[str, tuple],
                                                                               Result]:
    """Step 3: a function that scores one student's executed notebook into the instructor's
    gradebook with nbgrader, writes their record file and returns their Result; its outcome is
    (notebook, status, reason, evidence, warnings, (wall seconds, CPU seconds))."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.preprocessors import (
        AssignLatePenalties,
        CheckCellMetadata,
        LimitOutput,
        SaveAutoGrades,
    )

    from autograder.settings import nbgrader_config

    executed_dir = work / "executed"
    config = nbgrader_config(root, db_url)
    config.CourseDirectory.submitted_directory = str(executed_dir.relative_to(root))
    config.Autograde.sanitize_preprocessors = []
    config.Autograde.autograde_preprocessors = [StderrToStdout, LimitOutput, SaveAutoGrades,
                                                AssignLatePenalties, CheckCellMetadata]
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)

    def record(student: str, outcome: tuple) -> Result:
        nb, status, reason, evidence, warnings, seconds = outcome
        target = executed_dir / student / day
        target.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target / f"{day}.ipynb"))
        stamp = root / "submitted" / student / day / "timestamp.txt"
        if stamp.exists():
            shutil.copy(stamp, target / "timestamp.txt")
        result = api.autograde(day, student, force=True, create=True)
        if not result.get("success"):
            # nbgrader could not take this notebook: record a zero rather than lose the student
            nbformat.write(zero_notebook(read(work / "template" / RELEASE_DIR / day /
                                              f"{day}.ipynb"), "error", "could not be recorded"),
                           str(target / f"{day}.ipynb"))
            status, reason = "error", (reason + "; " if reason else "") + "nbgrader could not " \
                "record the executed notebook; scored zero"
            retry = api.autograde(day, student, force=True, create=True)
            if not retry.get("success"):
                raise GradingError(f"cannot record a grade for {student}: {retry.get('error')}")
        with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
            submission = gb.find_submission(day, student)
            score, max_score = float(submission.score), float(submission.max_score)
        graded = Result(student, score, max_score, status, reason,
                        summarize(evidence) if evidence else "", warnings,
                        round(seconds[0], 2), round(seconds[1], 2))
        path = root / "autograded" / student / day / RECORD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": fingerprint(root / "submitted" / student
                                                               / day), **asdict(graded)}))
        return graded

    return record


def summary_table(results: list[Result], exercise_rows: list[tuple] | None = None,
                  day: str | None = None) -> str:
    """The results as an aligned text table. With `exercise_rows` (reports.exercise_scores)
    and `day`: a column per exercise of that day, between the status and the reason."""
    exercises: list[str] = []
    scores: dict[tuple[str, str], float] = {}
    for student, d, exercise, score, _ in exercise_rows or []:
        if d == day:
            exercises += [exercise] if exercise not in exercises else []
            scores[(student, exercise)] = score
    rows = [("student", "score", "max", "status", *exercises, "reason")]
    rows += [(r.student, f"{r.score:g}", f"{r.max_score:g}", r.status,
              *[f"{scores.get((r.student, e), 0.0):g}" for e in exercises], "; ".join(
                  t for t in (r.reason[:100], f"warnings: {r.warnings[:100]}" if r.warnings
                              else "", f"evidence: {r.evidence[:200]}" if r.evidence else "")
                  if t)) for r in results]
    last = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(last)]
    lines = ["  ".join(cell.ljust(widths[i]) if i < last else cell
                       for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    return "\n".join(line.rstrip() for line in lines)
