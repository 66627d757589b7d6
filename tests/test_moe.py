"""Tests of tinygpt.moe (day 20): the routers against transformers' own (Qwen3-MoE, Mixtral,
DeepSeek-V3), dispatch and the decode path against the per-token loop and a float64 run,
capacity, experts nobody chose, the MoE layer against transformers' MoE blocks, and the
formulas (distinct experts by simulation, bytes per step, the critical batch by a scan).

Float tolerances follow tinygpt.testing.check_float32_error: a float32 result must be about as
close to the float64 computation as an independent float32 implementation (transformers', or
the per-token loop) is, measured in the test itself."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tinygpt import moe as M
from tinygpt.cpu_kernels import MAX_ROWS
from tinygpt.testing import check_float32_error

EPS = torch.finfo(torch.float32).eps


def randn(*shape: int, seed: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def experts_weights(e: int, i: int, d: int, seed: int = 1, std: float = 0.1):
    return (randn(e, i, d, seed=seed, std=std), randn(e, i, d, seed=seed + 1, std=std),
            randn(e, d, i, seed=seed + 2, std=std))


def truth_weights(logits64: torch.Tensor, experts: torch.Tensor, router: str,
                  renormalize: bool, scale: float = 1.0) -> torch.Tensor:
    """The routing weights of the chosen experts computed in float64 (the choice is the
    float32 router's: the truth of its weights, not of a near tie)."""
    if router == "softmax":
        w = torch.softmax(logits64, -1).gather(1, experts)
    else:
        w = torch.sigmoid(logits64).gather(1, experts)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scale


def by_expert(weights: torch.Tensor, experts: torch.Tensor):
    """Each row's (experts, weights) sorted by expert id (transformers' DeepSeek-V3 router
    returns them unsorted)."""
    order = experts.argsort(-1)
    return experts.gather(1, order), weights.gather(1, order)


# --------------------------------------------------------------------------------------------
# routers against transformers


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_equals_qwen3_moe(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4,
                         norm_topk_prob=renormalize, moe_intermediate_size=32)
    router = Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(randn(16, 64, seed=2, std=0.3))
        x = randn(50, 64, seed=3)
        _, theirs_w, theirs_e = router(x)
        logits = F.linear(x, router.weight)
        ours_w, ours_e = M.route_softmax_topk(logits, 4, renormalize)
        truth = truth_weights(F.linear(x.double(), router.weight.double()), ours_e, "softmax",
                              renormalize)
    assert torch.equal(ours_e, theirs_e), "the same experts, in the same order"
    assert ours_w.dtype == torch.float32 and ours_e.dtype == torch.int64
    check_float32_error("route_softmax_topk's weights", ours_w, theirs_w, truth, floor=EPS)
    if renormalize:
        assert torch.allclose(ours_w.sum(-1), torch.ones(50))
    else:
        assert (ours_w.sum(-1) < 1).all()


def test_softmax_router_equals_mixtral_and_moe_route():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2,
                        intermediate_size=32)
    router = MixtralTopKRouter(cfg)
    layer = M.MoE(64, 8, 2, 32)
    with torch.no_grad():
        router.weight.copy_(randn(8, 64, seed=4, std=0.3))
        layer.gate.weight.copy_(router.weight)
        x = randn(40, 64, seed=5)
        _, theirs_w, theirs_e = router(x)
        ours_w, ours_e = layer.route(x)
        truth = truth_weights(F.linear(x.double(), router.weight.double()), ours_e, "softmax",
                              True)
    assert torch.equal(ours_e, theirs_e)
    check_float32_error("MoE.route (Mixtral)", ours_w, theirs_w, truth, floor=EPS)


