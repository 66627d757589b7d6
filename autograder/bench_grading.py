"""How fast does the grader get through a class? `make bench-grading` runs this.

    python -m autograder.bench_grading [--days all|day01_logits,day13_batching] [--per-day 3]
                                       [--students 50] [--workers N] [--json PATH]
                                       [--compare-cold] [--integrity-cost]

Two measurements:

1. Per day (every day, or the `--days` given): `--per-day` honest submissions (the solution)
   graded with `python -m autograder grade --workers 1`, once on a quiet machine and once while
   another process keeps every core busy. For each day: the median seconds one submission's
   execution step takes (from the moment its serving worker takes the job to its reply:
   nbgrader's sanitizing, the kernel (started while the previous student ran, so only waited
   for when that took longer), the notebook in grading mode, the kernel's shutdown), against
   the target of PER_SUBMISSION_TARGET_S, with NOT MET and the reason where missed (what the
   notebook's cells alone take, graded ones apart, and its slowest cells). Beside it: the CPU
   seconds per submission (the worker's and the whole life of the student's kernel, warm-up
   included), what a kernel start with the day's imports takes on its own (the preflight
   check: the cost the warm kernels take off each submission), and under load whether any
   honest submission ended `timeout` (none may). `--compare-cold` adds the plain path's
   figure (`grade --cold`: a process per student starting its own kernel).
2. A class (day 01, `--students`, 0 to skip): correct ones, partly correct ones (one or two
   answers swapped for entries of the mistakes corpus) and bad ones (cases of the
   bad-submission corpus, hangs and crashes included), collected and graded; reports
   submissions per minute. Target: 50 submissions within 5 minutes on 2 cores.

The machine the numbers come from is printed with them; timings on a machine shared with other
work are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
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
PER_SUBMISSION_TARGET_S = 5.0   # kernel start, imports and the graded cells, 1 worker, 2 cores
PER_DAY_CELL_TIMEOUT_S = 60.0   # the per-day table's (the grader's default); not --cell-timeout
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


def cores() -> int:
    """The cores this process may run on (taskset / cgroup affinity), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


class Burner:
    """Keeps every core busy (one spinning process per core) while in use."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Burner:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.processes)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def bench_day(day: str, n: int, cell_timeout: float, loaded: bool, cold: bool = False) -> dict:
    """Grade n copies of `day`'s solution with one worker; {seconds per submission, statuses,
    import seconds, the cells' own seconds}. `loaded`: every core is kept busy by other
    processes meanwhile. `cold`: with `grade --cold` (a process per student, its kernel started
    on demand: the plain path) instead of a serving worker with kernels started ahead."""
    from autograder.notebooks import read, release_path
    from autograder.preflight import check_imports

    with tempfile.TemporaryDirectory(prefix=f"bench-{day}-") as tmp:
        root = Path(tmp) / "course"
        for folder in ("solutions", "course"):
            shutil.copytree(REPO_ROOT / folder / day, root / folder / day)
        for i in range(n):
            folder = root / "submitted" / f"student{i:02d}" / day
            folder.mkdir(parents=True)
            shutil.copy(solution_path(day), folder / f"{day}.ipynb")
        run = [sys.executable, "-m", "autograder"]
        sandbox = [] if shutil.which("bwrap") else ["--no-sandbox"]
        grade = [*run, "grade", day, "--root", str(root), "--workers", "1", "--cell-timeout",
                 str(cell_timeout), "--no-progress", "--force", *sandbox,
                 *(["--cold"] if cold else []), "--json", str(Path(tmp) / "results.json")]
        with Burner(cores()) if loaded else contextlib.nullcontext():
            start = time.perf_counter()
            subprocess.run(grade, check=True, capture_output=True)
            total = time.perf_counter() - start
            start = time.perf_counter()
            check_imports(read(release_path(day)), sandbox=not sandbox)
            imports = time.perf_counter() - start
        results = json.loads((Path(tmp) / "results.json").read_text())
        reports = [json.loads(p.read_text()) for p in
                   (root / ".grading" / day / "workers").glob("*/report.json")]
    cells = [r.get("cell_seconds", []) for r in reports]
    per_cell: dict[tuple[str, str], list[float]] = {}
    for timing in cells:
        for label, seconds, kind in timing:
            per_cell.setdefault((label, kind), []).append(seconds)
    slowest = sorted(((_median(v), label, kind) for (label, kind), v in per_cell.items()),
                     reverse=True)[:3]
    return {"submissions": len(results),
            "seconds_per_submission": round(_median([r["seconds"] for r in results]), 2),
            "cpu_seconds_per_submission": round(_median([r["cpu_seconds"] for r in results]), 2),
            "cells_s": round(_median([sum(t[1] for t in c) for c in cells]), 2),
            "graded_cells_s": round(_median([sum(t[1] for t in c if t[2] == "graded")
                                             for c in cells]), 2),
            "slowest_cells": [{"cell": label, "kind": kind, "seconds": round(sec, 2)}
                              for sec, label, kind in slowest],
            "warm_kernels": sum(bool(r.get("warm_kernel")) for r in reports),
            "load_average_1min": round(os.getloadavg()[0], 1),
            "slowest_s": round(max(r["seconds"] for r in results), 2),
            "kernel_start_and_imports_s": round(imports, 2),
            "grade_command_s": round(total, 1),
            "statuses": dict(Counter(r["status"] for r in results)),
            "full_marks": all(r["score"] == r["max_score"] for r in results)}


def miss_reason(quiet: dict) -> str:
    """Why a day's quiet figure misses the target: what its own cells take, and the slowest."""
    slow = ", ".join(f"{c['cell']} ({c['kind']}) {c['seconds']:.1f} s"
                     for c in quiet["slowest_cells"])
    return (f"{quiet['seconds_per_submission']:.1f} s > {PER_SUBMISSION_TARGET_S:g} s "
            f"({quiet['cpu_seconds_per_submission']:.1f} CPU s); the notebook's cells alone take "
            f"{quiet['cells_s']:.1f} s (graded cells {quiet['graded_cells_s']:.1f} s), slowest: "
            f"{slow}; load average {quiet['load_average_1min']:.1f} on {cores()} cores")


