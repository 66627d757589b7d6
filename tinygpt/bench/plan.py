"""How hard `python -m tinygpt bench` measures: the quick (CI smoke) and full plans of the
core rows (requests, KV cache, Hugging Face, decode bandwidth, roofline). Rows that later days
register read `BenchContext.quick` and size themselves."""

from __future__ import annotations

from dataclasses import dataclass

from tinygpt.bench.models import (
    bandwidth_model_config,
    course_model_config,
    cuda_bandwidth_model_config,
    medium_model_config,
)
from tinygpt.model import ModelConfig


@dataclass(frozen=True)
class BenchPlan:
    """What run_bench measures, and how hard. bench_plan(quick) gives the two standard plans.

    requests / request_new_tokens / request_prompt_lengths: the streamed-request metrics, on
    the course-sized model.   cache_*: the cached-vs-uncached comparison.   hf_*: the Hugging
    Face comparison (hf_info_model: an extra, untargeted run at another size, or None).
    bandwidth_*: the decode-bandwidth model (fp32 on CPU; on a GPU cuda_bandwidth_model in
    bf16, as the course's GPU target asks), the bytes of the bandwidth-measuring buffers, the
    prefilled context, the timed decode steps per round and the rounds (each round measures
    the bandwidths and then the decode steps, so every ratio divides figures taken seconds
    apart; the median round is reported).   roofline_seconds: budget of
    roofline.measure_local_roofline.
    """

    name: str
    requests: int
    request_new_tokens: int
    request_prompt_lengths: tuple[int, ...]
    request_model: ModelConfig
    cache_model: ModelConfig
    cache_prompt_len: int
    cache_new_tokens: int
    cache_repeats: int
    hf_model: ModelConfig
    hf_prompt_len: int
    hf_new_tokens: int
    hf_repeats: int
    hf_info_model: ModelConfig | None
    bandwidth_model: ModelConfig
    cuda_bandwidth_model: ModelConfig
    bandwidth_bytes: int
    bandwidth_repeats: int
    decode_context: int
    decode_steps: int
    decode_rounds: int
    roofline_seconds: float


def bench_plan(quick: bool = False) -> BenchPlan:
    """The standard plans. Quick: the course-sized model wherever possible, few repeats (a CI
    smoke run of every row: 165 s alone on one thread of the 2-core AVX2 EPYC, 200 s in
    make test beside the other worker, 2026-11-28). Full: a ~31M model for the cache
    comparison, more repeats and rounds (not re-timed since 2026-11-21, when the plan was much
    smaller).
    Both measure bandwidth on the 610 MB model of bandwidth_model_config().
    Both keep the targets' workloads: 512 + 128 tokens for the cache, 128 new tokens for HF."""
    course = course_model_config()
    return BenchPlan(
        name="quick" if quick else "full",
        requests=8 if quick else 24, request_new_tokens=32 if quick else 64,
        request_prompt_lengths=(16, 64, 128, 256), request_model=course,
        cache_model=course if quick else medium_model_config(), cache_prompt_len=512,
        cache_new_tokens=128, cache_repeats=3,
        hf_model=course, hf_prompt_len=32, hf_new_tokens=128, hf_repeats=3 if quick else 5,
        hf_info_model=None if quick else medium_model_config(),
        bandwidth_model=bandwidth_model_config(),
        cuda_bandwidth_model=cuda_bandwidth_model_config(),
        bandwidth_bytes=2**28, bandwidth_repeats=3 if quick else 5,
        decode_context=64, decode_steps=10 if quick else 30, decode_rounds=3 if quick else 5,
        roofline_seconds=1.0 if quick else 4.0)