def test_sigmoid_group_router_equals_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e, k, groups, keep, scale = 32, 4, 4, 2, 2.5
    cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=e, num_experts_per_tok=k,
                           n_group=groups, topk_group=keep, routed_scaling_factor=scale,
                           norm_topk_prob=True, moe_intermediate_size=32)
    router = DeepseekV3TopkRouter(cfg)
    bias = randn(e, seed=6, std=0.1)
    with torch.no_grad():
        router.weight.copy_(randn(e, 64, seed=7, std=0.3))
        router.e_score_correction_bias.copy_(bias)
        x = randn(64, 64, seed=8)
        _, theirs_w, theirs_e = router(x)
        logits = F.linear(x, router.weight)
        ours_w, ours_e = M.route_sigmoid_groups(logits, bias, k, groups, keep, True, scale)
        truth = truth_weights(logits.double(), ours_e, "sigmoid", True, scale)
        # the case must exercise both rules: groups and bias change some choices
        plain = torch.sigmoid(logits).topk(k, -1).indices.sort(-1).values
        no_bias = M.route_sigmoid_groups(logits, torch.zeros(e), k, groups, keep, True, scale)[1]
    ours_e_sorted, ours_w_sorted = by_expert(ours_w, ours_e)
    theirs_e_sorted, theirs_w_sorted = by_expert(theirs_w, theirs_e)
    assert torch.equal(ours_e_sorted, theirs_e_sorted)
    _, truth_sorted = by_expert(truth, ours_e)
    check_float32_error("route_sigmoid_groups' weights", ours_w_sorted, theirs_w_sorted,
                        truth_sorted, floor=scale * EPS)
    assert not torch.equal(plain, ours_e_sorted), "no choice was changed by the groups"
    assert not torch.equal(no_bias.sort(-1).values, ours_e_sorted), "the bias changed nothing"
    assert torch.allclose(ours_w.sum(-1), torch.full((64,), scale))


def test_the_bias_changes_the_choice_but_not_the_weight():
    logits = torch.logit(torch.tensor([[0.9, 0.6, 0.5, 0.1]], dtype=torch.float64)).float()
    bias = torch.tensor([0.0, 0.0, 0.2, 0.0])
    w, e = M.route_sigmoid_groups(logits, torch.zeros(4), 2, renormalize=False)
    assert e.tolist() == [[0, 1]] and torch.allclose(w, torch.tensor([[0.9, 0.6]]))
    w, e = M.route_sigmoid_groups(logits, bias, 2, renormalize=False)
    assert e.tolist() == [[0, 2]], "0.5 + 0.2 beats 0.6: the bias chooses expert 2"
    assert torch.allclose(w, torch.tensor([[0.9, 0.5]])), "its weight is its unbiased score"
    w, e = M.route_sigmoid_groups(logits, bias, 2, renormalize=True, scale=2.5)
    assert torch.allclose(w, torch.tensor([[0.9, 0.5]]) / 1.4 * 2.5)


def test_groups_exclude_the_best_single_expert():
    logits = torch.logit(torch.tensor([[0.7, 0.6, 0.9, 0.1]], dtype=torch.float64)).float()
    _, e = M.route_sigmoid_groups(logits, torch.zeros(4), 1)
    assert e.tolist() == [[2]]
    # groups {0, 1} (top-2 sum 1.3) and {2, 3} (1.0): only the first stays eligible
    _, e = M.route_sigmoid_groups(logits, torch.zeros(4), 1, n_group=2, topk_group=1)
    assert e.tolist() == [[0]]


