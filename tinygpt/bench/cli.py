"""`python -m tinygpt bench`: the command line over run_bench, the table and the JSON report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinygpt.bench.plan import bench_plan
from tinygpt.bench.registry import row_groups
from tinygpt.bench.report import format_table, plot_timeline, write_json
from tinygpt.bench.run import REQUESTS, run_bench


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m tinygpt bench`."""
    parser = argparse.ArgumentParser(
        prog="python -m tinygpt bench",
        description="Measure TTFT, TPOT, tokens/s, goodput and the course's speed targets "
                    "side by side; print a table, optionally write JSON.")
    parser.add_argument("--quick", action="store_true",
                        help="small models and few repeats: a smoke run of every row (165 s "
                             "alone on one thread of a 2-core AVX2 machine, 200 s beside make "
                             "test's other worker; see bench_plan)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the JSON report")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="save a timeline plot of one request (PNG)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (the course's targets), cuda or mps (default cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the number of usable cores)")
    parser.add_argument("--ttft-slo", type=float, default=0.1, help="TTFT SLO in s (0.1)")
    parser.add_argument("--tpot-slo", type=float, default=0.02, help="TPOT SLO in s (0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", metavar="GROUP", default=None,
                        help="run only this row group (repeatable): 'requests' or a name "
                             "from --list")
    parser.add_argument("--list", action="store_true", help="list the row groups and exit")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when a target is not met")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m tinygpt bench [--quick] [--json PATH] ...`; see build_parser().
    `python -m tinygpt bench serve ...` runs the load generator (tinygpt.bench.load)."""
    if argv and argv[0] == "serve":
        from tinygpt.bench.load import main as load_main

        return load_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import tinygpt

    if args.list:
        print(f"{REQUESTS:<20} day 12  streamed greedy requests: TTFT, TPOT, ITL, goodput")
        for group in row_groups():
            print(f"{group.name:<20} day {group.day:02d}  {group.description}")
        return 0
    try:
        device = tinygpt.usable_device(args.device)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        for name, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if args.only:
            row_groups([n for n in args.only if n != REQUESTS])   # unknown names fail here
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report, trace = run_bench(bench_plan(args.quick), device=str(device), threads=args.threads,
                              ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, seed=args.seed,
                              log=lambda line: print(line, file=sys.stderr, flush=True),
                              only=args.only)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot and trace is not None:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_timeline(trace).savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 1 if args.strict and not report["all_targets_met"] else 0
