"""The device-side sampler (tinygpt/device_sampling.py) against tinygpt.sampling: the same kept
sets, the same distribution (a seeded chi-square test, with a wrong sampler as the control),
greedy rows exact, and no host synchronization (checked on CPU with a dispatch mode that fails
on any op a capturing CUDA stream refuses). Also tinygpt.pick_device / usable_device, which
check a --device before any CUDA call."""

from __future__ import annotations

import pytest
import torch

import tinygpt
from tests.test_captured import _Recorder
from tinygpt import sampling as S
from tinygpt.device_sampling import (
    fast_path_refusal,
    filtered_logits,
    row_params,
    sample_rows,
)

SIGNIFICANCE = 1e-3     # a correct sampler fails the chi-square test with this probability


def reference_filtered(logits: torch.Tensor, params: S.SamplingParams) -> torch.Tensor:
    out = logits.float()
    if not params.greedy:
        out = S.apply_temperature(out, params.temperature)
    return S.min_p_filter(S.top_p_filter(S.top_k_filter(out, params.top_k), params.top_p),
                          params.min_p)


CASES = [S.SamplingParams(temperature=1.0), S.SamplingParams(temperature=0.7, top_k=5),
         S.SamplingParams(temperature=1.3, top_p=0.8), S.SamplingParams(min_p=0.1),
         S.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
         S.SamplingParams(top_k=100), S.SamplingParams(top_p=0.3), S.SamplingParams(top_k=1),
         S.SamplingParams(top_p=1e-60)]     # below float32's smallest number: the top token


def test_the_kept_sets_equal_tinygpt_samplings_filters():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), 64) * 3
    logits[0, :4] = 2.5                 # ties at the top
    logits[5, 10:30] = 1.0              # ties around the k-th value
    ours = filtered_logits(logits, row_params(CASES))
    for row, params in enumerate(CASES):
        want = reference_filtered(logits[row:row + 1], params)[0]
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(want)), params
        kept = ~torch.isinf(want)
        torch.testing.assert_close(ours[row][kept], want[kept], rtol=1e-6, atol=1e-6)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (cells with expected
    count >= 5; the rest pooled), from the regularized upper incomplete gamma function."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big].double(), expected[~big].double().sum()[None]])
    if exp[-1] < 5:          # pool the small cells into the last big one
        obs, exp = obs[:-2].tolist() + [obs[-2:].sum().item()], exp[:-2].tolist() + [
            exp[-2:].sum().item()]
        obs, exp = torch.tensor(obs), torch.tensor(exp)
    stat = ((obs - exp) ** 2 / exp).sum().item()
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def draws(sampler, logits_row: torch.Tensor, params: S.SamplingParams, n: int, seed: int):
    batch = logits_row.expand(n, -1).contiguous()
    generator = torch.Generator().manual_seed(seed)
    return sampler(batch, row_params([params] * n), generator)


@pytest.mark.parametrize("params", [S.SamplingParams(temperature=0.8, top_p=0.9),
                                    S.SamplingParams(temperature=1.2, top_k=6, min_p=0.02)])
def test_the_draws_follow_the_reference_distribution(params):
    torch.manual_seed(1)
    logits = torch.randn(1, 12) * 1.5
    want = torch.softmax(reference_filtered(logits, params), dim=-1)[0]
    ids = draws(sample_rows, logits, params, 40_000, seed=7)
    counts = torch.bincount(ids, minlength=12)
    assert counts[want == 0].sum() == 0, "a filtered-out token was drawn"
    p = chi_square_p_value(counts, want)
    assert p > SIGNIFICANCE, f"chi-square p = {p:.2g}: draws do not follow the distribution"


