"""tinygpt.captured: the decode loop a CUDA graph replays, checked on the CPU where it runs
eagerly (the same step) and on a GPU (`-m gpu`) where it is captured.

On the CPU: its tokens against batch-1 generate() (greedy) and against an eager loop of
decode_step and the same device sampler (sampled); the step asks the host nothing (no .item(),
no tensor made from Python data, no boolean indexing: a capturing stream refuses them) and
runs the same operations on the same shapes at every position of a bucket (what a replay
repeats). On a GPU: the replayed graphs give the eager step's tokens, one capture per bucket
whatever the prompt lengths, and no sync while replaying.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tinygpt.model as model_module
from tests.test_kv_cache import ids_for
from tests.test_kv_cache import make_model as small_model
from tinygpt.captured import CapturedDecoder, refusal
from tinygpt.device_sampling import row_params, sample_rows
from tinygpt.generate import generate
from tinygpt.kv_cache import KVCache, decode_step, prefill
from tinygpt.model import TinyGPT
from tinygpt.sampling import SamplingParams


def make_model(max_seq_len: int = 80, **extra) -> TinyGPT:
    return small_model(max_seq_len=max_seq_len, **extra)


prompts = ids_for          # (batch, length, seed=1) -> seeded ids in the vocabulary


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("length", [5, 16, 17])
def test_greedy_rows_equal_batch_one_generate_across_buckets(length):
    model = make_model()
    decoder = CapturedDecoder(model, batch_size=3, bucket=16)
    assert decoder.buckets == (16, 32, 48, 64, 80) and not decoder.capture
    ids = prompts(3, length)
    got = decoder.generate(ids, GREEDY, 40)                   # positions up to length + 38
    for row in range(3):
        want = generate(model, ids[row].tolist(), SamplingParams(0.0, max_new_tokens=40))
        assert got[row].tolist() == want.token_ids, f"row {row}"
    assert decoder.length == length + 39


def test_sampled_rows_equal_an_eager_loop_with_the_same_sampler_and_seed():
    """Each row its own knobs; the oracle: prefill and decode_step on an ordinary static cache,
    sample_rows with a generator seeded alike."""
    model = make_model()
    params = [SamplingParams(0.8, top_p=0.9), GREEDY, SamplingParams(1.2, top_k=5, min_p=0.05)]
    ids = prompts(3, 9, seed=4)
    got = CapturedDecoder(model, batch_size=3, bucket=16).generate(ids, params, 30, seed=7)
    cache = KVCache.for_model(model, batch_size=3)
    knobs, generator = row_params(params), torch.Generator().manual_seed(7)
    token = sample_rows(prefill(model, cache, ids), knobs, generator)
    want = [token]
    for _ in range(29):
        token = sample_rows(decode_step(model, cache, token[:, None]), knobs, generator)
        want.append(token)
    assert torch.equal(got, torch.stack(want, 1))
    again = CapturedDecoder(model, batch_size=3, bucket=16).generate(ids, params, 30, seed=8)
    assert not torch.equal(got[0], again[0]), "another seed drew the same 30 tokens"
    assert torch.equal(got[1], again[1]), "the greedy row changed with the seed"


class _Recorder(TorchDispatchMode):
    """Every operation the step dispatches, with its tensors' shapes; the ones a capturing
    CUDA stream refuses (a copy to the host, a tensor made from Python data, an output whose
    size depends on the values) in `syncs`."""

    REFUSED = {"aten._local_scalar_dense.default", "aten.lift_fresh.default",
               "aten.lift_fresh_copy.default", "aten.nonzero.default", "aten.is_nonzero.default",
               "aten.masked_select.default", "aten.equal.default", "aten.item.default"}

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.syncs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        shapes = tuple(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor))
        self.ops.append((name, shapes))
        if name in self.REFUSED or (name.startswith("aten.index") and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat[1:])):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_the_step_asks_the_host_nothing_and_repeats_itself_within_a_bucket(monkeypatch):
    model = make_model()
    decoder = CapturedDecoder(model, batch_size=2, bucket=16)
    decoder.start(prompts(2, 20), [SamplingParams(0.7, top_k=9), GREEDY], seed=0)
    monkeypatch.setattr(model_module, "capturing", lambda device: True)    # as on a GPU
    buffers = [t.data_ptr() for t in (decoder.token, decoder.pos, decoder.out,
                                      decoder.cache.layers[0].k)]
    runs = []
    for _ in range(3):                      # positions 20, 21, 22: the 32-slot bucket
        view = decoder._view(decoder.bucket_for(decoder.length))
        with _Recorder() as recorder, torch.inference_mode():
            decoder._body(view)
        decoder.length += 1
        assert recorder.syncs == [], f"the step syncs with the host: {recorder.syncs}"
        runs.append(recorder.ops)
    assert runs[0] == runs[1] == runs[2]
    assert buffers == [t.data_ptr() for t in (decoder.token, decoder.pos, decoder.out,
                                              decoder.cache.layers[0].k)]
    assert decoder.pos.tolist() == [23] and decoder.count.tolist() == [4]
    view = decoder._view(48)
    with _Recorder() as recorder, torch.inference_mode():     # the next bucket reads more
        decoder._body(view)
    assert recorder.ops != runs[0]


def test_the_recorder_catches_what_a_capture_refuses():
    x = torch.randn(4)
    for sync in (lambda: int(x.argmax()), lambda: torch.tensor(float("-inf")),
                 lambda: x[x > 0]):
        with _Recorder() as recorder:
            sync()
        assert recorder.syncs, "a host sync went unnoticed"


def test_narrowed_cache_views_the_same_storage():
    model = make_model()
    cache = KVCache.for_model(model, batch_size=2, static=True)
    view = cache.narrowed(32)
    assert view.max_len == 32 and view.layers[0].k.shape[2] == 32
    assert view.layers[1].v.data_ptr() == cache.layers[1].v.data_ptr()
    view.layers[0].k[1, 0, 31].fill_(3.0)
    assert cache.layers[0].k[1, 0, 31].eq(3.0).all()
    for bad in (0, 81, 2.5, True):
        with pytest.raises(ValueError, match="capacity must be an int"):
            cache.narrowed(bad)
    with pytest.raises(ValueError, match="views a static cache"):
        KVCache.for_model(model).narrowed(8)


def test_bad_arguments_are_clear_errors():
    model = make_model()
    with pytest.raises(ValueError, match="capture=True needs the model on a CUDA device"):
        CapturedDecoder(model, capture=True)
    with pytest.raises(TypeError, match="model must be a TinyGPT"):
        CapturedDecoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="bucket must be a positive int"):
        CapturedDecoder(model, bucket=0)
    decoder = CapturedDecoder(model, batch_size=2)
    with pytest.raises(ValueError, match=r"prompt must be a long tensor \(batch_size=2, T\)"):
        decoder.generate(prompts(3, 4), GREEDY, 4)
    with pytest.raises(ValueError, match=r"positions must be in \[1, max_len=80\]"):
        decoder.generate(prompts(2, 70), GREEDY, 12)
    with pytest.raises(ValueError, match="prompt must be a long tensor"):
        decoder.generate([[1, 2], [3, 4]], GREEDY, 2)
    with pytest.raises(ValueError, match="repetition_penalty"):
        decoder.generate(prompts(2, 4), SamplingParams(repetition_penalty=1.2), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        decoder.generate(prompts(2, 4), GREEDY, 0)
    with pytest.raises(ValueError, match="one SamplingParams or 2 of them"):
        decoder.generate(prompts(2, 4), [GREEDY], 4)
    moe = make_model(n_experts=4, top_k=2, d_expert=16)
    assert "mixture of experts" in refusal(moe) and refusal(model) is None
    assert CapturedDecoder(moe).capture is False     # eagerly it runs


# -- on a GPU ------------------------------------------------------------------------------


def _cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: replaying captured decode steps needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_replayed_graphs_give_the_eager_steps_tokens_and_capture_once_per_bucket(compile):
    _cuda_or_skip()
    model = make_model(max_seq_len=256).cuda()
    captured = CapturedDecoder(model, batch_size=2, bucket=64, compile=compile)
    eager = CapturedDecoder(model, batch_size=2, bucket=64, capture=False)
    assert captured.capture
    for length in (7, 30, 61, 100):                # four prompt lengths, buckets 64 .. 192
        ids = prompts(2, length, seed=length)
        got = captured.generate(ids, GREEDY, 60)
        assert torch.equal(got, eager.generate(ids, GREEDY, 60)), f"prompt length {length}"
    assert captured.captures == 3, "a new prompt length captured again"    # 64, 128, 192
    params = [SamplingParams(0.9, top_p=0.95), SamplingParams(0.7, top_k=20)]
    first = captured.generate(prompts(2, 12), params, 50, seed=3)
    assert torch.equal(first, captured.generate(prompts(2, 12), params, 50, seed=3))
    assert not torch.equal(first, captured.generate(prompts(2, 12), params, 50, seed=4))


@pytest.mark.gpu
def test_replays_do_not_sync_with_the_host():
    _cuda_or_skip()
    model = make_model(max_seq_len=128).cuda()
    decoder = CapturedDecoder(model, batch_size=4, bucket=32)
    decoder.start(prompts(4, 10).cuda(), SamplingParams(0.8), seed=0)
    decoder.step()                               # captures the 32-slot graph
    assert decoder.captures == 1
    decoder.capture_all()                        # (a capture synchronizes: not in the loop)
    assert decoder.captures == len(decoder.buckets) == 4
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(40):                      # crosses into the 64-slot graph
            decoder.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert decoder.length == 51 and decoder.captures == 4


def test_bench_measurements_run_on_the_cpu_and_the_group_skips_there():
    from tinygpt.bench import captured as bench
    from tinygpt.bench.registry import BenchContext

    model = make_model()
    decoder = CapturedDecoder(model, batch_size=2, bucket=16)
    seconds = bench.measure_steps(decoder, prompts(2, 10), steps=5)
    assert seconds > 0 and decoder.length == 10 + 3 + 5
    assert bench.measure_generate(decoder, prompts(2, 10), bench.SAMPLED, 12, seed=1) > 0
    assert decoder.length == 10 + 11
    decoder.capture_all()                          # nothing to capture off CUDA
    assert decoder.captures == 0
    row = bench._bandwidth_row("r", "d", 0.001, 10**9, 2e12, 0.7, {})
    assert not row.met and "50% of the 2000 GB/s" in row.reason
    logged = []
    assert bench.captured_decode_rows(BenchContext(log=logged.append)) == []
    assert "CUDA graphs need a GPU" in logged[0]


def test_the_groups_rows_run_end_to_end_off_cuda():
    """The code the GPU runs, run here on a tiny model (the steps eager): every row comes out
    with its figures; on the CPU they mean nothing and are not judged here."""
    from tests.test_bench import micro_plan
    from tinygpt.bench import captured as bench
    from tinygpt.bench.registry import BenchContext

    rows = bench.measured_rows(BenchContext(plan=micro_plan(), log=lambda line: None),
                               compiled=False)
    assert [r.name for r in rows] == ["captured_step_bandwidth", "captured_greedy",
                                      "captured_sampled", "captured_batch32",
                                      "captured_new_lengths"]
    assert all(r.value > 0 and len(r.details["round_values"]) == 3 for r in rows[:4])
    lengths = rows[4].details["lengths"]
    assert len(lengths) == 16 and len(rows[4].details["seconds_per_token"]) == 16


def test_compiled_forward_gives_the_same_tokens():
    """compile=True compiles the model's forward whole (fullgraph: a graph break, such as a
    host sync or an argument dynamo does not take, is an error here, not on the GPU)."""
    model = make_model(max_seq_len=32)
    ids = prompts(2, 6)
    plain = CapturedDecoder(model, batch_size=2, bucket=32).generate(ids, GREEDY, 12)
    compiled = CapturedDecoder(model, batch_size=2, bucket=32, compile=True)
    assert torch.equal(compiled.generate(ids, GREEDY, 12), plain)