def test_router_errors_name_the_argument():
    logits = randn(3, 8)
    for k in (0, 9, True, 2.0):
        with pytest.raises(ValueError, match="k must be an int in"):
            M.route_softmax_topk(logits, k)
    with pytest.raises(ValueError, match="logits must be a tensor of shape"):
        M.route_softmax_topk(logits[0], 2)
    with pytest.raises(ValueError, match="bias must have shape"):
        M.route_sigmoid_groups(logits, torch.zeros(7), 2)
    for groups in (3, 8, 0):
        with pytest.raises(ValueError, match="n_group must split E=8"):
            M.route_sigmoid_groups(logits, torch.zeros(8), 2, n_group=groups)
    for keep, k in ((0, 1), (5, 1), (1, 3)):
        with pytest.raises(ValueError, match="topk_group must be in"):
            M.route_sigmoid_groups(logits, torch.zeros(8), k, n_group=4, topk_group=keep)
    with pytest.raises(ValueError, match="router must be one of"):
        M.MoE(8, 4, 2, 8, router="hash")
    with pytest.raises(ValueError, match="top_k must be in"):
        M.MoE(8, 4, 5, 8)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(top_k=2.0), TypeError, "top_k must be an int, got 2.0"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(d_expert=8.0), TypeError, "d_expert must be an int"),
    (dict(d_expert=0), ValueError, "d_expert must be >= 1"),
    (dict(renormalize=1), TypeError, "renormalize must be True or False"),
    (dict(n_group=2), ValueError, "n_group must be 1 with router 'softmax'"),
    (dict(topk_group=2), ValueError, "topk_group must be 1 with router 'softmax'"),
    (dict(scale=2.5), ValueError, "scale must be 1 with router 'softmax'"),
    (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    (dict(router="sigmoid_groups", n_group=3), ValueError,
     "n_group must divide n_experts=4 into groups of at least 2"),
    (dict(router="sigmoid_groups", n_group=2, topk_group=3), ValueError,
     "topk_group must be in"),
    (dict(router="sigmoid_groups", n_group=2, topk_group=1, top_k=3), ValueError,
     "keep at least top_k=3 experts eligible"),
])
def test_moe_refuses_bad_arguments_up_front(kwargs, error, match):
    """When the layer is built, with ModelConfig's messages (not at the first forward, and
    no option ignored: groups and a scale belong to the sigmoid router)."""
    args = dict(d_model=8, n_experts=4, top_k=2, d_expert=8) | kwargs
    with pytest.raises(error, match=match):
        M.MoE(**args)
    M.MoE(8, 4, 2, 8, router="sigmoid_groups", n_group=2, topk_group=1, scale=2.5)


# --------------------------------------------------------------------------------------------
# running the experts


def routed(n: int, d: int, e: int, k: int, seed: int = 0):
    x = randn(n, d, seed=seed)
    logits = x @ randn(e, d, seed=seed + 9, std=0.5).T
    return x, logits, *M.route_softmax_topk(logits, k)


def test_dispatch_equals_the_loop_and_the_float64_run():
    e, k, i, d = 8, 3, 40, 48
    x, logits, weights, experts = routed(37, d, e, k)
    w1, w3, w2 = experts_weights(e, i, d)
    got = M.dispatch(x, weights, experts, w1, w3, w2)
    loop = M.moe_loop(x, weights, experts, w1, w3, w2)
    w64 = truth_weights(logits.double(), experts, "softmax", True)
    args64 = (x.double(), w64, experts, w1.double(), w3.double(), w2.double())
    truth = M.moe_loop(*args64)
    assert truth.dtype == torch.float64
    assert torch.allclose(M.dispatch(*args64), truth, rtol=0, atol=1e-13), \
        "in float64 both run in float64"
    check_float32_error("dispatch", got, loop, truth, floor=EPS * truth.abs().max().item())
    check_float32_error("moe_loop", loop, got, truth, floor=EPS * truth.abs().max().item())


def test_sort_by_expert_by_hand():
    order, tokens, counts = M.sort_by_expert(torch.tensor([[2, 0], [0, 1], [2, 1]]), 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]
    assert tokens.tolist() == [0, 1, 1, 2, 0, 2]
    assert counts.tolist() == [2, 2, 2, 0]