def per_day_table(days: list[str], n: int, cell_timeout: float,
                  compare_cold: bool = False) -> list[dict]:
    """bench_day for every day, quiet then loaded (and quiet with --cold when `compare_cold`);
    prints the table as it goes."""
    rows = []
    header = (f"{'day':<18} {'s/submission':>12} {'CPU s':>6} {'cells s':>7} {'graded s':>8} "
              f"{'imports s':>9} {'load':>5} {'loaded s':>8}  {'loaded statuses':<16} "
              + (f"{'cold s':>6}  " if compare_cold else "") + "result")
    print(f"per-day grading, 1 worker, {cores()} cores, target <= "
          f"{PER_SUBMISSION_TARGET_S:g} s per submission (a serving worker, each student's "
          "kernel started while the previous one ran; 'imports s': what starting a kernel and "
          f"importing the day's modules takes on its own); loaded: {cores()} spinning "
          "processes beside it" + ("" if shutil.which("bwrap") else
                                   " (no sandbox: bubblewrap is not installed)")
          + "\n" + header, flush=True)
    for day in days:
        quiet = bench_day(day, n, cell_timeout, loaded=False)
        busy = bench_day(day, n, cell_timeout, loaded=True)
        cold = bench_day(day, n, cell_timeout, loaded=False, cold=True) if compare_cold \
            else None
        reasons = []
        if quiet["seconds_per_submission"] > PER_SUBMISSION_TARGET_S:
            reasons.append(miss_reason(quiet))
        if busy["statuses"].get("timeout"):
            reasons.append(f"{busy['statuses']['timeout']} honest submissions ended timeout "
                           "under load")
        if not (quiet["full_marks"] and busy["full_marks"]):
            reasons.append("an honest submission lost points")
        row = {"day": day, "quiet": quiet, "loaded": busy, "target_met": not reasons,
               "reason": "; ".join(reasons)}
        if cold is not None:
            row["cold"] = cold
        rows.append(row)
        statuses = ",".join(f"{k}={v}" for k, v in busy["statuses"].items())
        print(f"{day:<18} {quiet['seconds_per_submission']:>12.2f} "
              f"{quiet['cpu_seconds_per_submission']:>6.2f} {quiet['cells_s']:>7.2f} "
              f"{quiet['graded_cells_s']:>8.2f} "
              f"{quiet['kernel_start_and_imports_s']:>9.2f} {quiet['load_average_1min']:>5.1f} "
              f"{busy['seconds_per_submission']:>8.2f}  {statuses:<16} "
              + (f"{cold['seconds_per_submission']:>6.2f}  " if cold else "")
              + f"{'met' if not reasons else 'NOT MET: ' + row['reason']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.bench_grading")
    parser.add_argument("--days", default="all",
                        help="comma-separated days for the per-day table, 'all' (default) or "
                             "'none'")
    parser.add_argument("--per-day", type=int, default=3,
                        help="honest submissions graded per day and pass, >= 1")
    parser.add_argument("--students", type=int, default=50,
                        help="size of the day-01 class (0: skip the class)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--cell-timeout", type=float, default=20.0,
                        help="seconds per cell in the class run only; the per-day table uses "
                             f"{PER_DAY_CELL_TIMEOUT_S:g} s, the grader's default")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--compare-cold", action="store_true",
                        help="also grade each day with `grade --cold` (a process per student, "
                             "kernels started on demand) and show its seconds per submission")
    parser.add_argument("--integrity-cost", action="store_true",
                        help="grade the class a second time without the integrity guard and "
                             "scan, and report what they cost")
    args = parser.parse_args(argv)
    if args.per_day < 1:
        parser.error(f"--per-day must be >= 1, got {args.per_day}")
    from autograder.notebooks import days as all_days

    known = all_days()
    chosen = [] if args.days == "none" else known if args.days == "all" else [
        d.strip() for d in args.days.split(",") if d.strip()]
    unknown = [d for d in chosen if d not in known]
    if unknown:
        parser.error(f"--days: unknown {unknown}; the days are {', '.join(known)}")
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                               f"{platform.system()}"}
    if chosen:
        report["per_day"] = per_day_table(chosen, args.per_day, PER_DAY_CELL_TIMEOUT_S,
                                          args.compare_cold)
        report["per_day_target_s"] = PER_SUBMISSION_TARGET_S
    if args.students > 0:
        report.update(bench_class(args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def bench_class(args) -> dict:
    """The day-01 class of `args.students` mixed submissions (see the module docstring)."""
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
    print(f"target {report['target']}: {'met' if report['target_met'] else 'NOT MET'}")
    if without is not None:
        print(f"without the integrity guard and scan: {without:.1f} s (they cost "
              f"{seconds - without:+.1f} s, {(seconds - without) / without:+.1%})")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
