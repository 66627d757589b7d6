"""run_bench: the streamed-request metrics, then every registered row group, into one report.

The report: {"schema_version", "tool", "created_utc", "plan", "machine", "settings",
"requests" (request_metrics + "model", its tokens_per_s with the slow tail p10 and p1 too, or
None when not selected), "comparisons" (Comparison
dicts, in day order), "groups" (the row groups that ran), "skipped" ({group or row: why it did
not run}, BenchContext.skip), "all_targets_met", "seconds"}.

all_targets_met: True when every targeted row met its target and no targeted row was skipped
(a skip is not a pass); False when one missed or was skipped; None when nothing was judged.
The quick plan judges no speed: its rows are information ("quick: not judged"), a 1-round run
on small workloads being too few samples to claim a target; only a group that raised (its
`<group>_failed` row) stays targeted there, so a smoke run still fails on a crash.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
import traceback
from collections.abc import Callable

import torch

from tinygpt import flops as F
from tinygpt.bench.harness import Comparison, machine_info, run_requests
from tinygpt.bench.models import model_info
from tinygpt.bench.plan import BenchPlan, bench_plan
from tinygpt.bench.registry import REQUESTS, BenchContext, row_groups
from tinygpt.metrics import RequestTrace, percentile, request_metrics, tokens_per_second

SCHEMA_VERSION = 1
QUICK_NOT_JUDGED = "quick: not judged"


def _all_targets_met(comparisons: list[Comparison], missed: list[str]) -> bool | None:
    """all_targets_met of a report (see the module's docstring)."""
    targeted = [c for c in comparisons if c.targeted]
    if not targeted and not missed:
        return None
    return all(c.met for c in targeted) and not missed


def run_group(group, ctx: BenchContext) -> list[Comparison]:
    """A group's rows; a group that raises gives one row instead, `<name>_failed`, NOT MET
    with the error (and the log gets its traceback), so that one broken group (a missing
    model, a device it cannot use) does not lose the rows of a long run's other groups."""
    try:
        return group.run(ctx)
    except Exception as err:  # noqa: BLE001 - reported as a missed row, not swallowed
        ctx.log(f"{group.name}: FAILED\n{traceback.format_exc()}")
        return [Comparison(f"{group.name}_failed", f"the {group.name} rows raised an error",
                           0.0, 1.0, ">=", "rows", False, f"{type(err).__name__}: {err}",
                           {"group": group.name})]


def run_bench(plan: BenchPlan | None = None, *, device: str = "cpu",
              threads: int | None = None, ttft_slo: float = 0.1, tpot_slo: float = 0.02,
              seed: int = 0, log: Callable[[str], None] = print,
              only: list[str] | None = None) -> tuple[dict, RequestTrace | None]:
    """Run the measurements of `plan` (default: the full plan); returns (report dict, the
    trace of one request for a timeline plot, or None when the requests were not run).

    device: where the models run ("cpu" for the course's CPU targets; on "cuda" the decode
    step is compiled and the bandwidth target is 60%). threads: torch threads (default: the
    number of usable cores). only: names of row groups to run ("requests" for the streamed
    requests; see registry.row_groups), default all.
    """
    plan = bench_plan(False) if plan is None else plan
    began = time.perf_counter()
    if threads is None:
        threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
    F._check_int("threads", threads)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    groups = row_groups(None if only is None else [n for n in only if n != REQUESTS])
    ctx = BenchContext(plan=plan, device=dev, seed=seed, threads=threads, log=log)

    requests, trace = None, None
    if only is None or REQUESTS in only:
        log("requests: streamed timings ...")
        request_model = ctx.build(plan.request_model)
        traces = run_requests(request_model, plan.requests, plan.request_new_tokens,
                              plan.request_prompt_lengths, seed=seed)
        requests = request_metrics(traces, ttft_slo, tpot_slo)
        # higher is better: the slow tail of tokens/s is its low percentiles
        rates = [tokens_per_second(t) for t in traces]
        requests["tokens_per_s"].update(p10=percentile(rates, 10), p1=percentile(rates, 1))
        requests["model"] = model_info(request_model)
        trace = traces[0]
        del request_model

    comparisons: list[Comparison] = []
    failed = set()
    for group in groups:
        rows = run_group(group, ctx)
        failed.update(c.name for c in rows if c.name == f"{group.name}_failed")
        comparisons.extend(rows)
    missed = sorted(ctx.missed)
    if ctx.quick:                   # too few samples to judge a speed: information only
        missed = []
        for c in comparisons:
            if c.name not in failed:
                c.targeted = False
                c.details["not_judged"] = QUICK_NOT_JUDGED

    report = {
        "schema_version": SCHEMA_VERSION,
        "tool": "python -m tinygpt bench",
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "plan": plan.name,
        "machine": machine_info(threads),
        "settings": {"device": str(dev), "threads": threads, "seed": seed,
                     "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo},
        "requests": requests,
        "comparisons": [dataclasses.asdict(c) for c in comparisons],
        "groups": [g.name for g in groups],
        "skipped": {name: reason + (" (a targeted row: counted as not met)"
                                    if name in missed else "")
                    for name, reason in ctx.skipped.items()},
        "all_targets_met": _all_targets_met(comparisons, missed),
        "seconds": time.perf_counter() - began,
    }
    return report, trace
