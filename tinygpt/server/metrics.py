"""GET /metrics: Prometheus counters, gauges and histograms over the engine, in a registry of
the app's own (two apps in one process never share counts). HTTP requests by path and status
(counted by a middleware, paths outside the API as "other"), finished requests by reason,
generated tokens, TTFT, inter-token latency and queue time (observed when the engine ends a
request), and what engine.stats() says at scrape time: gauges of the running and waiting
requests, the KV pool and the prefix cache's blocks and hit rate, and counters of the
preemptions and the prefix cache's queries and hits (running totals: NAME_total)."""

from __future__ import annotations

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tinygpt.engine import latency_samples

# the paths counted under their own name; /v1/models/{id} counts as /v1/models
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
         "/tokenize", "/detokenize", "/tokenizer_info")

GAUGES = {   # name: (help, the EngineStats field it reads)
    "tinygpt_requests_running": ("requests generating now", "running"),
    "tinygpt_requests_waiting": ("requests waiting for the engine", "waiting"),
    "tinygpt_kv_blocks_used": ("KV-cache blocks in use", "kv_blocks_used"),
    "tinygpt_kv_blocks_total": ("KV-cache blocks in the pool", "kv_blocks_total"),
    "tinygpt_prefix_cache_blocks": ("KV blocks findable by a prefix key (in use or kept "
                                     "after their request ended)", "prefix_cached_blocks"),
}

# running totals of the engine's, exposed as counters: NAME_total in the text
TOTALS = {   # name: (help, the EngineStats field it reads)
    "tinygpt_preemptions": ("sequences preempted so far", "preemptions"),
    "tinygpt_prefix_cache_queries": ("prompt tokens looked up in the prefix cache",
                                     "prefix_query_tokens"),
    "tinygpt_prefix_cache_hits": ("prompt tokens found in the prefix cache (not computed)",
                                  "prefix_hit_tokens"),
}


class Totals(Collector):
    """TOTALS, read from one engine.stats() at each scrape."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, (doc, attr) in TOTALS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr))


class Metrics:
    """The registry over `engine` (AsyncEngine's stats()); `observe` is what the engine calls
    when a request ends, `count` what the HTTP middleware calls for each response."""

    def __init__(self, engine) -> None:
        self.registry = registry = prom.CollectorRegistry()
        self.http_requests = prom.Counter("tinygpt_http_requests",
                                          "HTTP requests by path and status", ["path", "status"],
                                          registry=registry)
        self.finished = prom.Counter("tinygpt_requests_finished",
                                     "generation requests by finish reason", ["reason"],
                                     registry=registry)
        self.tokens = prom.Counter("tinygpt_generated_tokens", "tokens generated",
                                   registry=registry)
        self.ttft = prom.Histogram("tinygpt_time_to_first_token_seconds",
                                   "TTFT (queue included)", registry=registry)
        self.itl = prom.Histogram("tinygpt_inter_token_latency_seconds", "gap between tokens",
                                  buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2),
                                  registry=registry)
        for name, (doc, attr) in GAUGES.items():
            prom.Gauge(name, doc, registry=registry).set_function(
                lambda attr=attr: getattr(engine.stats(), attr))

        registry.register(Totals(engine))

        def hit_rate() -> float:
            stats = engine.stats()
            return stats.prefix_hit_tokens / stats.prefix_query_tokens if \
                stats.prefix_query_tokens else 0.0

        prom.Gauge("tinygpt_prefix_cache_hit_rate", "prefix-cache hits over queries (tokens)",
                   registry=registry).set_function(hit_rate)
        self.queue = prom.Histogram("tinygpt_queue_seconds", "time waiting before the engine "
                                    "ran the request", registry=registry)

    def observe(self, request) -> None:
        """A finished request (the engine's on_finish: called on its worker thread, or on the
        event loop for the requests SerialEngine.shutdown cancels while they wait)."""
        self.finished.labels(request.finish_reason or "unknown").inc()
        if request.queue_time is not None:
            self.queue.observe(request.queue_time)
        if getattr(request, "scoring", False):
            return      # an echo with max_tokens 0: its one token scored the prompt, none returned
        self.tokens.inc(len(request.token_times))
        first, gaps = latency_samples(request)
        if first is not None:
            self.ttft.observe(first)
        for gap in gaps:
            self.itl.observe(gap)

    def count(self, path: str, status: int) -> None:
        known = path if path in PATHS else "/v1/models" if path.startswith(
            "/v1/models/") else "other"
        self.http_requests.labels(known, str(status)).inc()

    def text(self) -> tuple[str, str]:
        """The exposition text and its media type."""
        return prom.generate_latest(self.registry).decode(), prom.CONTENT_TYPE_LATEST
