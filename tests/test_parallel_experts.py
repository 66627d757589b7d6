"""Expert parallelism (tinygpt.parallel.experts) on local gloo ranks, checked against the
one-process MoE layer and model: outputs as close to a float64 MoE as the one-process float32
layer's, greedy tokens identical, the bytes the all-to-alls moved equal to the routing's count
and to the cost model's under uniform routing."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tinygpt import parallel as P
from tinygpt.generate import generate
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.moe import MoE, expert_mlp
from tinygpt.parallel.experts import (
    EPStats,
    ExpertParallelMoE,
    dispatch_rows,
    ep_check,
    expert_parallel_model,
    expert_range,
    measure_ep_decode,
    token_range,
)
from tinygpt.sampling import SamplingParams
from tinygpt.testing import check_float32_error

EPS = torch.finfo(torch.float32).eps
D, E, K, D_EXPERT = 16, 8, 2, 12


def _moe(router: str = "softmax", seed: int = 0, d_shared: int = 0) -> MoE:
    """A MoE layer with decisive routing (see _fill)."""
    kw = dict(n_group=4, topk_group=2, scale=2.5) if router == "sigmoid_groups" else {}
    return _fill(MoE(D, E, K, D_EXPERT, router=router, d_shared=d_shared, **kw), seed)


def _fill(moe: MoE, seed: int) -> MoE:
    """Gate std 0.4 on inputs of norm ~4 (logits ~1.6 apart: no near ties between the float32
    and float64 choices), experts std 0.3 (outputs ~1, so a wrong row shows)."""
    router = moe.router
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, D, generator=gen) * 0.4)
        for w in (moe.w1, moe.w3, moe.w2):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
        if router == "sigmoid_groups":
            moe.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
        if moe.shared is not None:
            for w in moe.shared.parameters():
                w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
    return moe.eval()


def _moe_float64(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer in float64, token by token (the plain loop), with the float32 router's expert
    choice (a discrete decision, not a rounding error). Returns (output, experts (N, k))."""
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        _, experts = moe.route(flat)
    x64 = flat.double()
    logits = x64 @ moe.gate.weight.double().T
    if moe.router == "softmax":
        weights = torch.softmax(logits, dim=-1).gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True) if moe.renormalize else weights
    else:
        weights = torch.sigmoid(logits).gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True) if moe.renormalize else weights
        weights = weights * moe.scale
    w1, w3, w2 = (w.detach().double() for w in (moe.w1, moe.w3, moe.w2))
    out = torch.zeros_like(x64)
    for n in range(len(x64)):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            out[n] += weights[n, j] * expert_mlp(x64[n:n + 1], w1[e], w3[e], w2[e])[0]
    if moe.shared is not None:
        with torch.no_grad():
            out += copy.deepcopy(moe.shared).double()(x64)
    return out.reshape(x.shape), experts


