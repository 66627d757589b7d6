"""`make lab` starts a JupyterLab that serves the course (HTTP 200 from /lab and day 01 listed)."""

import json

import pytest

from tests.lab_server import running_lab

pytestmark = pytest.mark.slow


def test_make_lab_serves_the_course(tmp_path):
    with running_lab(tmp_path, command="make") as lab:
        status, body = lab.get("/lab")
        assert status == 200, f"/lab answered {status}\n{lab.log_text()}"
        assert "JupyterLab" in body
        status, listing = lab.get("/api/contents")
        names = [item["name"] for item in json.loads(listing)["content"]]
        assert status == 200 and any(n.startswith("day01_") for n in names), names
        status, ext = lab.get("/lab/api/extensions")
        installed = {e["name"] for e in json.loads(ext)} if status == 200 else set()
        assert "jupyter-widgets-jupyterlab-manager" in installed, sorted(installed)
        assert "jupyter-nbgrader" in installed, sorted(installed)