def test_capacity_drops_exactly_the_counted_pairs_latest_first():
    e, k, i, d, cap = 6, 2, 16, 24, 5
    x, _, weights, experts = routed(30, d, e, k, seed=3)
    w1, w3, w2 = experts_weights(e, i, d, seed=4)
    keep = torch.zeros_like(experts, dtype=torch.bool)
    seen = [0] * e
    for n in range(experts.shape[0]):                # token order: the earliest are kept
        for j in range(k):
            ex = int(experts[n, j])
            keep[n, j] = seen[ex] < cap
            seen[ex] += 1
    dropped = int((~keep).sum())
    assert dropped > 0, "the case must overflow some expert"
    assert M.dropped_pairs(experts, e, cap) == dropped
    got = M.dispatch(x, weights, experts, w1, w3, w2, capacity=cap)
    want = M.moe_loop(x, weights * keep, experts, w1, w3, w2)
    scale = want.abs().max().item()
    assert torch.allclose(got, want, rtol=0, atol=16 * EPS * scale)
    full = M.dispatch(x, weights, experts, w1, w3, w2)
    changed = (got - full).abs().amax(-1) > 16 * EPS * scale
    assert torch.equal(changed, ~keep.all(-1)), "exactly the tokens that lost a pair change"
    assert M.dropped_pairs(experts, e, 10**6) == 0
    assert M.dispatch(x, weights, experts, w1, w3, w2, capacity=0).abs().max() == 0
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="capacity must be"):
            M.dispatch(x, weights, experts, w1, w3, w2, capacity=bad)
        with pytest.raises(ValueError, match="capacity must be"):
            M.dropped_pairs(experts, e, bad)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(scale=-2.5), ValueError, "scale must be a finite number > 0"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number > 0"),
    (dict(scale=float("inf")), ValueError, "scale must be a finite number > 0"),
    (dict(scale="2.5"), TypeError, "scale must be a number"),
    (dict(renormalize="no"), TypeError, "renormalize must be True or False"),
])
def test_sigmoid_group_router_refuses_what_moe_refuses(kwargs, error, match):
    logits, bias = randn(3, 8, seed=1), torch.zeros(8)
    with pytest.raises(error, match=match):
        M.route_sigmoid_groups(logits, bias, 2, 2, 1, **kwargs)
    with pytest.raises(error, match=match):                   # the layer words it the same
        M.MoE(16, 8, 2, 8, router="sigmoid_groups", n_group=2, **kwargs)


def test_dispatch_errors_name_the_argument():
    x, _, weights, experts = routed(4, 8, 4, 2)
    w1, w3, w2 = experts_weights(4, 6, 8)
    with pytest.raises(ValueError, match="experts must lie in"):
        M.dispatch(x, weights, experts + 3, w1, w3, w2)
    with pytest.raises(ValueError, match="weights and experts must both be"):
        M.dispatch(x, weights[:, :1], experts, w1, w3, w2)
    with pytest.raises(ValueError, match="x must be"):
        M.moe_loop(x[:, :5], weights, experts, w1, w3, w2)
    with pytest.raises(ValueError, match=r"w3 must have w1's shape .* = \(4, 6, 8\), got "
                                         r"\(4, 5, 8\)"):
        M.dispatch(x, weights, experts, w1, w3[:, :5], w2)
    with pytest.raises(ValueError, match=r"w2 must have shape .* = \(4, 8, 6\), got \(4, 6, 8\)"):
        M.dispatch(x, weights, experts, w1, w3, w1)        # w2 given w1's layout
    with pytest.raises(ValueError, match=r"w2 must have shape"):
        M.moe_loop(x, weights, experts, w1, w3, w2[:3])


def poisoned_layer(shared: bool = False) -> M.MoE:
    """A DeepSeek-style layer whose last expert's bias keeps it from ever being chosen, and
    whose weights are NaN: a path that reads it returns NaN."""
    layer = M.MoE(32, 8, 2, 16, router="sigmoid_groups", n_group=2, topk_group=2, scale=2.5,
                  d_shared=16 if shared else 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(randn(*p.shape, seed=p.numel(), std=0.2))
        layer.e_score_correction_bias[-1] = -10.0            # scores are in (0, 1)
    return layer


@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_an_expert_nobody_chose_is_never_read(tokens):
    layer = poisoned_layer()
    x = randn(tokens, 32, seed=11)
    with torch.no_grad():
        clean = layer(x)
        assert 7 not in layer.last_ran and layer.last_experts.max() < 7
        for w in (layer.w1, layer.w3, layer.w2):
            w[7] = float("nan")
        poisoned = layer(x)
        decoded = M.MoEDecode(layer)(x)
        tiled = M.MoEDecode(layer, M.tiled_products)(x)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)
    assert torch.equal(decoded, clean) and torch.isfinite(tiled).all()


