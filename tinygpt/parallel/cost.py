"""The cost model: what tensor parallelism sends, and what that costs on a link.

Predicted:

    Link, LINKS              a link's bandwidth and per-collective latency, with sources
    ring_allreduce_seconds   latency + 2 (p - 1) / p x bytes / bandwidth
    allgather_seconds        the same for a ring all-gather
    allreduce_bytes          the bytes of one all-reduce: the (tokens, d_model) activations
    activation_dtype         the dtype those activations have for a weight dtype (int8 / int4
                             weights: bf16)
    tp_decode_estimate       the roofline's decode step over p devices, plus the messages

Measured on local ranks (gloo on a CPU, NCCL on GPUs):

    measure_allreduce        seconds of one all-reduce, per size
    fit_link                 a Link fitted to those seconds
    measure_tp_decode        greedy decode in one process against p tensor-parallel ranks,
                             with the prediction on the fitted link beside it

Expert parallelism (tinygpt.parallel.experts) sends token rows with all-to-alls instead:

    alltoall_bytes           bytes one rank sends in one all-to-all under uniform routing
    alltoall_seconds         latency + the bytes the busiest rank sends / bandwidth
    ep_comm_estimate         an expert-parallel step's all-to-alls and all-gathers on a link
    measure_alltoall         seconds of one all-to-all on local ranks, per size
    fit_alltoall_link        a Link fitted to those seconds

SMOLLM2_135M is the course's real model's shape, for the estimates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinygpt.model import ModelConfig
from tinygpt.parallel.comm import COMM
from tinygpt.parallel.model import shard_model
from tinygpt.parallel.ranks import run_ranks
from tinygpt.parallel.sharding import _check_d_ff, plan_heads
from tinygpt.parallel.source import load_source, source_config

# SmolLM2-135M-Instruct's shape (the course's real model: its GGUF's metadata): 30 layers,
# d_model 576, 9 heads over 3 KV heads, d_ff 1536, vocabulary 49,152, tied embeddings.
SMOLLM2_135M = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           d_ff=1536, max_seq_len=8192, rope_base=100000.0,
                           tie_embeddings=True)


@dataclass(frozen=True)
class Link:
    """A link between devices: bandwidth in bytes/s per direction, the fixed cost of one
    collective in seconds, and where each figure comes from."""

    name: str
    bandwidth: float
    latency: float
    source: str

    def __post_init__(self) -> None:
        for field, value, low in (("bandwidth", self.bandwidth, "> 0"),
                                  ("latency", self.latency, ">= 0")):
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) \
                and math.isfinite(value) and (value > 0 if low == "> 0" else value >= 0)
            if not ok:
                raise ValueError(f"Link {field} must be a finite number {low}, got {value!r}")


# Bandwidth: the vendors' figures, per direction. Latency: NOT a vendor figure (datasheets give
# none); an assumed order of magnitude for one small NCCL all-reduce, to be replaced by a
# measurement (measure_allreduce) wherever one can be made.
LINKS: dict[str, Link] = {
    "nvlink4-h100-sxm": Link(
        "nvlink4-h100-sxm", 450e9, 10e-6,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM column): NVLink 900 GB/s, the total of both "
        "directions over 18 fourth-generation links, so 450 GB/s each way; latency ASSUMED "
        "10 us per small all-reduce"),
    "nvlink3-a100-sxm": Link(
        "nvlink3-a100-sxm", 300e9, 10e-6,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM column): NVLink 600 GB/s total of both "
        "directions, so 300 GB/s each way; latency ASSUMED 10 us per small all-reduce"),
    "pcie5-x16": Link(
        "pcie5-x16", 63.0e9, 25e-6,
        "PCI-SIG PCI Express 5.0 specification: 32 GT/s per lane x 16 lanes, 128b/130b "
        "encoding: 32 x 16 x 128/130 / 8 = 63.0 GB/s each way (NVIDIA's H100 PCIe datasheet: "
        "128 GB/s for both directions, before the encoding); latency ASSUMED 25 us per small "
        "all-reduce through the host bridge"),
    "pcie4-x16": Link(
        "pcie4-x16", 31.5e9, 25e-6,
        "PCI-SIG PCI Express 4.0 specification: 16 GT/s per lane x 16 lanes, 128b/130b "
        "encoding: 16 x 16 x 128/130 / 8 = 31.5 GB/s each way (NVIDIA's A100 PCIe datasheet: "
        "64 GB/s for both directions, before the encoding); latency ASSUMED 25 us per small "
        "all-reduce"),
}


def _check_link(link) -> Link:
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"link must be a Link or one of {sorted(LINKS)}, got {link!r}")
        return LINKS[link]
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link or a LINKS name, got {type(link).__name__}")
    return link


def ring_allreduce_seconds(nbytes: float, world_size: int, link) -> float:
    """Time of one ring all-reduce of `nbytes` over `world_size` ranks on `link`:

        latency + 2 (p - 1) / p x nbytes / bandwidth

    A ring all-reduce is a reduce-scatter then an all-gather, each p - 1 steps moving
    nbytes / p per rank, so each rank sends (and receives) 2 (p - 1) / p x nbytes in all,
    whatever p. 0 for p = 1 (nothing to send).
    """
    link = _check_link(link)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if world_size == 1:
        return 0.0
    return link.latency + 2 * (world_size - 1) / world_size * nbytes / link.bandwidth


def allgather_seconds(nbytes: float, world_size: int, link) -> float:
    """Time of a ring all-gather whose result is `nbytes` (each rank sends (p-1)/p of it):
    latency + (p - 1) / p x nbytes / bandwidth, 0 for p = 1."""
    link = _check_link(link)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if world_size == 1:
        return 0.0
    return link.latency + (world_size - 1) / world_size * nbytes / link.bandwidth


def allreduce_bytes(cfg: ModelConfig, tokens: int = 1, dtype: str = "fp32") -> int:
    """Bytes of ONE all-reduce of tensor parallelism: the (tokens, d_model) activations after
    wo or w2, `dtype` being the activations' (a float one: weight-only quantization leaves
    them full width, see activation_dtype). A layer does two, so a decode step at batch B
    sends 2 x L of B x D x bytes, whatever the degree (plus one for the embedding and the
    logits' gather)."""
    from tinygpt.flops import DTYPE_BITS

    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be one of the activations' dtypes "
                         f"{sorted(ACTIVATION_DTYPES)}, got {dtype!r} (weight-only quantized "
                         f"models keep float activations: see activation_dtype)")
    _check_count("tokens", tokens)
    return tokens * cfg.d_model * DTYPE_BITS[dtype] // 8


