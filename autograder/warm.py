"""One fresh sandboxed kernel per student, started before that student's turn comes.

Starting a grading kernel costs seconds that have nothing to do with the student: bubblewrap
sets up the sandbox, IPython starts, and the notebook's first cell imports torch, numpy and
tinygpt. A serving worker (autograder/worker.py) grades its students one after another, so
while one student's notebook runs, `KernelSupply` starts the kernel of the NEXT student in the
background and has it import the modules the day's notebook imports (the preflight's list,
autograder/preflight.py, plus the integrity guard's modules). When that student's turn comes
the kernel is ready, and the time the student waits is the time of their own cells.

What this does not change:
- every student gets their own kernel in their own new scratch folder, with the same sandbox,
  memory limit and environment as before; a kernel is handed out once (`take`) and closed after
  that one student, never reused;
- pre-importing runs no student code: it is the grader importing installed packages into
  `sys.modules` (`exec` of each import statement in a throwaway namespace, through
  `user_expressions`, so nothing is added to the student's namespace or input history). The
  integrity guard is installed after `take`, before the student's first cell, exactly as for a
  kernel started on demand;
- a warm kernel that died or stopped answering before its student's turn is closed and replaced
  by a kernel started on the spot, so its death is never charged to the next student.

Two kernels of the same worker never see each other: each has its own PID and network
namespace, binds only its own scratch folder and has a private /tmp.

A sandboxed kernel's HOME is its new scratch folder, so tinygpt.native's build cache
($HOME/.cache/tinygpt) starts empty in every one: a notebook that decodes with the package's C
kernels (day 19's constrained_generate, any tinygpt.generate on the CPU) compiled them again in
every submission, about 2 s of the 2-core AVX-512 EPYC's graded time (2026-11-27). The grader
builds them once, in a sandbox like the kernels' (`native_builds`), and copies the shared
objects into each scratch folder's cache: the same files the kernel would have built (their
names are the cache key: source, compiler and CPU), so nothing the notebook computes changes,
only when they were compiled.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from autograder.kernel import Kernel, grading_env
from autograder.sandbox import (
    DEFAULT_MEMORY_BYTES,
    SandboxKernelManager,
    SandboxPolicy,
    SandboxUnavailable,
    sandbox_prefix,
)

WARM_UP_TIMEOUT_S = 120.0   # importing torch on a busy machine: seconds, not minutes
ALIVE_TIMEOUT_S = 10.0      # an idle kernel answers a no-op at once


@dataclass(frozen=True)
class KernelRecipe:
    """How every student's kernel of one grading run is made."""

    files_dir: Path | None = None   # the non-notebook files of course/<day> the kernel gets
    cell_timeout: float = 60.0
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    sandbox: bool = True
    preload: tuple[str, ...] = field(default=())  # import statements a warm kernel runs


def scratch_prefix(pid: int) -> str:
    """How the scratch folders of the kernels process `pid` starts begin (in the temporary
    folder): whoever kills that process removes what it left behind by this prefix."""
    return f"tinygpt-grade-{pid}-"


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and all its descendants,
    including their children that already exited (read from /proc; 0.0 where there is none)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:       # it exited meanwhile
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        parents[int(entry)] = int(rest[1])
        used[int(entry)] = sum(int(v) for v in rest[11:15]) / ticks
    tree, total = {pid}, 0.0
    changed = True
    while changed:
        changed = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                changed = True
    for member in tree:
        total += used.get(member, 0.0)
    return total


def _preload_expression(statements: tuple[str, ...]) -> str:
    """A user expression that runs each import statement in a throwaway namespace (a failure is
    skipped: the student's own cell will fail the same way, and the preflight reports it)."""
    code = (f"for _s in {list(statements)!r}:\n"
            "    try:\n"
            "        exec(_s, {})\n"
            "    except Exception:\n"
            "        pass\n")
    return f"exec({code!r}, {{}})"


NATIVE_BUILD = ("from tinygpt import cpu_gemm, cpu_kernels, native\n"
                "for lib in (cpu_kernels._library, cpu_gemm._library):\n"
                "    native.compile_source(lib.source, lib.flags)\n")


@functools.cache
def native_builds() -> tuple[Path, ...]:
    """The package's C libraries (tinygpt.cpu_kernels, tinygpt.cpu_gemm), built once per
    grading process by a sandboxed Python exactly like the kernels' (the cache key holds the
    compiler's --version, and the sandbox, without /etc, finds gcc where the host finds cc),
    in a folder removed with the process's scratch folders; () where they cannot be built
    (a kernel then builds them, or falls back, as it would have anyway)."""
    home = Path(tempfile.mkdtemp(prefix=scratch_prefix(os.getpid()) + "native-"))
    atexit.register(shutil.rmtree, home, True)
    try:
        subprocess.run(sandbox_prefix(SandboxPolicy(home)) + [sys.executable, "-c",
                                                              NATIVE_BUILD],
                       check=True, capture_output=True, timeout=WARM_UP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError, SandboxUnavailable):
        return ()
    return tuple(sorted((home / ".cache" / "tinygpt").glob("*.so")))