def test_moe_equals_transformers_deepseek_v3_block_with_a_shared_expert():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    d, e, k, i = 32, 8, 2, 16
    cfg = DeepseekV3Config(hidden_size=d, n_routed_experts=e, num_experts_per_tok=k, n_group=2,
                           topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                           moe_intermediate_size=i, n_shared_experts=1)
    theirs = DeepseekV3MoE(cfg).eval()
    ours = poisoned_layer(shared=True)
    ours.topk_group = 1
    with torch.no_grad():
        ours.e_score_correction_bias.copy_(randn(e, seed=12, std=0.05))
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.e_score_correction_bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.w1, ours.w3], 1))
        theirs.experts.down_proj.copy_(ours.w2)
        theirs.shared_experts.gate_proj.weight.copy_(ours.shared.w1.weight)
        theirs.shared_experts.up_proj.weight.copy_(ours.shared.w3.weight)
        theirs.shared_experts.down_proj.weight.copy_(ours.shared.w2.weight)
        x = randn(2, 9, d, seed=13)
        got, want = ours(x), theirs(x)
        experts = ours.last_experts
        flat64 = x.reshape(-1, d).double()
        logits64 = F.linear(flat64, ours.gate.weight.double())
        w64 = truth_weights(logits64, experts, "sigmoid", True, 2.5)
        truth = M.moe_loop(flat64, w64, experts, ours.w1.double(), ours.w3.double(),
                           ours.w2.double()) + copy.deepcopy(ours.shared).double()(flat64)
    assert got.shape == x.shape
    check_float32_error("MoE with a shared expert (DeepSeek-V3)", got.reshape(-1, d),
                        want.reshape(-1, d), truth, floor=EPS * truth.abs().max().item())


def test_moe_equals_transformers_qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    d, e, k, i = 32, 16, 4, 24
    cfg = Qwen3MoeConfig(hidden_size=d, num_experts=e, num_experts_per_tok=k,
                         norm_topk_prob=False, moe_intermediate_size=i)
    theirs = Qwen3MoeSparseMoeBlock(cfg).eval()
    ours = M.MoE(d, e, k, i, renormalize=False)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(randn(*p.shape, seed=p.numel() + 1, std=0.2))
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.w1, ours.w3], 1))
        theirs.experts.down_proj.copy_(ours.w2)
        x = randn(1, 21, d, seed=14)
        got, want = ours(x), theirs(x)
        flat64 = x.reshape(-1, d).double()
        w64 = truth_weights(F.linear(flat64, ours.gate.weight.double()), ours.last_experts,
                            "softmax", False)
        truth = M.moe_loop(flat64, w64, ours.last_experts, ours.w1.double(), ours.w3.double(),
                           ours.w2.double())
    check_float32_error("MoE (Qwen3-MoE)", got.reshape(-1, d), want.reshape(-1, d), truth,
                        floor=EPS * truth.abs().max().item())


# --------------------------------------------------------------------------------------------
# the decode path