ACTIVATION_DTYPES = ("fp32", "bf16", "fp16")  # what an all-reduce carries: activations


def activation_dtype(dtype: str) -> str:
    """The dtype of the activations a model of weight dtype `dtype` all-reduces: the same for
    a float dtype; bf16 for int8 / int4 weights (weight-only quantization dequantizes them
    inside the product: the activations, and so the all-reduces, stay 16-bit floats)."""
    from tinygpt.flops import DTYPE_BITS

    if dtype not in DTYPE_BITS:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BITS)}, got {dtype!r}")
    return dtype if dtype in ACTIVATION_DTYPES else "bf16"


@dataclass(frozen=True)
class TPEstimate:
    """Predicted decode step of a tensor-parallel model (seconds and bytes per device)."""

    world_size: int
    compute_seconds: float       # the roofline's decode step over p (weights and cache split)
    comm_seconds: float          # 2 L all-reduces + the embedding's + the logits' all-gather
    seconds: float
    allreduces: int
    weight_bytes_per_device: float
    kv_bytes_per_device: float

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.seconds


def tp_decode_estimate(cfg: ModelConfig, hw, link, world_size: int, batch: int = 1,
                       context_len: int = 512, dtype: str = "bf16") -> TPEstimate:
    """The decode step of `cfg` split over `world_size` devices of kind `hw` (a
    tinygpt.roofline.Hardware or its name) joined by `link` (a Link or a LINKS name).

    Compute: the roofline's decode step (tinygpt.roofline.decode_estimate) over p, as if each
    device read 1/p of the weights and of the KV cache. Past p = n_kv_heads a device holds a
    replica of one KV head, more than 1/p of the cache: compute_seconds does not count that
    (kv_bytes_per_device does). Communication: 2 L + 1 ring all-reduces of batch x D values
    of the activations' dtype (activation_dtype(dtype): int8 / int4 weights still all-reduce
    16-bit activations) and one all-gather of the batch's V float32 logits, at `link`'s
    bandwidth and latency. Tensor
    parallelism lowers the latency when the compute saved, t1 (1 - 1/p), exceeds what the
    messages add. ValueError for a degree the sharding refuses (plan_heads, d_ff).
    """
    from tinygpt import flops as F
    from tinygpt.roofline import decode_estimate, get_hardware

    hw = get_hardware(hw) if isinstance(hw, str) else hw
    plan = plan_heads(cfg, 0, world_size)
    _check_d_ff(cfg, world_size)
    one = decode_estimate(cfg, hw, batch, context_len, dtype)
    compute = one.seconds / world_size
    n_ar = 2 * cfg.n_layers + (1 if world_size > 1 else 0)
    nbytes = allreduce_bytes(cfg, batch, activation_dtype(dtype))
    comm = n_ar * ring_allreduce_seconds(nbytes, world_size, link)
    comm += allgather_seconds(batch * cfg.vocab_size * 4, world_size, link)
    kv_heads = plan.n_kv_heads
    kv = F.kv_cache_bytes(cfg, context_len, batch, dtype) * kv_heads / cfg.n_kv_heads
    return TPEstimate(world_size, compute, comm, compute + comm,
                      n_ar if world_size > 1 else 0,
                      F.weight_bytes(cfg, dtype) / world_size, kv)


