"""Tests of tinygpt.roofline: the hardware table, the roofline model, estimates, measurement,
plotting and the `python -m tinygpt roofline` command line.

References: vendor datasheet figures (dense, not sparse), hand arithmetic, and the known
Llama-2-70B on one H100 example (140 GB / 3.35 TB/s ~ 42 ms per decode step).
"""

from __future__ import annotations

import dataclasses
import math
import time

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from tinygpt import flops, roofline  # noqa: E402
from tinygpt.roofline import HARDWARE, Hardware  # noqa: E402

P = flops.PRESETS
H100, H200 = HARDWARE["h100-sxm"], HARDWARE["h200"]


# --------------------------------------------------------------------------- the table

# (name, dense bf16 TFLOP/s, TB/s, GB): the datasheet figures, sparsity NOT included.
DATASHEET = [
    ("a100-40gb-sxm", 312, 1.555, 40),
    ("a100-80gb-sxm", 312, 2.039, 80),
    ("h100-sxm", 989.4, 3.35, 80),
    ("h100-pcie", 756, 2.0, 80),
    ("h200", 989.4, 4.8, 141),
    ("l4", 121, 0.3, 24),
    ("rtx-4090", 165.2, 1.008, 24),
]


@pytest.mark.parametrize("name,tflops,tb_s,gb", DATASHEET)
def test_datasheet_figures_are_dense(name, tflops, tb_s, gb):
    hw = HARDWARE[name]
    assert hw.name == name
    assert hw.peak("bf16") == pytest.approx(tflops * 1e12, rel=1e-3)
    assert hw.bandwidth == pytest.approx(tb_s * 1e12, rel=1e-3)
    assert hw.memory == pytest.approx(gb * 1e9, rel=1e-3)
    assert hw.peak("fp16") == hw.peak("bf16")
    assert hw.peak("fp32") < hw.peak("bf16")
    for figure in [*hw.peak_flops, "bandwidth", "memory"]:
        assert "datasheet" in hw.source[figure] or "whitepaper" in hw.source[figure]


def test_h100_is_not_the_sparse_figure_and_h200_shares_its_compute():
    assert H100.peak("bf16") < 1000e12          # 1,979 TFLOP/s is the 2:4 sparse figure
    assert H200.peak_flops == H100.peak_flops
    assert H200.bandwidth / H100.bandwidth == pytest.approx(4.8 / 3.35)


def test_an_apple_chip_with_estimates_marked():
    apple = [hw for name, hw in HARDWARE.items() if name.startswith("apple-m")]
    assert apple, "HARDWARE needs one Apple M-series row"
    hw = apple[0]
    assert hw.bandwidth == 400e9 and hw.peak("fp32") == 10.4e12
    assert "ESTIMATE" in hw.source["fp16"] and "ESTIMATE" not in hw.source["bandwidth"]


def test_hardware_validates_its_rows():
    good = dict(name="x", peak_flops={"bf16": 1e12}, bandwidth=1e11, memory=1e9,
                source={"bf16": "a", "bandwidth": "b", "memory": "c"})
    Hardware(**good)
    with pytest.raises(ValueError, match="missing"):
        Hardware(**{**good, "source": {"bf16": "a", "bandwidth": "b"}})
    with pytest.raises(ValueError, match="bandwidth"):
        Hardware(**{**good, "bandwidth": -1.0})
    with pytest.raises(ValueError, match="peak_flops key"):
        Hardware(**{**good, "peak_flops": {"bfloat16": 1e12}})
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16'\]"):
        Hardware(**good).peak("fp8")
    with pytest.raises(ValueError, match="hardware must be one of"):
        roofline.get_hardware("h100")
    peaks = {"bf16": 1e12}
    row = Hardware(**{**good, "peak_flops": peaks})
    peaks["bf16"] = 5.0
    assert row.peak("bf16") == 1e12             # the frozen row kept its own copy
    assert len({row, Hardware(**good), HARDWARE["l4"]}) == 2          # hashable, equal rows


# --------------------------------------------------------------------------- the roofline


