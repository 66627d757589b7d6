"""Day 12's metrics of one request, computed from streamed timestamps.

    submit ──── prefill ────▶ token 1 ─▶ token 2 ─▶ ... ─▶ token n
    |<────────── TTFT ─────────>|<ITL>|                    |
    |<──────────────────── end-to-end latency ────────────>|

Pure Python over timestamps: no torch, so the serving engine and the simulators of later days
use the same definitions. This module sits outside the tinygpt.bench package on purpose: day 13's
batching and day 17's engine import it, and importing anything inside tinygpt.bench runs
tinygpt/bench/__init__.py, which loads the whole benchmark suite. tinygpt.bench.metrics and
tinygpt.bench re-export every name here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PERCENTILES", "RequestTrace", "e2e_latency", "goodput", "inter_token_latencies",
           "meets_slo", "percentile", "request_metrics", "summarize", "tokens_per_second",
           "tpot", "ttft"]

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTrace:
    """Timestamps of one streamed request, in seconds of one clock (e.g. time.perf_counter).

    start: when the request was submitted.   token_times: when each new token arrived, in
    order (at least one).   prompt_tokens: the prompt's length (an int >= 0). Every time is a
    finite number (a NaN would pass every order check unseen).
    """

    start: float
    token_times: tuple[float, ...]
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        times = tuple(float(t) for t in self.token_times)
        if not times:
            raise ValueError("token_times must hold at least one timestamp")
        if not all(math.isfinite(t) for t in (float(self.start), *times)):
            raise ValueError(f"start and token_times must be finite numbers of seconds, got "
                             f"start={self.start!r} and {len(times)} token times with "
                             f"{sum(not math.isfinite(t) for t in times)} not finite")
        count = self.prompt_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {count!r}")
        if times[0] < self.start or any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("token_times must be non-decreasing and not before start")
        object.__setattr__(self, "token_times", times)

    @property
    def n_tokens(self) -> int:
        return len(self.token_times)


def ttft(trace: RequestTrace) -> float:
    """Time to first token: token_times[0] - start."""
    return trace.token_times[0] - trace.start


def inter_token_latencies(trace: RequestTrace) -> list[float]:
    """The n - 1 gaps between consecutive tokens (empty for a one-token request)."""
    times = trace.token_times
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def tpot(trace: RequestTrace) -> float | None:
    """Time per output token after the first: (t_n - t_1) / (n - 1); None when n == 1."""
    if trace.n_tokens < 2:
        return None
    return (trace.token_times[-1] - trace.token_times[0]) / (trace.n_tokens - 1)


def e2e_latency(trace: RequestTrace) -> float:
    """End-to-end latency: last token time - start."""
    return trace.token_times[-1] - trace.start


def tokens_per_second(trace: RequestTrace) -> float:
    """Output tokens per second of one request: n / e2e latency, math.inf when that latency
    is 0 (every token stamped at `start`: a clock too coarse to tell them apart, or a
    simulated step of 0 seconds)."""
    e2e = e2e_latency(trace)
    return trace.n_tokens / e2e if e2e > 0 else math.inf


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between order statistics.

    Sorted values v_0 .. v_{n-1}: position p = q / 100 * (n - 1), answer v_floor(p) +
    (p - floor(p)) * (v_ceil(p) - v_floor(p)), or v_floor(p) when p is whole or the two are
    equal (so an infinite value gives inf, not 0 * inf = nan). Same as numpy.percentile's
    default on finite values. A NaN is a ValueError (sorting with it depends on the order the
    values came in).
    """
    if isinstance(q, bool) or not isinstance(q, int | float) or not 0 <= q <= 100:
        raise ValueError(f"q must be a number in [0, 100], got {q!r}")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("values must not be empty")
    if any(math.isnan(v) for v in ordered):
        raise ValueError("values must not contain NaN")
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    if position == low or ordered[high] == ordered[low]:
        return ordered[low]
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def summarize(values: Sequence[float]) -> dict:
    """{"n", "mean", "min", "p50", "p90", "p99", "max"} of a non-empty list of numbers."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("values must not be empty")
    out = {"n": len(values), "mean": statistics.fmean(values), "min": min(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    out["max"] = max(values)
    return out


def meets_slo(trace: RequestTrace, ttft_slo: float, tpot_slo: float) -> bool:
    """TTFT <= ttft_slo and TPOT <= tpot_slo (a one-token request has no TPOT to miss)."""
    per_token = tpot(trace)
    return ttft(trace) <= ttft_slo and (per_token is None or per_token <= tpot_slo)


def goodput(traces: Sequence[RequestTrace], ttft_slo: float, tpot_slo: float,
            duration: float | None = None) -> float:
    """Requests per second that meet both SLOs (seconds): count meeting / duration.

    duration defaults to the span of the run: the last token of any request minus the
    earliest start.
    """
    for name, value in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    if not traces:
        raise ValueError("traces must not be empty")
    if duration is None:
        duration = (max(t.token_times[-1] for t in traces) - min(t.start for t in traces))
    if isinstance(duration, bool) or not isinstance(duration, int | float) \
            or not 0 < duration < math.inf:
        raise ValueError(f"duration must be a finite number of seconds > 0, got {duration!r}")
    return sum(meets_slo(t, ttft_slo, tpot_slo) for t in traces) / duration


def request_metrics(traces: Sequence[RequestTrace], ttft_slo: float, tpot_slo: float) -> dict:
    """Percentile summaries of every metric over `traces`, and the goodput under the SLOs.

    Returns {"requests", "ttft_s", "tpot_s", "itl_s", "e2e_s", "tokens_per_s", "slo",
    "slo_met", "goodput_rps"}; each *_s / tokens_per_s entry is a `summarize` dict (tpot_s
    is None when every request produced one token).
    """
    if not traces:
        raise ValueError("traces must not be empty")
    tpots = [v for v in map(tpot, traces) if v is not None]
    itls = [gap for t in traces for gap in inter_token_latencies(t)]
    return {
        "requests": len(traces),
        "ttft_s": summarize([ttft(t) for t in traces]),
        "tpot_s": summarize(tpots) if tpots else None,
        "itl_s": summarize(itls) if itls else None,
        "e2e_s": summarize([e2e_latency(t) for t in traces]),
        "tokens_per_s": summarize([tokens_per_second(t) for t in traces]),
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "slo_met": sum(meets_slo(t, ttft_slo, tpot_slo) for t in traces),
        "goodput_rps": goodput(traces, ttft_slo, tpot_slo),
    }

