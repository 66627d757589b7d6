"""Day 12's request metrics under their first import path: they live in tinygpt.metrics.

The definitions (RequestTrace, TTFT / ITL / TPOT / e2e, percentiles, goodput) moved out of the
bench package so that later days' modules (tinygpt.batching, tinygpt.engine) can use them
without loading every benchmark row: importing anything inside tinygpt.bench runs
tinygpt/bench/__init__.py. Inside the package, import tinygpt.metrics directly.
"""

from tinygpt.metrics import *  # noqa: F403 (every name of tinygpt.metrics, as before)
from tinygpt.metrics import __all__  # noqa: F401
