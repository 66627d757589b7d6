"""The course's command line for maintainers and instructors: python -m autograder COMMAND.

    release [DAY ...]   regenerate course/ from solutions/ (all days by default)
    execute [DAY ...]   run solution notebooks in place so their saved outputs are current
    days                list the days that have a solution notebook
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from autograder.notebooks import days


def _pick_days(requested: list[str]) -> list[str]:
    known = days()
    unknown = [d for d in requested if d not in known]
    if unknown:
        raise SystemExit(f"unknown day(s) {unknown}; the course has {known}")
    return requested or known


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("release", "regenerate course/ from solutions/"),
                        ("execute", "run solution notebooks in place")]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("days", nargs="*", help="day ids such as day01_logits (default: all)")
    sub.add_parser("days", help="list the days")
    args = parser.parse_args(argv)

    if args.command == "days":
        print("\n".join(days()))
    elif args.command == "execute":
        from autograder.grading import execute_solution

        for day in _pick_days(args.days):
            print(f"executing {execute_solution(day).relative_to(Path.cwd().resolve())}")
    elif args.command == "release":
        from autograder.grading import release

        for day in _pick_days(args.days):
            with tempfile.TemporaryDirectory(prefix=f"release-{day}-") as scratch:
                print(f"released {release(day, Path(scratch))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
