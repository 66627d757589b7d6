"""Tensor parallelism (tinygpt.parallel): each rank a local process over gloo, checked against
the one-process model: logits as close to the float64 model as the one-process float32 model's,
greedy tokens identical."""

from __future__ import annotations

import copy
import dataclasses
import os
import time

import pytest
import torch

from tinygpt import parallel as P
from tinygpt.generate import generate
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error
from tinygpt.train import load_pretrained

# SmolLM2-135M's head layout (9 query heads, 3 KV heads, tied embeddings), shrunk so it is cheap
SMOLLM2_LAYOUT = ModelConfig(vocab_size=301, d_model=9 * 16, n_layers=2, n_heads=9,
                             n_kv_heads=3, d_ff=96, max_seq_len=96, rope_base=100000.0,
                             tie_embeddings=True)
PROMPTS = [[5, 17, 33, 2], [101, 7, 250, 64, 3, 3, 90], [12, 40, 41, 42, 43, 44, 45, 46]]


def _reference(model: TinyGPT, prompts, max_new_tokens: int):
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    with torch.inference_mode():
        logits = [model(torch.tensor([p]))[0] for p in prompts]
        tokens = [generate(model, p, params).token_ids for p in prompts]
    return logits, tokens


def _float64_logits(model: TinyGPT, prompts) -> list[torch.Tensor]:
    """The same model's logits in float64 (on a copy: the caller's model stays float32)."""
    exact = copy.deepcopy(model).double()
    with torch.inference_mode():
        return [exact(torch.tensor([p]))[0] for p in prompts]


def _check_against(model: TinyGPT, out: dict, prompts, max_new_tokens: int
                   ) -> tuple[float, float]:
    """Logits as close to the float64 model as the one-process float32 model's (2x its
    distance + 1e-6), tokens identical. The all-reduce adds the ranks' partial sums in another
    order than one matmul adds them, and another CPU's kernels sum in another order again: on
    the shipped model (logits up to 21.5) the two float32 runs differed by 1.1e-5, 1.7e-5 and
    1.4e-5 from float64 (AMD EPYC with AVX-512 2026-11-27), where a fixed 1e-5 + 1e-5 relative left
    a 4.6x margin. A wrong shard or a missing all-reduce is off by whole logits. Returns the
    float64 errors (parallel, one process)."""
    logits, tokens = _reference(model, prompts, max_new_tokens)
    truth = _float64_logits(model, prompts)
    errors = check_float32_error("the tensor-parallel logits", torch.cat(out["logits"]),
                                 torch.cat(logits), torch.cat(truth), floor=1e-6)
    assert out["tokens"] == tokens, "greedy generate() tokens differ from one process"
    assert out["engine_tokens"] == tokens, "greedy engine tokens differ from one process"
    assert out["ranks_agree"], "the ranks disagree on the tokens or the logits"
    assert out["argmax_agree"], "distributed_argmax disagrees with argmax of the logits"
    return errors


# -- no processes: the plan and the arithmetic of the shards ----------------------------------