@pytest.mark.parametrize("tokens", [1, 2, 4, 9])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_decode_equals_the_layer_plain_and_tiled(tokens, shared):
    layer = poisoned_layer(shared)
    x = randn(tokens, 1, 32, seed=15)
    with torch.no_grad():
        want = layer(x)
        want_ran, want_experts = layer.last_ran, layer.last_experts
        plain = M.MoEDecode(layer)(x)
        assert torch.equal(plain, want), "the plain products give the layer's bits"
        assert layer.last_ran == want_ran and torch.equal(layer.last_experts, want_experts)
        assert layer.last_ran == tuple(torch.unique(want_experts).tolist())
        tiled = M.MoEDecode(layer, M.tiled_products)(x)
        if tokens > MAX_ROWS:      # more rows than the kernels take: all products plain
            assert torch.equal(tiled, want)
        flat64 = x.reshape(-1, 32).double()
        w64 = truth_weights(F.linear(flat64, layer.gate.weight.double()), want_experts,
                            "sigmoid", True, 2.5)
        truth = M.moe_loop(flat64, w64, want_experts, layer.w1.double(), layer.w3.double(),
                           layer.w2.double())
        if shared:
            truth = truth + copy.deepcopy(layer.shared).double()(flat64)
    check_float32_error("MoEDecode on tiled products", tiled.reshape(-1, 32),
                        want.reshape(-1, 32), truth, floor=EPS * truth.abs().max().item())


def test_moe_decode_of_one_token_adds_its_experts_in_dispatch_order():
    """Bit for bit, also with k = 4 (with two terms the order of a float sum cannot show)."""
    layer = M.MoE(32, 16, 4, 8)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(randn(*p.shape, seed=p.numel() + 2, std=0.3))
        decode = M.MoEDecode(layer)
        for seed in range(20):
            x = randn(1, 32, seed=seed)
            want, want_ran = layer(x), layer.last_ran
            assert torch.equal(decode(x), want) and layer.last_ran == want_ran


def test_tiled_products_are_tiled_where_the_kernels_run():
    from tinygpt import cpu_kernels

    w = randn(32, 16)
    product = M.tiled_products(w, w)
    if cpu_kernels.available() is None:
        assert isinstance(product, M.TiledProducts)
    assert type(M.tiled_products(w.double())) is M.PlainProducts
    assert len(product(randn(3, 16))) == 2 and product(randn(7, 16))[0].shape == (7, 32)
    with pytest.raises(TypeError, match="moe must be a tinygpt.moe.MoE"):
        M.MoEDecode(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------
# load, distinct experts, bytes, the critical batch


def test_expert_load_and_imbalance_by_hand():
    experts = torch.tensor([[0, 1], [0, 2], [0, 3]])
    assert M.expert_load(experts, 5).tolist() == [3, 1, 1, 1, 0]
    assert M.load_imbalance(experts, 4) == pytest.approx(3 / 1.5)
    assert M.load_imbalance(torch.tensor([[0, 1], [2, 3]]), 4) == 1.0
    with pytest.raises(ValueError, match=r"experts must lie in \[0, n_experts=4\), got .* "
                                         r"\[0, 4\]"):
        M.load_imbalance(torch.tensor([[0, 4], [2, 3]]), 4)      # 4 is no expert of 4
    with pytest.raises(ValueError, match=r"experts must lie in \[0, n_experts=5\)"):
        M.expert_load(torch.tensor([[-1, 2]]), 5)
    with pytest.raises(ValueError, match="experts must lie in"):
        M.dropped_pairs(experts, 3, 1)
    with pytest.raises(ValueError, match="n_experts must be an int >= 1"):
        M.load_imbalance(experts, 0)
    with pytest.raises(ValueError, match="at least one"):
        M.load_imbalance(torch.zeros(0, 2, dtype=torch.long), 4)


@pytest.mark.parametrize("e,k,b", [(16, 4, 4), (16, 2, 16), (64, 6, 8)])
def test_expected_distinct_experts_by_simulation(e, k, b):
    trials = 4000
    gen = torch.Generator().manual_seed(e * b + k)
    chosen = torch.rand(trials, b, e, generator=gen).topk(k, -1).indices     # uniform k-sets
    hit = torch.zeros(trials, e, dtype=torch.bool)
    hit.scatter_(1, chosen.reshape(trials, -1), True)
    distinct = hit.sum(-1).double()
    se = distinct.std().item() / math.sqrt(trials)
    assert abs(distinct.mean().item() - M.expected_distinct_experts(e, k, b)) <= 4 * se
    assert M.expected_distinct_experts(e, k, 1) == k
    assert M.expected_distinct_experts(e, k, 0) == 0


def test_deepseek_v3_figures():
    got = [M.expected_distinct_experts(256, 8, b) for b in (1, 4, 16, 64)]
    assert got[0] == pytest.approx(8)
    assert [round(got[1], 1), round(got[2]), round(got[3])] == [30.5, 102, 222]
    with pytest.raises(ValueError, match="need 1 <= k <= n_experts"):
        M.expected_distinct_experts(8, 9, 1)


def test_moe_decode_bytes_by_hand():
    dense, expert, layers = 1e9, 2e6, 10
    assert M.moe_decode_bytes(dense, expert, layers, 8, 2, 1) == pytest.approx(
        dense + layers * 2 * expert)
    b16 = 8 * (1 - (1 - 2 / 8) ** 16)
    assert M.moe_decode_bytes(dense, expert, layers, 8, 2, 16) == pytest.approx(
        dense + layers * b16 * expert)
    assert M.moe_decode_bytes(dense, expert, layers, 8, 8, 3) == pytest.approx(
        dense + layers * 8 * expert)


@pytest.mark.parametrize("e,k", [(8, 2), (64, 6), (256, 8)])
def test_critical_batch_against_a_scan(e, k):
    def intensity(b: int) -> float:
        return 2.0 * b * k / M.expected_distinct_experts(e, k, b)

    for fpb in (1.0, 2.5, 10.0, 40.0, 150.0, 600.0):
        scan = next((b for b in range(1, 5000) if intensity(b) >= fpb), None)
        assert M.critical_batch(fpb, e, k, max_batch=4999) == scan
    assert M.critical_batch(1e9, e, k, max_batch=64) is None
    # a dense MLP (k = E) reaches flops_per_byte at batch flops_per_byte / 2
    assert M.critical_batch(100.0, 4, 4) == 50
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="flops_per_byte must be"):
            M.critical_batch(bad, e, k)
    with pytest.raises(ValueError, match="max_batch must be"):
        M.critical_batch(10.0, e, k, max_batch=0)


