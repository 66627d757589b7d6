"""`python -m tinygpt bench`: the command line over run_bench, the table and the JSON report.

Every argument is checked before the first measurement, each bad one a single `error: ...` line
(exit 2): --threads, --seed, the SLOs, the --only groups (with --list too; a flag of a run
beside --list is refused rather than ignored), the device, and the output files
(tinygpt.roofline.output_path: --json and --plot name a file whose folder exists or can be
made, a plot's extension is one matplotlib writes). --plot draws the timeline of one streamed
request, so it needs the "requests" rows.
"""

from __future__ import annotations

import argparse
import math
import sys

from tinygpt.bench.load import MAX_SEED
from tinygpt.bench.plan import bench_plan
from tinygpt.bench.registry import row_groups
from tinygpt.bench.report import format_table, plot_timeline, write_json
from tinygpt.bench.run import REQUESTS, run_bench
from tinygpt.roofline import output_path


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m tinygpt bench`."""
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt bench",
        description="Measure TTFT, TPOT, tokens/s, goodput and the course's speed targets "
                    "side by side; print a table, optionally write JSON. `python -m tinygpt "
                    "bench serve --help`: the load generator against a running server.")
    parser.add_argument("--quick", action="store_true",
                        help="small models and few repeats: a smoke run of every row (165 s "
                             "alone on one thread of a 2-core AVX2 machine, 200 s beside make "
                             "test's other worker; see bench_plan)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the JSON report")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="save a timeline plot of one streamed request (needs the "
                             "'requests' rows; .png, .pdf, .svg, ...)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (the course's targets), cuda or mps (default cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the number of usable cores)")
    parser.add_argument("--ttft-slo", type=float, default=0.1, help="TTFT SLO in s (0.1)")
    parser.add_argument("--tpot-slo", type=float, default=0.02, help="TPOT SLO in s (0.02)")
    parser.add_argument("--seed", type=int, default=0, help=f"0 .. {MAX_SEED} (0)")
    parser.add_argument("--only", action="append", metavar="GROUP", default=None,
                        help="run only this row group (repeatable): 'requests' or a name "
                             "from --list")
    parser.add_argument("--list", action="store_true",
                        help="list the row groups (with --only, the chosen ones) and exit")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when a target is not met or a targeted row "
                             "was skipped, or (outside --quick) when nothing was judged; "
                             "--quick judges no target, so it fails only on a row group that "
                             "raised")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every argument but --device (tinygpt.usable_device checks it); a ValueError naming the
    option and its allowed values."""
    import tinygpt

    if args.threads is not None:
        tinygpt.thread_count(args.threads, "--threads")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be an int in 0 .. {MAX_SEED}, got {args.seed}")
    for name, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
    if args.only:
        row_groups([n for n in args.only if n != REQUESTS])   # unknown names fail here
    if args.plot is not None and args.only and REQUESTS not in args.only:
        raise ValueError(f"--plot draws the timeline of one streamed request: it needs the "
                         f"'{REQUESTS}' rows (add --only {REQUESTS}), got --only "
                         f"{' --only '.join(args.only)}")
    if args.json is not None:
        output_path(args.json, "--json")
    if args.plot is not None:
        output_path(args.plot, "--plot", plot=True)


def check_list_alone(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--list runs nothing: a flag of a run beside it (--json, --quick, ...) would be ignored,
    so it is a ValueError naming the flags; --only chooses what is listed."""
    ignored = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
               if name not in ("list", "only") and value != parser.get_default(name)]
    if ignored:
        raise ValueError(f"--list only lists the row groups (with --only, the chosen ones): "
                         f"{', '.join(ignored)} would do nothing; drop --list to run")


def list_groups(only: list[str] | None) -> None:
    """Print the row groups, or only those named in `only` (an unknown name is a ValueError,
    raised before anything is printed, as a run raises it), one a line."""
    groups = row_groups(None if only is None else [n for n in only if n != REQUESTS])
    if only is None or REQUESTS in only:
        print(f"{REQUESTS:<20} day 12  streamed greedy requests: TTFT, TPOT, ITL, goodput")
    for group in groups:
        print(f"{group.name:<20} day {group.day:02d}  {group.description}")


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt bench [--quick] [--json PATH] ...`; see build_parser().
    `python -m tinygpt bench serve ...` runs the load generator (tinygpt.bench.load)."""
    if argv and argv[0] == "serve":
        from tinygpt.bench.load import main as load_main

        return load_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import tinygpt

    try:
        if args.list:
            check_list_alone(args, parser)
            list_groups(args.only)
            return 0
        device = tinygpt.usable_device(args.device)
        check_args(args)                  # last: it makes the output files' folders
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report, trace = run_bench(bench_plan(args.quick), device=str(device), threads=args.threads,
                              ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, seed=args.seed,
                              log=lambda line: print(line, file=sys.stderr, flush=True),
                              only=args.only)
    print(format_table(report))
    if args.json is not None:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot is not None:                   # check_args made sure the requests ran
        plot_timeline(trace).savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 1 if args.strict and strict_failure(report) else 0


def strict_failure(report: dict) -> bool:
    """Whether --strict exits 1: a target missed or a targeted row skipped (all_targets_met
    False), or nothing judged (None) outside the quick plan, whose rows are never judged."""
    judged = report["all_targets_met"]
    return judged is False or (judged is None and report.get("plan") != "quick")
