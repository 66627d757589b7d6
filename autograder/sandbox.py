"""A Jupyter kernel that runs untrusted student code in a bubblewrap sandbox.

What the sandboxed kernel can see and do:
- read-only: the system's /usr (and /bin, /lib links), the Python installation and virtual
  environment, and the `tinygpt` package the grader itself imports (the kernel imports that
  one, see imported_tinygpt): enough to import numpy, torch and tinygpt;
- read-write: only its own scratch folder, which is also its working directory and HOME;
- nothing else of the host file system: not solutions/, not the gradebook, not other
  students' submissions, not /etc, not /root;
- no network (a private network namespace with only a loopback interface), its own PID
  namespace (it cannot see or signal host processes), a clean environment (no inherited
  secrets such as a database URL), an address-space limit so a memory bomb fails with
  MemoryError inside the kernel instead of exhausting the machine (per process: a kernel
  that starts child processes gets the limit once for each), a file-size limit
  (MAX_FILE_BYTES per file written) and a size limit on its private /tmp (TMP_BYTES, where
  bubblewrap can set one).

Not limited here (that needs cgroups, which a plain container lacks): the number of processes
(RLIMIT_NPROC counts every process of the user on the host and does not bind root, so it would
fail honest kernels or do nothing) and the total disk space the scratch folder takes.

The trusted side (our executor) talks to the kernel over ZeroMQ IPC sockets that live in the
scratch folder's .runtime folder, so no TCP port crosses the network namespace. That folder is
a mount point of its own inside the sandbox, so student code cannot rename it or put a link to
another folder in its place, and the trusted side removes its files only while it still is the
folder it created.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from jupyter_client.manager import KernelManager

from autograder.settings import REPO_ROOT

DEFAULT_MEMORY_BYTES = 6 * 1024**3  # address space, not resident memory: torch maps a lot
MAX_FILE_BYTES = 1024**3  # the largest file the kernel may write
TMP_BYTES = 512 * 1024**2  # the kernel's private /tmp (a tmpfs: it takes memory)


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces on this machine."""


@dataclass(frozen=True)
class SandboxPolicy:
    scratch: Path  # the only writable folder; the kernel's working directory
    memory_bytes: int = DEFAULT_MEMORY_BYTES

    def readonly_paths(self) -> list[Path]:
        """Host paths the kernel may read: the interpreter, the venv and the tinygpt package."""
        paths = {Path("/usr"), Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(),
                 Path(sysconfig.get_paths()["purelib"]).resolve(), REPO_ROOT / "tinygpt",
                 imported_tinygpt()}
        paths.add(Path(os.path.realpath(sys.executable)).parent.parent)
        # Never widen to the repository itself (that would expose solutions/ and gradebook.db).
        return sorted(p for p in paths if p.exists() and p != REPO_ROOT)

    def aliased_paths(self) -> list[tuple[Path, Path]]:
        """(host folder, the path it is reached by) for a virtual environment reached through a
        symlink (a clone whose .venv links to another): readonly_paths binds resolved paths,
        but the kernel is started as sys.executable, which must exist as given inside."""
        pairs = set()
        for given in (Path(sys.prefix), Path(sys.executable).parent.parent):
            given, real = Path(os.path.abspath(given)), given.resolve()
            if given != real and real.exists():
                pairs.add((real, given))
        return sorted(pairs)


def imported_tinygpt() -> Path:
    """The folder this Python imports the tinygpt package from: an editable install may point
    outside this repository, and the sandbox must bind that folder, not an assumed one. A
    clone whose .venv links to another checkout's venv imports its own tinygpt (the current
    folder comes first) while the install points to the other checkout's: sandbox_prefix puts
    this folder's parent on the kernel's PYTHONPATH, so that the kernel imports this one too."""
    spec = importlib.util.find_spec("tinygpt")
    if spec is None or spec.origin is None:
        return REPO_ROOT / "tinygpt"
    return Path(spec.origin).resolve().parent


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed; on Debian/Ubuntu: apt-get install bubblewrap. "
            "Grading untrusted notebooks without it is refused (use --no-sandbox only for "
            "code you trust).")
    return path