def test_ridge_points():
    assert roofline.ridge_point(H100, "bf16") == pytest.approx(295, abs=1)
    assert roofline.ridge_point(H200, "bf16") == pytest.approx(206, abs=1)
    assert roofline.ridge_point(HARDWARE["a100-80gb-sxm"]) == pytest.approx(312 / 2.039, rel=1e-9)


def test_attainable_flops_is_min_of_the_two_roofs():
    ridge = roofline.ridge_point(H100)
    assert roofline.attainable_flops(H100, 1.0) == H100.bandwidth
    assert roofline.attainable_flops(H100, 10.0) == 10 * H100.bandwidth
    assert roofline.attainable_flops(H100, ridge) == pytest.approx(H100.peak("bf16"))
    assert roofline.attainable_flops(H100, 10 * ridge) == H100.peak("bf16")
    with pytest.raises(ValueError, match="intensity"):
        roofline.attainable_flops(H100, -1.0)
    with pytest.raises(TypeError, match="Hardware"):
        roofline.attainable_flops("h100-sxm", 1.0)


def test_op_time_70b_decode_on_one_h100():
    # 70B parameters in bf16 = 140 GB to read per decode step at batch 1; 2 x 70e9 FLOPs.
    seconds, bound = roofline.op_time(2 * 70e9, 140e9, H100, "bf16")
    assert bound == "memory" and seconds == pytest.approx(140e9 / 3.35e12) == pytest.approx(
        0.0418, abs=1e-4)
    assert 2 * 70e9 / H100.peak("bf16") == pytest.approx(0.14e-3, rel=0.02)
    _, bound = roofline.op_time(1e15, 1e9, H100, "bf16")
    assert bound == "compute"


def test_decode_estimate_70b_on_one_h100():
    est = roofline.decode_estimate(P["llama-2-70b"], H100, 1, 1, "bf16")
    assert est.bound == "memory"
    assert 0.040 < est.seconds < 0.043                       # ~137 GB of weights read
    assert est.flops / H100.peak("bf16") == pytest.approx(0.139e-3, rel=0.01)
    assert est.intensity == pytest.approx(1.0, rel=0.01)     # ~batch FLOP/byte in 16-bit
    assert est.seconds == pytest.approx(est.bytes / H100.bandwidth)


def test_decode_intensity_grows_with_batch_attention_does_not():
    cfg = P["llama-3-8b"]
    for batch in (1, 8, 64):
        est = roofline.decode_estimate(cfg, H100, batch, 1)
        assert est.intensity == pytest.approx(batch, rel=0.08)
    # Attention alone does n_rep (the GQA group, 4) FLOPs per byte of bf16 cache, any batch.
    kv = flops.kv_cache_bytes(cfg, 8192, 1, "bf16")
    assert flops.attention_flops_per_token(cfg, 8192) / kv == cfg.n_rep == 4
    # So with a long context a huge batch only approaches (2N + attention) / cache bytes, ~18.
    limit = flops.flops_per_token(cfg, 8192) / (kv + 2 * cfg.d_model)
    long = roofline.decode_estimate(cfg, H100, 4096, 8192)
    assert long.bound == "memory" and long.intensity == pytest.approx(limit, rel=0.01)
    assert long.intensity < limit < roofline.ridge_point(H100) / 10


def test_prefill_is_compute_bound_and_estimate_fields():
    cfg = P["llama-3-8b"]
    est = roofline.prefill_estimate(cfg, H100, 1, 512)
    assert est.phase == "prefill" and est.batch == 1 and est.bound == "compute"
    assert est.flops == flops.prefill_flops(cfg, 1, 512, all_logits=False)
    assert est.bytes == flops.prefill_bytes(cfg, 1, 512, "bf16")
    assert est.intensity == est.flops / est.bytes
    assert est.seconds == pytest.approx(est.flops / H100.peak("bf16"))
    assert est.flops_per_second == pytest.approx(H100.peak("bf16"))


