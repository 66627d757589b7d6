"""tinygpt.parallel's checks: wrong input refused with a clear error before any rank starts,
shards that must agree with their process group, the pipeline under dynamic RoPE, and the
tensor-parallel server's watchdog and rendezvous."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from tinygpt import parallel as P
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.parallel import cost, disaggregation, experts, pipeline, ranks, serving
from tinygpt.testing import check_float32_error

CFG = ModelConfig(vocab_size=37, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=32)
MOE_CFG = dataclasses.replace(CFG, n_experts=4, top_k=2, d_expert=16)
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail a test whose call would launch ranks: every check must come before that."""
    def launched(*args, **kwargs):
        raise AssertionError("ranks were launched before the arguments were checked")

    for module in (cost, disaggregation, experts, pipeline):
        monkeypatch.setattr(module, "run_ranks", launched)


def _source(cfg: ModelConfig = CFG):
    return (cfg, TinyGPT(cfg, seed=0).state_dict())


# -- the pipeline ------------------------------------------------------------------------------


def test_pipeline_matches_the_model_under_dynamic_rope():
    """Dynamic (NTK) RoPE's tables depend on the pass's length: past the original context the
    stages must use the rescaled ones TinyGPT.forward uses (the plain tables were off by
    2.7e-4 here, float32 rounding is 1e-6)."""
    cfg = dataclasses.replace(CFG, max_seq_len=64, rope_scaling={
        "rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8})
    model = TinyGPT(cfg, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    run = P.pipeline_run((cfg, model.state_dict()), 2, ids, 1, timeout_s=60)
    with torch.inference_mode():
        want = model(ids)
        truth = copy.deepcopy(model).double()(ids)
    check_float32_error("the dynamic-RoPE pipeline's logits", run.logits, want, truth,
                        floor=1e-6)


def test_pipeline_run_checks_ids_and_stages_before_starting_ranks(no_ranks):
    source = _source()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(TypeError, match="ids must hold integer token ids"):
        P.pipeline_run(source, 2, ids.float(), 1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=37\)"):
        P.pipeline_run(source, 2, ids + 37, 1)
    with pytest.raises(ValueError, match="T=40 exceeds max_seq_len=32"):
        P.pipeline_run(source, 2, torch.zeros(2, 40, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="T >= 1"):
        P.pipeline_run(source, 2, torch.zeros(2, 0, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        P.pipeline_run(source, 4, ids, 1)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        P.pipeline_run(source, 0, ids, 1)
    with pytest.raises(TypeError, match="ids must be a torch.LongTensor"):
        P.pipeline_run(source, 2, [[1, 2]], 1)


# -- shards and their process group --------------------------------------------------------------


def _contradicting_shards(rank: int, world_size: int, cfg, state, moe_cfg, moe_state) -> list:
    """On ranks of a group of 2: every rank / world_size that contradicts the group, and the
    messages they got (None for one that was accepted)."""
    def build(make, **kwargs):
        try:
            make(**kwargs)
        except ValueError as err:
            return str(err)
        return None

    def tp(**kwargs):
        return P.shard_model(P.load_source((cfg, state)), **kwargs)

    def ep(**kwargs):
        return P.expert_parallel_model(P.load_source((moe_cfg, moe_state)), **kwargs)

    other = 1 - rank
    return [build(tp, rank=rank, world_size=4), build(tp, rank=0 if rank else 1, world_size=2),
            build(tp, rank=other), build(tp, world_size=1),
            build(ep, rank=rank, world_size=1), build(ep, rank=other, world_size=2),
            build(tp, rank=rank, world_size=2), build(tp), build(ep)]


def test_a_shard_must_agree_with_its_process_group():
    cfg = dataclasses.replace(CFG, n_layers=2, d_ff=32)
    moe_cfg = dataclasses.replace(MOE_CFG, n_layers=2)
    out = P.run_ranks(_contradicting_shards, 2, cfg, TinyGPT(cfg, seed=1).state_dict(), moe_cfg,
                      TinyGPT(moe_cfg, seed=1).state_dict(), timeout_s=60, backend="gloo")
    for rank, messages in enumerate(out):
        refused, accepted = messages[:6], messages[6:]
        names = ["world_size", "rank", "rank", "world_size", "world_size", "rank"]
        for message, name in zip(refused, names, strict=True):
            assert message is not None and message.startswith(f"{name}=") \
                and "contradicts the process group" in message, (rank, message)
        assert accepted == [None, None, None], (rank, accepted)


# -- launching ranks -----------------------------------------------------------------------------


def test_run_ranks_refuses_a_function_the_ranks_cannot_import():
    def local(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="fn .* is a lambda.*define it at the top level"):
        P.run_ranks(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match="fn .* is a function defined inside another"):
        P.run_ranks(local, 2)
    with pytest.raises(TypeError, match="fn must be a callable"):
        P.run_ranks(3, 2)
    code = ("from tinygpt.parallel import run_ranks\n"
            "def f(rank, world_size):\n    return rank\n"
            "try:\n    run_ranks(f, 2)\nexcept ValueError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert "defined in a __main__ without a file" in done.stdout, done.stdout + done.stderr


def test_run_ranks_and_init_rank_refuse_a_timeout_torch_cannot_hold():
    for bad in (math.inf, math.nan, 0, -1, 1e30, True):
        with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds"):
            P.run_ranks(divmod, 2, timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        P.init_rank(0, 1, 1, timeout_s=math.inf)


def test_init_rank_shares_out_the_usable_cores(monkeypatch):
    """Default threads: the cores this process may use (its affinity), over the ranks; not
    os.cpu_count(), which ignores the affinity."""
    before = torch.get_num_threads()
    monkeypatch.setattr(ranks, "usable_cores", lambda: 3)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    try:
        P.init_rank(0, 1, P.free_port(), timeout_s=30)
        assert torch.get_num_threads() == 3
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(before)


# -- the measurements and the cost model ----------------------------------------------------------


def test_measurements_check_their_arguments_before_starting_ranks(no_ranks):
    dense, moe = _source(), _source(MOE_CFG)
    link = P.LINKS["pcie4-x16"]
    measured = {576: 1e-4, 49152: 3e-4}
    for world_size in (0, 1, True):
        with pytest.raises(ValueError, match="world_size must be an int >= 2"):
            P.fit_link(measured, world_size)
        with pytest.raises(ValueError, match="world_size must be an int >= 2"):
            P.measure_tp_decode(dense, world_size, new_tokens=2, link=link)
    for bad in ({576: 1e-4}, {576: 1e-4, 1024: 0.0}, {0: 1e-4, 1024: 1e-3}):
        with pytest.raises(ValueError, match="measured"):
            P.fit_link(bad, 2)
    with pytest.raises(ValueError, match="new_tokens must be an int >= 1"):
        P.measure_tp_decode(dense, 2, new_tokens=0, link=link)
    with pytest.raises(ValueError, match="prompt_len must be an int >= 1"):
        P.measure_tp_decode(dense, 2, prompt_len=0, link=link)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=32"):
        P.measure_tp_decode(dense, 2, prompt_len=28, new_tokens=2, link=link)
    with pytest.raises(ValueError, match=r"degree \(3\) must divide n_heads"):
        P.measure_tp_decode(dense, 3, new_tokens=2, link=link)
    with pytest.raises(ValueError, match="new_tokens must be an int >= 1"):
        P.measure_ep_decode(moe, 2, new_tokens=0, link=link)
    with pytest.raises(ValueError, match="no MoE layer"):
        P.measure_ep_decode(dense, 2, new_tokens=2, link=link)
    with pytest.raises(ValueError, match="must be divisible by the expert-parallel degree"):
        P.measure_ep_decode(moe, 3, new_tokens=2, link=link)
    for measure in (P.measure_allreduce, P.measure_alltoall):
        with pytest.raises(ValueError, match="repeats must be an int >= 1"):
            measure(2, sizes=(8, 64), repeats=0)
    for sizes in ((0, 64), (-2, 64), ()):
        with pytest.raises(ValueError, match="sizes must be"):
            P.measure_allreduce(2, sizes=sizes, repeats=2)


def test_cost_model_refuses_what_the_implementation_refuses():
    link = P.LINKS["nvlink4-h100-sxm"]
    with pytest.raises(ValueError, match=r"top_k \(5\) must be at most n_experts \(4\)"):
        P.ep_comm_estimate(1, 5, 64, 4, 2, link)
    with pytest.raises(ValueError, match="must be divisible by the expert-parallel degree"):
        P.ep_comm_estimate(1, 2, 64, 6, 4, link)
    for tokens in (-3, 0, 1.5, True):
        with pytest.raises(ValueError, match="tokens must be an int >= 1"):
            P.allreduce_bytes(CFG, tokens)
    for field, value in (("bandwidth", 0), ("bandwidth", -1e9), ("bandwidth", math.inf),
                         ("latency", -1e-6), ("latency", math.nan)):
        with pytest.raises(ValueError, match=f"Link {field} must be a finite number"):
            P.Link("x", **{"bandwidth": 1e9, "latency": 1e-5, field: value}, source="")
    assert P.Link("x", 1e9, 0.0, "").latency == 0.0


def test_quantized_weights_all_reduce_full_width_activations():
    """int8 / int4 weights are dequantized inside the products: the activations the layers
    all-reduce stay 16-bit, so the messages cost what bf16's do (not a half or a quarter)."""
    smol = P.SMOLLM2_135M
    bf16 = P.tp_decode_estimate(smol, "h100-sxm", "pcie5-x16", 3, dtype="bf16")
    for dtype in ("int8", "int4"):
        quantized = P.tp_decode_estimate(smol, "h100-sxm", "pcie5-x16", 3, dtype=dtype)
        assert quantized.comm_seconds == bf16.comm_seconds
        assert quantized.weight_bytes_per_device < bf16.weight_bytes_per_device
    with pytest.raises(ValueError, match="activations' dtypes"):
        P.allreduce_bytes(smol, 1, "int4")


# -- disaggregation ------------------------------------------------------------------------------


def test_workloads_are_checked_when_made():
    prompts = ((1, 2), (3,))
    with pytest.raises(ValueError, match="one entry per request"):
        P.Workload((0.0,), prompts, (2, 2))
    with pytest.raises(ValueError, match="at least one request"):
        P.Workload((), (), ())
    with pytest.raises(ValueError, match="arrivals must be in increasing order"):
        P.Workload((0.3, 0.0), prompts, (2, 2))
    with pytest.raises(ValueError, match=r"arrivals\[1\] must be a finite number"):
        P.Workload((0.0, math.nan), prompts, (2, 2))
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be an int >= 1"):
        P.Workload((0.0, 0.0), prompts, (2, 0))
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty sequence"):
        P.Workload((0.0, 0.0), ((1,), ()), (2, 2))
    for name, value in (("n_short", -1), ("short_len", 0), ("vocab_size", 0),
                        ("new_tokens", 0), ("spacing_s", -0.1)):
        with pytest.raises(ValueError, match=name):
            P.mixed_workload(**{"vocab_size": 64, name: value})
    with pytest.raises(ValueError, match="n_short \\+ n_long"):
        P.mixed_workload(64, n_short=0, n_long=0)


def test_compare_disaggregation_checks_before_starting_ranks(no_ranks):
    source = _source(dataclasses.replace(CFG, max_seq_len=64))
    work = P.mixed_workload(37, n_short=2, n_long=1, short_len=4, long_len=20, new_tokens=4,
                            long_new_tokens=2)
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 64\]"):
        P.compare_disaggregation(source, work, block_size=0)
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= the workload's 3"):
        P.compare_disaggregation(source, work, chunk_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens >= 2"):
        P.compare_disaggregation(source, P.Workload((0.0, 0.0), ((1, 2), (3,)), (1, 1)))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        P.compare_disaggregation(source, P.mixed_workload(1000, n_short=2, n_long=0))
    with pytest.raises(ValueError, match="exceed the model's max_seq_len=64"):
        P.compare_disaggregation(source, P.mixed_workload(37, n_short=1, n_long=1,
                                                          long_len=62, long_new_tokens=4))


# -- the tensor-parallel server ------------------------------------------------------------------


def test_the_tensor_parallel_refusal_of_day_21_models_gives_its_own_reason():
    for cfg, what in ((dataclasses.replace(CFG, sliding_window=8), "sliding-window attention "
                       "(sliding_window=8)"),
                      (dataclasses.replace(CFG, rope_scaling={
                          "rope_type": "dynamic", "factor": 2.0,
                          "original_max_position_embeddings": 16}), "'dynamic' (NTK) RoPE")):
        with pytest.raises(ValueError, match="tensor parallelism is not implemented for") as err:
            P.shard_model(TinyGPT(cfg, seed=0), 0, 2)
        assert what in str(err.value) and "fused kernels" not in str(err.value)


class _Proc:
    def __init__(self, exitcode=None) -> None:
        self.exitcode = exitcode


def test_the_watchdog_stops_a_server_whose_step_stalls():
    """A stopped or starved rank leaves every rank waiting in the step's collectives: rank 0's
    watchdog reports a step running past the bound, and a dead worker, by rank."""
    clock = serving._StepClock()
    procs = [_Proc(), _Proc()]
    assert serving._rank_problem(procs, clock, 120.0, now=1000.0) is None
    clock.started = 950.0
    assert serving._rank_problem(procs, clock, 120.0, now=1000.0) is None
    clock.started = 800.0
    problem = serving._rank_problem(procs, clock, 120.0, now=1000.0)
    assert problem is not None and "has not finished after 200 s" in problem
    procs[1].exitcode = -9
    assert "tensor-parallel rank 2 exited with code -9" in serving._rank_problem(
        procs, None, 120.0, now=0.0)


BUSY_PORT_SERVER = """
import socket, sys
import tinygpt.parallel.serving as serving
from tinygpt.server.cli import main
busy = socket.socket()
busy.bind(("127.0.0.1", 0))
busy.listen()
serving.free_port = lambda: busy.getsockname()[1]    # every port chosen is taken meanwhile
sys.exit(main(["--threads", "1", "--tensor-parallel-size", "2", "--port", "0"]))
"""


def test_a_rendezvous_port_taken_meanwhile_gives_one_error_line():
    done = subprocess.run([sys.executable, "-c", BUSY_PORT_SERVER], capture_output=True,
                          text=True, timeout=300, env=ENV)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "could not form their process group on 127.0.0.1 (3 ports tried)" in done.stderr