def test_plan_heads_owns_whole_heads_and_their_kv_heads():
    plans = [P.plan_heads(SMOLLM2_LAYOUT, r, 3) for r in range(3)]
    assert [(p.q_start, p.n_heads, p.kv_start, p.n_kv_heads) for p in plans] == [
        (0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    for plan in plans:                      # every query head reads a KV head of its own rank
        for h in range(plan.q_start, plan.q_start + plan.n_heads):
            assert plan.kv_start <= h // SMOLLM2_LAYOUT.n_rep < plan.kv_start + plan.n_kv_heads


def test_plan_heads_replicates_or_refuses():
    cfg = ModelConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8,
                      max_seq_len=8)
    plans = [P.plan_heads(cfg, r, 4) for r in range(4)]        # 2 KV heads over 4 ranks
    assert [(p.kv_start, p.n_kv_heads, p.replicas) for p in plans] == [
        (0, 1, 2), (0, 1, 2), (1, 1, 2), (1, 1, 2)]
    with pytest.raises(ValueError, match=r"must divide n_heads \(4\)"):
        P.plan_heads(cfg, 0, 3)
    wide = ModelConfig(vocab_size=10, d_model=96, n_layers=1, n_heads=12, n_kv_heads=4, d_ff=12,
                       max_seq_len=8)
    with pytest.raises(ValueError, match=r"n_kv_heads \(4\)"):
        P.plan_heads(wide, 0, 6)
    with pytest.raises(ValueError, match="rank must be"):
        P.plan_heads(cfg, 2, 2)
    narrow = dataclasses.replace(cfg, d_ff=6)
    with pytest.raises(ValueError, match=r"must divide d_ff \(6\)"):
        P.shard_state_dict(TinyGPT(narrow).state_dict(), narrow, 0, 4)


def test_shards_recombine_to_the_full_products():
    """Column slices stacked, row-parallel partial sums added and vocabulary slices
    concatenated in rank order give the one-process products (no processes needed)."""
    model = TinyGPT(SMOLLM2_LAYOUT, seed=3)
    state, p = model.state_dict(), 3
    shards = [P.shard_state_dict(state, SMOLLM2_LAYOUT, r, p) for r in range(p)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, SMOLLM2_LAYOUT.d_model, generator=gen)
    key = "layers.1.attention.wq.weight"
    assert torch.equal(torch.cat([s[key] for s in shards]), state[key])
    hidden = torch.randn(5, SMOLLM2_LAYOUT.d_ff, generator=gen)
    # float32 products summed in another order than one matmul's: each within 2x the one
    # matmul's distance from float64 (measured on AMD EPYC with AVX-512 2026-11-27: partial sums
    # 5e-8 and one matmul 1.1e-7 for outputs up to 0.33; vocabulary slices 4e-7 and 4e-7 for outputs
    # up to 1), where a slice taken from the wrong rows is off by the outputs' own size
    key, step = "layers.0.feed_forward.w2.weight", SMOLLM2_LAYOUT.d_ff // p
    partial = [hidden[:, r * step:(r + 1) * step] @ shards[r][key].T for r in range(p)]
    check_float32_error("the row-parallel partial sums", sum(partial), hidden @ state[key].T,
                        hidden.double() @ state[key].double().T, floor=1e-7)
    logits = torch.cat([x @ s["output.weight"].T for s in shards], -1)[:, :301]
    check_float32_error("the vocabulary-parallel logits", logits, x @ state["output.weight"].T,
                        x.double() @ state["output.weight"].double().T, floor=1e-7)


def test_shard_model_needs_a_tinygpt_and_a_rank():
    with pytest.raises(TypeError, match="must be a TinyGPT"):
        P.shard_model(torch.nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match="pass rank and world_size"):
        P.shard_model(TinyGPT(SMOLLM2_LAYOUT))


# -- ranks as processes --------------------------------------------------------------------


def test_degree_2_on_the_shipped_model_is_exact():
    model, _ = load_pretrained()
    out = P.tp_check("shipped", 2, PROMPTS, max_new_tokens=6)
    # the one-process float32 model is itself this far from float64: the parallel model's
    # differences are float32 rounding, not a bug (it is as close to float64 as one process)
    _check_against(model, out, PROMPTS, 6)
    assert out["kv_heads"] == 1                               # 2 KV heads over 2 ranks


def _smollm2_layout_model() -> TinyGPT:
    """A loader as the ranks get one (a module-level function: it is pickled to them)."""
    return TinyGPT(SMOLLM2_LAYOUT, seed=7).eval()


def test_degree_3_on_the_smollm2_head_layout_is_exact():
    model = _smollm2_layout_model()
    out = P.tp_check((SMOLLM2_LAYOUT, model.state_dict()), 3, PROMPTS, max_new_tokens=5)
    _check_against(model, out, PROMPTS, 5)
    assert out["kv_heads"] == 1


def test_a_loader_callable_as_the_source_is_exact():
    """The source the real model's rows use (`functools.partial(load_model, "smollm2")`): each
    rank calls it and shards what it returns."""
    out = P.tp_check(_smollm2_layout_model, 3, PROMPTS[:1], max_new_tokens=3)
    _check_against(_smollm2_layout_model(), out, PROMPTS[:1], 3)


def test_degree_4_replicates_kv_heads_and_stays_exact():
    model, _ = load_pretrained()
    out = P.tp_check("shipped", 4, PROMPTS[:2], max_new_tokens=3)
    _check_against(model, out, PROMPTS[:2], 3)
    assert out["plan"].replicas == 2


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    torch.distributed.barrier()                  # rank 0 waits for a peer that never comes
    return rank


def _die_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()
    return rank


def _sleep(rank: int, world_size: int) -> int:
    time.sleep(30)
    return rank


def test_a_failing_or_dead_rank_raises_instead_of_hanging():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*broke on purpose"):
        P.run_ranks(_raise_on_rank_1, 2, timeout_s=30)
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 3"):
        P.run_ranks(_die_on_rank_1, 2, timeout_s=30)
    with pytest.raises(TimeoutError, match="not done after 1.0 s"):
        P.run_ranks(_sleep, 2, timeout_s=1.0)
    assert time.monotonic() - started < 20
    assert P.run_ranks(divmod, 3) == [divmod(r, 3) for r in range(3)]
    with pytest.raises(ValueError, match="world_size"):
        P.run_ranks(divmod, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where NCCL cannot start")
def test_a_group_that_cannot_connect_is_launched_again_then_reported():
    with pytest.raises(RuntimeError, match=r"could not join the process group(.|\n)*"
                                           r"after 3 launches"):
        P.run_ranks(divmod, 2, backend="nccl", timeout_s=30)


# -- pipeline and cost model ----------------------------------------------------------------


def test_pipeline_stages_and_bubble_formula():
    assert [list(P.stage_layers(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(P.stage_layers(30, r, 4)) for r in range(4)] == [8, 8, 7, 7]
    with pytest.raises(ValueError, match="cannot fill"):
        P.stage_layers(2, 0, 3)
    assert P.bubble_fraction(4, 1) == 0.75 and P.bubble_fraction(4, 13) == 0.1875
    assert P.bubble_fraction(1, 5) == 0.0
    with pytest.raises(ValueError, match="micro_batches"):
        P.bubble_fraction(2, 0)


def test_pipeline_run_matches_one_process_and_measures_idle_time():
    model = TinyGPT(SMOLLM2_LAYOUT, seed=5).eval()
    ids = torch.randint(0, SMOLLM2_LAYOUT.vocab_size, (4, 12),
                        generator=torch.Generator().manual_seed(1))
    run = P.pipeline_run((SMOLLM2_LAYOUT, model.state_dict()), 2, ids, micro_batches=2)
    with torch.inference_mode():
        want = model(ids)
        truth = copy.deepcopy(model).double()(ids)
    # micro-batches of 2 rows against one batch of 4: float32 rounding only (measured on AMD
    # EPYC 2026-11-27: both 9.0e-7 from float64 for logits up to 2.5)
    check_float32_error("the pipeline's logits", run.logits, want, truth, floor=1e-6)
    assert run.predicted_idle == pytest.approx(1 / 3)
    assert 0 < run.idle_fraction < 1 and len(run.busy) == 2
    assert run.makespan >= max(run.busy)


def _bfloat16_model() -> TinyGPT:
    """A bfloat16 model, as a source the ranks call (module level: it is pickled to them)."""
    return TinyGPT(SMOLLM2_LAYOUT, seed=5).to(torch.bfloat16).eval()


def test_pipeline_run_checks_micro_batches_before_starting_ranks():
    ids = torch.zeros(4, 3, dtype=torch.long)
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="micro_batches must be an int >= 1"):
            P.pipeline_run("shipped", 2, ids, bad)
    with pytest.raises(ValueError, match="B >= micro_batches"):
        P.pipeline_run("shipped", 2, ids, 5)


def test_pipeline_runs_the_micro_batches_asked_in_the_models_dtype():
    """5 rows in 4 micro-batches are 4 (2, 1, 1, 1 rows; tensor.chunk would make 3), and
    GPipe's prediction is for 4; the stages send the model's bfloat16 activations."""
    model = _bfloat16_model()
    ids = torch.randint(0, SMOLLM2_LAYOUT.vocab_size, (5, 12),
                        generator=torch.Generator().manual_seed(2))
    run = P.pipeline_run(_bfloat16_model, 2, ids, micro_batches=4, timeout_s=60)
    assert run.micro_batches == 4 and run.predicted_idle == pytest.approx(1 / 5)
    assert run.logits.dtype == torch.bfloat16
    with torch.inference_mode():
        want = model(ids)
        truth = copy.deepcopy(model).double()(ids)
    # micro-batches of 2 and 1 rows against one batch of 5: on a 2-core AMD EPYC with AVX-512
    # (2026-11-29, 4 draws) equal to one process bit for bit, both 0.008 to 0.010 from float64 for
    # logits up to 2.8; another CPU's kernels may round other batch shapes otherwise. The floor is
    # one bfloat16 step (2^-8 relative) of the largest logit. A float32 buffer for bfloat16
    # activations fails the stage outright.
    check_float32_error("the bfloat16 pipeline's logits", run.logits, want, truth,
                        floor=2 ** -8 * truth.abs().max().item())


def test_ring_allreduce_cost_model():
    link = P.Link("test", bandwidth=100e9, latency=10e-6, source="made up")
    assert P.ring_allreduce_seconds(1e9, 1, link) == 0.0
    # p = 2: each rank sends half, then receives half back: 2 (p-1)/p = 1 x the bytes
    assert P.ring_allreduce_seconds(1e9, 2, link) == pytest.approx(10e-6 + 1e9 / 100e9)
    assert P.ring_allreduce_seconds(1e9, 8, link) == pytest.approx(10e-6 + 1.75 * 1e9 / 100e9)
    assert P.allreduce_bytes(SMOLLM2_LAYOUT, tokens=3, dtype="bf16") == 3 * 144 * 2
    nvlink = P.LINKS["nvlink4-h100-sxm"]
    assert nvlink.bandwidth == 450e9 and "900 GB/s" in nvlink.source
    assert P.LINKS["pcie5-x16"].bandwidth == 63.0e9 and P.LINKS["pcie4-x16"].bandwidth == 31.5e9
    with pytest.raises(ValueError, match="link must be"):
        P.ring_allreduce_seconds(1.0, 2, "token-ring")
    # an all-gather: each rank sends (p - 1) / p of the result
    assert P.allgather_seconds(1e9, 1, link) == 0.0
    assert P.allgather_seconds(1e9, 4, link) == pytest.approx(10e-6 + 0.75 * 1e9 / 100e9)
    for seconds in (P.ring_allreduce_seconds, P.allgather_seconds):
        for size in (0, True, 2.0):
            with pytest.raises(ValueError, match="world_size must be a positive integer"):
                seconds(1e9, size, link)
        for nbytes in (-100, float("nan")):
            with pytest.raises(ValueError, match="nbytes must be >= 0"):
                seconds(nbytes, 2, link)
    fitted = P.fit_link({1000: 1e-3 + 4000 / 1e9, 100000: 1e-3 + 400000 / 1e9}, 2)
    assert fitted.latency == pytest.approx(1e-3) and fitted.bandwidth == pytest.approx(1e9)


def test_tp_estimate_splits_compute_and_adds_messages():
    smol = dataclasses.replace(SMOLLM2_LAYOUT, vocab_size=49152, d_model=576, n_layers=30,
                               d_ff=1536, max_seq_len=2048)
    one = P.tp_decode_estimate(smol, "h100-sxm", "nvlink4-h100-sxm", 1)
    three = P.tp_decode_estimate(smol, "h100-sxm", "nvlink4-h100-sxm", 3)
    assert one.comm_seconds == 0 and three.allreduces == 61
    assert three.compute_seconds == pytest.approx(one.compute_seconds / 3)
    assert three.weight_bytes_per_device == pytest.approx(one.weight_bytes_per_device / 3)
    # a 135M model on NVLink: 61 all-reduces' latency outweigh the 2/3 of a 84 us step saved
    assert three.seconds > one.seconds
    # degrees the sharding refuses: 9 divides the heads (9 over 3 KV heads) but not d_ff 1536
    with pytest.raises(ValueError, match=r"degree \(9\) must divide d_ff \(1536\)"):
        P.tp_decode_estimate(smol, "h100-sxm", "nvlink4-h100-sxm", 9)
    with pytest.raises(ValueError, match=r"degree \(9\) must divide d_ff \(1536\)"):
        P.shard_state_dict({}, smol, 0, 9)
    with pytest.raises(ValueError, match=r"degree \(2\) must divide n_heads \(9\)"):
        P.tp_decode_estimate(smol, "h100-sxm", "nvlink4-h100-sxm", 2)


# -- disaggregated prefill and decode ---------------------------------------------------------


def test_disaggregated_decode_gives_the_colocated_tokens_and_ships_whole_blocks():
    model = TinyGPT(SMOLLM2_LAYOUT, seed=2).eval()
    work = P.mixed_workload(SMOLLM2_LAYOUT.vocab_size, n_short=2, n_long=1, short_len=5,
                            long_len=40, new_tokens=6, long_new_tokens=2, spacing_s=0.02)
    report = P.compare_disaggregation((SMOLLM2_LAYOUT, model.state_dict()), work,
                                      chunk_tokens=16, block_size=16)
    assert report.tokens_identical
    # K and V: 2 x layers x blocks x KV heads x block_size x head_dim x 4 bytes
    per_block = 2 * SMOLLM2_LAYOUT.n_layers * 3 * 16 * 16 * 4
    assert report.kv_bytes == (per_block, per_block, 3 * per_block)
    assert all(s > 0 for s in report.kv_seconds)
    assert report.disaggregated["gaps"] == 2 * 5


def test_a_one_token_request_gets_one_token_from_the_decode_rank():
    """The prefill's token is a max_new_tokens=1 request's only one: the decode rank finishes
    it on arrival, as the colocated engine does (a decode step would add a second)."""
    model = TinyGPT(SMOLLM2_LAYOUT, seed=2).eval()
    work = P.Workload(arrivals=(0.0, 0.0, 0.02), prompts=((5, 6, 7), (8, 9, 10, 11), (12, 13)),
                      max_new_tokens=(1, 4, 1))
    report = P.compare_disaggregation((SMOLLM2_LAYOUT, model.state_dict()), work,
                                      chunk_tokens=16, block_size=16)
    assert report.tokens_identical
    assert report.disaggregated["gaps"] == 3            # request 1's 4 tokens only


# -- the served protocol without HTTP ---------------------------------------------------------


def test_followers_mirror_the_leader_engine_even_for_unseeded_sampling():
    """Rank 0's engine draws a seed for a request that has none and sends it with the
    request: the other rank samples the same tokens (it checks every step's tokens against
    rank 0's), and greedy requests get the one-process engine's tokens."""
    model, _ = load_pretrained()
    prompts = PROMPTS[:2] + [PROMPTS[0]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=5),
              SamplingParams(temperature=0.0, max_new_tokens=3),
              SamplingParams(temperature=1.0, max_new_tokens=6)]          # no seed
    leader, follower = P.run_ranks(P._mirror_rank, 2, "shipped", prompts, params)
    assert leader == follower and len(leader) == 3
    for i in (0, 1):                                                       # the greedy ones
        _, want = _reference(model, prompts[i:i + 1], params[i].max_new_tokens)
        assert leader[i] == want[0]
    assert len(leader[2]) == 6