def test_int8_weights_halve_decode_time_and_compute_in_bf16():
    cfg = P["llama-2-70b"]
    bf16 = roofline.decode_estimate(cfg, H100, 1, 1, "bf16")
    int8 = roofline.decode_estimate(cfg, H100, 1, 1, "int8")
    assert int8.seconds == pytest.approx(bf16.seconds / 2, rel=1e-3)
    m1 = HARDWARE["apple-m1-max"]
    with pytest.raises(ValueError, match=r"^compute_dtype must be one of \['bf16', 'fp16', "
                                         r"'fp32'\] for hardware 'apple-m1-max', got 'int8'"):
        roofline.decode_estimate(cfg, m1, 1, 1, "int8", compute_dtype="int8")
    with pytest.raises(ValueError, match="^compute_dtype must be one of"):
        roofline.prefill_estimate(cfg, m1, 1, 8, "bf16", compute_dtype="float16")
    with pytest.raises(ValueError, match="^compute_dtype must be one of"):
        roofline.critical_batch_size(cfg, m1, "bf16", compute_dtype="fp8")
    with pytest.raises(ValueError, match="no peak for 'bf16', the compute dtype of dtype 'int8'"):
        roofline.decode_estimate(cfg, Hardware("fp32 only", {"fp32": 1e12}, 1e12, 1e9,
                                               {"fp32": "t", "bandwidth": "t", "memory": "t"}),
                                 1, 1, "int8")


def test_generation_estimate_averages_the_decode_steps():
    cfg, hw = P["llama-3-8b"], HARDWARE["a100-80gb-sxm"]
    prefill, decode = roofline.generation_estimate(cfg, hw, 4, 100, 11)
    steps = [roofline.decode_estimate(cfg, hw, 4, 100 + i) for i in range(1, 11)]
    assert prefill == roofline.prefill_estimate(cfg, hw, 4, 100)
    assert decode.seconds == pytest.approx(sum(s.seconds for s in steps) / 10)
    assert decode.flops == pytest.approx(sum(s.flops for s in steps) / 10)
    assert decode.bound == "memory"
    assert roofline.generation_estimate(cfg, hw, 1, 10, 1)[1] is None


# --------------------------------------------------------------------------- critical batch


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b", "llama-2-70b"])
def test_critical_batch_is_about_the_ridge_point_for_16_bit_weights(name):
    cfg = P[name]
    ridge = roofline.ridge_point(H100)
    assert roofline.critical_batch_size(cfg, H100, "bf16") == pytest.approx(ridge, rel=0.01)
    assert roofline.critical_batch_size(cfg, H100, "int8") == pytest.approx(ridge / 2, rel=0.01)
    assert roofline.critical_batch_size(cfg, H100, "int4") == pytest.approx(ridge / 4, rel=0.01)


def test_critical_batch_matches_decode_estimates():
    cfg = P["llama-3-8b"]
    b = roofline.critical_batch_size(cfg, H100, "bf16", context_len=64)
    assert roofline.decode_estimate(cfg, H100, math.ceil(b), 64).bound == "compute"
    assert roofline.decode_estimate(cfg, H100, math.floor(b), 64).bound == "memory"


def test_long_context_decode_never_turns_compute_bound():
    # Llama-2-7B has no GQA: attention reads 1 byte of cache per FLOP, far below the ridge.
    cfg = P["llama-2-7b"]
    assert roofline.critical_batch_size(cfg, H100, "bf16", context_len=4096) == math.inf
    assert roofline.decode_estimate(cfg, H100, 10_000, 4096).bound == "memory"
    with pytest.raises(ValueError, match="context_len"):
        roofline.critical_batch_size(cfg, H100, "bf16", context_len=-1)


# --------------------------------------------------------------------------- measuring


def test_measure_matmul_and_copy_are_positive_and_finite():
    rate = roofline.measure_matmul_flops((32, 64), repeats=2, warmup=1, device="cpu")
    bandwidth = roofline.measure_copy_bandwidth(2**20, repeats=2, device="cpu")
    for value in (rate, bandwidth):
        assert math.isfinite(value) and value > 0
    assert rate < 1e14 and bandwidth < 1e13                   # no CPU is this fast


