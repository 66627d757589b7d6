"""Output of `python -m tinygpt bench`: the readable table, the JSON file, a timeline plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tinygpt.metrics import RequestTrace, inter_token_latencies, tpot

PERCENT_UNITS = ("%", "fraction", "relative error")


def _format_value(value: float, unit: str) -> str:
    """A ratio as "2.50x", a fraction as "61.7%", anything else as "<value> <unit>"."""
    if unit == "x":
        return f"{value:.2f}x"
    if unit in PERCENT_UNITS:
        return f"{value:.1%}"
    return f"{value:.4g} {unit}"


def _met_by_value(c: dict) -> bool:
    """Whether a row's value satisfies its target as the table prints them."""
    if c["direction"] == ">=":
        return c["value"] >= c["target"]
    return c["value"] <= c["target"]


def verdict(c: dict) -> str:
    """The result column of one row: "met" or "NOT MET: <reason>" for a targeted row; for
    the others no verdict, their label ("info", or "quick: not judged" from
    details["not_judged"]) with the reason, when there is one, as information."""
    if c["targeted"]:
        return "met" if c["met"] else f"NOT MET: {c['reason']}"
    label = c["details"].get("not_judged") or "info"
    return label if c["reason"] is None else f"{label}: {c['reason']}"


def _machine_line(report: dict) -> str:
    machine = report["machine"]
    cpu = machine.get("cpu") or {}
    name = cpu.get("name") or machine.get("processor") or "unknown CPU"
    if cpu.get("family") is not None:
        name += f" (family {cpu['family']}, model {cpu.get('model')})"
    isa = ", ".join(cpu.get("isa") or []) or "none of the ISA flags the kernels use"
    gpu = f"; GPU {machine['cuda']}" if machine.get("cuda") else ""
    return (f"machine: {name}; ISA: {isa}; {machine['cpu_count']} CPUs; "
            f"{machine['platform']}{gpu}")


def _request_lines(req: dict) -> list[str]:
    """The streamed-request percentiles. Each column's tail is the slow side: p90 / p99 for a
    time, p10 / p1 for tokens/s (fewer tokens per second is slower)."""
    lines = [f"\nrequests: {req['requests']} streamed greedy requests, "
             f"{req['model']['parameters']:,}-parameter model",
             f"  {'metric':<10}{'p50':>11}{'slow 90%':>11}{'slow 99%':>11}{'mean':>11}"
             f"{'n':>6}"]
    rows = (("ttft_s", "TTFT", 1e3, "ms", ("p90", "p99")),
            ("tpot_s", "TPOT", 1e3, "ms", ("p90", "p99")),
            ("itl_s", "ITL", 1e3, "ms", ("p90", "p99")),
            ("e2e_s", "e2e", 1e3, "ms", ("p90", "p99")),
            ("tokens_per_s", "tokens/s", 1, "", ("p10", "p1")))
    for key, label, scale, unit, tail in rows:
        summary = req[key]
        if summary is None:
            continue
        keys = ("p50", *tail, "mean") if all(k in summary for k in tail) else \
            ("p50", "p90", "p99", "mean")        # a report written before p10 / p1
        cells = "".join(f"{summary[k] * scale:>9.2f}{unit:>2}" for k in keys)
        lines.append(f"  {label:<10}{cells}{summary['n']:>6}")
    lines.append("  (slow 90% / 99%: p90 / p99 of the times, p10 / p1 of tokens/s)")
    slo = req["slo"]
    lines.append(f"  goodput {req['goodput_rps']:.2f} requests/s meeting TTFT <= "
                 f"{slo['ttft_s'] * 1e3:g} ms and TPOT <= {slo['tpot_s'] * 1e3:g} ms "
                 f"({req['slo_met']}/{req['requests']} requests)")
    return lines


def _summary_line(report: dict) -> str:
    met = report["all_targets_met"]
    seconds = f"({report['seconds']:.0f} s)"
    if report["plan"] == "quick":
        return (f"all targets met: {met} {seconds}: the quick plan judges no target (too few "
                f"samples); it only checks that every row runs")
    if met is None:
        return f"all targets met: None {seconds}: no targeted row ran, nothing was judged"
    return f"all targets met: {met} {seconds}"