# --------------------------------------------------------------------------------------------
# measured on local ranks, and the model fitted to the measurement



def _allreduce_rank(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    """Mean seconds of an all-reduce of each size (float32 elements) on this group."""
    out = {}
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    for n in sizes:
        x = torch.ones(n, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        # back to back, as a decode step issues them: a barrier before each one would hide
        # the wait for a peer the operating system has not scheduled yet
        t0 = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        out[n] = (time.perf_counter() - t0) / repeats
    return out


def measure_allreduce(world_size: int = 2, sizes: tuple[int, ...] = (576, 49152, 1 << 20),
                      repeats: int = 30, backend: str | None = None) -> dict[int, float]:
    """Measured seconds of one all-reduce of n float32 values on local ranks (gloo on a CPU,
    NCCL on GPUs), for each n in sizes: `repeats` back-to-back all-reduces, the slowest
    rank's mean."""
    _check_count("world_size", world_size)
    _check_count("repeats", repeats)
    _check_sizes(sizes)
    per_rank = run_ranks(_allreduce_rank, world_size, list(sizes), repeats, backend=backend)
    return {n: max(r[n] for r in per_rank) for n in sizes}


def fit_link(measured: Mapping[int, float], world_size: int, name: str = "measured") -> Link:
    """A Link fitted to measure_allreduce's figures by least squares on
    t = latency + 2 (p - 1) / p x bytes / bandwidth (bytes = 4 n). world_size >= 2: one rank
    sends nothing, so its times say nothing of a link."""
    _check_count("world_size", world_size, low=2)
    _check_measured(measured)
    xs = [2 * (world_size - 1) / world_size * 4 * n for n in measured]
    return _fit_line(name, xs, list(measured.values()), "all-reduce")


def _fit_line(name: str, xs: list[float], ts: list[float], what: str) -> Link:
    """The Link of the least-squares line t = latency + x / bandwidth (x: bytes a rank sends)."""
    k = len(xs)
    if k < 2:
        raise ValueError(f"fitting a link needs at least 2 measured sizes, got {k}")
    mean_x, mean_t = sum(xs) / k, sum(ts) / k
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts, strict=True)) / var
    slope = max(slope, 1e-15)
    latency = max(mean_t - slope * mean_x, 0.0)
    return Link(name, 1 / slope, latency,
                f"fitted to {k} {what} sizes measured on this machine's ranks")


