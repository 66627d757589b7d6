"""Tests of tinygpt.bench: the request metrics on hand-made timestamps (TTFT, ITL, TPOT, e2e,
percentiles, goodput), streamed traces with a fake clock, each comparison's arithmetic on
synthetic measurements, the JSON report's schema from a miniature run, the table, the timeline
plot and the command line. Real benchmark numbers are not asserted: they belong to `make bench`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tinygpt import bench as B
from tinygpt import flops as F
from tinygpt import roofline as R
from tinygpt.generate import generate
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams

TINY = ModelConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                   max_seq_len=64)


def tiny_model(seed: int = 0) -> TinyGPT:
    model = TinyGPT(TINY, seed=seed).eval()
    with torch.no_grad():  # sharper logits: no argmax near-ties between implementations
        model.output.weight.mul_(40)
    return model


def trace(start, *times, prompt_tokens=3):
    return B.RequestTrace(start, times, prompt_tokens)


# ----------------------------------------------------------------------------------------------
# metrics on synthetic timestamps


def test_metrics_of_one_request_by_hand():
    t = trace(10.0, 10.5, 10.6, 10.8, 11.1)
    assert B.ttft(t) == pytest.approx(0.5)
    assert B.inter_token_latencies(t) == pytest.approx([0.1, 0.2, 0.3])
    assert B.tpot(t) == pytest.approx(0.6 / 3)               # (t_n - t_1) / (n - 1)
    assert B.e2e_latency(t) == pytest.approx(1.1)
    assert B.tokens_per_second(t) == pytest.approx(4 / 1.1)
    assert B.e2e_latency(t) == pytest.approx(B.ttft(t) + 3 * B.tpot(t))
    one = trace(2.0, 2.25)
    assert B.tpot(one) is None and B.inter_token_latencies(one) == []
    assert B.tokens_per_second(one) == pytest.approx(4.0)


def test_trace_validation():
    with pytest.raises(ValueError, match="at least one"):
        trace(0.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        trace(0.0, 0.2, 0.1)
    with pytest.raises(ValueError, match="before start"):
        trace(1.0, 0.5)
    assert trace(0, 1, 1).n_tokens == 2  # two tokens in one flush are fine
    # a NaN passed every order check; a negative prompt length was kept
    for bad in ((math.nan, 1.0), (0.0, math.nan), (0.0, 0.5, math.inf)):
        with pytest.raises(ValueError, match="must be finite numbers of seconds"):
            trace(*bad)
    with pytest.raises(ValueError, match="prompt_tokens must be an int >= 0, got -3"):
        B.RequestTrace(0.0, (1.0,), prompt_tokens=-3)


def test_percentile_by_hand_and_against_numpy():
    assert B.percentile([1, 2, 3, 4], 50) == 2.5
    assert B.percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)   # 1 + 0.9 * 3 = 3.7th value
    assert B.percentile([7], 99) == 7
    assert B.percentile([1, 2], 0) == 1 and B.percentile([1, 2], 100) == 2
    rng = np.random.default_rng(0)
    for n in (2, 5, 37):
        values = rng.exponential(size=n).tolist()
        for q in (0, 12.5, 50, 90, 99, 100):
            assert B.percentile(values, q) == pytest.approx(np.percentile(values, q))
    with pytest.raises(ValueError, match="q must be"):
        B.percentile([1], 101)
    with pytest.raises(ValueError, match="empty"):
        B.percentile([], 50)
    with pytest.raises(ValueError, match="NaN"):      # its answer depended on the order
        B.percentile([3, math.nan, 1, 2], 50)


def test_summarize():
    s = B.summarize([3.0, 1.0, 2.0, 10.0])
    assert list(s) == ["n", "mean", "min", "p50", "p90", "p99", "max"]
    assert s["n"] == 4 and s["mean"] == 4.0 and s["min"] == 1.0 and s["max"] == 10.0
    assert s["p50"] == 2.5 and s["p90"] == pytest.approx(3 + 0.7 * 7)
    with pytest.raises(ValueError):
        B.summarize([])


def test_goodput_by_hand():
    traces = [
        trace(0.0, 0.05, 0.07, 0.09),          # TTFT 0.05, TPOT 0.02: meets both
        trace(0.1, 0.4, 0.41),                 # TTFT 0.3: misses the TTFT SLO
        trace(0.5, 0.6, 0.7, 0.8, 0.9),        # TPOT 0.1: misses the TPOT SLO
        trace(1.0, 1.1),                       # one token: TTFT 0.1, no TPOT to miss
    ]
    met = [B.meets_slo(t, 0.2, 0.05) for t in traces]
    assert met == [True, False, False, True]
    assert B.goodput(traces, 0.2, 0.05) == pytest.approx(2 / 1.1)  # span 0.0 .. 1.1 s
    assert B.goodput(traces, 0.2, 0.05, duration=4.0) == pytest.approx(0.5)
    assert B.goodput(traces, 1.0, 1.0) == pytest.approx(4 / 1.1)
    with pytest.raises(ValueError, match="ttft_slo"):
        B.goodput(traces, 0, 0.05)
    with pytest.raises(ValueError, match="empty"):
        B.goodput([], 0.2, 0.05)
    for bad in (True, math.inf, 0):                   # True was read as one second
        with pytest.raises(ValueError, match="duration must be a finite number of seconds"):
            B.goodput(traces, 0.2, 0.05, duration=bad)


def test_request_metrics():
    traces = [trace(0.0, 0.1, 0.2, 0.4), trace(1.0, 1.3)]
    m = B.request_metrics(traces, ttft_slo=0.2, tpot_slo=0.2)
    assert m["requests"] == 2 and m["slo_met"] == 1
    assert m["ttft_s"]["p50"] == pytest.approx(0.2)             # TTFTs 0.1 and 0.3
    assert m["tpot_s"]["n"] == 1 and m["tpot_s"]["mean"] == pytest.approx(0.15)
    assert m["itl_s"]["n"] == 2 and m["itl_s"]["max"] == pytest.approx(0.2)
    assert m["e2e_s"]["max"] == pytest.approx(0.4)
    assert m["goodput_rps"] == pytest.approx(1 / 1.3)
    assert B.request_metrics([trace(0, 1)], 2, 2)["tpot_s"] is None


# ----------------------------------------------------------------------------------------------
# measuring


def test_trace_request_timestamps_every_streamed_token():
    model = tiny_model()
    ticks = iter(range(100))
    params = SamplingParams(temperature=0, max_new_tokens=6)
    t, ids = B.trace_request(model, [1, 2, 3], params, clock=lambda: float(next(ticks)))
    assert t.start == 0.0 and t.token_times == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    assert B.ttft(t) == 1.0 and B.tpot(t) == 1.0 and t.prompt_tokens == 3
    assert ids == generate(model, [1, 2, 3], params).token_ids
    t2, ids2 = B.trace_request(model, torch.tensor([1, 2, 3]), params, use_cache=False)
    assert ids2 == ids and t2.n_tokens == 6 and t2.prompt_tokens == 3


def test_run_requests_and_random_prompt_refuse_bad_arguments():
    model = tiny_model()
    traces = B.run_requests(model, 3, 2, (3, 5), warmup=3)
    assert [t.prompt_tokens for t in traces] == [3, 5, 3] and all(t.n_tokens == 2 for t in traces)
    for kwargs, match in [(dict(prompt_lengths=()), "prompt_lengths must be a non-empty"),
                          (dict(prompt_lengths=4), "prompt_lengths must be a non-empty"),
                          (dict(prompt_lengths=(4, 0)), r"prompt_lengths\[1\] must be >= 1"),
                          (dict(warmup=-1), "warmup must be >= 0, got -1"),
                          (dict(warmup=4), "warmup must be at most n_requests=3")]:
        with pytest.raises((ValueError, TypeError), match=match):
            B.run_requests(model, 3, 2, **{"prompt_lengths": (3,), **kwargs})
    assert B.random_prompt(4, 1, seed=0) == [0, 0, 0, 0]
    for vocab_size in (0, -5):
        with pytest.raises(ValueError, match=f"vocab_size must be >= 1, got {vocab_size}"):
            B.random_prompt(4, vocab_size, seed=0)
    for seed, error in ((1.5, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="seed must be"):
            B.random_prompt(4, 10, seed=seed)


def test_measure_decode_step_counts_the_bytes_it_must_read():
    model = tiny_model()
    step = B.measure_decode_step(model, context_len=8, steps=4, warmup=2)
    assert step["context_len"] == round(8 + 2 + 5 / 2)
    assert step["bytes_per_step"] == F.decode_step_bytes(TINY, 1, step["context_len"], "fp32")
    assert len(step["step_s_all"]) == 4 and step["step_s"] > 0
    assert step["compiled"] is False and step["compile_note"] is None
    assert step["packed"] is False and step["pack_note"] is None
    packed = B.measure_decode_step(model, context_len=8, steps=2, warmup=1, pack_weights=True)
    assert packed["packed"] is True and packed["pack_note"] is None


def test_measure_read_bandwidth():
    assert B.measure_read_bandwidth(2**20, repeats=1) > 0
    with pytest.raises(ValueError, match="nbytes"):
        B.measure_read_bandwidth(2)


# ----------------------------------------------------------------------------------------------
# the comparisons' arithmetic


def test_compare_bandwidth_by_hand():
    step = {"bytes_per_step": 10**9, "step_s": 0.5}              # 2 GB/s achieved
    c = B.compare_bandwidth(step, copy_bandwidth=3e9, read_bandwidth=4e9, target=0.5)
    assert c.value == pytest.approx(0.5) and c.met and c.reason is None
    assert c.details["judged_against"] == "read"                  # the higher bandwidth
    assert c.details["utilization_vs_copy"] == pytest.approx(2 / 3)
    assert c.details["utilization_vs_read"] == pytest.approx(0.5)
    c = B.compare_bandwidth(step, copy_bandwidth=5e9, read_bandwidth=4e9, target=0.5)
    assert c.value == pytest.approx(0.4) and not c.met and "40%" in c.reason
    assert c.details["judged_against"] == "copy"


def test_compare_roofline_by_hand():
    hw = R.Hardware("test", {"fp32": 1e12}, 1e10, 1e11,
                    {"fp32": "made up", "bandwidth": "made up", "memory": "made up"})
    context = 40
    nbytes = F.decode_step_bytes(TINY, 1, context, "fp32")
    predicted = nbytes / 1e10                                    # memory-bound: bytes / W
    c = B.compare_roofline(TINY, {"context_len": context, "step_s": predicted * 1.25}, hw,
                           "fp32", read_bandwidth=2e10)
    assert c.details["predicted_s"] == pytest.approx(predicted)
    assert c.value == pytest.approx(abs(1 / 1.25 - 1)) and c.met   # 20% error
    assert c.details["predicted_s_read_bandwidth"] == pytest.approx(nbytes / 2e10)
    c = B.compare_roofline(TINY, {"context_len": context, "step_s": predicted * 2}, hw, "fp32")
    assert c.value == pytest.approx(0.5) and not c.met and "-50%" in c.reason


def test_median_round_keeps_one_real_round():
    def c(value):
        return B.Comparison("x", "", value, 0.5, ">=", "fraction", value >= 0.5, None,
                            {"step_s": value})
    rounds = [c(0.7), c(0.2), c(0.55)]
    chosen = B.median_round(rounds)
    assert chosen is rounds[2] and chosen.details == {"step_s": 0.55,
                                                      "round_values": [0.7, 0.2, 0.55]}
    assert B.median_round([c(0.1), c(0.9)]).value == 0.9
    with pytest.raises(ValueError, match="rounds"):
        B.median_round([])


def test_compare_cache_and_hf_on_a_tiny_model():
    model = tiny_model()
    c = B.compare_cache(model, prompt_len=8, new_tokens=4, repeats=1)
    assert c.details["identical_tokens"] and c.value > 0 and c.unit == "x"
    assert c.details["cached_tokens_per_s"] == pytest.approx(4 / c.details["cached_s"])
    assert c.value == pytest.approx(c.details["uncached_s"] / c.details["cached_s"])
    strict = B.compare_cache(model, prompt_len=8, new_tokens=4, repeats=1, target=1e9)
    assert not strict.met and "below" in strict.reason
    h = B.compare_hf(model, prompt_len=5, new_tokens=6, repeats=1)
    assert h.details["identical_tokens"], "HF greedy must pick the same tokens on equal weights"
    assert h.value == pytest.approx(h.details["hf_s"] / h.details["tinygpt_s"])
    assert h.met == (h.value >= 1.5)


# ----------------------------------------------------------------------------------------------
# the report


# the row groups of days 11-12 (later days test their own rows directly)
CORE = ["requests", "kv_cache", "hf_generate", "decode_bandwidth"]


def micro_plan() -> B.BenchPlan:
    return B.BenchPlan(
        name="micro", requests=2, request_new_tokens=3, request_prompt_lengths=(4, 6),
        request_model=TINY, cache_model=TINY, cache_prompt_len=6, cache_new_tokens=3,
        cache_repeats=1, hf_model=TINY, hf_prompt_len=4, hf_new_tokens=3, hf_repeats=1,
        hf_info_model=TINY, bandwidth_model=TINY, cuda_bandwidth_model=TINY,
        bandwidth_bytes=2**20, bandwidth_repeats=1,
        decode_context=4, decode_steps=2, decode_rounds=2, roofline_seconds=0.05)


@pytest.fixture(scope="module")
def micro_report():
    threads = torch.get_num_threads()
    try:
        report, one = B.run_bench(micro_plan(), threads=1, log=lambda line: None, only=CORE)
    finally:
        torch.set_num_threads(threads)
    return report, one


def test_report_schema(micro_report, tmp_path):
    report, one = micro_report
    assert set(report) == {"schema_version", "tool", "created_utc", "plan", "machine",
                           "settings", "requests", "comparisons", "groups", "skipped",
                           "all_targets_met", "seconds"}
    assert report["groups"] == CORE[1:] and report["skipped"] == {}
    assert report["schema_version"] == B.SCHEMA_VERSION and report["plan"] == "micro"
    assert report["settings"]["threads"] == 1 and report["machine"]["torch_threads"] == 1
    req = report["requests"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(req[key]) == {"n", "mean", "min", "p50", "p90", "p99", "max"}
    rates = req["tokens_per_s"]           # higher is better: the slow tail is p10 / p1
    assert set(rates) == {"n", "mean", "min", "p1", "p10", "p50", "p90", "p99", "max"}
    assert rates["min"] <= rates["p1"] <= rates["p10"] <= rates["p50"]
    assert req["requests"] == 2 and req["model"]["parameters"] == F.param_count(TINY)
    names = [c["name"] for c in report["comparisons"]]
    assert names == ["kv_cache_speedup", "hf_generate_speedup", "hf_generate_speedup_0m",
                     "decode_bandwidth", "decode_bandwidth_unpacked", "roofline_prediction"]
    for c in report["comparisons"]:
        assert set(c) == {"name", "description", "value", "target", "direction", "unit", "met",
                          "reason", "details", "targeted"}
        assert c["direction"] in (">=", "<=") and (c["reason"] is None) == c["met"]
        assert math.isfinite(c["value"])
    by_name = {c["name"]: c for c in report["comparisons"]}
    for name in ("decode_bandwidth", "decode_bandwidth_unpacked", "roofline_prediction"):
        values = by_name[name]["details"]["round_values"]
        assert len(values) == 2 and by_name[name]["value"] == max(values)   # upper median
    assert by_name["decode_bandwidth"]["details"]["tiled"] is True
    assert by_name["decode_bandwidth_unpacked"]["details"]["tiled"] is False
    roof = by_name["roofline_prediction"]["details"]
    assert roof["hardware_bandwidth"] > 0 and roof["local_roofline_bandwidth"] > 0
    targeted = [c for c in report["comparisons"] if c["targeted"]]
    assert len(targeted) == 4
    assert report["all_targets_met"] == all(c["met"] for c in targeted)
    assert isinstance(one, B.RequestTrace) and one.n_tokens == 3
    path = tmp_path / "bench.json"
    B.write_json(report, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    # a ratio over a zero or a figure not measured here: null in strict JSON, never a crash
    # (on a copy: the report is the module's fixture, which other tests read)
    report = copy.deepcopy(report)
    report["comparisons"][0]["value"] = math.inf
    report["comparisons"][0]["details"]["not_measured"] = [1.0, math.nan]
    B.write_json(report, str(path))
    written = json.loads(path.read_text())["comparisons"][0]
    assert written["value"] is None and written["details"]["not_measured"] == [1.0, None]


@pytest.mark.gpu
def test_bench_on_cuda_compiles_the_step_in_bf16():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: the GPU benchmark test needs a GPU")
    report, _ = B.run_bench(micro_plan(), device="cuda", threads=1, log=lambda line: None)
    by_name = {c["name"]: c for c in report["comparisons"]}
    assert "decode_bandwidth_unpacked" not in by_name            # packing is a CPU option
    step = by_name["decode_bandwidth"]["details"]
    assert step["model"]["dtype"] == "torch.bfloat16" and step["model"]["device"] == "cuda:0"
    assert step["compiled"], step["compile_note"]
    assert by_name["decode_bandwidth"]["target"] == 0.6
    assert by_name["roofline_prediction"]["description"].endswith("bf16")


def test_table_shows_every_comparison_and_never_hides_a_miss(micro_report):
    report, _ = micro_report
    text = B.format_table(report)
    for c in report["comparisons"]:
        row = next(line for line in text.splitlines() if line.startswith(c["name"] + " "))
        assert ("NOT MET" in row) == (c["targeted"] and not c["met"])
        assert row.endswith("  met") == (c["targeted"] and c["met"])     # never on an info row
        assert ("  info" in row) == (not c["targeted"])
    for label in ("TTFT", "TPOT", "ITL", "e2e", "tokens/s", "goodput", "all targets met"):
        assert label in text
    missed = json.loads(json.dumps(report))
    missed["comparisons"][0].update(met=False, reason="made-up miss")
    assert "NOT MET: made-up miss" in B.format_table(missed)


def test_plot_timeline():
    t = trace(0.0, 0.03, 0.035, 0.041, 0.05)
    fig = B.plot_timeline(t)
    assert len(fig.axes) == 2
    assert "TTFT 30.0 ms" in fig.axes[0].get_legend_handles_labels()[1][0]
    assert len(fig.axes[1].patches) == 3                         # one bar per ITL
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    assert B.plot_timeline(trace(0.0, 0.01), ax=ax) is ax.figure


# ----------------------------------------------------------------------------------------------
# command line


def test_cli_arguments(capsys):
    assert B.main(["--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    for argv, message in ((["--threads", "0"], "--threads"), (["--ttft-slo", "0"], "--ttft-slo"),
                          (["--device", "tpu"], "device")):
        assert B.main(argv) == 2
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():             # a clear error, not torch's assertion
        assert B.main(["--device", "cuda", "--only", "captured_decode"]) == 2
        assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_cli_writes_json_and_plot(micro_report, monkeypatch, tmp_path, capsys):
    report, one = micro_report
    seen = {}

    def fake_run(plan, **kwargs):
        seen["plan"], seen["kwargs"] = plan, kwargs
        return report, one

    monkeypatch.setattr(B.cli, "run_bench", fake_run)
    out_json, out_png = tmp_path / "r.json", tmp_path / "t.png"
    assert B.main(["--quick", "--json", str(out_json), "--plot", str(out_png), "--threads",
                   "1"]) == 0
    assert seen["plan"] == B.bench_plan(True) and seen["kwargs"]["threads"] == 1
    assert json.loads(out_json.read_text())["plan"] == "micro"
    assert out_png.read_bytes().startswith(b"\x89PNG")
    assert "kv_cache_speedup" in capsys.readouterr().out
    failing = {**report, "all_targets_met": False}
    monkeypatch.setattr(B.cli, "run_bench", lambda plan, **kwargs: (failing, one))
    assert B.main([]) == 0 and B.main(["--strict"]) == 1


def test_a_benchs_server_gets_the_environment_without_the_benchs_own_settings(monkeypatch):
    """running_server starts `python -m tinygpt serve` in the environment the user gave the
    bench: the keys the bench command added for itself (TINYGPT_ENV_ADDED) are left out, a
    key the user set stays, and an explicit env is passed as it is."""
    from tinygpt.bench import load

    seen = []

    class Exited:                        # a server that exits at once: running_server raises
        def __init__(self, args, env=None, **kwargs):
            seen.append(env)

        def poll(self):
            return 1

        def kill(self):
            pass

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(load.subprocess, "Popen", Exited)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "200000")
    monkeypatch.setenv("TINYGPT_ENV_ADDED", "OMP_WAIT_POLICY")          # the user set the other
    for env in (None, {"A": "1"}):
        with pytest.raises(RuntimeError, match="did not start"), \
                load.running_server(timeout=1, env=env):
            pass
    default, explicit = seen
    assert "OMP_WAIT_POLICY" not in default and "TINYGPT_ENV_ADDED" not in default
    assert default["GOMP_SPINCOUNT"] == "200000" and default["PATH"] == os.environ["PATH"]
    assert explicit == {"A": "1"}


def test_bench_cli_sets_the_openmp_wait_policy_only_before_torch_loads(monkeypatch):
    probe = ("import os; from tinygpt.__main__ import main; main(['bench', '--help']); "
             "print('policy', os.environ.get('OMP_WAIT_POLICY'), "
             "os.environ.get('GOMP_SPINCOUNT'), os.environ.get('TINYGPT_ENV_ADDED'))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TINYGPT_ENV_ADDED")}
    for preset, expected in ((None, "ACTIVE 200000 OMP_WAIT_POLICY,GOMP_SPINCOUNT"),
                             ("PASSIVE", "PASSIVE 200000 GOMP_SPINCOUNT")):
        run_env = env if preset is None else {**env, "OMP_WAIT_POLICY": preset}
        out = subprocess.run([sys.executable, "-c", probe], env=run_env, capture_output=True,
                             text=True, check=True).stdout
        assert f"policy {expected}" in out
    # in a process that already loaded torch (a notebook, this test) nothing is changed
    from tinygpt.__main__ import main as dispatch

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert dispatch(["bench", "--help"]) == 0 and "OMP_WAIT_POLICY" not in os.environ


def test_standard_plans_keep_the_targets_workloads():
    for quick in (True, False):
        plan = B.bench_plan(quick)
        assert (plan.cache_prompt_len, plan.cache_new_tokens) == (512, 128)
        assert plan.cache_model.max_seq_len >= 640 and plan.hf_new_tokens == 128
        weights = F.weight_bytes(plan.bandwidth_model, "fp32")
        kv = F.kv_cache_bytes(plan.bandwidth_model, plan.decode_context + plan.decode_steps + 3,
                              1, "fp32")
        assert weights > 100 * kv and weights > 128 * 2**20  # weights dwarf cache and L3
        assert 0.9e9 < F.param_count(plan.cuda_bandwidth_model) < 1.3e9   # "about 1B" (bf16)


@pytest.mark.slow
def test_bench_quick_smoke(tmp_path, capsys):
    """The real `python -m tinygpt bench --quick`, every row group (4-5 minutes on the 2-core
    AVX2 EPYC, 2026-11-28)."""
    from tinygpt.__main__ import main as dispatch

    threads = torch.get_num_threads()
    try:
        assert dispatch(["bench", "--quick", "--threads", "1", "--json",
                         str(tmp_path / "q.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "q.json").read_text())
    names = [c["name"] for c in report["comparisons"]]
    assert report["plan"] == "quick" and report["groups"] == [g.name for g in B.row_groups()]
    assert names[:5] == ["kv_cache_speedup", "hf_generate_speedup", "decode_bandwidth",
                         "decode_bandwidth_unpacked", "roofline_prediction"]
    assert len(names) > 5, "the later days' rows must run in the quick plan too"
    rows = {c["name"]: c for c in report["comparisons"]}
    for name in ("engine_vs_serial", "engine_vs_hf_cb", "speculative_greedy",
                 "batched_decode"):
        assert rows[name]["details"]["identical_tokens"], f"{name}: the tokens differ"
    assert rows["engine_vs_serial"]["details"]["tokens"] == 16 * 32
    assert rows["engine_vs_hf_cb"]["details"]["hf_cache"]["max_batch_tokens"] == 2048
    prefix = rows["serve_prefix_cache"]["details"]
    assert prefix["identical_replies"], "the prefix cache changed a reply"
    assert prefix["cached_prefill_tokens"] < prefix["uncached_prefill_tokens"] == \
        prefix["uncached_prompt_tokens"]
    assert "all targets met" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# the registry of row groups


def test_row_groups_are_ordered_by_day_and_selectable():
    groups = B.row_groups()
    days = [g.day for g in groups]
    assert days == sorted(days) and days[:4] == [11, 11, 11, 12]
    assert [g.name for g in B.row_groups(["decode_bandwidth", "kv_cache"])] == [
        "kv_cache", "decode_bandwidth"]
    with pytest.raises(ValueError, match="unknown bench row group.*'nope'.*kv_cache"):
        B.row_groups(["nope"])


def test_register_refuses_bad_names_days_and_a_second_owner():
    with pytest.raises(ValueError, match="name"):
        B.register("has space", day=13)
    with pytest.raises(ValueError, match="day"):
        B.register("fine", day=0)

    def kv_cache(ctx):      # another function under an existing group's name
        return []

    with pytest.raises(ValueError, match="already registered"):
        B.register("kv_cache", day=11)(kv_cache)


def test_only_some_groups_and_other_units_in_the_table(monkeypatch):
    def rows(ctx):
        assert ctx.quick and ctx.on_cpu and ctx.seed == 3
        return [B.Comparison("toy_rate", "a rate", 1234.5, 1000.0, ">=", "tokens/s", True, None,
                             {"summary": "1234.5 tokens/s on a toy"})]

    monkeypatch.setitem(B.registry._GROUPS, "toy", B.registry.RowGroup("toy", 99, rows))
    report, trace = B.run_bench(B.bench_plan(quick=True), threads=1, seed=3,
                                log=lambda line: None, only=["toy"])
    assert trace is None and report["requests"] is None and report["groups"] == ["toy"]
    table = B.format_table(report)
    assert "1234 tokens/s" in table and ">= 1000 tokens/s" in table
    assert "toy_rate: 1234.5 tokens/s on a toy" in table and "requests:" not in table


def test_cli_lists_groups_and_rejects_unknown_ones(capsys):
    assert B.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "requests" in listed and "kv_cache" in listed and "decode_bandwidth" in listed
    assert B.main(["--only", "nope"]) == 2
    assert "unknown bench row group" in capsys.readouterr().err


def test_the_batched_decode_row_on_a_tiny_model(monkeypatch):
    from tinygpt.bench import batching as row

    monkeypatch.setattr(row, "bandwidth_model_config", lambda: TINY)
    ctx = B.BenchContext(plan=B.bench_plan(quick=True), threads=1, log=lambda line: None)
    (c,) = row.batched_decode(ctx)
    assert c.name == "batched_decode" and c.unit == "x" and c.value > 0
    assert c.details["identical_tokens"] and c.details["rows_compared"] == 2
    assert c.met == (c.value >= 6.0) and "tokens/s" in c.details["summary"]
    _, ids = row.greedy_decode(B.build_model(TINY), torch.zeros(2, 3, dtype=torch.long), 4,
                               pack=False)
    assert len(ids) == 2 and all(len(r) == 1 + 2 + 4 for r in ids)


def test_a_group_that_raises_costs_only_its_own_rows(monkeypatch):
    def broken(ctx):
        raise FileNotFoundError("no such model: smollm2")

    def fine(ctx):
        return [B.Comparison("toy_rate", "a rate", 2.0, 1.0, ">=", "x", True, None)]

    monkeypatch.setitem(B.registry._GROUPS, "broken", B.registry.RowGroup("broken", 98, broken))
    monkeypatch.setitem(B.registry._GROUPS, "toy", B.registry.RowGroup("toy", 99, fine))
    logged = []
    report, _ = B.run_bench(B.bench_plan(quick=True), threads=1, log=logged.append,
                            only=["broken", "toy"])
    rows = {c["name"]: c for c in report["comparisons"]}
    assert rows["toy_rate"]["met"] and not report["all_targets_met"]
    failed = rows["broken_failed"]
    assert not failed["met"] and failed["reason"] == "FileNotFoundError: no such model: smollm2"
    assert "broken: FAILED" in logged[-1] and "Traceback" in logged[-1]
    assert "NOT MET" in B.format_table(report)
