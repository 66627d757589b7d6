"""One student's execution step, run as its own process by `autograder.grade`.

    python -m autograder.worker ROOT DAY STUDENT [--cell-timeout S] [--total-timeout S]
                                [--memory BYTES] [--files DIR] [--no-sandbox]

ROOT is a private scratch course folder holding submitted/STUDENT/DAY/DAY.ipynb (the staged
submission) and gradebook.db (a private copy with the assignment's test cells, hidden tests
included). nbgrader sanitizes the submission there (restoring every test cell from the private
gradebook), then SandboxExecute runs it. The result is ROOT/autograded/STUDENT/DAY/DAY.ipynb and
ROOT/report.json. The instructor's gradebook is never opened here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from autograder.sandbox import DEFAULT_MEMORY_BYTES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.worker")
    parser.add_argument("root", type=Path)
    parser.add_argument("day")
    parser.add_argument("student")
    parser.add_argument("--cell-timeout", type=float, default=60.0)
    parser.add_argument("--total-timeout", type=float, default=600.0)
    parser.add_argument("--memory", type=int, default=DEFAULT_MEMORY_BYTES)
    parser.add_argument("--files", default="")
    parser.add_argument("--no-sandbox", action="store_true")
    parser.add_argument("--guard", type=Path, default=None,
                        help="a file with the integrity guard's spec (GuardSpec JSON)")
    args = parser.parse_args(argv)

    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    from autograder.execute import SandboxExecute
    from autograder.settings import autograde_preprocessors, ensure_venv_on_path, nbgrader_config

    ensure_venv_on_path()
    report = args.root / "report.json"
    config = nbgrader_config(args.root)
    config.Autograde.autograde_preprocessors = [
        SandboxExecute if pp.__name__ == "Execute" else pp for pp in autograde_preprocessors()]
    config.SandboxExecute.cell_timeout = args.cell_timeout
    config.SandboxExecute.total_timeout = args.total_timeout
    config.SandboxExecute.memory_bytes = args.memory
    config.SandboxExecute.sandbox = not args.no_sandbox
    config.SandboxExecute.files_dir = args.files
    config.SandboxExecute.report_path = str(report)
    if args.guard is not None:
        config.SandboxExecute.guard = args.guard.read_text()
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    result = api.autograde(args.day, args.student, force=True, create=True)
    if not result.get("success"):
        report.write_text(json.dumps({"status": "error", "reason": "nbgrader failed: " + str(
            result.get("error", "")).strip().splitlines()[-1][:300] if result.get("error")
            else "nbgrader failed"}))
        print(result.get("log", ""), result.get("error", ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