def test_a_wrong_race_fails_the_same_test():
    """The control: multiplying by the exponential instead of dividing samples the wrong
    distribution, and the test above must notice."""
    def wrong(logits, params, generator):
        probs = torch.softmax(filtered_logits(logits, params), dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        return torch.argmax(probs * race, dim=-1)

    params = S.SamplingParams(temperature=0.8, top_p=0.9)
    torch.manual_seed(1)
    logits = torch.randn(1, 12) * 1.5
    want = torch.softmax(reference_filtered(logits, params), dim=-1)[0]
    counts = torch.bincount(draws(wrong, logits, params, 40_000, seed=7), minlength=12)
    assert chi_square_p_value(counts, want) < SIGNIFICANCE


def test_greedy_rows_take_the_argmax_and_sampled_rows_are_seeded():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    logits[0, 3] = logits[0, 7] = 9.0           # a tie: the first index wins, as in sampling
    params = row_params([S.SamplingParams(temperature=0.0), S.SamplingParams(0.9),
                         S.SamplingParams(temperature=0.0, top_k=3), S.SamplingParams(1.0)])
    a = sample_rows(logits, params, torch.Generator().manual_seed(5))
    b = sample_rows(logits, params, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.dtype == torch.long and a.shape == (4,)
    assert a[0] == 3 and a[2] == torch.argmax(logits[2])


class NoHostReads(_Recorder):
    """Fails on any op a capturing CUDA stream refuses: tests/test_captured.py's _Recorder
    (a copy to the host, a tensor made from Python data, nonzero, masked_select, boolean
    indexing), and torch.unique, whose output size also depends on the values."""

    REFUSED = _Recorder.REFUSED | {"aten._unique.default", "aten._unique2.default",
                                   "aten.unique_dim.default", "aten.unique_consecutive.default"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.syncs:
            raise AssertionError(f"host synchronization: {self.syncs[0]}")
        return out


def test_sampling_never_reads_a_tensor_value_on_the_host():
    logits = torch.randn(3, 40)
    params = row_params([S.SamplingParams(0.7, top_k=5, top_p=0.9, min_p=0.05),
                         S.SamplingParams(0.0), S.SamplingParams(1.0)])
    generator = torch.Generator().manual_seed(0)
    with NoHostReads():
        sample_rows(logits, params, generator)
    with pytest.raises(AssertionError, match="host synchronization"), NoHostReads():
        S.sample_next_token(logits[:1], S.SamplingParams(top_p=0.9), generator)


@pytest.mark.parametrize("sync", [lambda x: x[x > 0], torch.nonzero, torch.unique,
                                  lambda x: torch.masked_select(x, x > 0),
                                  lambda x: torch.tensor(0.5)],
                         ids=["boolean-index", "nonzero", "unique", "masked_select", "tensor"])
def test_no_host_reads_refuses_what_a_capture_refuses(sync):
    """The control: a sampler that keeps its tokens by a value-sized op fails the test above."""
    def syncing_sampler(logits, params, generator):
        sync(logits)
        return sample_rows(logits, params, generator)

    params = row_params([S.SamplingParams(0.7)] * 3)
    with pytest.raises(AssertionError, match="host synchronization"), NoHostReads():
        syncing_sampler(torch.randn(3, 40), params, torch.Generator().manual_seed(0))


def test_requests_that_need_the_host_path_are_refused_by_name():
    assert fast_path_refusal(S.SamplingParams(top_p=0.5)) is None
    for knob in ("repetition_penalty", "frequency_penalty", "presence_penalty", "typical_p"):
        value = {"repetition_penalty": 1.2, "typical_p": 0.5}.get(knob, 0.5)
        with pytest.raises(ValueError, match=rf"params\[1\]: {knob}"):
            row_params([S.SamplingParams(), S.SamplingParams(**{knob: value})])
    with pytest.raises(TypeError, match="sequence of SamplingParams"):
        row_params(S.SamplingParams())
    with pytest.raises(TypeError, match=r"params\[1\] must be a SamplingParams, got dict"):
        row_params([S.SamplingParams(), {"temperature": 1.0}])
    with pytest.raises(ValueError, match="one row per logits row"):
        sample_rows(torch.zeros(2, 5), row_params([S.SamplingParams()]))


def test_copy_into_fixed_buffers_keeps_their_addresses():
    buffers = row_params([S.SamplingParams()] * 2)
    address = buffers.top_p.data_ptr()
    buffers.copy_(row_params([S.SamplingParams(top_p=0.5), S.SamplingParams(0.0)]))
    assert buffers.top_p.data_ptr() == address and buffers.top_p.tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match="batch 2"):
        buffers.copy_(row_params([S.SamplingParams()]))


def test_a_device_name_is_checked_before_any_cuda_call(monkeypatch):
    def no_cuda():
        raise AssertionError("a CUDA call")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    monkeypatch.setattr(torch.cuda, "device_count", no_cuda)
    for name in ("cuda:abc", "cuda:", "cuda:-1", "cuda:01", "cuda:128", "gpu"):
        with pytest.raises(ValueError, match=r"device must be one of .* 'cuda:1', got"):
            tinygpt.pick_device(name)
        with pytest.raises(ValueError, match="^--device: device must be one of"):
            tinygpt.usable_device(name)
    assert tinygpt.pick_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # a one-GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert tinygpt.usable_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"--device cuda:7: this machine has 1 CUDA device"):
        tinygpt.usable_device("cuda:7")


@pytest.mark.gpu
def test_sampling_inside_a_cuda_graph_without_syncs():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: capturing the sampler in a CUDA graph needs a GPU")
    logits = torch.randn(8, 1000, device="cuda")
    params = row_params([S.SamplingParams(0.8, top_p=0.9)] * 8, device="cuda")
    out = sample_rows(logits, params, None)           # warm up outside the graph
    graph = torch.cuda.CUDAGraph()                   # the default generator is graph-safe
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = sample_rows(logits, params, None)
        graph.replay()
        first = out.clone()
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.equal(first, out), "two replays drew the same 8 tokens: stale randomness"
