"""The course's command line for instructors and maintainers: python -m autograder COMMAND.

An instructor's term, in order (every command takes --root, the course folder, default: this
repository; those that use the gradebook, release, grade, export and feedback, take --db, its
URL, default: sqlite:///<root>/gradebook.db; the others refuse it):

    release [DAY ...]           generate course/ from solutions/, record it in the gradebook
    collect SOURCE              import submissions: a folder <student>/<dayNN>/*.ipynb or an
                                LMS zip of <student>_<dayNN>....ipynb files
    grade DAY                   autograde every pending submission of DAY in parallel, each in
                                a sandbox; prints a summary table (--force regrades)
    export [CSV]                grades to CSV: a row per student, a column per day, a total;
                                and grades-by-exercise.csv beside it
    feedback DAY                feedback/<student>/DAY/DAY.html: pass/fail and messages, and
                                the day's item analysis (mean and full marks per exercise,
                                over the submissions), never the hidden tests; none for a
                                student who submitted nothing

Maintainers: `execute [DAY ...]` re-runs solution notebooks in place; `days` lists the days;
`mutants [DAY ...]` grades single-point mutants of the answer cells (autograder/mutants.py).

Bad input is refused before any slow work, with one `error: ...` line naming the option and
what it accepts, and exit status 2: a --root without a course (solutions/dayNN_slug/), a --db
that is not a database URL or cannot be opened, a SQLite gradebook that does not exist (only
release creates one; grade creates the default <root>/gradebook.db as release would), an
unknown day, a --student that is not a student id (collect's rule) or that grade or feedback
does not know, a collect source or --pattern collect cannot use, an output file (export's CSV,
grade's --json) that cannot be written, a --memory-gb too small for a kernel to start, grade
of a day nobody submitted (unless --force), feedback of a day nobody has been graded on, and
a grade while another grade runs on the same gradebook. A gradebook that fails later is one
`error:` line too, with exit status 1.
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
from autograder.settings import REPO_ROOT, SOURCE_DIR

GRADEBOOK_COMMANDS = ("release", "grade", "export", "feedback")
# Below this address-space limit a sandboxed kernel does not start at all (on the development
# machine, the AVX-512 EPYC, 2026-11-29: 512 MiB failed, 768 MiB started; importing torch
# needs more still).
MIN_MEMORY_GB = 1.0
SHOWN = 10  # known students listed in an error message


class UsageError(Exception):
    """Bad input found before any work: main prints it as one `error:` line, exit status 2."""


def _listing(names: list[str]) -> str:
    """The first SHOWN names, comma-separated, and how many more."""
    if not names:
        return "none"
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _pick_days(requested: list[str], root: Path) -> list[str]:
    known = days(root)
    unknown = [d for d in requested if d not in known]
    if unknown:
        raise UsageError(f"unknown day(s) {', '.join(unknown)}; the course has "
                         f"{', '.join(known)}")
    return requested or known


def _check_root(text: str) -> Path:
    """--root as a resolved Path: a folder whose solutions/ holds at least one day."""
    if text == "":
        raise UsageError("--root is empty: give the course folder (it holds solutions/)")
    root = Path(text).resolve()
    if not root.is_dir():
        raise UsageError(f"--root {text}: not a folder; give the course folder (it holds "
                         f"{SOURCE_DIR}/)")
    if not days(root):
        raise UsageError(f"--root {text}: not a course folder: no {SOURCE_DIR}/dayNN_slug/"
                         f"dayNN_slug.ipynb in it (every command reads the days there)")
    return root


def _check_db(url: str | None, root: Path, command: str) -> None:
    """--db, when given: a URL SQLAlchemy can parse, whose driver loads, that opens. A SQLite
    file that does not exist (SQLite would create it empty): only release creates one from a
    --db; export and feedback refuse the default <root>/gradebook.db too (there is nothing to
    read), while grade creates that one as release would (grade_day records the day)."""
    if url is None:
        default = root / "gradebook.db"
        if command in ("export", "feedback") and not default.exists():
            raise UsageError(f"no gradebook at {default}; run release first (or give the "
                             "gradebook with --db)")
        return
    if url == "":
        raise UsageError("--db is empty: give a gradebook URL such as sqlite:////path/"
                         "gradebook.db or postgresql://user@/tinygpt?host=/run/pg (or leave "
                         "--db out for <root>/gradebook.db)")
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UsageError(f"--db {url!r} is not a database URL: give one such as sqlite:////"
                         "path/gradebook.db or postgresql://user@/tinygpt?host=/run/pg") from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).parent
        if not folder.is_dir():
            raise UsageError(f"--db {shown}: the SQLite file's folder {folder} does not exist")
        if command != "release" and not Path(parsed.database).exists():
            raise UsageError(f"--db {shown}: no gradebook at {parsed.database}; run release "
                             "first (only release creates a gradebook)")
    try:
        engine = create_engine(parsed)
        with engine.connect():
            pass
        engine.dispose()
    except (SQLAlchemyError, ImportError) as err:
        raise UsageError(f"--db {shown}: cannot open the gradebook: "
                         f"{str(err).strip().splitlines()[0]}") from None


def _output_file(text: str, option: str) -> Path:
    """`text` as a Path a file can be written to (its folder exists, it is not a folder)."""
    if text == "":
        raise UsageError(f"{option} is empty: give a file path")
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"{option} {text}: is a folder; give a file path")
    if not path.parent.is_dir():
        raise UsageError(f"{option} {text}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {text}: cannot be written (permission denied)")
    return path


def _check_student_ids(students: list[str] | None) -> None:
    from autograder.collect import STUDENT_ID, STUDENT_ID_RULE

    for student in students or []:
        if not STUDENT_ID.match(student):
            raise UsageError(f"--student {student!r} is not a student id: {STUDENT_ID_RULE}")


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


class _NoGradebook(argparse.Action):
    """--db on a command that uses no gradebook: refused by name (left undefined, argparse would
    take its URL for the command's positional argument and blame another word)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {parser.prog.rsplit(' ', 1)[-1]} uses no gradebook; "
                     f"only {', '.join(GRADEBOOK_COMMANDS)} take --db")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=str(REPO_ROOT),
                        help="course folder with solutions/ and course/ (default: this repo)")
    # Only the commands that open the gradebook take --db: elsewhere it would be ignored.
    gradebook = argparse.ArgumentParser(add_help=False, parents=[common])
    gradebook.add_argument("--db", default=None,
                           help="gradebook URL, e.g. postgresql://user@/tinygpt?host=/run/pg "
                                "(default: sqlite:///<root>/gradebook.db)")
    no_gradebook = argparse.ArgumentParser(add_help=False, parents=[common])
    no_gradebook.add_argument("--db", action=_NoGradebook, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("days", parents=[no_gradebook], help="list the days")
    for name, help_, parent in [
            ("release", "generate course/ from solutions/ and record it", gradebook),
            ("execute", "run solution notebooks in place", no_gradebook)]:
        p = sub.add_parser(name, parents=[parent], help=help_)
        p.add_argument("days", nargs="*", help="day ids such as day01_logits (default: all)")
    p = sub.add_parser("collect", parents=[no_gradebook], help="import submissions")
    p.add_argument("source", help="a folder <student>/<dayNN>/ or a .zip")
    p.add_argument("--pattern", default=None,
                   help="regex with groups 'student' and 'day' for zip file names (a .zip "
                        "source only)")
    p = sub.add_parser("grade", parents=[gradebook], help="autograde a day")
    p.add_argument("day")
    p.add_argument("--student", action="append", help="only these students (repeatable)")
    p.add_argument("--workers", type=_count, default=os.cpu_count(),
                   help="parallel students, >= 1 (default: the core count)")
    p.add_argument("--force", action="store_true", help="regrade unchanged submissions too")
    p.add_argument("--cell-timeout", type=_positive, default=60.0, help="seconds per cell, > 0")
    p.add_argument("--total-timeout", type=_positive, default=600.0,
                   help="seconds per notebook, > 0")
    p.add_argument("--memory-gb", type=_positive, default=None,
                   help=f"address-space limit per sandboxed kernel in GiB, >= {MIN_MEMORY_GB:g} "
                        "(default: 6; not with --no-sandbox, which sets no limit)")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run student code without bubblewrap (only for code you trust)")
    p.add_argument("--no-integrity", action="store_true",
                   help="skip the integrity guard and scan (only to measure what they cost)")
    p.add_argument("--cold", action="store_true",
                   help="a worker process per student, its kernel started on demand (the plain, "
                        "slower path; default: serving workers with kernels started ahead)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--by-exercise", action="store_true",
                   help="show a column per exercise in the summary")
    p = sub.add_parser("export", parents=[gradebook], help="grades to CSV")
    p.add_argument("csv", nargs="?", default="grades.csv")
    p = sub.add_parser("mutants", parents=[no_gradebook],
                       help="mutation testing: grade single-point mutants of the answer cells "
                            "of <root>/solutions (no gradebook)")
    p.add_argument("days", nargs="*", help="day ids such as day07_sampling (default: all)")
    p.add_argument("--sample", type=_count, default=None,
                   help="grade only this many mutants per day, >= 1 (the seeded sample make "
                        "test uses; default: all)")
    p.add_argument("--no-diff", action="store_true", help="list survivors without their diffs")
    p = sub.add_parser("feedback", parents=[gradebook], help="per-student HTML feedback")
    p.add_argument("day")
    p.add_argument("--student", action="append", help="only these students (repeatable)")
    return parser


def _check_grade(args: argparse.Namespace) -> None:
    """grade's options that need no gradebook: --memory-gb and --json."""
    if args.memory_gb is not None and args.no_sandbox:
        raise UsageError("--memory-gb applies in the sandbox only (prlimit inside bubblewrap); "
                         "with --no-sandbox no memory limit is set: give one of the two")
    if args.memory_gb is not None and args.memory_gb < MIN_MEMORY_GB:
        raise UsageError(f"--memory-gb {args.memory_gb:g} is too small for a kernel to start: "
                         f"give a number >= {MIN_MEMORY_GB:g}")
    if args.json is not None:
        args.json = _output_file(args.json, "--json")


def _check_grade_students(args: argparse.Namespace, root: Path) -> None:
    """Every --student of grade has a submission of the day or is in the gradebook (a typo
    must not add a student)."""
    if not args.student:
        return
    from autograder.grade import students_for
    from autograder.grading import _api

    known = students_for(args.day, root, _api(root, args.db))
    unknown = [s for s in args.student if s not in known]
    if unknown:
        raise UsageError(f"--student {', '.join(unknown)}: no submission of {args.day} in "
                         f"submitted/ and not in the gradebook; known students: "
                         f"{_listing(known)}")


def _check_submitted(args: argparse.Namespace, root: Path) -> None:
    """grade DAY needs someone's submission of the day (else it would record zeros for the
    whole class), unless --force."""
    if args.force or any(p.is_dir() for p in (root / "submitted").glob(f"*/{args.day}")):
        return
    raise UsageError(f"nobody submitted {args.day} (no {root / 'submitted'}/<student>/"
                     f"{args.day}/): collect first, or give --force to record zeros for "
                     "everyone in the gradebook")


def _check_feedback_students(args: argparse.Namespace, root: Path) -> None:
    """feedback needs graded submissions of the day: an error when nobody has one, or none of
    the --student; a warning naming the --student that have none when some do."""
    from autograder.reports import graded_students

    graded = graded_students(args.day, root, args.db)
    if not graded:
        raise UsageError(f"nobody has a graded submission of {args.day}: run grade "
                         f"{args.day} first")
    if not args.student:
        return
    missing = [s for s in dict.fromkeys(args.student) if s not in graded]
    if len(missing) == len(set(args.student)):
        raise UsageError(f"--student {', '.join(missing)}: no graded submission of {args.day}; "
                         f"graded students: {_listing(graded)}")
    if missing:
        print(f"warning: --student {', '.join(missing)}: no graded submission of {args.day}, "
              "no feedback written for them", file=sys.stderr)


def _check_args(args: argparse.Namespace, root: Path) -> None:
    """Every check of the command's input, the cheap ones first and those that open the
    gradebook last; raises UsageError."""
    if args.command in ("execute", "release", "mutants"):
        args.days = _pick_days(args.days, root)
    if args.command in ("grade", "feedback"):
        _pick_days([args.day], root)
        _check_student_ids(args.student)
    if args.command == "grade":
        _check_grade(args)
    elif args.command == "export":
        from autograder.reports import BY_EXERCISE_FILE

        args.csv = _output_file(args.csv, "export CSV")
        _output_file(str(args.csv.parent / BY_EXERCISE_FILE), "export CSV's companion")
    if args.command in GRADEBOOK_COMMANDS:
        _check_db(args.db, root, args.command)
    if args.command == "grade":
        _check_submitted(args, root)
        _check_grade_students(args, root)
    elif args.command == "feedback":
        _check_feedback_students(args, root)


def main(argv: list[str] | None = None) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", module="nbgrader")  # its SQLAlchemy session warnings
    try:
        root = _check_root(args.root)
        _check_args(args, root)
        return _run(args, root)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SQLAlchemyError as err:
        url = getattr(args, "db", None) or "sqlite:///<root>/gradebook.db"
        print(f"error: the gradebook ({url}) failed: {str(err).strip().splitlines()[0]}",
              file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, root: Path) -> int:
    """The command, its input already checked (_check_args)."""
    if args.command == "days":
        print("\n".join(days(root)))
    elif args.command == "execute":
        from autograder.grading import execute_solution

        for day in args.days:
            print(f"executed {execute_solution(day, root)}")
    elif args.command == "release":
        from autograder.grading import release

        for day in args.days:
            print(f"released {release(day, root, args.db)}")
    elif args.command == "collect":
        from autograder.collect import CollectError, collect

        try:
            print(collect(args.source, root, args.pattern).text())
        except CollectError as err:  # raised before anything is imported
            raise UsageError(f"collect: {err}") from None
    elif args.command == "grade":
        from autograder.grade import GradingBusy, Limits, grade_day, summary_table
        from autograder.sandbox import DEFAULT_MEMORY_BYTES, SandboxUnavailable, bwrap_path

        if not args.no_sandbox:
            try:
                bwrap_path()
            except SandboxUnavailable as err:
                raise SystemExit(str(err)) from None
        memory = (int(args.memory_gb * 2**30) if args.memory_gb is not None
                  else DEFAULT_MEMORY_BYTES)
        limits = Limits(args.cell_timeout, args.total_timeout, memory,
                        sandbox=not args.no_sandbox, integrity=not args.no_integrity,
                        warm=not args.cold)
        from autograder.preflight import PreflightError

        try:
            results = grade_day(args.day, root=root, db_url=args.db, students=args.student,
                                workers=args.workers, force=args.force, limits=limits,
                                progress=not args.no_progress)
        except PreflightError as err:
            raise SystemExit(f"grade {args.day}: stopped before grading anyone: {err}") from None
        except GradingBusy as err:
            raise UsageError(str(err)) from None
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

        return mutants_main(args.days, root=root, sample_size=args.sample,
                            diffs=not args.no_diff)
    elif args.command == "feedback":
        from autograder.reports import (
            exercise_scores,
            format_item_analysis,
            gradebook_students,
            graded_students,
            item_analysis,
            write_feedback,
        )

        for path in write_feedback(args.day, root, args.db, args.student):
            print(f"wrote {path}")
        graded = graded_students(args.day, root, args.db)
        others = [s for s in gradebook_students(root, args.db) if s not in graded]
        if others and not args.student:
            print(f"no feedback for {len(others)} student(s) of the gradebook without a "
                  f"submission of {args.day}: {_listing(others)}")
        items = item_analysis(exercise_scores(root, args.db), args.day, graded)
        if items:
            print(format_item_analysis(items, args.day, len(others)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