def _tp_decode_rank(rank: int, world_size: int, source, prompt_len: int,
                    new_tokens: int) -> dict:
    """Greedy decode timing on one rank: seconds per step and the collectives' seconds."""
    from tinygpt.kv_cache import KVCache, decode_step, prefill

    torch.set_num_threads(1)         # one core per rank; one process: torch's batch-1 products
    model = load_source(source)      # do not spread over a second core anyway
    if world_size > 1:
        model = shard_model(model, rank, world_size)
    cache = KVCache.for_model(model, max_len=prompt_len + new_tokens + 3)
    device = model.norm.weight.device
    ids = torch.arange(prompt_len, device=device)[None] % model.cfg.vocab_size
    with torch.inference_mode():
        token = prefill(model, cache, ids).argmax(-1, keepdim=True)
        for _ in range(2):                                    # warm-up steps
            token = decode_step(model, cache, token).argmax(-1, keepdim=True)
        if world_size > 1:
            dist.barrier()
        COMM.reset()
        tokens, t0 = [], time.perf_counter()
        for _ in range(new_tokens):
            token = decode_step(model, cache, token).argmax(-1, keepdim=True)
            tokens.append(int(token))
        seconds = time.perf_counter() - t0
    return dict(step_seconds=seconds / new_tokens, comm_seconds=COMM.seconds / new_tokens,
                comm_calls=COMM.calls / new_tokens, comm_bytes=COMM.bytes / new_tokens,
                tokens=tokens)


@dataclass(frozen=True)
class TPDecodeMeasurement:
    """Measured greedy decode, one process against `world_size` tensor-parallel ranks, with
    the cost model's prediction from a link fitted on the same machine (fit_link)."""

    world_size: int
    one_step_seconds: float          # one process
    tp_step_seconds: float           # the slowest rank's
    comm_seconds: float              # per step, the slowest rank's time inside collectives
    comm_calls: float                # collectives per step
    comm_bytes: float                # bytes per step and rank handed to collectives
    predicted_comm_seconds: float    # comm_calls collectives on the fitted link
    predicted_step_seconds: float    # one_step / p + predicted comm
    link: Link
    tokens_identical: bool

    @property
    def speedup(self) -> float:
        return self.one_step_seconds / self.tp_step_seconds

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.tp_step_seconds


def measure_tp_decode(source, world_size: int, prompt_len: int = 16, new_tokens: int = 16,
                      link: Link | None = None, timeout_s: float = 300.0) -> TPDecodeMeasurement:
    """Time greedy decode of the model from `source` in one process, then over `world_size`
    tensor-parallel ranks; predict the parallel step with the cost model on `link` (default:
    fitted to all-reduces measured now on the same ranks). world_size >= 2: one process is
    the baseline measured beside it."""
    source_cfg = source_config(source)
    _check_decode_run(source_cfg, world_size, prompt_len, new_tokens)
    plan_heads(source_cfg, 0, world_size)
    _check_d_ff(source_cfg, world_size)
    if link is not None:
        _check_link(link)
    if link is None:
        link = fit_link(measure_allreduce(world_size, backend="gloo"), world_size,
                        "this machine (fitted)")
    one = run_ranks(_tp_decode_rank, 1, source, prompt_len, new_tokens, timeout_s=timeout_s,
                    backend="gloo")[0]
    many = run_ranks(_tp_decode_rank, world_size, source, prompt_len, new_tokens,
                     timeout_s=timeout_s, backend="gloo")       # both on the CPU
    worst = max(many, key=lambda r: r["step_seconds"])
    per_ar = ring_allreduce_seconds(allreduce_bytes(source_cfg, 1, "fp32"), world_size, link)
    n_ar = worst["comm_calls"] - 1                     # all-reduces; the last is the gather
    predicted_comm = n_ar * per_ar + allgather_seconds(source_cfg.vocab_size * 4, world_size,
                                                       link)
    return TPDecodeMeasurement(
        world_size, one["step_seconds"], worst["step_seconds"],
        max(r["comm_seconds"] for r in many), worst["comm_calls"], worst["comm_bytes"],
        predicted_comm, one["step_seconds"] / world_size + predicted_comm, link,
        all(r["tokens"] == one["tokens"] for r in many))


