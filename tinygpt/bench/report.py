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


def format_table(report: dict) -> str:
    """The report as readable text: request percentiles, then one row per comparison."""
    lines = []
    machine = report["machine"]
    lines.append(f"tinygpt bench ({report['plan']}) on "
                 f"{report['settings']['device']}, {machine['torch_threads']} threads, "
                 f"{machine['cpu_count']} CPUs, load average {machine['load_average_1_5_15']}")
    load = machine["load_average_1_5_15"]
    if load and load[0] > (machine["cpu_count"] or 1):
        lines.append(f"WARNING: the machine was loaded (1-minute load average {load[0]:.1f} on "
                     f"{machine['cpu_count']} CPUs): timings are noisy and ratios unreliable")
    req = report["requests"]
    if req is not None:
        lines.append(f"\nrequests: {req['requests']} streamed greedy requests, "
                     f"{req['model']['parameters']:,}-parameter model")
        lines.append(f"  {'metric':<14}{'p50':>11}{'p90':>11}{'p99':>11}{'mean':>11}")
        rows = (("ttft_s", "TTFT", 1e3, "ms"), ("tpot_s", "TPOT", 1e3, "ms"),
                ("itl_s", "ITL", 1e3, "ms"), ("e2e_s", "e2e", 1e3, "ms"),
                ("tokens_per_s", "tokens/s", 1, ""))
        for key, label, scale, unit in rows:
            summary = req[key]
            if summary is None:
                continue
            cells = "".join(f"{summary[k] * scale:>9.2f}{unit:>2}" for k in ("p50", "p90", "p99",
                                                                              "mean"))
            lines.append(f"  {label:<14}{cells}")
        slo = req["slo"]
        lines.append(f"  goodput {req['goodput_rps']:.2f} requests/s meeting TTFT <= "
                     f"{slo['ttft_s'] * 1e3:g} ms and TPOT <= {slo['tpot_s'] * 1e3:g} ms "
                     f"({req['slo_met']}/{req['requests']} requests)")
    lines.append("")
    header = f"{'comparison':<30}{'measured':>12}{'target':>12}  result"
    lines.append(header)
    lines.append("-" * len(header))
    for c in report["comparisons"]:
        target = f"{c['direction']} {_format_value(c['target'], c['unit'])}"
        result = "met" if c["met"] else f"NOT MET: {c['reason']}"
        if not c["targeted"]:
            result = f"(information only) {result}"
        lines.append(f"{c['name']:<30}{_format_value(c['value'], c['unit']):>12}{target:>12}  "
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
            for note in ("compile_note", "pack_note"):
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
    lines.append(f"\nall targets met: {report['all_targets_met']} "
                 f"({report['seconds']:.0f} s)")
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

