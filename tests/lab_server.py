"""Start and stop a JupyterLab server for the tests (`make lab`, or `jupyter lab` on a folder).

Both tests that need a live server (test_lab.py: `make lab` serves the course; test_browser.py:
a real browser drives the widgets) use `running_lab`, which binds a free localhost port, sets a
random token, keeps Jupyter's config and runtime files in a scratch folder, waits for /lab to
answer and, however the test ends, stops the server and everything it started.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from autograder.settings import REPO_ROOT

START_TIMEOUT_S = 90


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    """(HTTP status, body) of a GET; HTTP errors come back as their status with an empty body."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


@dataclass
class Lab:
    """A running JupyterLab: `base` is http://127.0.0.1:<port>, `log` its combined output."""

    base: str
    token: str
    proc: subprocess.Popen
    log: Path

    def url(self, path: str) -> str:
        """The absolute URL of `path` (starting with /), with the token as a query parameter."""
        sep = "&" if "?" in path else "?"
        return f"{self.base}{path}{sep}token={self.token}"

    def get(self, path: str) -> tuple[int, str]:
        return get(self.url(path))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def server_args(token: str) -> list[str]:
    """Arguments that keep a test server private, quiet and offline: localhost only, a token,
    no browser, no update check and no news feed."""
    return [
        "--ip=127.0.0.1",
        "--no-browser",
        f"--IdentityProvider.token={token}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]


def make_lab_command(port: int, token: str) -> list[str]:
    """`make lab` (which serves course/) on `port` with `token`."""
    return ["make", "-s", "lab", f"PORT={port}", f"LAB_ARGS={' '.join(server_args(token))}"]


def jupyter_lab_command(port: int, token: str, root_dir: Path, *extra: str) -> list[str]:
    """The venv's `jupyter lab` serving `root_dir`; --allow-root as root, like the Makefile."""
    jupyter_lab = Path(sys.executable).with_name("jupyter-lab")
    root_flag = ["--allow-root"] if os.geteuid() == 0 else []
    return [str(jupyter_lab), f"--notebook-dir={root_dir}", f"--port={port}", *server_args(token),
            *root_flag, *extra]


@contextmanager
def running_lab(scratch: Path, command: str = "make", root_dir: Path | None = None,
                extra_args: tuple[str, ...] = (),
                user_settings: Mapping[str, Mapping] | None = None) -> Iterator[Lab]:
    """Start JupyterLab, yield a `Lab` once it answers, and stop it on exit.

    command: "make" runs `make lab` (course/); "jupyter" runs `jupyter lab` on `root_dir`.
    scratch: a folder for the server's log, config and runtime files (the user's own Jupyter
    settings and workspaces never leak into a test).
    user_settings: JupyterLab settings by plugin id, e.g.
    {"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"}}.
    """
    if command not in ("make", "jupyter"):
        raise ValueError(f"command must be 'make' or 'jupyter', got {command!r}")
    if command == "jupyter" and root_dir is None:
        raise ValueError("command='jupyter' needs root_dir")
    port, token = free_port(), secrets.token_hex(16)
    if command == "make":
        argv = make_lab_command(port, token)
    else:
        argv = jupyter_lab_command(port, token, root_dir, *extra_args)
    config = scratch / "jupyter-config"
    config.mkdir(parents=True, exist_ok=True)
    for plugin, values in (user_settings or {}).items():
        package, _, name = plugin.rpartition(":")
        path = config / "lab" / "user-settings" / package / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(scratch / "jupyter-runtime"),
               JUPYTER_CONFIG_DIR=str(config),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # conftest.py sets MPLBACKEND=Agg for the test process; kernels need their inline backend.
    env.pop("MPLBACKEND", None)
    log_path = scratch / "lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        lab = Lab(f"http://127.0.0.1:{port}", token, proc, log_path)
        try:
            wait_until_up(lab)
            yield lab
        finally:
            stop(proc)


def wait_until_up(lab: Lab, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll /api/status until it answers; fail with the server's log if it dies or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            lab.get("/api/status")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if lab.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {lab.proc.returncode}:\n"
                                   f"{lab.log_text()}") from None
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer within {timeout_s} s:\n{lab.log_text()}")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server and what it started (make, jupyter, kernels: one process group)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
