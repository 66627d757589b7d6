"""Day 12: measuring inference.

A request's life, as a client watching the stream sees it:

    submit ──── prefill ────▶ token 1 ─▶ token 2 ─▶ ... ─▶ token n
    |<────────── TTFT ─────────>|<ITL>|                    |
    |<──────────────────── end-to-end latency ────────────>|

    TTFT       time to first token: queueing + prefill + the first sampling step
    ITL        inter-token latency: the gap before each later token (n - 1 of them)
    TPOT       time per output token after the first: (t_n - t_1) / (n - 1), the mean ITL
    e2e        end-to-end latency t_n - t_submit = TTFT + (n - 1) * TPOT
    tokens/s   n / e2e for one request (output tokens; the prompt is not counted)
    goodput    requests per second that meet BOTH a TTFT and a TPOT service-level objective

Latencies are reported as percentiles (p50 / p90 / p99) over repeated requests, because tails
matter to users and means hide them. Every timing here synchronizes the device before reading
the clock, runs under torch.inference_mode, and is preceded by warm-up runs.

`python -m tinygpt bench` also runs the course's speed comparisons side by side in one process
and prints each ratio against its target (never hiding a miss). Day 11-12's rows:

    kv_cache_speedup       cached vs uncached generate, 512-token prompt, 128 new tokens
    hf_generate_speedup    tinygpt cached greedy vs transformers LlamaForCausalLM.generate
    decode_bandwidth       bytes a batch-1 decode step must read / step time / bandwidth
    roofline_prediction    tinygpt.roofline's predicted decode step time vs the measured one

On CPU the decode step runs as generate() runs it, on tinygpt.cpu_kernels' tiled products
(every product split over the cores); decode_bandwidth_unpacked shows torch's plain products
(DecodeStep(tiled=False)) for comparison. On CUDA the step is compiled (CUDA graphs).

Bandwidth: tinygpt.roofline.measure_copy_bandwidth counts a copy's read and write bytes;
measure_read_bandwidth here only reads (what a decode step does with the weights). Both are
reported, and the utilization target is judged against the HIGHER of the two, so a pass
cannot come from picking the smaller denominator.

The request metrics (RequestTrace, TTFT / ITL / TPOT / e2e, percentiles, goodput; pure Python)
live in tinygpt.metrics, outside this package, because later days' modules (batching, engine)
use them and importing anything inside tinygpt.bench runs this file, which loads every row;
they are re-exported here and under their first path, tinygpt.bench.metrics.

The package, one module per concern (imports run down this list):

    harness     clocks, read bandwidth, random prompts, streamed requests, Comparison
    models      the benchmarked model shapes and seeded builds
    plan        the quick and full plans of the core rows
    registry    BenchContext and @register: each day adds its rows in its own module
    decode      days 11-12's rows;  later days: batching, speculative, quant, ...
    run         run_bench: requests, then every registered row group, into one report
    report      the table, the JSON file, the timeline plot
    cli         python -m tinygpt bench [--quick] [--only GROUP] [--json PATH] ...
    load        python -m tinygpt bench serve --url URL: Poisson load on a running server
"""

from tinygpt.bench.cli import build_parser, main
from tinygpt.bench.decode import (
                                   compare_bandwidth,
                                   compare_cache,
                                   compare_hf,
                                   compare_roofline,
                                   measure_decode_step,
)
from tinygpt.bench.harness import (
                                   Comparison,
                                   machine_info,
                                   measure_read_bandwidth,
                                   median_round,
                                   random_prompt,
                                   run_requests,
                                   synchronize,
                                   trace_request,
)
from tinygpt.bench.models import (
                                   bandwidth_model_config,
                                   build_model,
                                   course_model_config,
                                   cuda_bandwidth_model_config,
                                   medium_model_config,
                                   model_info,
)
from tinygpt.bench.plan import BenchPlan, bench_plan
from tinygpt.bench.registry import BenchContext, register, row_groups
from tinygpt.bench.report import format_table, plot_timeline, write_json
from tinygpt.bench.run import SCHEMA_VERSION, run_bench
from tinygpt.metrics import *  # noqa: F403 (day 12's request metrics, see tinygpt.metrics)
from tinygpt.metrics import __all__ as _METRICS

__all__ = [
    *_METRICS, "Comparison", "machine_info", "measure_read_bandwidth", "median_round",
    "random_prompt", "run_requests", "synchronize", "trace_request", "bandwidth_model_config",
    "build_model", "course_model_config", "cuda_bandwidth_model_config", "medium_model_config",
    "model_info", "BenchPlan", "bench_plan", "BenchContext", "register", "row_groups",
    "compare_bandwidth", "compare_cache", "compare_hf", "compare_roofline",
    "measure_decode_step", "SCHEMA_VERSION", "run_bench", "format_table", "plot_timeline",
    "write_json", "build_parser", "main",
]