# --------------------------------------------------------------------------------------------
# expert parallelism: the all-to-all (tinygpt.parallel.experts)


def _check_count(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_sizes(sizes, multiple_of: int = 1, name: str = "sizes") -> None:
    """ValueError naming `name` unless sizes is a non-empty sequence of positive ints
    (multiples of multiple_of)."""
    if not isinstance(sizes, (tuple, list)) or not sizes:
        raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {sizes!r}")
    bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n < 1
           or n % multiple_of]
    if bad:
        what = "positive ints" if multiple_of == 1 else \
            f"positive multiples of world_size={multiple_of}"
        raise ValueError(f"{name} must be {what}, got {bad[0]!r}")


def _check_measured(measured) -> None:
    """ValueError unless measured maps at least 2 positive int sizes to positive seconds."""
    if not isinstance(measured, Mapping) or len(measured) < 2:
        raise ValueError(f"measured must map at least 2 sizes to their seconds (as "
                         f"measure_allreduce / measure_alltoall return), got {measured!r}")
    _check_sizes(tuple(measured), name="measured sizes")
    bad = [t for t in measured.values() if isinstance(t, bool)
           or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0]
    if bad:
        raise ValueError(f"measured seconds must be finite numbers > 0, got {bad[0]!r}")


def _check_decode_run(cfg: ModelConfig, world_size: int, prompt_len: int,
                      new_tokens: int) -> None:
    """The arguments of a measured decode (measure_tp_decode, measure_ep_decode): ValueError
    before any rank starts. The cache holds the prompt, 2 warm-up steps and new_tokens."""
    _check_count("world_size", world_size, low=2)
    _check_count("prompt_len", prompt_len)
    _check_count("new_tokens", new_tokens)
    if prompt_len + new_tokens + 3 > cfg.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens + 3 (2 warm-up steps and one position "
                         f"spare) = {prompt_len + new_tokens + 3} exceeds the model's "
                         f"max_seq_len={cfg.max_seq_len}")


def alltoall_bytes(tokens: float, top_k: int, d_model: int, world_size: int,
                   dtype: str = "fp32") -> float:
    """Bytes ONE rank sends to the other ranks in one expert-parallel all-to-all (the dispatch;
    the combine sends as many back), for `tokens` tokens on that rank, each routed to top_k
    experts, when routing is uniform over experts spread evenly over p ranks:

        tokens x top_k x (p - 1) / p x d_model x bytes per value

    A (token, slot) row stays home with probability 1/p, so (p - 1)/p of the rows leave. With
    a batch of B split over p ranks the busiest rank holds ceil(B / p) tokens; under uniform
    routing it also receives as many rows as it sends, on average. 0 for p = 1.
    """
    from tinygpt.flops import DTYPE_BITS

    if dtype not in DTYPE_BITS:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BITS)}, got {dtype!r}")
    if not tokens >= 0:
        raise ValueError(f"tokens must be >= 0, got {tokens!r}")
    _check_count("top_k", top_k)
    _check_count("d_model", d_model)
    _check_count("world_size", world_size)
    return tokens * top_k * (world_size - 1) / world_size * d_model * DTYPE_BITS[dtype] / 8


def alltoall_seconds(nbytes: float, world_size: int, link) -> float:
    """Time of one all-to-all in which the busiest rank sends (or receives) `nbytes` to (from)
    the others: latency + nbytes / bandwidth.

    Every rank has its own link into a switch (NVSwitch, a PCIe switch), each direction at
    `link.bandwidth`, so the ranks' sends proceed at once and the busiest rank's bytes set the
    time; an uneven routing makes one rank the busiest. 0 for p = 1 (nothing leaves).
    """
    link = _check_link(link)
    _check_count("world_size", world_size)
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if world_size == 1:
        return 0.0
    return link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class EPCommEstimate:
    """Predicted communication of one expert-parallel forward (one decode step at batch B):
    per MoE layer three all-to-alls (the counts, the dispatch, the combine) and one all-gather
    of the token outputs, for the busiest rank under uniform routing."""

    world_size: int
    alltoalls: int                   # all-to-alls per step
    gathers: int                     # all-gathers per step
    alltoall_seconds: float          # all of them together
    gather_seconds: float
    bytes_per_alltoall: float        # the dispatch's rows one rank sends (the combine's too)

    @property
    def seconds(self) -> float:
        return self.alltoall_seconds + self.gather_seconds


