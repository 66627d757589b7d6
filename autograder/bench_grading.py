"""How fast does the grader get through a class? `make bench-grading` runs this.

    python -m autograder.bench_grading [--students 50] [--workers N] [--json PATH]

Builds a scratch course with day 01 and a class of generated submissions: correct ones, partly
correct ones (one or two answers swapped for entries of the mistakes corpus) and bad ones
(cases of the bad-submission corpus, hangs and crashes included), collects them and grades
them with `python -m autograder grade`, then reports submissions per minute. Target: 50
submissions within 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import nbformat

from autograder import bad_submissions, mistakes
from autograder.notebooks import nbgrader_meta, solution_path
from autograder.settings import REPO_ROOT

DAY = bad_submissions.DAY
BAD_KINDS = ["infinite-loop", "os-exit", "corrupt-json", "nothing", "stripped-metadata",
             "memory-bomb", "network", "huge-output"]
TARGET_SECONDS_FOR_50 = 300.0


def make_class(out: Path, n: int, seed: int = 0) -> Counter:
    """Write n submissions to out/<student>/day01_logits/: 60% correct, 25% partly correct,
    15% bad (rounded). Returns how many of each kind."""
    rng = random.Random(seed)
    wrong = mistakes.for_day(DAY)
    bad = {c.student: c for c in bad_submissions.CASES}
    n_bad, n_partial = round(0.15 * n), round(0.25 * n)
    kinds = Counter()
    ctx = {"solutions": "/nonexistent", "gradebook": "/nonexistent", "port": 9,
           "package": "/nonexistent/hacked.py"}
    for i in range(n):
        student = f"student{i:03d}"
        folder = out / student / DAY
        if i < n_bad:
            kind = BAD_KINDS[i % len(BAD_KINDS)]
            bad[kind].build(folder, ctx)
        elif i < n_bad + n_partial:
            kind = "partly-correct"
            nb = nbformat.read(str(solution_path(DAY)), as_version=4)
            for mistake in rng.sample(wrong, k=rng.choice([1, 2])):
                cell = next(c for c in nb.cells
                            if nbgrader_meta(c).get("grade_id") == mistake.grade_id)
                cell.source = mistake.code
            folder.mkdir(parents=True)
            nbformat.write(nb, str(folder / f"{DAY}.ipynb"))
        else:
            kind = "correct"
            folder.mkdir(parents=True)
            shutil.copy(solution_path(DAY), folder / f"{DAY}.ipynb")
        kinds[kind] += 1
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.bench_grading")
    parser.add_argument("--students", type=int, default=50)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--cell-timeout", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--integrity-cost", action="store_true",
                        help="grade the class a second time without the integrity guard and "
                             "scan, and report what they cost")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        root = Path(tmp) / "course"
        for folder in ("solutions", "course"):
            shutil.copytree(REPO_ROOT / folder / DAY, root / folder / DAY)
        kinds = make_class(Path(tmp) / "export", args.students)
        run = [sys.executable, "-m", "autograder"]
        subprocess.run([*run, "release", DAY, "--root", str(root)], check=True,
                       capture_output=True)
        subprocess.run([*run, "collect", str(Path(tmp) / "export"), "--root", str(root)],
                       check=True, capture_output=True)
        grade = [*run, "grade", DAY, "--root", str(root), "--workers", str(args.workers),
                 "--cell-timeout", str(args.cell_timeout), "--no-progress", "--force"]
        start = time.perf_counter()
        subprocess.run([*grade, "--json", str(Path(tmp) / "results.json")], check=True,
                       capture_output=True)
        seconds = time.perf_counter() - start
        results = json.loads((Path(tmp) / "results.json").read_text())
        without = None
        if args.integrity_cost:
            start = time.perf_counter()
            subprocess.run([*grade, "--no-integrity"], check=True, capture_output=True)
            without = time.perf_counter() - start
    per_minute = 60.0 * len(results) / seconds
    budget = TARGET_SECONDS_FOR_50 * len(results) / 50
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "students": len(results), "workers": args.workers, "cell_timeout_s": args.cell_timeout,
        "kinds": dict(kinds), "statuses": dict(Counter(r["status"] for r in results)),
        "seconds": round(seconds, 1), "submissions_per_minute": round(per_minute, 1),
        "target": f"{len(results)} submissions within {budget:.0f} s",
        "target_met": seconds <= budget,
    }
    if without is not None:
        report["seconds_without_integrity"] = round(without, 1)
        report["integrity_cost_s"] = round(seconds - without, 1)
    print(f"graded {len(results)} submissions ({dict(kinds)}) in {seconds:.1f} s with "
          f"{args.workers} workers: {per_minute:.1f} submissions/minute")
    print(f"statuses: {report['statuses']}")
    print(f"target {report['target']}: {'met' if report['target_met'] else 'NOT met'}")
    if without is not None:
        print(f"without the integrity guard and scan: {without:.1f} s (they cost "
              f"{seconds - without:+.1f} s, {(seconds - without) / without:+.1%})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