def sandbox_prefix(policy: SandboxPolicy) -> list[str]:
    """The bwrap (+ prlimit) command that wraps a kernel command line."""
    cmd = [bwrap_path(), "--die-with-parent", "--new-session", "--unshare-all",
           "--clearenv", "--proc", "/proc", "--dev", "/dev",
           *(["--size", str(TMP_BYTES)] if _bwrap_sizes_tmpfs() else []), "--tmpfs", "/tmp"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = Path("/") / link
        if target.is_symlink():
            cmd += ["--symlink", os.readlink(target), str(target)]
        elif target.exists():
            cmd += ["--ro-bind", str(target), str(target)]
    for path in policy.readonly_paths():
        cmd += ["--ro-bind", str(path), str(path)]
    for real, given in policy.aliased_paths():
        cmd += ["--ro-bind", str(real), str(given)]
    scratch = str(policy.scratch)
    cmd += ["--bind", scratch, scratch]
    runtime = policy.scratch / ".runtime"
    if runtime.is_dir() and not runtime.is_symlink():   # a mount point: it cannot be moved
        cmd += ["--bind", str(runtime), str(runtime)]
    cmd += ["--chdir", scratch]
    env = {
        "HOME": scratch,
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": f"{scratch}/.matplotlib",
        "JUPYTER_RUNTIME_DIR": f"{scratch}/.runtime",
        "IPYTHONDIR": f"{scratch}/.ipython",
        "PYTHONDONTWRITEBYTECODE": "1",
        "NBGRADER_EXECUTION": "autograde",
        "TINYGPT_GRADING": "1",
        "OMP_NUM_THREADS": "1",
        "LANG": "C.UTF-8",
        # The path search comes before an editable install's finder: the kernel imports the
        # tinygpt the grader imports (bound above), not the one the install points to.
        "PYTHONPATH": str(imported_tinygpt().parent),
    }
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
    return cmd + ["--", prlimit, f"--as={policy.memory_bytes}", "--core=0",
                  f"--fsize={MAX_FILE_BYTES}", "--"]


@functools.cache
def _bwrap_sizes_tmpfs() -> bool:
    """Whether this bubblewrap takes --size for a tmpfs (0.5 and later)."""
    try:
        done = subprocess.run([bwrap_path(), "--help"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in done.stdout + done.stderr


class SandboxKernelManager(KernelManager):
    """A KernelManager whose kernel process runs inside `sandbox_prefix(policy)`."""

    def __init__(self, policy: SandboxPolicy, **kwargs) -> None:
        runtime = policy.scratch / ".runtime"
        runtime.mkdir(parents=True, exist_ok=True)
        super().__init__(kernel_name="python3", transport="ipc",
                         ip=str(runtime / "kernel-ipc"),
                         connection_file=str(runtime / "kernel.json"), **kwargs)
        self.policy = policy
        self._runtime = (runtime, os.path.realpath(runtime))
        # Interrupt through the control channel: a signal sent to bwrap would not reach the
        # kernel inside its PID namespace.
        self.kernel_spec.interrupt_mode = "message"

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return sandbox_prefix(self.policy) + super().format_kernel_cmd(extra_arguments)

    def _runtime_intact(self) -> bool:
        """Whether .runtime is still the folder this manager created (not a link the kernel
        put in its place): only then are jupyter_client's file removals safe to follow."""
        if not hasattr(self, "_runtime"):    # never fully set up: it wrote no files
            return False
        path, real = self._runtime
        return path.is_dir() and not path.is_symlink() and os.path.realpath(path) == real

    def cleanup_connection_file(self) -> None:
        if self._runtime_intact():
            super().cleanup_connection_file()

    def cleanup_ipc_files(self) -> None:
        if self._runtime_intact():
            super().cleanup_ipc_files()

    def start_kernel(self, **kw):  # the kernel runs in the scratch folder, with a clean env
        kw.setdefault("cwd", str(self.policy.scratch))
        kw.setdefault("env", {"PATH": "/usr/bin:/bin"})
        return super().start_kernel(**kw)
