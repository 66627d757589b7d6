"""Before grading anyone, `grade` checks that the grading kernel imports what the notebook
imports, and stops with a clear error before any grade is written when it cannot."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from autograder import sandbox
from autograder.notebooks import read, release_path, solution_path
from autograder.preflight import PreflightError, check_imports, import_statements
from autograder.settings import REPO_ROOT
from tests.conftest import DAYS

DAY = "day01_logits"
MISSING = "tinygpt_no_such_module"


def test_import_statements_are_the_top_level_imports_in_order():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import numpy as np\nfrom tinygpt import corpus\nx = 1"),
        nbformat.v4.new_code_cell("def f():\n    import json\ntry:\n    import yaml\nexcept "
                                  "ImportError:\n    pass\nimport numpy as np"),
        nbformat.v4.new_code_cell("%matplotlib inline\nimport os"),   # a magic: not Python
        nbformat.v4.new_markdown_cell("import sys"),
    ])
    assert import_statements(nb) == ["import numpy as np", "from tinygpt import corpus"]


@pytest.mark.parametrize("day", DAYS)
def test_every_released_day_imports_tinygpt(day):
    statements = import_statements(read(release_path(day)))
    assert any(re.match(r"(import|from) tinygpt(\.\w+)*( |$)", s) for s in statements), \
        (day, statements)


def test_the_sandbox_binds_the_folder_tinygpt_is_imported_from(tmp_path):
    import tinygpt

    imported = Path(tinygpt.__file__).resolve().parent
    assert imported in sandbox.SandboxPolicy(tmp_path).readonly_paths()


SANDBOXED = """
import subprocess, sys
from pathlib import Path
from autograder.sandbox import SandboxPolicy, sandbox_prefix
cmd = sandbox_prefix(SandboxPolicy(Path(sys.argv[1]))) + [sys.executable, "-c", "import numpy"]
sys.exit(subprocess.run(cmd, capture_output=True).returncode)
"""


def test_a_virtual_environment_reached_through_a_symlink_starts_in_the_sandbox(tmp_path):
    # the kernel is started as sys.executable, as given: with the venv bound only at its
    # resolved path, prlimit inside found no such file (exit 127: "the kernel did not start")
    try:
        sandbox.bwrap_path()
    except sandbox.SandboxUnavailable as err:
        pytest.skip(str(err))
    link = tmp_path / "linked-venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = subprocess.run([str(link / "bin" / Path(sys.executable).name), "-c", SANDBOXED,
                           str(scratch)], cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0


@pytest.mark.slow
def test_grade_stops_before_grading_anyone_when_an_import_fails(tmp_path):
    """A notebook that imports a module the grading environment lacks: `grade` exits non-zero
    with a message naming the module, and writes no grade, no executed notebook."""
    root = tmp_path / "course-root"
    for folder in ("solutions", "course"):
        shutil.copytree(REPO_ROOT / folder / DAY, root / folder / DAY)
    source = root / "solutions" / DAY / f"{DAY}.ipynb"
    nb = nbformat.read(str(source), as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.source = f"import {MISSING}\n" + first.source
    nbformat.write(nb, str(source))
    student = root / "submitted" / "alice" / DAY
    student.mkdir(parents=True)
    shutil.copy(solution_path(DAY), student / f"{DAY}.ipynb")
    proc = subprocess.run([sys.executable, "-m", "autograder", "grade", DAY, "--root", str(root),
                           "--no-sandbox", "--no-progress", "--force"],
                          capture_output=True, text=True, cwd=root)
    assert proc.returncode != 0, proc.stdout
    assert "stopped before grading anyone" in proc.stderr and MISSING in proc.stderr, proc.stderr
    assert "ModuleNotFoundError" in proc.stderr
    assert not (root / "autograded").exists(), "a grade was written despite the failed check"
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "tinygpt") as gb:
        assert not [s.id for s in gb.students if s.submissions], "a submission was recorded"


@pytest.mark.slow
def test_a_sandbox_that_cannot_import_tinygpt_stops_the_check(tmp_path, monkeypatch):
    """Break the environment on purpose: a sandbox that does not bind the tinygpt package (as
    when an editable install points outside the folders it binds)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap): no sandbox here")
    import tinygpt

    hidden = Path(tinygpt.__file__).resolve().parent
    plain = sandbox.SandboxPolicy.readonly_paths
    monkeypatch.setattr(sandbox.SandboxPolicy, "readonly_paths",
                        lambda self: [p for p in plain(self) if p != hidden])
    with pytest.raises(PreflightError, match=r"(?s)cannot import.*tinygpt.*ModuleNotFound"):
        check_imports(read(release_path(DAY)), sandbox=True)
    monkeypatch.setattr(sandbox.SandboxPolicy, "readonly_paths", plain)
    assert check_imports(read(release_path(DAY)), sandbox=True)   # the real sandbox imports it
