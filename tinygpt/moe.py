"""Day 20: mixture of experts: routers, dispatch by expert, load, and what a decode step reads.

A mixture-of-experts (MoE) layer replaces one SwiGLU MLP with E of them ("experts") and a
router that sends each token to k << E of them:

    logits = x @ router.T                        (N, E)   one score per token and expert
    weights, experts = route(logits)             (N, k)   the k chosen experts and their weights
    y[n] = sum_j weights[n, j] * expert_{experts[n, j]}(x[n])      (+ shared experts, if any)

Routers (transformers' modeling files are the reference):

    route_softmax_topk    softmax over all E, keep the top k, renormalize them to sum to 1
                          (Mixtral always; Qwen2/3-MoE and OLMoE when norm_topk_prob)
    route_sigmoid_groups  DeepSeek-V3: sigmoid scores; a per-expert bias is added for choosing
                          only; experts come in n_group groups, a group is ranked by the sum of
                          its top 2 biased scores and only the best topk_group groups compete;
                          the weights are the unbiased scores, normalized, times a scale (2.5)

Two ways to run the experts, equal up to float32 summation order:

    moe_loop      the plain oracle: for every token, for every chosen expert, one MLP on one row
    dispatch      sort the (token, expert) pairs by expert, one product per expert over all its
                  rows, scatter the weighted rows back with index_add: reads each chosen
                  expert's weights once, and never an expert nobody chose

Expert weights are stacked: w1 and w3 (E, d_expert, D) (gate and up), w2 (E, D, d_expert)
(down), so expert e's MLP is w2[e](silu(w1[e] x) * w3[e] x), SwiGLU's layout per expert.

A decode step's few tokens take a third way, MoEDecode: the same sums as dispatch (bit for bit
on PlainProducts), but each expert's products are built once over its contiguous slices,
by default on tinygpt.cpu_kernels' tiled copies (tiled_products: gate and up stacked into one
product, down another, each split over the cores). At batch 1 only the k chosen experts' 3
matrices are read; tinygpt.kv_cache.DecodeStep runs a MoE model's layers this way.

What a batch costs: under uniform routing a token misses a given expert with probability
1 - k/E, so B tokens touch E (1 - (1 - k/E)^B) distinct experts on average
(`expected_distinct_experts`); a decode step reads those experts' weights plus every dense
weight (`moe_decode_bytes`). At batch 1 that is k experts; at large B it is nearly all E.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("softmax", "sigmoid_groups")


# --------------------------------------------------------------------------------------------
# routers: logits (N, E) -> weights (N, k) float32, experts (N, k) int64


def _check_logits(logits: torch.Tensor, k: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ValueError(f"logits must be a tensor of shape (N, E), got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be an int in [1, E={logits.shape[1]}], got {k!r}")


def route_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), the top k, renormalized when `renormalize`.

    Renormalizing the top k of a softmax equals a softmax over the top k logits (Mixtral).
    Returns weights (N, k) float32 and experts (N, k) int64, largest weight first.
    """
    _check_logits(logits, k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_sigmoid_groups(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1,
                         topk_group: int = 1, renormalize: bool = True, scale: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: sigmoid scores, bias for choosing only, group-limited top k.

    logits (N, E); bias (E,) (`e_score_correction_bias`, balances the load without an aux loss);
    E must split into n_group groups of at least 2; the topk_group groups with the largest sum
    of their 2 best biased scores stay eligible. The weights are the chosen experts' sigmoid
    scores without the bias, divided by their sum when `renormalize`, times `scale`.
    Returns weights (N, k) float32 and experts (N, k) int64.
    """
    _check_logits(logits, k)
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be True or False, got {renormalize!r}")
    _check_scale(scale)
    n, e = logits.shape
    if bias.shape != (e,):
        raise ValueError(f"bias must have shape (E,) = ({e},), got {tuple(bias.shape)}")
    _check_groups(e, n_group, topk_group, k, "split E", "k")
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    keep = keep.repeat_interleave(e // n_group, dim=1)                          # (N, E)
    experts = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


# --------------------------------------------------------------------------------------------
# running the experts


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
               ) -> torch.Tensor:
    """One expert's SwiGLU on rows x (M, D): w2(silu(w1 x) * w3 x) with w1, w3 (I, D), w2 (D, I)."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _accumulator(x: torch.Tensor) -> torch.dtype:
    """The dtype the weighted expert outputs are formed in: float32, or x's when wider
    (a float64 run stays float64 throughout: the tests' truth)."""
    return torch.promote_types(x.dtype, torch.float32)


def moe_loop(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
             w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The oracle: token by token, chosen expert by chosen expert. x (N, D) -> (N, D).

    Reads an expert's weights once per (token, expert) pair: N k matrix-vector products.
    """
    _check_pairs(x, weights, experts, w1, w3, w2)
    acc = _accumulator(x)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            y = expert_mlp(x[n:n + 1], w1[e], w3[e], w2[e])
            out[n] += (weights[n, j].to(acc) * y[0].to(acc)).to(x.dtype)
    return out


def sort_by_expert(experts: torch.Tensor, n_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert.

    experts (N, k) -> order (N k,) the flat pair indices sorted by expert (stable: tokens in
    order within an expert), tokens (N k,) the token of each sorted pair, counts (E,) pairs per
    expert. Expert e's rows are order[offsets[e]:offsets[e + 1]], offsets = 0, cumsum(counts).
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // experts.shape[1]
    counts = torch.bincount(flat, minlength=n_experts)
    return order, tokens, counts


def _check_pairs(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
    """Clear errors for dispatch's and moe_loop's arguments."""
    if x.ndim != 2 or w1.ndim != 3 or x.shape[1] != w1.shape[2]:
        raise ValueError(f"x must be (N, D) and w1 (E, d_expert, D) with the same D, got x "
                         f"{tuple(x.shape)} and w1 {tuple(w1.shape)}")
    e, d_expert, d = w1.shape
    if w3.shape != w1.shape:
        raise ValueError(f"w3 must have w1's shape (E, d_expert, D) = {(e, d_expert, d)}, got "
                         f"{tuple(w3.shape)}")
    if w2.shape != (e, d, d_expert):
        raise ValueError(f"w2 must have shape (E, D, d_expert) = {(e, d, d_expert)}, got "
                         f"{tuple(w2.shape)}")
    if experts.ndim != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(f"weights and experts must both be (N={x.shape[0]}, k), got "
                         f"{tuple(weights.shape)} and {tuple(experts.shape)}")
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < w1.shape[0]:
        raise ValueError(f"experts must lie in [0, E={w1.shape[0]}), got values in "
                         f"[{int(experts.min())}, {int(experts.max())}]")


def _dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
              w3: torch.Tensor, w2: torch.Tensor, capacity: int | None
              ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """dispatch, and the experts whose weights it read (in the order it ran them)."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 0):
        raise ValueError(f"capacity must be None (dropless) or an int >= 0, got {capacity!r}")
    _check_pairs(x, weights, experts, w1, w3, w2)
    n_experts = w1.shape[0]
    order, tokens, counts = sort_by_expert(experts, n_experts)
    flat_weights = weights.reshape(-1)[order]
    acc = _accumulator(x)
    out = torch.zeros_like(x)
    ran = []
    start = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        end = start + count
        rows = tokens[start:end] if capacity is None else tokens[start:min(end, start + capacity)]
        if len(rows):
            y = expert_mlp(x[rows], w1[e], w3[e], w2[e])
            w = flat_weights[start:start + len(rows), None].to(acc)
            out.index_add_(0, rows, (y.to(acc) * w).to(x.dtype))
            ran.append(e)
        start = end
    return out, tuple(ran)


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
             w3: torch.Tensor, w2: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Grouped dispatch: one product per chosen expert over all of its rows. x (N, D) -> (N, D).

    capacity: at most this many rows per expert, the earliest tokens first; the pairs past it
    are dropped (their weight is lost, as in capacity-factor training). None: dropless, as
    inference engines run (a dropped pair changes a token's output because of other tokens in
    the batch).
    """
    return _dispatch(x, weights, experts, w1, w3, w2, capacity)[0]


def dropped_pairs(experts: torch.Tensor, n_experts: int, capacity: int) -> int:
    """How many (token, expert) pairs a per-expert capacity drops."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
    counts = expert_load(experts, n_experts)
    return int((counts - capacity).clamp(min=0).sum())


# --------------------------------------------------------------------------------------------
# the layer


def _check_moe_args(d_model, n_experts, top_k, d_expert, router, renormalize, n_group,
                    topk_group, scale, d_shared) -> None:
    """MoE's arguments, checked up front, value errors worded as ModelConfig's: TypeError for
    a wrong type, ValueError for a bad value."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be True or False, got {renormalize!r}")
    ints = dict(d_model=d_model, n_experts=n_experts, top_k=top_k, d_expert=d_expert,
                n_group=n_group, topk_group=topk_group, d_shared=d_shared)
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    for name in ("d_model", "n_experts", "d_expert"):
        if ints[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {ints[name]!r}")
    if d_shared < 0:
        raise ValueError(f"d_shared must be >= 0, got {d_shared!r}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k!r}")
    _check_scale(scale)
    if router == "softmax":
        for name, value in (("n_group", n_group), ("topk_group", topk_group), ("scale", scale)):
            if value != 1:
                raise ValueError(f"{name} must be 1 with router 'softmax' (groups and a scale "
                                 f"are 'sigmoid_groups' options), got {value!r}")
        return
    _check_groups(n_experts, n_group, topk_group, top_k, "divide n_experts", "top_k")


def _check_scale(scale: float) -> None:
    """The routed weights' factor: a finite number > 0 (DeepSeek-V3: 2.5)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a number, got {scale!r}")
    if not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


def _check_groups(e: int, n_group: int, topk_group: int, k: int, split: str, k_name: str):
    """DeepSeek-V3's groups: n_group groups of at least 2 of the e experts, topk_group of them
    kept, enough to hold the k chosen ones (the messages name the caller's arguments)."""
    if n_group < 1 or e % n_group or e // n_group < 2:
        raise ValueError(f"n_group must {split}={e} into groups of at least 2 experts, got "
                         f"{n_group!r}")
    if not 1 <= topk_group <= n_group or k > topk_group * (e // n_group):
        raise ValueError(f"topk_group must be in [1, n_group={n_group}] and keep at least "
                         f"{k_name}={k} experts eligible, got {topk_group!r}")


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: router, E SwiGLU experts, optional shared expert.

    x (..., D) -> (..., D). router: "softmax" (renormalize: Mixtral True, Qwen's norm_topk_prob)
    or "sigmoid_groups" (DeepSeek-V3: n_group, topk_group, scale; bias is the buffer
    `e_score_correction_bias`, float32 or wider whatever the module's dtype). d_shared > 0
    adds a shared SwiGLU expert every token goes through (DeepSeek-V3: n_shared_experts *
    d_expert wide). `last_experts` holds the experts the
    most recent forward chose (N, k) and `last_ran` those whose weights it read, for measuring
    what a step reads (MoEDecode, the decode steps' path, sets both too). Bad arguments are
    refused up front (value errors worded as ModelConfig's; n_group, topk_group and scale
    other than 1 need router "sigmoid_groups").
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, d_expert: int,
                 router: str = "softmax", renormalize: bool = True, n_group: int = 1,
                 topk_group: int = 1, scale: float = 1.0, d_shared: int = 0) -> None:
        super().__init__()
        _check_moe_args(d_model, n_experts, top_k, d_expert, router, renormalize, n_group,
                        topk_group, scale, d_shared)
        self.n_experts, self.top_k, self.d_expert = n_experts, top_k, d_expert
        self.router, self.renormalize, self.scale = router, renormalize, scale
        self.n_group, self.topk_group = n_group, topk_group
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        if router == "sigmoid_groups":
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))
        self.shared = None
        if d_shared:
            from tinygpt.model import SwiGLU  # day 05's MLP (model imports this module)

            self.shared = SwiGLU(d_model, d_shared)
        self.last_experts: torch.Tensor | None = None
        self.last_ran: tuple[int, ...] = ()

    def _apply(self, fn, recurse=True):
        """nn.Module's, except that `e_score_correction_bias` is never narrower than float32:
        .to(torch.bfloat16), .half() and the like move it but keep its float32 values, as
        transformers keeps DeepSeek-V3's in float32 (a bfloat16 bias near 3.0 is rounded in
        steps of 1/64, which flips near-tied choices)."""
        bias = self._buffers.get("e_score_correction_bias")
        super()._apply(fn, recurse)
        moved = self._buffers.get("e_score_correction_bias")
        if bias is not None and moved is not None and moved.is_floating_point() \
                and torch.finfo(moved.dtype).bits < 32:
            self._buffers["e_score_correction_bias"] = (
                moved.float() if bias.is_meta != moved.is_meta else
                bias.to(device=moved.device, dtype=torch.float32))
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> weights (N, k) float32, experts (N, k)."""
        if self.router == "softmax":
            return route_softmax_topk(self.gate(x), self.top_k, self.renormalize)
        logits = F.linear(x.float(), self.gate.weight.float())      # DeepSeek-V3: float32
        return route_sigmoid_groups(logits, self.e_score_correction_bias, self.top_k,
                                    self.n_group, self.topk_group, self.renormalize, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        self.last_experts = experts
        out, self.last_ran = _dispatch(flat, weights, experts, self.w1, self.w3, self.w2, None)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, top_k={self.top_k}, d_expert={self.d_expert}, "
                f"router={self.router!r}")


# --------------------------------------------------------------------------------------------
# decode: few tokens, only the chosen experts' products


class PlainProducts:
    """y_i = x @ W_i^T with F.linear for weights that share their input: the plain products
    (the oracle). Called with x (..., K), returns one output per weight."""

    def __init__(self, *weights: torch.Tensor) -> None:
        self.weights = weights

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, w) for w in self.weights)


class TiledProducts(PlainProducts):
    """The same products on tinygpt.cpu_kernels' tiled float32 weights (stacked: an expert's
    gate and up are one product), split over the cores, for up to cpu_kernels.MAX_ROWS rows;
    more rows run the plain products. Build it with `tiled_products`, which returns
    PlainProducts where the kernels cannot run. The tiles are a copy of the weights."""

    def __init__(self, *weights: torch.Tensor) -> None:
        from tinygpt.cpu_kernels import MAX_ROWS, TiledLinear

        super().__init__(*weights)
        self.tiled, self.max_rows = TiledLinear(*weights), MAX_ROWS

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.dtype != torch.float32 or x.numel() // x.shape[-1] > self.max_rows:
            return super().__call__(x)
        return self.tiled(x)


def tiled_products(*weights: torch.Tensor) -> PlainProducts:
    """TiledProducts for float32 CPU weights when the C kernels can run here, else
    PlainProducts (same results up to float32 summation order)."""
    from tinygpt import cpu_kernels

    if cpu_kernels.available() is not None or cpu_kernels.TiledLinear.refusal(*weights) \
            is not None or any(w.dtype != torch.float32 for w in weights):
        return PlainProducts(*weights)
    return TiledProducts(*weights)


class MoEDecode:
    """A MoE layer's forward for a decode step's few tokens: only the chosen experts run.

    MoEDecode(moe, linear) builds, per expert e, the product of its gate and up slices
    (linear(w1[e], w3[e]), both (d_expert, D), contiguous in the stacked weights) and of its
    down slice (linear(w2[e])), and the shared expert's likewise. `linear(*weights)` returns a
    callable x (M, K) -> one output per weight: PlainProducts (the default), tiled_products
    (tinygpt.cpu_kernels' tiled copies, split over the cores: at batch 1 an expert's 3
    matrix-vector products then stream at the decode step's rate) or a decode step's own.

    Called with x (..., D): routes with moe.route, then runs the distinct chosen experts in
    increasing order, each over its tokens in order, and adds each weighted output as
    `dispatch` does, so with PlainProducts the result equals moe(x) bit for bit; with other
    products it differs by their summation order. Sets moe.last_experts and moe.last_ran
    (the experts whose weights this call read). The products are built once: a change to
    moe's weights afterwards does not reach tiled copies (build a new MoEDecode). A call with
    more tokens than a product takes at once (its `max_rows`: cpu_kernels.MAX_ROWS for the
    tiled ones) runs every product plain, F.linear on the same slices, as the dense layers of
    such a batch do: the kernels' threads spin for a while after each product, and torch's
    own threads beside them would fight them for the cores.
    """

    def __init__(self, moe: MoE, linear: Callable[..., Callable] = PlainProducts) -> None:
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a tinygpt.moe.MoE, got {type(moe).__name__}")
        self.moe = moe
        with torch.no_grad():
            self.gate_up = [linear(moe.w1[e], moe.w3[e]) for e in range(moe.n_experts)]
            self.down = [linear(moe.w2[e]) for e in range(moe.n_experts)]
            self.shared = None if moe.shared is None else (
                linear(moe.shared.w1.weight, moe.shared.w3.weight),
                linear(moe.shared.w2.weight))
        products = [*self.gate_up, *self.down, *(self.shared or ())]
        self.max_rows = min(getattr(p, "max_rows", math.inf) for p in products)

    @staticmethod
    def _swiglu(gate_up, down, x: torch.Tensor, plain: bool) -> torch.Tensor:
        if plain:                  # F.linear on the same weights (PlainProducts' sums)
            gate, up = (F.linear(x, w) for w in gate_up.weights)
            return F.linear(F.silu(gate) * up, down.weights[0])
        gate, up = gate_up(x)
        return down(F.silu(gate) * up)[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = moe.route(flat)
        moe.last_experts = experts
        acc = _accumulator(flat)
        plain = flat.shape[0] > self.max_rows
        if flat.shape[0] == 1:             # one token: its k experts in order, no indexing
            pairs = sorted(zip(experts[0].tolist(), weights[0].tolist(), strict=True))
            out = None
            for e, w in pairs:
                y = self._swiglu(self.gate_up[e], self.down[e], flat, plain)
                term = (y.to(acc) * w).to(flat.dtype)
                out = term if out is None else out + term
            moe.last_ran = tuple(e for e, _ in pairs)
        else:
            by_expert: dict[int, tuple[list[int], list[float]]] = {}
            for n, (row_e, row_w) in enumerate(zip(experts.tolist(), weights.tolist(),
                                                   strict=True)):
                for e, w in zip(row_e, row_w, strict=True):
                    tokens, ws = by_expert.setdefault(e, ([], []))
                    tokens.append(n)
                    ws.append(w)
            out = torch.zeros_like(flat)
            for e in sorted(by_expert):
                tokens, ws = by_expert[e]
                rows = torch.tensor(tokens)
                y = self._swiglu(self.gate_up[e], self.down[e], flat[rows], plain).to(acc)
                out.index_add_(0, rows, (y * torch.tensor(ws, dtype=acc)[:, None])
                               .to(flat.dtype))
            moe.last_ran = tuple(sorted(by_expert))
        if self.shared is not None:
            out = out + self._swiglu(*self.shared, flat, plain)
        return out.reshape(shape)

    @property
    def nbytes(self) -> int:
        """Bytes of weights the products hold (tiled copies included), for the report."""
        products = [*self.gate_up, *self.down, *(self.shared or ())]
        return sum(p.tiled.nbytes if hasattr(p, "tiled") else sum(w.nbytes for w in p.weights)
                   for p in products)


# --------------------------------------------------------------------------------------------
# load and bytes


def _check_expert_ids(experts: torch.Tensor, n_experts: int) -> None:
    """n_experts an int >= 1 and every id in experts (any shape) in [0, n_experts)."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be an int >= 1, got {n_experts!r}")
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < n_experts:
        raise ValueError(f"experts must lie in [0, n_experts={n_experts}), got values in "
                         f"[{int(experts.min())}, {int(experts.max())}]")


def expert_load(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: (E,) int64. Ids outside [0, n_experts) are refused."""
    _check_expert_ids(experts, n_experts)
    return torch.bincount(experts.reshape(-1), minlength=n_experts)


def load_imbalance(experts: torch.Tensor, n_experts: int) -> float:
    """The busiest expert's load over the mean load (1.0 = perfectly balanced).

    With capacity-free dispatch on one device per expert, the step waits for the busiest one.
    experts holds at least one id, each in [0, n_experts).
    """
    if not experts.numel():
        raise ValueError("experts must hold at least one (token, expert) pair, got none")
    load = expert_load(experts, n_experts).float()
    return float(load.max() / load.mean())


def expected_distinct_experts(n_experts: int, k: int, batch: int) -> float:
    """Distinct experts B tokens touch under uniform top-k routing: E (1 - (1 - k/E)^B)."""
    if not 1 <= k <= n_experts or batch < 0:
        raise ValueError(f"need 1 <= k <= n_experts and batch >= 0, got k={k}, "
                         f"n_experts={n_experts}, batch={batch}")
    return n_experts * (1.0 - (1.0 - k / n_experts) ** batch)


def moe_decode_bytes(dense_bytes: float, expert_bytes: float, n_moe_layers: int,
                     n_experts: int, k: int, batch: int) -> float:
    """Weight bytes one decode step of `batch` sequences reads, under uniform routing.

    dense_bytes: everything every token uses (embeddings row aside: attention, norms, routers,
    shared experts, dense layers, the head). expert_bytes: one expert's three matrices.
    """
    return dense_bytes + n_moe_layers * expected_distinct_experts(n_experts, k, batch) \
        * expert_bytes


def critical_batch(flops_per_byte: float, n_experts: int, k: int, max_batch: int = 1 << 16
                   ) -> int | None:
    """The smallest batch whose expert products reach a machine's FLOPs per byte.

    An expert's products do 2 flops per weight per row it sees; at batch B each touched expert
    sees B k / distinct(B) rows on average, so its arithmetic intensity is 2 B k / distinct(B)
    flops per weight, which is flops per byte at 1 byte per weight: for wider weights pass
    flops_per_byte times the bytes per weight (an H100's bfloat16 ridge, ~295, times 2). A
    dense MLP reaches the same intensity at B = flops_per_byte / 2: routing moves the critical
    batch out by about E / k. None when max_batch does not reach it.
    """
    if not flops_per_byte > 0 or flops_per_byte == float("inf"):
        raise ValueError(f"flops_per_byte must be a finite number > 0, got {flops_per_byte!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")

    def intensity(b: int) -> float:                    # grows with b: bisect
        return 2.0 * b * k / expected_distinct_experts(n_experts, k, b)

    if intensity(max_batch) < flops_per_byte:
        return None
    low, high = 1, max_batch
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if intensity(mid) < flops_per_byte else (low, mid)
    return low


__all__ = ["ROUTERS", "route_softmax_topk", "route_sigmoid_groups", "expert_mlp", "moe_loop",
           "sort_by_expert", "dispatch", "dropped_pairs", "MoE", "expert_load",
           "load_imbalance", "expected_distinct_experts", "moe_decode_bytes", "critical_batch",
           "PlainProducts", "TiledProducts", "tiled_products", "MoEDecode"]