def _check_layer(what: str, got: torch.Tensor, moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """got as close to the float64 layer as the one-process float32 MoE is: 2x its distance
    plus one float32 step of the largest output (for a reference that happens to be exact).
    The shard routes its own chunk of tokens and each expert runs the same rows as one
    process's dispatch, so the two agree to float32 rounding (measured on a 2-core AMD EPYC with
    AVX-512 2026-11-27: in the four float32 cases below both were 1.2e-7 to 1.2e-6 from float64 for
    outputs up to 5.5, the same distance each time; bitwise equal in three cases, the shared
    expert on a chunk of rows rounding differently in the fourth; the bfloat16 case 5.3e-3
    for both, bitwise equal); a lost, doubled or misplaced row is off by an expert's whole
    output. Returns the one-process experts."""
    with torch.no_grad():
        want = moe(x)
    truth, experts = _moe_float64(moe, x)
    check_float32_error(what, got, want, truth, floor=EPS * truth.abs().max().item())
    return experts


# -- no processes: the plan -------------------------------------------------------------------


def test_ranges_split_experts_and_tokens():
    assert [expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match=r"n_experts \(E=8\) must be divisible.*world_size=3"):
        expert_range(8, 0, 3)
    with pytest.raises(ValueError, match="world_size=3"):
        ExpertParallelMoE(_moe(), 0, 3)
    with pytest.raises(ValueError, match="rank must be"):
        expert_range(8, 2, 2)
    # contiguous chunks in rank order, the first N mod p ranks one token more
    assert [token_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [token_range(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]    # rank 1: none
    for n in range(12):
        spans = [token_range(n, r, 4) for r in range(4)]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1
    with pytest.raises(TypeError, match="tinygpt.moe.MoE"):
        ExpertParallelMoE(torch.nn.Linear(2, 2), 0, 1)


def test_dispatch_rows_counts_rows_by_home_and_owner():
    experts = torch.tensor([[0, 5], [7, 1], [2, 3]])        # tokens 0, 1 on rank 0; 2 on rank 1
    assert dispatch_rows(experts, 8, 2).tolist() == [[2, 2], [2, 0]]
    # 4 ranks, 2 experts each: one token on each of ranks 0..2, none on rank 3
    assert dispatch_rows(experts, 8, 4).tolist() == [[1, 0, 1, 0], [1, 0, 0, 1],
                                                     [0, 2, 0, 0], [0, 0, 0, 0]]


def test_one_rank_runs_the_same_path_without_a_group():
    for router, shared in (("softmax", 0), ("sigmoid_groups", 8)):
        moe = _moe(router, seed=1, d_shared=shared)
        ep = ExpertParallelMoE(moe, 0, 1)
        x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            got = ep(x)
        _check_layer(f"the 1-rank shard ({router})", got, moe, x)
        assert ep.last_rows == 15 * K and ep.moe.w1.shape == (E, D_EXPERT, D)


def test_a_float64_shard_stays_float64():
    """tinygpt.moe's rule, a float64 run stays float64 throughout (the tests' truth): one
    rank's shard of a float64 layer runs the same sums in the same order as the layer, so it
    equals it bit for bit (weights rounded to float32 on the way would be ~1e-7 off)."""
    for router, shared in (("softmax", 0), ("sigmoid_groups", 8)):
        moe = _moe(router, seed=1, d_shared=shared).double()
        x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        with torch.no_grad():
            got, want = ExpertParallelMoE(moe, 0, 1)(x), moe(x)
        assert got.dtype == torch.float64 and torch.equal(got, want), router


# -- one layer over 2 ranks --------------------------------------------------------------------


def _layer_rank(rank: int, world_size: int, cases: list) -> list[dict]:
    """Each case's shard output on this rank, its counters, routing and expert shape."""
    out = []
    for moe, x in cases:
        stats = EPStats()
        ep = ExpertParallelMoE(moe, rank, world_size, stats=stats)
        with torch.inference_mode():
            y = ep(x)
        out.append(dict(y=y, stats=stats.snapshot(), experts=ep.last_experts,
                        rows=ep.last_rows, local_experts=tuple(ep.moe.w1.shape)))
    return out


def _cases() -> dict[str, tuple[MoE, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    skewed = _moe("softmax", seed=4)
    base = torch.randn(D, generator=gen)
    with torch.no_grad():                 # experts 0 and 4..7 score -3 |base|^2 on these tokens
        skewed.gate.weight[0] = -3 * base
        skewed.gate.weight[4:] = -3 * base
    return {
        "uneven batch": (_moe("softmax", seed=5), torch.randn(3, 5, D, generator=gen)),
        "batch 1": (_moe("softmax", seed=6), torch.randn(1, 1, D, generator=gen)),
        "rank 1 idle": (skewed, base + 0.1 * torch.randn(5, D, generator=gen)),
        "sigmoid groups + shared": (_moe("sigmoid_groups", seed=7, d_shared=8),
                                    torch.randn(2, 3, D, generator=gen)),
        "bfloat16": (_moe("softmax", seed=10).to(torch.bfloat16),
                     torch.randn(9, D, generator=gen).to(torch.bfloat16)),
    }


def test_ep_layer_equals_the_one_process_layer_and_counts_its_bytes():
    cases = _cases()
    ranks = P.run_ranks(_layer_rank, 2, list(cases.values()), timeout_s=60)
    for i, (name, (moe, x)) in enumerate(cases.items()):
        got = [r[i] for r in ranks]
        assert torch.equal(got[0]["y"], got[1]["y"]), f"{name}: the ranks' outputs differ"
        experts = _check_layer(f"the 2-rank EP layer ({name})", got[0]["y"], moe, x)
        assert torch.equal(torch.cat([g["experts"] for g in got]), experts), name
        assert [g["local_experts"] for g in got] == [(E // 2, D_EXPERT, D)] * 2
        # the bytes the all-to-alls moved: the counts (E/2 int64 each way), the dispatch
        # (rows that leave) and the combine (rows that came, going back) in x's dtype
        rows = dispatch_rows(experts, E, 2)
        for r, g in enumerate(got):
            out_rows = int(rows[r].sum() - rows[r, r])
            in_rows = int(rows[:, r].sum() - rows[r, r])
            moved = (E // 2) * 8 + (out_rows + in_rows) * D * x.element_size()
            assert g["stats"]["alltoall_bytes_sent"] == moved, (name, r)
            assert g["stats"]["alltoall_bytes_received"] == moved, (name, r)
            assert g["stats"]["alltoall_calls"] == 3 and g["stats"]["gather_calls"] == 1
            assert g["rows"] == g["stats"]["expert_rows"] == int(rows[:, r].sum()), (name, r)
    # the edge cases happened
    one = [r[1] for r in ranks]
    assert one[1]["experts"].shape == (0, K), "batch 1: rank 1 should route no token"
    idle = [r[2] for r in ranks]
    assert idle[1]["rows"] == 0, "rank 1's experts should receive no row"
    chosen = set(torch.cat([g["experts"] for g in idle]).flatten().tolist())
    assert 0 not in chosen and chosen <= {1, 2, 3}, chosen    # expert 0: nobody chose it


# -- a whole model -----------------------------------------------------------------------------


# Qwen3-MoE's layout (softmax top-k, q/k norm, a dense first layer) and DeepSeek-V3's (sigmoid
# groups, a bias, a shared expert), small; both built by TinyGPT from their configs
QWEN_LIKE = ModelConfig(vocab_size=97, d_model=D, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=24,
                        max_seq_len=64, n_experts=E, top_k=K, d_expert=D_EXPERT,
                        dense_layers=(0,), qk_norm=True)
DEEPSEEK_LIKE = dataclasses.replace(QWEN_LIKE, router="sigmoid_groups", n_group=4,
                                    topk_group=2, routed_scale=2.5, n_shared_experts=1,
                                    qk_norm=False)
PROMPTS = [[5, 17, 33, 2], [11, 7, 90, 64, 3, 3, 40]]


def _moe_model(cfg: ModelConfig, seed: int = 3) -> TinyGPT:
    """TinyGPT(cfg) with its MoE layers refilled so that routing is decisive (_fill)."""
    model = TinyGPT(cfg, seed=seed)
    for i in cfg.moe_layers:
        _fill(model.layers[i].feed_forward, seed + 10 * i)
    return model.eval()


@pytest.mark.parametrize("cfg", [QWEN_LIKE, DEEPSEEK_LIKE], ids=["qwen-like", "deepseek-like"])
def test_ep_model_decodes_the_one_process_tokens(cfg):
    model = _moe_model(cfg)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    with torch.inference_mode():
        want_logits = torch.cat([model(torch.tensor([p]))[0] for p in PROMPTS])
        want_tokens = [generate(model, p, params).token_ids for p in PROMPTS]
        truth = torch.cat([copy.deepcopy(model).double()(torch.tensor([p]))[0]
                           for p in PROMPTS])
    ranks = ep_check((cfg, model.state_dict()), 2, PROMPTS, max_new_tokens=6, timeout_s=90)
    for r, out in enumerate(ranks):
        assert out["tokens"] == want_tokens, f"rank {r}'s greedy tokens differ"
        assert out["ranks_agree"]
        # decode at batch 1: rank 1 routes no token but joins every all-to-all
        assert out["stats"]["alltoall_calls"] > 0 and out["stats"]["gather_calls"] > 0
    # the float64 model's routing is the float32 one here (decisive gates), so its logits
    # are the truth both float32 runs are measured against (2-core AMD EPYC with AVX-512 2026-11-27:
    # qwen-like 1.0e-7 over 2 ranks, 9.7e-8 in one process; deepseek-like 9.5e-8 and 1.0e-7;
    # logits up to 0.30)
    check_float32_error("the EP model's logits", torch.cat(ranks[0]["logits"]), want_logits,
                        truth, floor=EPS * truth.abs().max().item())
    assert [len(t) for t in want_tokens] == [6, 6]


def test_expert_parallel_model_refuses_dense_models_and_uneven_degrees():
    dense = ModelConfig(vocab_size=97, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                        max_seq_len=64)
    with pytest.raises(ValueError, match="no MoE layer"):
        expert_parallel_model(TinyGPT(dense, seed=0), 0, 2)
    with pytest.raises(ValueError, match="divisible"):
        expert_parallel_model(_moe_model(QWEN_LIKE), 0, 3)
    with pytest.raises(TypeError, match="TinyGPT"):
        expert_parallel_model(_moe(), 0, 2)
    with pytest.raises(ValueError, match="pass rank and world_size"):
        expert_parallel_model(_moe_model(QWEN_LIKE))
    full = _moe_model(DEEPSEEK_LIKE)
    want_w2 = full.layers[2].feed_forward.w2[4:].clone()
    shard = expert_parallel_model(full, 1, 2)
    layer = shard.layers[2].feed_forward
    assert isinstance(layer, ExpertParallelMoE) and layer.expert_start == 4
    assert torch.equal(layer.moe.w2, want_w2) and layer.moe.shared is not None
    assert not isinstance(shard.layers[0].feed_forward, ExpertParallelMoE)   # dense_layers


# -- the cost model ------------------------------------------------------------------------------


def test_alltoall_bytes_equal_the_rows_that_leave_under_uniform_routing():
    n = 6
    # every token's k slots on k different ranks: exactly (p - 1) / p of the rows leave
    for p, k in ((2, 2), (4, 4)):
        experts = torch.arange(k)[None].repeat(n * p, 1) * (E // p)           # one per rank
        rows = dispatch_rows(experts, E, p)
        for r in range(p):
            leave = int(rows[r].sum() - rows[r, r])
            assert leave * D * 2 == P.alltoall_bytes(n, k, D, p, "bf16") == n * k * (p - 1) / p \
                * D * 2
    # random uniform routing: the mean over ranks within 6 binomial sigmas (seeded)
    gen = torch.Generator().manual_seed(0)
    tokens, p = 2000, 4
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    rows = dispatch_rows(experts, E, p)
    leave = (rows.sum(1) - rows.diagonal()).double()
    expected = P.alltoall_bytes(tokens // p, K, D, p, "fp32") / (D * 4)   # 375 of 500 rows
    sigma = (tokens // p * K * (1 / p) * (1 - 1 / p)) ** 0.5
    assert (leave - expected).abs().max() < 6 * sigma, (leave, expected)
    assert P.alltoall_bytes(5, K, D, 1) == 0.0
    with pytest.raises(ValueError, match="dtype"):
        P.alltoall_bytes(1, K, D, 2, "fp8")
    with pytest.raises(ValueError, match="top_k"):
        P.alltoall_bytes(1, 0, D, 2)


def test_alltoall_time_and_the_ep_estimate():
    link = P.Link("test", bandwidth=100e9, latency=10e-6, source="made up")
    assert P.alltoall_seconds(1e9, 1, link) == 0.0
    assert P.alltoall_seconds(1e9, 8, link) == pytest.approx(10e-6 + 1e9 / 100e9)
    est = P.ep_comm_estimate(batch=5, top_k=2, d_model=1024, n_experts=64, world_size=4,
                             link=link, n_moe_layers=10, dtype="bf16")
    rows = 2 * 2 * 3 / 4 * 1024 * 2                    # ceil(5/4) = 2 tokens on the busiest rank
    assert est.bytes_per_alltoall == pytest.approx(rows)
    assert est.alltoalls == 30 and est.gathers == 10
    counts = 64 * 8 * 3 / 4
    assert est.alltoall_seconds == pytest.approx(10 * (3 * 10e-6 + (counts + 2 * rows) / 100e9))
    assert est.gather_seconds == pytest.approx(10 * (10e-6 + 3 / 4 * 4 * 2 * 1024 * 2 / 100e9))
    one = P.ep_comm_estimate(5, 2, 1024, 64, 1, link, 10)
    assert one.seconds == 0.0 and one.alltoalls == 0
    fitted = P.fit_alltoall_link({1000: 1e-3 + 2000 / 1e9, 100000: 1e-3 + 200000 / 1e9}, 2)
    assert fitted.latency == pytest.approx(1e-3) and fitted.bandwidth == pytest.approx(1e9)
    with pytest.raises(ValueError, match="sizes must be positive multiples"):
        P.measure_alltoall(2, sizes=(3,))


def test_measure_ep_decode_splits_the_step_and_keeps_the_tokens():
    link = P.Link("test", bandwidth=1e9, latency=1e-4, source="made up")
    model = _moe_model(QWEN_LIKE)
    m = measure_ep_decode((QWEN_LIKE, model.state_dict()), 2, batch=3, prompt_len=4,
                          new_tokens=3, link=link, timeout_s=90)
    assert m.tokens_identical and len(m.tokens) == 3 and len(m.tokens[0]) == 3
    assert m.alltoall_calls == 6                        # 3 per MoE layer, 2 MoE layers
    assert sum(m.expert_rows) == 3 * K * 2              # every (token, slot) pair, once
    assert 0 < m.alltoall_seconds < m.ep_step_seconds and m.other_seconds > 0
    assert len(m.steps) == 3 and sum(t for t, _, _ in m.steps) / 3 == pytest.approx(
        m.ep_step_seconds)
    assert sum(a for _, a, _ in m.steps) / 3 == pytest.approx(m.alltoall_seconds)
    assert m.predicted_alltoall_seconds == pytest.approx(
        P.ep_comm_estimate(3, K, D, E, 2, link, 2).alltoall_seconds)
    measured = P.measure_alltoall(2, sizes=(64, 4096), repeats=3)
    assert set(measured) == {64, 4096} and all(t > 0 for t in measured.values())