# --------------------------------------------------------------------------------------------
# the decode step of a MoE TinyGPT (tinygpt.kv_cache.DecodeStep runs MoEDecode)



def moe_model():
    from tinygpt.model import ModelConfig, TinyGPT

    cfg = ModelConfig(vocab_size=61, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96,
                      max_seq_len=64, n_experts=8, top_k=3, d_expert=32, dense_layers=(1,),
                      n_shared_experts=1)
    model = TinyGPT(cfg, seed=0).eval()
    with torch.no_grad():          # larger logits and router scores than the 0.02 init
        model.output.weight.mul_(40)
        for block in model.layers:
            if isinstance(block.feed_forward, M.MoE):
                block.feed_forward.gate.weight.mul_(20)
    return model


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "plain"])
@pytest.mark.parametrize("batch", [1, 3, 6])
def test_the_decode_step_runs_moe_layers_through_moe_decode(batch, tiled):
    from tests.float64 import float64_twin
    from tinygpt import cpu_kernels
    from tinygpt.kv_cache import DecodeStep, KVCache, decode_step, prefill

    model = moe_model()
    moe = [b.feed_forward for b in model.layers if isinstance(b.feed_forward, M.MoE)]
    ids = torch.randint(0, 61, (batch, 7), generator=torch.Generator().manual_seed(batch))
    fast_cache, plain_cache = KVCache.for_model(model, batch, 20), KVCache.for_model(
        model, batch, 20)
    step = DecodeStep(model, fast_cache, tiled=tiled)
    assert step.tiled == (tiled and cpu_kernels.available() is None)
    assert isinstance(step._weights[0][4], M.MoEDecode) and step._weights[1][5] is not None
    # on the tiled products the layers run in C (cpu_kernels.MoEDecodeLayers), up to MAX_ROWS
    assert isinstance(step._layers, cpu_kernels.MoEDecodeLayers) == step.tiled
    got, want = [], []
    with torch.inference_mode():
        token = prefill(model, fast_cache, ids).argmax(-1, keepdim=True)
        prefill(model, plain_cache, ids)
        for _ in range(5):
            ids = torch.cat([ids, token], 1)
            with step.token_threads(batch):
                got.append(step(token))
            assert all(ff.last_ran == tuple(torch.unique(ff.last_experts).tolist())
                       for ff in moe)
            if batch == 1:
                assert all(len(ff.last_ran) == 3 for ff in moe)
            want.append(decode_step(model, plain_cache, token))
            token = got[-1].argmax(-1, keepdim=True)
        truth = float64_twin(model)(ids)[:, 6:-1].transpose(0, 1)        # (steps, B, V)
    got, want = torch.stack(got), torch.stack(want)
    check_float32_error("the decode step's logits on a MoE model", got, want, truth,
                        factor=4, floor=EPS * truth.abs().max().item())


