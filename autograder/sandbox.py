"""A Jupyter kernel that runs untrusted student code in a bubblewrap sandbox.

What the sandboxed kernel can see and do:
- read-only: the system's /usr (and /bin, /lib links), the Python installation and virtual
  environment, and the `tinygpt` package: enough to import numpy, torch and tinygpt;
- read-write: only its own scratch folder, which is also its working directory and HOME;
- nothing else of the host file system: not solutions/, not the gradebook, not other
  students' submissions, not /etc, not /root;
- no network (a private network namespace with only a loopback interface), its own PID
  namespace (it cannot see or signal host processes), a clean environment (no inherited
  secrets such as a database URL), and an address-space limit so a memory bomb fails with
  MemoryError inside the kernel instead of exhausting the machine.

The trusted side (our executor) talks to the kernel over ZeroMQ IPC sockets that live in the
scratch folder, so no TCP port crosses the network namespace.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from jupyter_client.manager import KernelManager

from autograder.settings import REPO_ROOT

DEFAULT_MEMORY_BYTES = 6 * 1024**3  # address space, not resident memory: torch maps a lot


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
    outside this repository, and the sandbox must bind that folder, not an assumed one."""
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
           "--clearenv", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
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
    cmd += ["--bind", scratch, scratch, "--chdir", scratch]
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
    }
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
    return cmd + ["--", prlimit, f"--as={policy.memory_bytes}", "--core=0", "--"]


class SandboxKernelManager(KernelManager):
    """A KernelManager whose kernel process runs inside `sandbox_prefix(policy)`."""

    def __init__(self, policy: SandboxPolicy, **kwargs) -> None:
        runtime = policy.scratch / ".runtime"
        runtime.mkdir(parents=True, exist_ok=True)
        super().__init__(kernel_name="python3", transport="ipc",
                         ip=str(runtime / "kernel-ipc"),
                         connection_file=str(runtime / "kernel.json"), **kwargs)
        self.policy = policy
        # Interrupt through the control channel: a signal sent to bwrap would not reach the
        # kernel inside its PID namespace.
        self.kernel_spec.interrupt_mode = "message"

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return sandbox_prefix(self.policy) + super().format_kernel_cmd(extra_arguments)

    def start_kernel(self, **kw):  # the kernel runs in the scratch folder, with a clean env
        kw.setdefault("cwd", str(self.policy.scratch))
        kw.setdefault("env", {"PATH": "/usr/bin:/bin"})
        return super().start_kernel(**kw)
