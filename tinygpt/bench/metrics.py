"""Day 12's request metrics under their first import path: they live in tinygpt.metrics.

The definitions (RequestTrace, TTFT / ITL / TPOT / e2e, percentiles, goodput) moved out of the
bench package so that later days' modules (tinygpt.batching, tinygpt.engine) can use them
without loading every benchmark row: importing anything inside tinygpt.bench runs
tinygpt/bench/__init__.py. Inside the package, import tinygpt.metrics directly.
"""

from tinygpt.metrics import (
                             PERCENTILES,
                             RequestTrace,
                             e2e_latency,
                             goodput,
                             inter_token_latencies,
                             meets_slo,
                             percentile,
                             request_metrics,
                             summarize,
                             tokens_per_second,
                             tpot,
                             ttft,
)

__all__ = [
    "PERCENTILES", "RequestTrace", "e2e_latency", "goodput", "inter_token_latencies",
    "meets_slo", "percentile", "request_metrics", "summarize", "tokens_per_second", "tpot",
    "ttft",
]