def ep_comm_estimate(batch: int, top_k: int, d_model: int, n_experts: int, world_size: int,
                     link, n_moe_layers: int = 1, dtype: str = "fp32") -> EPCommEstimate:
    """The all-to-alls and all-gathers of `n_moe_layers` expert-parallel MoE layers for a batch
    of `batch` tokens split over `world_size` ranks on `link` (a Link or a LINKS name).

    Per layer, for the busiest rank (ceil(B / p) tokens): the counts (E / p int64 to each
    other rank: latency-bound), the dispatch and the combine (alltoall_bytes each), then the
    all-gather of the p x ceil(B / p) token outputs (allgather_seconds). At batch 1 every
    term is a latency: 4 collectives per MoE layer whatever the bytes.
    """
    from tinygpt.flops import DTYPE_BITS

    for name, value in (("batch", batch), ("n_experts", n_experts),
                        ("world_size", world_size), ("top_k", top_k)):
        _check_count(name, value)
    if top_k > n_experts:
        raise ValueError(f"top_k ({top_k}) must be at most n_experts ({n_experts})")
    if n_experts % world_size:
        raise ValueError(f"n_experts (E={n_experts}) must be divisible by the expert-parallel "
                         f"degree world_size={world_size}: each rank holds E / world_size whole "
                         f"experts")
    _check_count("n_moe_layers", n_moe_layers, low=0)
    link = _check_link(link)
    chunk = -(-batch // world_size)
    rows = alltoall_bytes(chunk, top_k, d_model, world_size, dtype)
    counts = n_experts * 8 * (world_size - 1) / world_size
    per_layer = alltoall_seconds(counts, world_size, link) \
        + 2 * alltoall_seconds(rows, world_size, link)
    gather = allgather_seconds(world_size * chunk * d_model * DTYPE_BITS[dtype] / 8,
                               world_size, link)
    many = world_size > 1
    return EPCommEstimate(world_size, 3 * n_moe_layers if many else 0,
                          n_moe_layers if many else 0, n_moe_layers * per_layer,
                          n_moe_layers * gather, rows)


def _alltoall_rank(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    """Mean seconds of an all-to-all of each size (float32 values each rank sends in all)."""
    out = {}
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    for n in sizes:
        x = torch.ones(n, device=device)
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        dist.barrier()
        t0 = time.perf_counter()                     # back to back, as a step issues them
        for _ in range(repeats):
            dist.all_to_all_single(y, x)
        out[n] = (time.perf_counter() - t0) / repeats
    return out


def measure_alltoall(world_size: int = 2, sizes: tuple[int, ...] = (1024, 65536, 1 << 20),
                     repeats: int = 30, backend: str | None = None) -> dict[int, float]:
    """Measured seconds of one all-to-all on local ranks in which each rank sends n float32
    values in all, n / p to every rank (itself included), for each n in sizes (multiples of
    world_size): `repeats` back-to-back all-to-alls, the slowest rank's mean."""
    _check_count("world_size", world_size, low=2)
    _check_count("repeats", repeats)
    _check_sizes(sizes, world_size)
    per_rank = run_ranks(_alltoall_rank, world_size, list(sizes), repeats, backend=backend)
    return {n: max(r[n] for r in per_rank) for n in sizes}


def fit_alltoall_link(measured: Mapping[int, float], world_size: int,
                      name: str = "measured") -> Link:
    """A Link fitted to measure_alltoall's figures by least squares on
    t = latency + (p - 1) / p x 4 n / bandwidth (the bytes that leave each rank)."""
    _check_count("world_size", world_size, low=2)
    _check_measured(measured)
    xs = [(world_size - 1) / world_size * 4 * n for n in measured]
    return _fit_line(name, xs, list(measured.values()), "all-to-all")
