"""The cost model: what tensor parallelism sends, and what that costs on a link.

Predicted:

    Link, LINKS              a link's bandwidth and per-collective latency, with sources
    ring_allreduce_seconds   latency + 2 (p - 1) / p x bytes / bandwidth
    allgather_seconds        the same for a ring all-gather
    allreduce_bytes          the bytes of one all-reduce: the (tokens, d_model) activations
    tp_decode_estimate       the roofline's decode step over p devices, plus the messages

Measured on local ranks (gloo on a CPU, NCCL on GPUs):

    measure_allreduce        seconds of one all-reduce, per size
    fit_link                 a Link fitted to those seconds
    measure_tp_decode        greedy decode in one process against p tensor-parallel ranks,
                             with the prediction on the fitted link beside it

SMOLLM2_135M is the course's real model's shape, for the estimates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tinygpt.model import ModelConfig
from tinygpt.parallel.comm import COMM
from tinygpt.parallel.model import shard_model
from tinygpt.parallel.ranks import run_ranks
from tinygpt.parallel.sharding import plan_heads
from tinygpt.parallel.source import load_source

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
    """Time of a ring all-gather whose result is `nbytes` (each rank sends (p-1)/p of it)."""
    link = _check_link(link)
    if world_size == 1:
        return 0.0
    return link.latency + (world_size - 1) / world_size * nbytes / link.bandwidth


def allreduce_bytes(cfg: ModelConfig, tokens: int = 1, dtype: str = "fp32") -> int:
    """Bytes of ONE all-reduce of tensor parallelism: the (tokens, d_model) activations after
    wo or w2. A layer does two, so a decode step at batch B sends 2 x L of B x D x bytes,
    whatever the degree (plus one for the embedding and the logits' gather)."""
    from tinygpt.flops import DTYPE_BITS

    if dtype not in DTYPE_BITS:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BITS)}, got {dtype!r}")
    return tokens * cfg.d_model * DTYPE_BITS[dtype] // 8


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

    Compute: the roofline's decode step (tinygpt.roofline.decode_estimate) over p: each
    device reads 1/p of the weights and of the KV cache (replicated KV heads are counted
    once per replica). Communication: 2 L + 1 ring all-reduces of batch x D values and one
    all-gather of the batch's V logits, at `link`'s bandwidth and latency. Tensor parallelism
    lowers the latency when the compute saved, t1 (1 - 1/p), exceeds what the messages add.
    """
    from tinygpt import flops as F
    from tinygpt.roofline import decode_estimate, get_hardware

    hw = get_hardware(hw) if isinstance(hw, str) else hw
    plan = plan_heads(cfg, 0, world_size)
    one = decode_estimate(cfg, hw, batch, context_len, dtype)
    compute = one.seconds / world_size
    n_ar = 2 * cfg.n_layers + (1 if world_size > 1 else 0)
    comm = n_ar * ring_allreduce_seconds(allreduce_bytes(cfg, batch, dtype), world_size, link)
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
    per_rank = run_ranks(_allreduce_rank, world_size, list(sizes), repeats, backend=backend)
    return {n: max(r[n] for r in per_rank) for n in sizes}


def fit_link(measured: Mapping[int, float], world_size: int, name: str = "measured") -> Link:
    """A Link fitted to measure_allreduce's figures by least squares on
    t = latency + 2 (p - 1) / p x bytes / bandwidth (bytes = 4 n)."""
    xs = [2 * (world_size - 1) / world_size * 4 * n for n in measured]
    ts = list(measured.values())
    k = len(xs)
    mean_x, mean_t = sum(xs) / k, sum(ts) / k
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts, strict=True)) / var
    slope = max(slope, 1e-15)
    latency = max(mean_t - slope * mean_x, 0.0)
    return Link(name, 1 / slope, latency,
                f"fitted to {k} all-reduce sizes measured on this machine's ranks")


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
    fitted to all-reduces measured now on the same ranks)."""
    if link is None:
        link = fit_link(measure_allreduce(world_size, backend="gloo"), world_size,
                        "this machine (fitted)")
    one = run_ranks(_tp_decode_rank, 1, source, prompt_len, new_tokens, timeout_s=timeout_s,
                    backend="gloo")[0]
    many = run_ranks(_tp_decode_rank, world_size, source, prompt_len, new_tokens,
                     timeout_s=timeout_s, backend="gloo")       # both on the CPU
    worst = max(many, key=lambda r: r["step_seconds"])
    source_cfg = load_source(source).cfg if not isinstance(source, tuple) else source[0]
    per_ar = ring_allreduce_seconds(allreduce_bytes(source_cfg, 1, "fp32"), world_size, link)
    n_ar = worst["comm_calls"] - 1                     # all-reduces; the last is the gather
    predicted_comm = n_ar * per_ar + allgather_seconds(source_cfg.vocab_size * 4, world_size,
                                                       link)
    return TPDecodeMeasurement(
        world_size, one["step_seconds"], worst["step_seconds"],
        max(r["comm_seconds"] for r in many), worst["comm_calls"], worst["comm_bytes"],
        predicted_comm, one["step_seconds"] / world_size + predicted_comm, link,
        all(r["tokens"] == one["tokens"] for r in many))