def test_measure_local_roofline_is_quick():
    start = time.perf_counter()
    hw = roofline.measure_local_roofline(seconds_budget=0.3, device="cpu")
    took = time.perf_counter() - start
    assert took < 3.0
    assert isinstance(hw, Hardware) and hw.name == "local"
    assert math.isfinite(hw.peak("fp32")) and hw.peak("fp32") > 0
    assert math.isfinite(hw.bandwidth) and hw.bandwidth > 0 and hw.memory > 0
    assert "measured" in hw.source["fp32"] and "read + write" in hw.source["bandwidth"]
    assert roofline.ridge_point(hw, "fp32") > 0


def test_measure_bad_inputs():
    with pytest.raises(ValueError, match="sizes"):
        roofline.measure_matmul_flops((), device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        roofline.measure_matmul_flops((8,), dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="nbytes"):
        roofline.measure_copy_bandwidth(0, device="cpu")
    with pytest.raises(ValueError, match="seconds_budget"):
        roofline.measure_local_roofline(seconds_budget=0)


# --------------------------------------------------------------------------- plotting


def test_plot_roofline_returns_a_log_log_figure():
    cfg = P["llama-3-8b"]
    points = [roofline.decode_estimate(cfg, H100, b, 512) for b in (1, 8, 64)]
    points.append(roofline.prefill_estimate(cfg, H100, 1, 512))
    points.append(("my op", 3.0, 5e12))
    fig = roofline.plot_roofline([H100, H200], points)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    texts = [t.get_text() for t in ax.texts]
    assert "decode B=8" in texts and "prefill B=1" in texts and "my op" in texts
    assert sum(t.startswith("ridge") for t in texts) == 2
    # The roof reaches the H100 peak.
    roof = ax.lines[0].get_ydata()
    assert max(roof) == pytest.approx(H100.peak("bf16"))


def test_plot_roofline_on_given_axes_and_bad_points():
    fig = Figure()
    ax = fig.subplots()
    assert roofline.plot_roofline(H100, [], ax=ax) is fig
    with pytest.raises(TypeError, match="points"):
        roofline.plot_roofline(H100, [3.0])
    with pytest.raises(ValueError, match="hw_list"):
        roofline.plot_roofline([], [])


# --------------------------------------------------------------------------- command line


def test_cli_table(capsys, tmp_path):
    out_png = tmp_path / "roof.png"
    argv = ["--model", "llama-3-8b", "--hardware", "h100-sxm", "--batch", "1", "8", "64",
            "--prompt", "512", "--new", "128", "--dtype", "bf16", "--plot", str(out_png)]
    assert roofline.main(argv) == 0
    out = capsys.readouterr().out
    assert "ridge point 295.3 FLOP/byte" in out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines()
            if line.strip()[:1].isdigit()}
    for batch in ("1", "8", "64"):
        assert "compute" in rows[(batch, "prefill")] and "TTFT" in rows[(batch, "prefill")]
        assert "memory" in rows[(batch, "decode")] and "per token" in rows[(batch, "decode")]
    # The TTFT printed for batch 1 is the prefill estimate's.
    prefill, decode = roofline.generation_estimate(P["llama-3-8b"], H100, 1, 512, 128)
    assert roofline._si(prefill.seconds, "s") in rows[("1", "prefill")]
    assert roofline._si(decode.seconds, "s") in rows[("1", "decode")]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_through_the_package_dispatcher(capsys):
    from tinygpt.__main__ import main as tinygpt_main

    assert tinygpt_main(["roofline", "--model", "llama-2-70b", "--hardware", "l4",
                         "--batch", "1", "--new", "2"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize("argv,allowed", [
    (["--model", "llama-9b"], "llama-3-8b"),
    (["--hardware", "h100"], "h100-sxm"),
    (["--dtype", "fp8"], "bf16"),
    (["--batch", "0"], "positive integer"),
])
def test_cli_bad_names_exit_2_listing_allowed_values(capsys, argv, allowed):
    with pytest.raises(SystemExit) as exc:
        roofline.main(argv)
    assert exc.value.code == 2
    assert allowed in capsys.readouterr().err


def test_estimate_is_a_frozen_dataclass():
    est = roofline.decode_estimate(P["tinygpt"], H100, 1, 1)
    assert {f.name for f in dataclasses.fields(est)} >= {"flops", "bytes", "intensity", "bound",
                                                         "seconds"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.seconds = 0.0
