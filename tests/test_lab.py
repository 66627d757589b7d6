"""`make lab` starts a JupyterLab that serves the course (HTTP 200 from /lab and day 01 listed)."""

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from autograder.settings import REPO_ROOT

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def test_make_lab_serves_the_course(tmp_path):
    port, token = free_port(), secrets.token_hex(16)
    args = f"--no-browser --ip=127.0.0.1 --IdentityProvider.token={token}"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path), JUPYTER_CONFIG_DIR=str(tmp_path))
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(["make", "-s", "lab", f"PORT={port}", f"LAB_ARGS={args}"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        status, body = 0, ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                status, body = get(f"{base}/lab?token={token}")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert proc.poll() is None, (tmp_path / "lab.log").read_text()
                time.sleep(0.5)
        assert status == 200, f"/lab answered {status}\n{(tmp_path / 'lab.log').read_text()}"
        assert "JupyterLab" in body
        status, listing = get(f"{base}/api/contents?token={token}")
        names = [item["name"] for item in json.loads(listing)["content"]]
        assert status == 200 and any(n.startswith("day01_") for n in names), names
        status, ext = get(f"{base}/lab/api/extensions?token={token}")
        installed = {e["name"] for e in json.loads(ext)} if status == 200 else set()
        assert "jupyter-widgets-jupyterlab-manager" in installed, sorted(installed)
        assert "jupyter-nbgrader" in installed, sorted(installed)
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """Stop make and the JupyterLab it started (they share a process group)."""
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
