"""The nbgrader configuration of the course, in one place.

`nbgrader_config.py` (for instructors who run nbgrader's own commands from this folder), the
`python -m autograder` command line and the tests all build their configuration here, so they
can never disagree about where notebooks live or how they are graded.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from traitlets.config import Config

REPO_ROOT = Path(__file__).resolve().parent.parent
COURSE_ID = "tinygpt"
SOURCE_DIR = "solutions"  # nbgrader "source": solutions, hidden tests, executed outputs
RELEASE_DIR = "course"  # nbgrader "release": what students open
CELL_TIMEOUT_S = 600  # day 06 trains a model in one cell: minutes, not seconds
NBGRADER_CELL_TIMEOUT_S = 120  # stock nbgrader's Execute (see nbgrader_config)
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"


def nbgrader_config(root: Path | str = REPO_ROOT, db_url: str | None = None) -> Config:
    """Return the nbgrader Config for a course rooted at `root`.

    `root` holds solutions/ and course/ (and, for an instructor, submitted/, autograded/,
    feedback/ and the gradebook). `db_url` defaults to `root/gradebook.db` (SQLite).
    """
    root = Path(root).resolve()
    c = Config()
    c.CourseDirectory.root = str(root)
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.source_directory = SOURCE_DIR
    c.CourseDirectory.release_directory = RELEASE_DIR
    c.CourseDirectory.db_url = db_url or f"sqlite:///{root / 'gradebook.db'}"
    c.ClearSolutions.code_stub = {"python": CODE_STUB}
    # Stock nbgrader's execution (the grading proofs): a cell that takes longer than this is
    # interrupted. nbclient has been seen to miss the end of a widget cell (an `interact`) and
    # wait for the full timeout with the kernel idle (nbclient issue #312); nbgrader sets
    # NBGRADER_EXECUTION, so the notebooks run in grading mode (tinygpt.testing.grading) and
    # create no widget at all (tests/test_course_integrity.py checks every widget cell). 120 s
    # stays as a cap, about 4x the slowest cell seen in make test before grading mode (32 s
    # under two workers on the 2-core development machine, most likely the AVX-512 EPYC,
    # 2026-11-24).
    c.Execute.timeout = NBGRADER_CELL_TIMEOUT_S
    c.Autograde.autograde_preprocessors = autograde_preprocessors()
    stamp_gradebooks_in_process()
    return c


@functools.cache
def alembic_head() -> str:
    """The revision of nbgrader's gradebook schema: what `alembic heads` prints for
    nbgrader's migrations, read from its migration scripts in this process."""
    from alembic.script import ScriptDirectory
    from nbgrader.dbutil import ALEMBIC_DIR

    return ScriptDirectory(ALEMBIC_DIR).get_current_head()


def stamp_gradebooks_in_process() -> None:
    """nbgrader stamps each new gradebook with that revision by running `alembic heads` in a
    subprocess, which imports nbgrader all over again: 5.5 s of CPU per new gradebook on the
    development machine (AVX2 EPYC, 2026-11-28), and every release and every grading run makes
    one. Point nbgrader at `alembic_head` instead (tests/test_autograder_units.py checks that
    both give the same revision)."""
    import nbgrader.api

    nbgrader.api.get_alembic_version = alembic_head


def autograde_preprocessors() -> list:
    """nbgrader's autograde pipeline with StderrToStdout right after execution."""
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from nbgrader.preprocessors import (
        AssignLatePenalties,
        CheckCellMetadata,
        Execute,
        IgnorePattern,
        LimitOutput,
        SaveAutoGrades,
    )

    from autograder.preprocessors import StderrToStdout

    return [Execute, StderrToStdout, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
            SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]


def ensure_venv_on_path() -> None:
    """nbgrader starts `alembic` by name (`nbgrader db upgrade`, and a new gradebook in a
    process that never built nbgrader_config): put our bin/ on PATH."""
    bindir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if bindir not in parts:
        os.environ["PATH"] = os.pathsep.join([bindir, *parts])
