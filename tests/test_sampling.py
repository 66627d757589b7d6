"""Tests of tinygpt.sampling: hand-computed values, transformers' processors as a reference, and
hypothesis properties (distributions, monotone knobs, greedy = argmax, seeded determinism)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinygpt.sampling import (
    FILTER_STAGES,
    HF_ORDER,
    VLLM_ORDER,
    SamplingParams,
    apply_frequency_presence_penalty,
    apply_penalties,
    apply_repetition_penalty,
    apply_stage,
    apply_temperature,
    entropy,
    explain_sampling,
    min_p_filter,
    sample_next_token,
    top_k_filter,
    top_p_filter,
    typical_filter,
)

WORKED = torch.tensor([[2.0, -1.5, 0.3, 4.2, -0.8]])
NEG_INF = float("-inf")


def kept(logits: torch.Tensor) -> set[int]:
    """Indices of the finite entries of a (1, V) row."""
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# SamplingParams
# ----------------------------------------------------------------------------------------------

def test_params_defaults_are_all_off():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (1.0, 0, 1.0, 0.0, 1.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == () and p.seed is None and p.max_new_tokens >= 1 and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_params_normalizes_types():
    p = SamplingParams(temperature=1, top_p=np.float64(0.5), top_k=np.int64(3), stop="###")
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert type(p.top_k) is int and p.top_k == 3
    assert p.stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"typical_p": 0.0}, "typical_p"),
    ({"typical_p": 1.2}, "typical_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": ("ok", "")}, "stop"),
])
def test_params_reject_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({"top_k": True}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 3.0}, "max_new_tokens"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"seed": True}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"stop": (b"x",)}, "stop"),
    ({"stop": 5}, "stop"),
])
def test_params_reject_bad_types(kwargs, name):
    with pytest.raises(TypeError, match=name):
        SamplingParams(**kwargs)


def test_params_are_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# The worked example and hand-computed values
# ----------------------------------------------------------------------------------------------

def test_worked_example():
    assert sample_next_token(WORKED, SamplingParams(temperature=0)).tolist() == [3]
    assert kept(top_k_filter(WORKED, 2)) == {3, 0}
    assert kept(top_p_filter(WORKED, 0.9)) == {3, 0}
    # softmax: p3 = 0.876, p0 = 0.097, p2 = 0.018: 0.876 < 0.9 so token 0 (crossing) is kept,
    # and 0.876 + 0.097 = 0.973 >= 0.9 so token 2 is not.
    probs = torch.softmax(WORKED, -1)[0]
    assert probs[3] < 0.9 <= probs[3] + probs[0]


def test_filters_keep_values_of_kept_tokens():
    out = top_k_filter(WORKED, 2)
    torch.testing.assert_close(out, torch.tensor([[2.0, NEG_INF, NEG_INF, 4.2, NEG_INF]]))


def test_temperature_divides():
    out = apply_temperature(WORKED, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -0.75, 0.15, 2.1, -0.4]]))
    torch.testing.assert_close(apply_temperature(WORKED, 1.0), WORKED)
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(WORKED, 0.0)
    # low temperature sharpens, high flattens (entropy decreases with 1/T)
    assert entropy(apply_temperature(WORKED, 0.5)) < entropy(WORKED) \
        < entropy(apply_temperature(WORKED, 3.0))


TINY_TEMPERATURES = [1e-38, 3e-38, 1e-45, 1e-300, 5e-324]
LARGE = WORKED * 10           # logits of a trained model's size: / 3e-38 overflows float32 too
TIED = torch.tensor([[40.0, 90.0, -30.0, 90.0, 89.99]])


@pytest.mark.parametrize("t", TINY_TEMPERATURES)
def test_a_tiny_temperature_is_the_argmax_not_an_overflow(t):
    # LARGE / 1e-38 overflows float32 to +inf (and 5e-324 is 0 in float32): the server once
    # answered such a request with a 500
    out = apply_temperature(LARGE, t)
    assert torch.isfinite(out.amax()) and not torch.isnan(out).any()
    assert torch.softmax(out, dim=-1).tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    params = SamplingParams(temperature=t, top_p=0.9, min_p=0.1, top_k=3)
    assert sample_next_token(LARGE.expand(4, -1), params).tolist() == [3] * 4
    assert explain_sampling(LARGE[0], params)[-1].probs == [0.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("t", TINY_TEMPERATURES)
def test_a_tiny_temperature_shares_the_draw_among_tied_maxima(t):
    probs = torch.softmax(apply_temperature(TIED, t), dim=-1)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]))
    drawn = {sample_next_token(TIED, SamplingParams(temperature=t, seed=s)).item()
             for s in range(40)}
    assert drawn == {1, 3}


def test_temperature_divides_exactly_when_nothing_overflows():
    rows = torch.tensor([[3e37, 2.9e37, -1e30], [1.0, 2.0, 4.0]])
    # row 0 overflows at T = 0.01, row 1 does not: only row 0 is shifted by its max
    out = apply_temperature(rows, 0.01)
    assert torch.equal(out[1], rows[1] / 0.01)
    assert out[0, 0] == 0 and -1.1e38 < out[0, 1] < -0.9e38 and out[0, 2] == float("-inf")
    assert torch.equal(apply_temperature(rows, 1e-3)[1], rows[1] / 1e-3)


def test_a_tiny_temperature_on_the_device_path_is_the_argmax():
    from tinygpt.device_sampling import filtered_logits, row_params, sample_rows

    for t in (1e-38, 3e-38, 1e-45):
        params = row_params([SamplingParams(temperature=t)] * 2)
        logits = torch.cat([LARGE, TIED])
        out = filtered_logits(logits, params)
        assert torch.softmax(out, dim=-1).tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0],
                                                       [0.0, 0.5, 0.0, 0.5, 0.0]]
        assert not torch.isnan(out).any()
        assert sample_rows(logits, params)[0].item() == 3


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert kept(top_k_filter(logits, 1)) == {1, 2, 4}
    assert kept(top_k_filter(logits, 3)) == {1, 2, 4}
    assert kept(top_k_filter(logits, 4)) == {1, 2, 3, 4}
    assert kept(top_k_filter(logits, 0)) == set(range(5))   # 0 = off
    assert kept(top_k_filter(logits, 99)) == set(range(5))  # k >= V keeps all
    with pytest.raises(ValueError, match=r"k must be >= 0 \(0 = off\), got -1"):
        top_k_filter(logits, -1)
    with pytest.raises(TypeError, match=r"k must be an int \(not bool\), got float 2.0"):
        top_k_filter(logits, 2.0)


def test_top_k_with_already_removed_tokens():
    logits = torch.tensor([[0.5, NEG_INF, NEG_INF, 0.1]])
    assert kept(top_k_filter(logits, 3)) == {0, 3}


def test_top_p_keeps_the_crossing_token():
    logits = log_probs(0.5, 0.3, 0.2)
    assert kept(top_p_filter(logits, 0.45)) == {0}
    assert kept(top_p_filter(logits, 0.55)) == {0, 1}      # 0.5 < 0.55: token 1 crosses
    assert kept(top_p_filter(logits, 0.79)) == {0, 1}
    assert kept(top_p_filter(logits, 0.85)) == {0, 1, 2}
    assert kept(top_p_filter(logits, 1e-9)) == {0}         # never empty
    assert kept(top_p_filter(logits, 1e-60)) == {0}        # p rounds to 0 in float32: still
    assert len(kept(typical_filter(logits, 1e-60))) == 1   # (the server's fuzzer found it)
    assert kept(top_p_filter(logits, 1.0)) == {0, 1, 2}


def test_top_p_unsorted_input_and_ties_in_index_order():
    logits = log_probs(0.2, 0.5, 0.3)
    assert kept(top_p_filter(logits, 0.55)) == {1, 2}
    uniform = torch.zeros(1, 4)  # probabilities exactly 0.25: the boundary is exact
    assert kept(top_p_filter(uniform, 0.5)) == {0, 1}      # mass before token 2 is 0.5, not < 0.5
    assert kept(top_p_filter(uniform, 0.6)) == {0, 1, 2}


def test_min_p_hand_values():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert kept(min_p_filter(logits, 0.5)) == {0, 1}       # threshold 0.25
    assert kept(min_p_filter(logits, 0.2)) == {0, 1, 2}    # threshold 0.10
    assert kept(min_p_filter(logits, 0.0)) == {0, 1, 2, 3}
    assert kept(min_p_filter(logits, 1.0)) == {0}
    assert kept(min_p_filter(torch.tensor([[2.0, 2.0, 1.0]]), 1.0)) == {0, 1}


def test_typical_hand_values_can_drop_the_most_likely_token():
    # p = [0.4, 0.3, 0.2, 0.1]: H = 1.2799 nats; |-log p - H| = [0.364, 0.076, 0.330, 1.023]
    # so the typical order is token 1, 2, 0, 3.
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    h = -(p * np.log(p)).sum()
    assert entropy(logits).item() == pytest.approx(h)
    np.testing.assert_array_equal(np.argsort(np.abs(-np.log(p) - h)), [1, 2, 0, 3])
    assert kept(typical_filter(logits, 0.25)) == {1}
    assert kept(typical_filter(logits, 0.4)) == {1, 2}      # 0.3 < 0.4: token 2 crosses
    assert kept(typical_filter(logits, 0.6)) == {0, 1, 2}
    assert kept(typical_filter(logits, 0.95)) == {0, 1, 2, 3}
    assert kept(typical_filter(logits, 1.0)) == {0, 1, 2, 3}


def test_typical_ignores_removed_tokens():
    logits = torch.tensor([[0.0, NEG_INF, 0.0, NEG_INF]])
    out = typical_filter(logits, 0.9)
    assert kept(out) == {0, 2}


def test_repetition_penalty_hand_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[0, 1, 0, 1, 0]])  # token 0 three times: still penalized once
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    assert apply_repetition_penalty(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, 3.0]]
    empty = torch.zeros(1, 0, dtype=torch.long)
    assert apply_repetition_penalty(logits, empty, 2.0).tolist() == logits.tolist()


def test_frequency_presence_hand_values():
    logits = torch.zeros(1, 5)
    generated = torch.tensor([[1, 1, 2]])
    out = apply_frequency_presence_penalty(logits, generated, 0.5, 0.25)
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.25, -0.75, 0.0, 0.0]]))
    out = apply_frequency_presence_penalty(logits, generated, -1.0, 0.0)  # negative rewards
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]]))


def test_penalties_prompt_counts_for_repetition_but_not_frequency():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    prompt, generated = torch.tensor([[0]]), torch.tensor([[1, 1]])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt, generated)
    assert rep.tolist() == [[0.5, 0.5, 1.0]]
    freq = apply_penalties(logits, SamplingParams(frequency_penalty=0.1, presence_penalty=0.2),
                           prompt, generated)
    torch.testing.assert_close(freq, torch.tensor([[1.0, 0.6, 1.0]]))


def test_repetition_penalty_is_per_row():
    logits = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0], [1]]), 4.0)
    assert out.tolist() == [[0.25, 1.0], [1.0, 0.25]]


@pytest.mark.parametrize("fn", [
    lambda x: apply_temperature(x, 0.7),
    lambda x: top_k_filter(x, 2),
    lambda x: top_k_filter(x, 0),
    lambda x: top_p_filter(x, 0.5),
    lambda x: top_p_filter(x, 1.0),
    lambda x: min_p_filter(x, 0.3),
    lambda x: typical_filter(x, 0.5),
    lambda x: apply_repetition_penalty(x, torch.tensor([[0, 3]]), 1.5),
    lambda x: apply_frequency_presence_penalty(x, torch.tensor([[0, 3]]), 0.5, 0.5),
    lambda x: apply_penalties(x, SamplingParams(), None, None),
])
def test_functions_return_new_tensors(fn):
    logits = WORKED.clone()
    out = fn(logits)
    assert torch.equal(logits, WORKED), "the input was modified in place"
    out.add_(1.0)
    assert torch.equal(logits, WORKED), "the output shares memory with the input"


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda x: apply_temperature(x, 1.0),
    lambda x: top_k_filter(x, 1),
    lambda x: top_p_filter(x, 0.5),
    lambda x: min_p_filter(x, 0.5),
    lambda x: typical_filter(x, 0.5),
])
def test_filters_reject_bad_logits(fn):
    with pytest.raises(ValueError, match="shape"):
        fn(torch.zeros(5))
    with pytest.raises(TypeError, match="floating"):
        fn(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        fn(torch.tensor([[0.0, math.nan]]))
    with pytest.raises(ValueError, match="-inf"):
        fn(torch.tensor([[0.0, 1.0], [NEG_INF, NEG_INF]]))


def test_knob_ranges_in_functions():
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\] \(1 = off\), got 0.0"):
        top_p_filter(WORKED, 0.0)
    with pytest.raises(ValueError, match="min_p"):
        min_p_filter(WORKED, 1.5)
    with pytest.raises(ValueError, match="typical_p"):
        typical_filter(WORKED, 0.0)
    with pytest.raises(ValueError, match="penalty"):
        apply_repetition_penalty(WORKED, torch.tensor([[0]]), 0.0)


def test_ids_are_checked():
    with pytest.raises(ValueError, match="seen_ids"):
        apply_repetition_penalty(WORKED, torch.tensor([[5]]), 1.2)
    with pytest.raises(ValueError, match="seen_ids"):
        apply_repetition_penalty(WORKED, torch.tensor([[-1]]), 1.2)
    with pytest.raises(TypeError, match="seen_ids"):
        apply_repetition_penalty(WORKED, torch.tensor([[0.0]]), 1.2)
    with pytest.raises(ValueError, match="generated_ids"):
        apply_frequency_presence_penalty(WORKED, torch.tensor([[0], [1]]), 1.0, 0.0)
    with pytest.raises(ValueError, match="prompt_ids"):
        sample_next_token(WORKED, SamplingParams(repetition_penalty=1.1),
                          prompt_ids=torch.tensor([[7]]))


def test_sample_next_token_rejects_bad_params_and_order():
    with pytest.raises(TypeError, match="params"):
        sample_next_token(WORKED, {"temperature": 0})
    with pytest.raises(ValueError, match="permutation"):
        sample_next_token(WORKED, SamplingParams(), order=("top_k", "top_p"))
    with pytest.raises(ValueError, match="permutation"):
        sample_next_token(WORKED, SamplingParams(), order=HF_ORDER[:-1] + ("top_k",))


# ----------------------------------------------------------------------------------------------
# Against transformers' logits processors
# ----------------------------------------------------------------------------------------------

lp = pytest.importorskip("transformers.generation.logits_process")


def random_logits(seed: int, batch: int = 4, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3.0


@pytest.mark.parametrize("penalty", [1.3, 0.6, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    for seed in range(3):
        logits = random_logits(seed)
        ids = torch.randint(0, 50, (4, 30), generator=torch.Generator().manual_seed(seed + 100))
        want = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        torch.testing.assert_close(apply_repetition_penalty(logits, ids, penalty), want,
                                   rtol=0, atol=0)


def assert_same_filter(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])


@pytest.mark.parametrize("k", [1, 2, 7, 49, 50])
def test_top_k_matches_transformers(k):
    for seed in range(3):
        logits = random_logits(seed)
        assert_same_filter(top_k_filter(logits, k), lp.TopKLogitsWarper(k)(None, logits))
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert_same_filter(top_k_filter(ties, 2), lp.TopKLogitsWarper(2)(None, ties))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.9, 0.99])
def test_top_p_matches_transformers(p):
    for seed in range(3):
        logits = random_logits(seed)
        assert_same_filter(top_p_filter(logits, p), lp.TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("m", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(m):
    for seed in range(3):
        logits = random_logits(seed)
        assert_same_filter(min_p_filter(logits, m), lp.MinPLogitsWarper(m)(None, logits))


@pytest.mark.parametrize("mass", [0.1, 0.5, 0.9, 0.99])
def test_typical_matches_transformers(mass):
    for seed in range(3):
        logits = random_logits(seed)
        assert_same_filter(typical_filter(logits, mass),
                           lp.TypicalLogitsWarper(mass)(None, logits))


def test_documented_tie_differences_from_transformers():
    # Exact ties at the boundary: transformers 5.23's top-p sorts ascending and keeps the
    # higher ids, its typical filter keeps every token tied with the boundary one; ours keep
    # the smallest set, lower ids first (a stable descending sort).
    uniform = torch.zeros(1, 4)
    assert kept(top_p_filter(uniform, 0.5)) == {0, 1}
    assert kept(lp.TopPLogitsWarper(0.5)(None, uniform)) == {2, 3}
    assert kept(typical_filter(uniform, 0.5)) == {0, 1}
    assert kept(lp.TypicalLogitsWarper(0.5)(None, uniform)) == {0, 1, 2, 3}


def test_hf_order_matches_a_transformers_processor_chain():
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95,
                            repetition_penalty=1.3)
    chain = lp.LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(1.3), lp.TemperatureLogitsWarper(0.8),
        lp.TopKLogitsWarper(20), lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.05),
        lp.TypicalLogitsWarper(0.95)])
    for seed in range(3):
        logits = random_logits(seed)
        ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(seed))
        ours = apply_penalties(logits, params, ids[:, :5], ids[:, 5:])
        for stage in HF_ORDER:
            ours = apply_stage(ours, stage, params)
        assert_same_filter(ours, chain(ids, logits.clone()))


# ----------------------------------------------------------------------------------------------
# Composition, order and seeds
# ----------------------------------------------------------------------------------------------

ORDER_DEMO = log_probs(0.4, 0.3, 0.2, 0.1).float()
ORDER_PARAMS = SamplingParams(top_p=0.75, min_p=0.5, seed=0)


def test_order_changes_the_kept_set():
    # HF: top-p first keeps {0, 1, 2} (0.7 < 0.75), then min-p (threshold 0.2) keeps the same.
    # vLLM: min-p first keeps {0, 1, 2}, renormalized to [0.44, 0.33, 0.22]; then top-p stops
    # after token 1 (0.78 >= 0.75).
    hf = explain_sampling(ORDER_DEMO[0], ORDER_PARAMS, order=HF_ORDER)[-1]
    vllm = explain_sampling(ORDER_DEMO[0], ORDER_PARAMS, order=VLLM_ORDER)[-1]
    assert hf.kept == [True, True, True, False]
    assert vllm.kept == [True, True, False, False]


def test_order_changes_what_is_sampled():
    logits = ORDER_DEMO.expand(4000, 4).contiguous()
    hf = sample_next_token(logits, ORDER_PARAMS, order=HF_ORDER)
    vllm = sample_next_token(logits, ORDER_PARAMS, order=VLLM_ORDER)
    assert set(vllm.tolist()) == {0, 1}
    assert set(hf.tolist()) == {0, 1, 2}


def test_greedy_is_first_argmax_and_ignores_filters():
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0], [9.0, 0.0, 9.0, 9.0]])
    params = SamplingParams(temperature=0, typical_p=0.1, top_k=1)
    assert sample_next_token(logits, params).tolist() == [1, 0]


def test_greedy_applies_penalties():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_next_token(logits, params, prompt_ids=torch.tensor([[0]])).tolist() == [1]
    params = SamplingParams(temperature=0, presence_penalty=5.0)
    assert sample_next_token(logits, params, prompt_ids=torch.tensor([[0]])).tolist() == [0]
    assert sample_next_token(logits, params, generated_ids=torch.tensor([[0]])).tolist() == [1]


def test_seeded_sampling_is_reproducible():
    logits = random_logits(3, batch=64)
    params = SamplingParams(temperature=1.5, seed=1234)
    a = sample_next_token(logits, params)
    b = sample_next_token(logits, params)
    assert torch.equal(a, b)
    c = sample_next_token(logits, SamplingParams(temperature=1.5, seed=1235))
    assert not torch.equal(a, c)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    seq1 = [sample_next_token(logits, SamplingParams(), generator=g1) for _ in range(3)]
    seq2 = [sample_next_token(logits, SamplingParams(), generator=g2) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(seq1, seq2, strict=True))
    assert not torch.equal(seq1[0], seq1[1])  # one generator advances between calls


def test_sampled_frequencies_match_explained_distribution():
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.95, seed=11)
    want = explain_sampling(WORKED[0], params)[-1].probs
    draws = sample_next_token(WORKED.expand(20000, 5).contiguous(), params)
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    np.testing.assert_allclose(freq.numpy(), want, atol=0.015)


# ----------------------------------------------------------------------------------------------
# explain_sampling: what the widget shows
# ----------------------------------------------------------------------------------------------

def test_explain_stages_and_values():
    params = SamplingParams(temperature=0.5, top_k=2)
    stages = explain_sampling(WORKED[0], params)
    assert [s.name for s in stages] == ["raw", *HF_ORDER, "renormalized"]
    np.testing.assert_allclose(stages[0].probs, torch.softmax(WORKED[0], -1).numpy(), rtol=1e-6)
    tempered = torch.softmax(WORKED[0] / 0.5, -1).numpy()
    np.testing.assert_allclose(stages[1].probs, tempered, rtol=1e-6)
    top_k = stages[2]
    assert top_k.kept == [True, False, False, True, False] and top_k.active
    np.testing.assert_allclose(top_k.probs, tempered * np.array([1, 0, 0, 1, 0]), rtol=1e-6)
    assert [s.active for s in stages[3:6]] == [False, False, False]
    final = np.array(stages[-1].probs)
    np.testing.assert_allclose(final, tempered * [1, 0, 0, 1, 0] / (tempered[0] + tempered[3]),
                               rtol=1e-6)
    assert all(isinstance(x, float) for x in final.tolist())


def test_explain_greedy_and_penalties():
    stages = explain_sampling(WORKED[0], SamplingParams(temperature=0, repetition_penalty=3.0),
                              prompt_ids=[3])
    assert [s.name for s in stages][:2] == ["raw", "penalties"]
    # 4.2 / 3 = 1.4 < 2.0, so the penalized argmax is token 0
    assert stages[-1].probs == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert sample_next_token(WORKED, SamplingParams(temperature=0, repetition_penalty=3.0),
                             prompt_ids=torch.tensor([[3]])).tolist() == [0]


def test_explain_rejects_batches_and_non_tensors():
    with pytest.raises(ValueError, match=r"logits_1d must be a 1-D tensor \(V,\), got shape "
                                         r"\(1, 5\)"):
        explain_sampling(WORKED, SamplingParams())
    with pytest.raises(TypeError, match="logits_1d must be a 1-D torch.Tensor .*got list"):
        explain_sampling(WORKED[0].tolist(), SamplingParams())


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------

finite = st.floats(min_value=-30, max_value=30, allow_nan=False, width=32)
rows = st.lists(st.one_of(finite, finite, finite, st.just(NEG_INF)), min_size=1, max_size=24)
logit_rows = rows.filter(lambda r: any(math.isfinite(x) for x in r)).map(
    lambda r: torch.tensor([r], dtype=torch.float32))
unit = st.floats(min_value=1e-4, max_value=1.0)
FILTERS = {
    "top_k": (top_k_filter, st.integers(0, 30)),
    "top_p": (top_p_filter, unit),
    "min_p": (min_p_filter, st.floats(0.0, 1.0)),
    "typical": (typical_filter, unit),
}


@settings(max_examples=40, deadline=None)
@given(logits=logit_rows, data=st.data())
def test_filters_give_distributions_and_never_empty(logits, data):
    for name, (fn, knob) in FILTERS.items():
        value = data.draw(knob, label=name)
        out = fn(logits, value)
        assert out.shape == logits.shape
        assert torch.isfinite(out).any(), f"{name}({value}) removed every token"
        assert kept(out) <= kept(logits), f"{name} revived a removed token"
        probs = torch.softmax(out.double(), -1)
        assert (probs >= 0).all() and abs(probs.sum().item() - 1) < 1e-9
        finite_out = torch.isfinite(out)
        assert torch.equal(out[finite_out], logits[finite_out])


@settings(max_examples=40, deadline=None)
@given(logits=logit_rows, a=unit, b=unit, k1=st.integers(1, 30), k2=st.integers(1, 30))
def test_kept_set_shrinks_as_knobs_tighten(logits, a, b, k1, k2):
    lo, hi = min(a, b), max(a, b)
    assert kept(top_k_filter(logits, min(k1, k2))) <= kept(top_k_filter(logits, max(k1, k2)))
    assert kept(top_p_filter(logits, lo)) <= kept(top_p_filter(logits, hi))
    assert kept(typical_filter(logits, lo)) <= kept(typical_filter(logits, hi))
    assert kept(min_p_filter(logits, hi)) <= kept(min_p_filter(logits, lo))


@settings(max_examples=40, deadline=None)
@given(logits=logit_rows, p=unit)
def test_top_p_keeps_a_minimal_prefix_reaching_p(logits, p):
    probs = torch.softmax(logits[0].double(), -1).numpy()
    keep = sorted(kept(top_p_filter(logits, p)))
    dropped = [i for i in range(len(probs)) if i not in keep and probs[i] > 0]
    # a top set (up to float32 rounding: the filter works in the logits' precision, so two
    # probabilities equal in float32 may be kept or dropped either way)
    assert not dropped or min(probs[keep]) >= max(probs[dropped]) - 1e-6
    assert probs[keep].sum() >= p - 1e-5 or len(dropped) == 0
    assert probs[keep].sum() - min(probs[keep]) < p + 1e-5  # without the last one: below p


@settings(max_examples=40, deadline=None)
@given(logits=logit_rows, k=st.integers(1, 30))
def test_top_k_keeps_at_least_k_and_only_the_largest(logits, k):
    keep = kept(top_k_filter(logits, k))
    row = logits[0].tolist()
    n_finite = sum(math.isfinite(x) for x in row)
    assert len(keep) >= min(k, n_finite)
    removed = [row[i] for i in range(len(row)) if i not in keep and math.isfinite(row[i])]
    assert not removed or min(row[i] for i in keep) > max(removed)


@settings(max_examples=50, deadline=None)
@given(row=st.lists(st.integers(-3, 3), min_size=1, max_size=12))
def test_greedy_equals_first_argmax(row):
    logits = torch.tensor([row], dtype=torch.float32)
    got = sample_next_token(logits, SamplingParams(temperature=0, top_p=0.5, min_p=0.3))
    assert got.tolist() == [row.index(max(row))]


@settings(max_examples=20, deadline=None)
@given(logits=logit_rows, seed=st.integers(0, 2**31), t=st.floats(0.1, 3.0))
def test_same_seed_same_token_and_token_is_allowed(logits, seed, t):
    params = SamplingParams(temperature=t, top_k=3, top_p=0.9, seed=seed)
    batch = logits.expand(8, -1).contiguous()
    a, b = sample_next_token(batch, params), sample_next_token(batch, params)
    assert torch.equal(a, b)
    final = explain_sampling(logits[0], params)[-1]
    allowed = {i for i, is_kept in enumerate(final.kept) if is_kept}
    assert set(a.tolist()) <= allowed


def test_filter_stage_names_are_complete():
    assert sorted(HF_ORDER) == sorted(FILTER_STAGES) == sorted(VLLM_ORDER)


def test_the_seed_is_bounded_by_what_a_torch_generator_takes():
    from tinygpt.sampling import MAX_GENERATOR_SEED

    assert MAX_GENERATOR_SEED == 2**64 - 1
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    for seed in (0, 2**63, MAX_GENERATOR_SEED):                 # every one of them samples
        assert 0 <= sample_next_token(logits, SamplingParams(seed=seed)).item() < 3
    with pytest.raises((ValueError, RuntimeError)):             # and the bound is torch's own
        torch.Generator().manual_seed(MAX_GENERATOR_SEED + 1)
    for seed in (MAX_GENERATOR_SEED + 1, 99_999_999_999_999_999_999_999):
        with pytest.raises(ValueError, match=r"seed must be None or an int in \[0, 2\*\*64 - 1\]"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("kwargs, name", [
    ({"repetition_penalty": 1e-39}, "repetition_penalty"),     # subnormal in float32
    ({"repetition_penalty": 1e39}, "repetition_penalty"),      # inf in float32
    ({"frequency_penalty": 1e39}, "frequency_penalty"),
    ({"presence_penalty": -1e39}, "presence_penalty"),
])
def test_penalties_are_bounded_to_what_float32_holds(kwargs, name):
    """These were accepted, and sampling then failed saying "logits must not contain NaN or
    +inf", blaming the model's logits for the penalty's overflow."""
    with pytest.raises(ValueError, match=rf"{name} must .*\[-?\d\.\d+e[-+]38, 3\.4028235e\+38\]"):
        SamplingParams(**kwargs)


def test_bounds_are_inclusive_and_an_overflow_inside_them_names_the_penalties():
    """Inside the bounds a penalty can still overflow a large logit; the error then names the
    penalties, not the logits."""
    from tinygpt.sampling import FLOAT32_MAX, FLOAT32_TINY

    SamplingParams(repetition_penalty=FLOAT32_TINY, frequency_penalty=-FLOAT32_MAX,
                   presence_penalty=FLOAT32_MAX)
    logits = torch.tensor([[10.0, 1.0, -1.0]])
    seen = torch.tensor([[0]])
    for params in (SamplingParams(repetition_penalty=2e-38), SamplingParams(
            temperature=0, frequency_penalty=-FLOAT32_MAX)):
        with pytest.raises(ValueError, match=r"the penalties \(repetition_penalty=.*overflow "
                                             r"torch.float32"):
            sample_next_token(logits, params, prompt_ids=seen, generated_ids=seen.repeat(1, 2))
    kept = apply_penalties(logits, SamplingParams(repetition_penalty=1e-30), seen)
    assert kept[0, 0] == pytest.approx(1e31) and torch.isfinite(kept).all()