def format_table(report: dict) -> str:
    """The report as readable text: the machine, request percentiles, one row per comparison
    (columns sized to their contents), the rows' notes, the skipped groups and rows."""
    lines = []
    machine = report["machine"]
    lines.append(f"tinygpt bench ({report['plan']}) on "
                 f"{report['settings']['device']}, {machine['torch_threads']} threads, "
                 f"{machine['cpu_count']} CPUs, load average {machine['load_average_1_5_15']}")
    lines.append(_machine_line(report))
    load = machine["load_average_1_5_15"]
    if load and load[0] > (machine["cpu_count"] or 1):
        lines.append(f"WARNING: the machine was loaded (1-minute load average {load[0]:.1f} on "
                     f"{machine['cpu_count']} CPUs): timings are noisy and ratios unreliable")
    if report["requests"] is not None:
        lines.extend(_request_lines(report["requests"]))
    lines.append("")
    cells = [(c["name"], _format_value(c["value"], c["unit"]),
              f"{c['direction']} {_format_value(c['target'], c['unit'])}", verdict(c))
             for c in report["comparisons"]]
    widths = [max([len(title), *(len(row[i]) for row in cells)])
              for i, title in enumerate(("comparison", "measured", "target"))]
    header = (f"{'comparison':<{widths[0]}}  {'measured':>{widths[1]}}  "
              f"{'target':>{widths[2]}}  result")
    lines.append(header)
    lines.append("-" * len(header))
    for name, value, target, result in cells:
        lines.append(f"{name:<{widths[0]}}  {value:>{widths[1]}}  {target:>{widths[2]}}  "
                     f"{result}")
    for c in report["comparisons"]:
        d = c["details"]
        if c["name"].startswith("decode_bandwidth"):
            layout = " (prepacked weights)" if d.get("packed") else ""
            lines.append(f"\n{c['name']}{layout}: {d['bytes_per_step'] / 1e6:.1f} MB per step in "
                         f"{d['step_s'] * 1e3:.2f} ms = {d['achieved_bytes_per_s'] / 1e9:.2f} "
                         f"GB/s; {d['utilization_vs_copy']:.0%} of copy bandwidth "
                         f"{d['copy_bandwidth'] / 1e9:.2f} GB/s (read + write counted), "
                         f"{d['utilization_vs_read']:.0%} of read-only bandwidth "
                         f"{d['read_bandwidth'] / 1e9:.2f} GB/s; judged against the "
                         f"{d['judged_against']} figure, the higher one")
            for note in ("compile_note", "pack_note", "tiled_note"):
                if d.get(note):
                    lines.append(f"  note: {d[note]}")
        if c["name"].startswith("hf_generate") or c["name"] == "kv_cache_speedup":
            rates = {k: v for k, v in d.items() if k.endswith("tokens_per_s")}
            text = ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:.1f} tokens/s"
                             for k, v in rates.items())
            lines.append(f"{c['name']}: {text}; {d['model']['parameters']:,} parameters; "
                         f"identical tokens: {d['identical_tokens']}")
        if d.get("summary"):       # a row's own one-line account of what it measured
            lines.append(f"{c['name']}: {d['summary']}")
    skipped = report.get("skipped") or {}
    if skipped:
        lines.append("\nskipped (did not run):")
        lines.extend(f"  {name}: {reason}" for name, reason in skipped.items())
    lines.append("\n" + _summary_line(report))
    return "\n".join(lines)


def _finite(value):
    """value with every infinite or NaN float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def write_json(report: dict, path: str) -> None:
    """Write the report as indented JSON, strict: an infinite or NaN figure (a ratio over a
    zero, a quantity not measured on this system) is written as null."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(_finite(report), handle, indent=2, allow_nan=False)
        handle.write("\n")


def plot_timeline(trace: RequestTrace, ax=None, *, title: str | None = None):
    """Timeline of one request: TTFT span, then a tick per token, and each ITL as a bar.

    Returns the matplotlib Figure (two stacked Axes when ax is None; with an ax, only the
    timeline is drawn on it). Built without pyplot, so no GUI is needed.
    """
    from matplotlib.figure import Figure

    times_ms = [(t - trace.start) * 1e3 for t in trace.token_times]
    if ax is None:
        fig = Figure(figsize=(8, 4.5))
        ax, ax_itl = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1, 2]})
    else:
        fig, ax_itl = ax.figure, None
    ax.axvspan(0, times_ms[0], color="tab:orange", alpha=0.3,
               label=f"TTFT {times_ms[0]:.1f} ms (prefill)")
    ax.vlines(times_ms, 0, 1, color="tab:blue", linewidth=1, label="token streamed")
    ax.set_yticks([])
    ax.set_xlabel("ms since the request was submitted")
    ax.set_xlim(0, times_ms[-1] * 1.02)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or f"one request: {trace.prompt_tokens}-token prompt, "
                 f"{trace.n_tokens} new tokens, e2e {times_ms[-1]:.1f} ms")
    if ax_itl is not None:
        gaps = [g * 1e3 for g in inter_token_latencies(trace)]
        if gaps:
            ax_itl.bar(range(2, len(gaps) + 2), gaps, color="tab:blue", width=0.8)
            per_token = tpot(trace) * 1e3
            ax_itl.axhline(per_token, color="black", linestyle="--",
                           label=f"TPOT {per_token:.2f} ms")
            ax_itl.legend(fontsize=8)
        ax_itl.set_xlabel("token index")
        ax_itl.set_ylabel("ITL (ms)")
        fig.tight_layout()
    return fig