def test_the_decode_step_of_a_moe_model_gives_generate_the_uncached_tokens():
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    model = moe_model()
    params = SamplingParams(temperature=0, max_new_tokens=12)
    for prompt in ([1, 2, 3], [5, 9, 14, 2, 2, 7]):
        assert generate(model, prompt, params).token_ids == \
            generate(model, prompt, params, use_cache=False).token_ids


def test_quantized_decode_weights_on_a_moe_model_run_the_plain_products():
    from tinygpt.cpu_kernels import q8_0_model
    from tinygpt.kv_cache import DecodeStep, KVCache

    with pytest.raises(ValueError, match="q8_0_model cannot quantize a mixture-of-experts"):
        q8_0_model(moe_model())
    model = moe_model()              # marked by hand: the step still refuses the blocks
    model.decode_weights = "q8_0"
    step = DecodeStep(model, KVCache.for_model(model, 1, 8))
    assert not step.tiled and "Q8_0 / Q4_1 decode weights" in step.tiled_reason


def test_extend_runs_several_positions_of_a_moe_model_in_c():
    from tests.float64 import float64_twin
    from tinygpt.kv_cache import DecodeStep, KVCache, prefill

    model = moe_model()
    ids = torch.randint(0, 61, (1, 13), generator=torch.Generator().manual_seed(7))
    cache = KVCache.for_model(model, 1, 20)
    with torch.inference_mode():
        prefill(model, cache, ids[:, :7])
        step = DecodeStep(model, cache)
        got = step.extend(ids[:, 7:])                        # 6 positions: 4, then 2, in C
        want = model(ids)[0, 7:]
        truth = float64_twin(model)(ids)[0, 7:]
    assert cache.length == 13
    check_float32_error("DecodeStep.extend on a MoE model", got, want, truth, factor=4,
                        floor=EPS * truth.abs().max().item())


def test_moe_decode_layers_refuse_what_they_cannot_run():
    from tinygpt import cpu_kernels
    from tinygpt.kv_cache import DecodeStep, KVCache, _moe_layers

    if cpu_kernels.available() is not None:
        pytest.skip(cpu_kernels.available())
    model = moe_model()
    cache = KVCache.for_model(model, 1, 8)
    step = DecodeStep(model, cache)
    layers = _moe_layers(step._weights)
    args = (cache.layers, model.rope_cos, step._sin_signed)
    assert cpu_kernels.MoEDecodeLayers.refusal(layers, *args) is None
    plain = _moe_layers(DecodeStep(model, KVCache.for_model(model, 1, 8), tiled=False)._weights)
    assert "TiledLinear" in cpu_kernels.MoEDecodeLayers.refusal(plain, *args)
    odd = [(*layer[:4], ("sparse",)) for layer in layers]
    assert "ffn must be" in cpu_kernels.MoEDecodeLayers.refusal(odd, *args)
    with pytest.raises(ValueError, match="x must be contiguous float32"):
        step._layers(torch.zeros(5, 64), 0)
