"""The execution step of grading, in a process of its own: one student, or many in turn.

    python -m autograder.worker ROOT DAY STUDENT [--cell-timeout S] [--total-timeout S]
                                [--memory BYTES] [--files DIR] [--guard FILE] [--no-sandbox]
    python -m autograder.worker serve DAY [the same options] [--preload FILE]

ROOT is a private scratch course folder holding submitted/STUDENT/DAY/DAY.ipynb (the staged
submission) and gradebook.db (a private copy with the assignment's test cells, hidden tests
included). nbgrader sanitizes the submission there (restoring every test cell from the private
gradebook), then SandboxExecute runs it. The result is ROOT/autograded/STUDENT/DAY/DAY.ipynb and
ROOT/report.json. The instructor's gradebook is never opened here.

The first form grades one student and exits (a kernel started for them on demand): the plain
path, kept as the reference the serving one is tested against (`grade --cold`). The second,
`serve`, is what `python -m autograder grade` starts, one per worker slot: it imports nbgrader
once, then reads one job per line on stdin ({"root", "student", "more"}) and grades them in
turn, exactly as the first form does (same nbgrader autograde call per student, same private
ROOT and gradebook copy), except that each student's kernel comes from a KernelSupply
(autograder/warm.py): started and warmed up while the previous student ran, still one new
kernel per student. After each job it writes one JSON line ({"student", "ok", "cpu_s"}) to its
original stdout; anything else the libraries print goes to stderr (the worker log).
`ServingWorker` is the trusted side's handle on such a process: it kills the process (and with
it the student's kernel) when a job overruns, and starts a new one for the next student.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autograder.sandbox import DEFAULT_MEMORY_BYTES

STARTUP_TIMEOUT_S = 300.0  # importing nbgrader on a busy machine: seconds, not minutes


def _parser(serve: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograder.worker" +
                                     (" serve" if serve else ""))
    if not serve:
        parser.add_argument("root", type=Path)
    parser.add_argument("day")
    if not serve:
        parser.add_argument("student")
    parser.add_argument("--cell-timeout", type=float, default=60.0)
    parser.add_argument("--total-timeout", type=float, default=600.0)
    parser.add_argument("--memory", type=int, default=DEFAULT_MEMORY_BYTES)
    parser.add_argument("--files", default="")
    parser.add_argument("--no-sandbox", action="store_true")
    parser.add_argument("--guard", type=Path, default=None,
                        help="a file with the integrity guard's spec (GuardSpec JSON)")
    if serve:
        parser.add_argument("--preload", type=Path, default=None,
                            help="a JSON list of import statements each warm kernel runs")
    return parser


def autograde_one(root: Path, day: str, student: str, args, executor) -> bool:
    """nbgrader's autograde of one staged submission in its private course folder `root`, with
    `executor` (SandboxExecute or a subclass) in place of nbgrader's Execute. False (and an
    error report in root/report.json) when nbgrader fails."""
    from autograder.grading import _api

    report = root / "report.json"
    api = _api(root, sandbox_execute=dict(
        executor=executor, cell_timeout=args.cell_timeout, total_timeout=args.total_timeout,
        memory_bytes=args.memory, sandbox=not args.no_sandbox, files_dir=args.files,
        report_path=str(report),
        **({"guard": args.guard.read_text()} if args.guard is not None else {})))
    result = api.autograde(day, student, force=True, create=True)
    if not result.get("success"):
        report.write_text(json.dumps({"status": "error", "reason": "nbgrader failed: " + str(
            result.get("error", "")).strip().splitlines()[-1][:300] if result.get("error")
            else "nbgrader failed"}))
        print(result.get("log", ""), result.get("error", ""), file=sys.stderr)
        return False
    return True


def serve(args) -> int:
    """The `serve` loop (see the module docstring)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # stray prints of nbgrader or a library: to the log, not into the replies

    from autograder.execute import SandboxExecute
    from autograder.settings import ensure_venv_on_path
    from autograder.warm import KernelRecipe, KernelSupply

    ensure_venv_on_path()
    preload = tuple(json.loads(args.preload.read_text())) if args.preload else ()
    supply = KernelSupply(KernelRecipe(Path(args.files) if args.files else None,
                                       args.cell_timeout, args.memory, not args.no_sandbox,
                                       preload))
    supply.prepare()          # the first student's kernel, while we wait for the first job
    executor = type("ServingSandboxExecute", (SandboxExecute,), {"kernels": supply})
    replies.write(json.dumps({"ready": True}) + "\n")
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            supply.expect_more = bool(job.get("more"))
            before = time.thread_time()
            ok = autograde_one(Path(job["root"]), args.day, job["student"], args, executor)
            replies.write(json.dumps({"student": job["student"], "ok": ok,
                                      "cpu_s": round(time.thread_time() - before, 3)}) + "\n")
    finally:
        supply.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(_parser(serve=True).parse_args(argv[1:]))
    args = _parser(serve=False).parse_args(argv)

    from autograder.execute import SandboxExecute
    from autograder.settings import ensure_venv_on_path

    ensure_venv_on_path()
    return 0 if autograde_one(args.root, args.day, args.student, args, SandboxExecute) else 1