def seed_native_cache(home: Path) -> None:
    """Copy native_builds() into the tinygpt.native cache of a kernel whose HOME is `home`."""
    builds = native_builds()
    if builds:
        cache = home / ".cache" / "tinygpt"
        cache.mkdir(parents=True, exist_ok=True)
        for build in builds:
            shutil.copy(build, cache / build.name)


class StudentKernel:
    """A kernel for exactly one student: a new scratch folder (the kernel's working directory
    and only writable folder, holding a copy of the day's files) and a kernel started in it,
    sandboxed unless the recipe says otherwise. `close` shuts the kernel down, records the CPU
    seconds its processes used (`cpu_seconds`) and deletes the folder."""

    def __init__(self, recipe: KernelRecipe) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=scratch_prefix(os.getpid()))
        self.scratch = Path(self._tmp.name) / "work"
        self.scratch.mkdir()
        self.warmed = False       # the preload ran before the student's turn
        self.cpu_seconds = 0.0
        self._closed = False
        try:
            if recipe.files_dir is not None and Path(recipe.files_dir).is_dir():
                for item in Path(recipe.files_dir).iterdir():
                    if item.suffix != ".ipynb" and item.name != ".ipynb_checkpoints":
                        copy = shutil.copytree if item.is_dir() else shutil.copy
                        copy(item, self.scratch / item.name)
            if recipe.sandbox:            # its HOME: the C kernels' cache, already built
                seed_native_cache(self.scratch)
            manager = SandboxKernelManager(SandboxPolicy(self.scratch, recipe.memory_bytes)) \
                if recipe.sandbox else None
            # Grading mode (tinygpt.testing.grading): the sandbox sets it in its clean
            # environment; an unsandboxed kernel gets it here.
            self.kernel = Kernel(self.scratch, timeout=recipe.cell_timeout, manager=manager,
                                 env=None if recipe.sandbox else grading_env())
        except BaseException:
            self._tmp.cleanup()
            raise

    def preload(self, statements: tuple[str, ...], timeout: float = WARM_UP_TIMEOUT_S) -> bool:
        """Import `statements`' modules (see the module docstring); True when the kernel
        finished and is idle again."""
        if not statements:
            self.warmed = True
            return True
        reply = self.kernel.evaluate(_preload_expression(statements), timeout=timeout)
        self.warmed = bool(reply) and reply.get("status") == "ok"
        return self.warmed

    def alive(self) -> bool:
        """The kernel process runs and answers a no-op."""
        if self.kernel.dead or not self.kernel.manager.is_alive():
            return False
        reply = self.kernel.evaluate("0", timeout=ALIVE_TIMEOUT_S)
        return bool(reply) and reply.get("status") == "ok"

    def pid(self) -> int | None:
        process = getattr(self.kernel.manager.provisioner, "process", None)
        return getattr(process, "pid", None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pid = self.pid()
        try:
            if pid is not None:
                self.cpu_seconds = process_tree_cpu_seconds(pid)
            self.kernel.close()
        finally:
            self._tmp.cleanup()


class KernelSupply:
    """Hands out a new StudentKernel per `take`, the next one warmed in the background.

    `take()` returns the kernel warmed for this turn when it is alive (else closes it and starts
    one on the spot) and, when `expect_more` is set, starts warming the one after in a
    background thread. Every kernel is handed out once; the caller closes it. `replaced`
    counts warm kernels that had died (or failed to warm up) and were replaced."""

    def __init__(self, recipe: KernelRecipe, warm: bool = True) -> None:
        self.recipe = recipe
        self.warm = warm
        self.expect_more = True
        self.replaced = 0
        self.handed_out = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warm-kernel")
        self._next: Future | None = None
        if recipe.sandbox:          # once per grading process, before any student's turn
            native_builds()

    def _start_warm(self) -> StudentKernel | None:
        kernel = StudentKernel(self.recipe)
        if not kernel.preload(self.recipe.preload):
            kernel.close()
            return None
        return kernel

    def prepare(self) -> None:
        """Start warming the next student's kernel (if none is warming or waiting)."""
        if self.warm and self._next is None:
            self._next = self._pool.submit(self._start_warm)

    def take(self) -> StudentKernel:
        kernel = None
        if self._next is not None:
            future, self._next = self._next, None
            try:
                kernel = future.result()
            except Exception:  # noqa: BLE001 (it did not start: start one now instead)
                kernel = None
            if kernel is None or not kernel.alive():
                if kernel is not None:
                    kernel.close()
                self.replaced += 1
                kernel = None
        if kernel is None:
            kernel = StudentKernel(self.recipe)
        self.handed_out += 1
        if self.expect_more:
            self.prepare()
        return kernel

    def close(self) -> None:
        """Close the kernel warmed for a turn that never came."""
        if self._next is not None:
            future, self._next = self._next, None
            try:
                kernel = future.result()
            except Exception:  # noqa: BLE001
                kernel = None
            if kernel is not None:
                kernel.close()
        self._pool.shutdown(wait=True)
