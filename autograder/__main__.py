"""The course's command line for instructors and maintainers: python -m autograder COMMAND.

An instructor's term, in order (every command takes --root, the course folder, default: this
repository, and --db, a gradebook URL, default: sqlite:///<root>/gradebook.db):

    release [DAY ...]           generate course/ from solutions/, record it in the gradebook
    collect SOURCE              import submissions: a folder <student>/<dayNN>/*.ipynb or an
                                LMS zip of <student>_<dayNN>....ipynb files
    grade DAY                   autograde every pending submission of DAY in parallel, each in
                                a sandbox; prints a summary table (--force regrades)
    export [CSV]                grades to CSV: a row per student, a column per day, a total;
                                and grades-by-exercise.csv beside it
    feedback DAY                feedback/<student>/DAY/DAY.html: pass/fail and messages, and
                                the day's item analysis (mean and full marks per exercise),
                                never the hidden tests

Maintainers: `execute [DAY ...]` re-runs solution notebooks in place; `days` lists the days;
`mutants [DAY ...]` grades single-point mutants of the answer cells (autograder/mutants.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from autograder.notebooks import days
from autograder.settings import REPO_ROOT


def _pick_days(requested: list[str], root: Path) -> list[str]:
    known = days(root)
    unknown = [d for d in requested if d not in known]
    if unknown:
        raise SystemExit(f"unknown day(s) {unknown}; the course has {known}")
    return requested or known


def _count(text: str) -> int:
    """An argparse type: an int >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _positive(text: str) -> float:
    """An argparse type: a finite number > 0 (argparse names the option in its error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="course folder with solutions/ and course/ (default: this repo)")
    common.add_argument("--db", default=None,
                        help="gradebook URL, e.g. postgresql://user@/tinygpt?host=/run/pg "
                             "(default: sqlite:///<root>/gradebook.db)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("days", parents=[common], help="list the days")
    for name, help_ in [("release", "generate course/ from solutions/ and record it"),
                        ("execute", "run solution notebooks in place")]:
        p = sub.add_parser(name, parents=[common], help=help_)
        p.add_argument("days", nargs="*", help="day ids such as day01_logits (default: all)")
    p = sub.add_parser("collect", parents=[common], help="import submissions")
    p.add_argument("source", type=Path, help="a folder <student>/<dayNN>/ or a .zip")
    p.add_argument("--pattern", default=None,
                   help="regex with groups 'student' and 'day' for zip file names")
    p = sub.add_parser("grade", parents=[common], help="autograde a day")
    p.add_argument("day")
    p.add_argument("--student", action="append", help="only these students (repeatable)")
    p.add_argument("--workers", type=_count, default=os.cpu_count(),
                   help="parallel students, >= 1 (default: the core count)")
    p.add_argument("--force", action="store_true", help="regrade unchanged submissions too")
    p.add_argument("--cell-timeout", type=_positive, default=60.0, help="seconds per cell, > 0")
    p.add_argument("--total-timeout", type=_positive, default=600.0,
                   help="seconds per notebook, > 0")
    p.add_argument("--memory-gb", type=_positive, default=6.0,
                   help="address-space limit per kernel in GiB, > 0")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run student code without bubblewrap (only for code you trust)")
    p.add_argument("--no-integrity", action="store_true",
                   help="skip the integrity guard and scan (only to measure what they cost)")
    p.add_argument("--cold", action="store_true",
                   help="a worker process per student, its kernel started on demand (the plain, "
                        "slower path; default: serving workers with kernels started ahead)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--by-exercise", action="store_true",
                   help="show a column per exercise in the summary")
    p = sub.add_parser("export", parents=[common], help="grades to CSV")
    p.add_argument("csv", nargs="?", type=Path, default=Path("grades.csv"))
    p = sub.add_parser("mutants", parents=[common],
                       help="mutation testing: grade single-point mutants of the answer cells "
                            "of <root>/solutions (no gradebook: --db is not used)")
    p.add_argument("days", nargs="*", help="day ids such as day07_sampling (default: all)")
    p.add_argument("--sample", type=_count, default=None,
                   help="grade only this many mutants per day, >= 1 (the seeded sample make "
                        "test uses; default: all)")
    p.add_argument("--no-diff", action="store_true", help="list survivors without their diffs")
    p = sub.add_parser("feedback", parents=[common], help="per-student HTML feedback")
    p.add_argument("day")
    p.add_argument("--student", action="append", help="only these students (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = args.root.resolve()
    warnings.filterwarnings("ignore", module="nbgrader")  # its SQLAlchemy session warnings

    if args.command == "days":
        print("\n".join(days(root)))
    elif args.command == "execute":
        from autograder.grading import execute_solution

        for day in _pick_days(args.days, root):
            print(f"executed {execute_solution(day, root)}")
    elif args.command == "release":
        from autograder.grading import release

        for day in _pick_days(args.days, root):
            print(f"released {release(day, root, args.db)}")
    elif args.command == "collect":
        from autograder.collect import DEFAULT_PATTERN, collect

        print(collect(args.source, root, args.pattern or DEFAULT_PATTERN).text())
    elif args.command == "grade":
        from autograder.grade import Limits, grade_day, summary_table
        from autograder.sandbox import SandboxUnavailable, bwrap_path

        _pick_days([args.day], root)
        if not args.no_sandbox:
            try:
                bwrap_path()
            except SandboxUnavailable as err:
                raise SystemExit(str(err)) from None
        limits = Limits(args.cell_timeout, args.total_timeout, int(args.memory_gb * 2**30),
                        sandbox=not args.no_sandbox, integrity=not args.no_integrity,
                        warm=not args.cold)
        from autograder.preflight import PreflightError

        try:
            results = grade_day(args.day, root=root, db_url=args.db, students=args.student,
                                workers=args.workers, force=args.force, limits=limits,
                                progress=not args.no_progress)
        except PreflightError as err:
            raise SystemExit(f"grade {args.day}: stopped before grading anyone: {err}") from None
        if args.by_exercise:
            from autograder.reports import exercise_scores

            print(summary_table(results, exercise_scores(root, args.db), args.day))
        else:
            print(summary_table(results))
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    elif args.command == "export":
        from autograder.reports import BY_EXERCISE_FILE, export_csv

        path = export_csv(args.csv, root, args.db)
        print(f"wrote {path} and {path.parent / BY_EXERCISE_FILE}")
    elif args.command == "mutants":
        from autograder.mutants import main as mutants_main

        return mutants_main(_pick_days(args.days, root), root=root, sample_size=args.sample,
                            diffs=not args.no_diff)
    elif args.command == "feedback":
        from autograder.reports import (
            exercise_scores,
            format_item_analysis,
            item_analysis,
            write_feedback,
        )

        _pick_days([args.day], root)
        for path in write_feedback(args.day, root, args.db, args.student):
            print(f"wrote {path}")
        items = item_analysis(exercise_scores(root, args.db), args.day)
        if items:
            print(format_item_analysis(items, args.day))
    return 0


if __name__ == "__main__":
    sys.exit(main())