class WorkerDied(RuntimeError):
    """The serving worker exited (or never said it was ready)."""


class ServingWorker:
    """The trusted side's handle on one `python -m autograder.worker serve` process.

    `grade(root, student, more, timeout)` sends one job and waits at most `timeout` seconds for
    its reply; it returns the reply (a dict), or None after killing the process when the time
    ran out. It raises WorkerDied when the process exited instead (the log tells why). A killed
    or dead process is replaced by a new one at the next `grade`.
    """

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd = cmd
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.started = 0          # processes started so far (1 unless one was killed or died)
        self._buffer = b""
        self._announced = False

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:     # a broken pipe to a process that is gone
                pass

    def _start(self) -> None:
        if self.proc is not None:       # a killed or dead one: let go of its pipes
            self._close_pipes()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, start_new_session=True,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.started += 1
        self._buffer = b""
        self._announced = False   # it has said {"ready": true}

    def start(self) -> None:
        """Start the process now (it imports nbgrader and warms its first kernel meanwhile)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()

    def _reply(self, timeout: float) -> dict | None:
        """The next JSON line from the process; None when `timeout` passed first."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.proc.wait()
                    raise WorkerDied(f"the worker exited (exit status {self.proc.returncode})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self) -> None:
        """Start the process if it is not running, and wait until it takes jobs."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if not self._announced:
            if self._reply(STARTUP_TIMEOUT_S) is None:
                self.kill()
                raise WorkerDied(f"the worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
            self._announced = True

    def grade(self, root: Path, student: str, more: bool, timeout: float) -> dict | None:
        self.wait_ready()
        try:
            self.proc.stdin.write((json.dumps({"root": str(root), "student": student,
                                               "more": more}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.proc.wait()
            raise WorkerDied(f"the worker exited (exit status {self.proc.returncode})") from None
        reply = self._reply(timeout)
        if reply is None:
            self.kill()
        return reply

    def kill(self) -> None:
        """Kill the process and its process group now (its kernels die with it: bubblewrap's
        --die-with-parent), and remove the scratch folders of its kernels."""
        from autograder.warm import scratch_prefix

        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            for left in Path(tempfile.gettempdir()).glob(scratch_prefix(self.proc.pid) + "*"):
                shutil.rmtree(left, ignore_errors=True)

    def close(self, timeout: float = 60.0) -> None:
        """End the process: its stdin closes, it shuts its warm kernel down and exits (killed
        if it has not after `timeout` seconds)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        self._close_pipes()


if __name__ == "__main__":
    sys.exit(main())
