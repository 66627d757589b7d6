"""tinygpt.numerics (day 01): values against independent computations, and input errors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tinygpt import numerics as nx

LOGITS = [2.0, -1.5, 0.3, 4.2, -0.8]

finite_rows = arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 12)),
                     elements=st.floats(-1e4, 1e4))


def test_worked_example_from_the_course():
    np.testing.assert_allclose(nx.softmax(LOGITS), [0.097, 0.003, 0.018, 0.876, 0.006], atol=5e-4)
    np.testing.assert_allclose(nx.softmax_with_temperature(LOGITS, 2.0),
                               [0.206, 0.036, 0.088, 0.619, 0.051], atol=5e-4)


@settings(max_examples=60, deadline=None)
@given(finite_rows)
def test_softmax_and_log_softmax_match_torch(x):
    t = torch.from_numpy(x)
    np.testing.assert_allclose(nx.softmax(x), torch.softmax(t, -1).numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(nx.log_softmax(x), torch.log_softmax(t, -1).numpy(), rtol=1e-9,
                               atol=1e-9)
    # float64 both; atol too: where max + log(sum) cancels to near 0, an ulp of exp or log
    # (numpy's and torch's differ by CPU) is no longer small relative to the result
    np.testing.assert_allclose(nx.logsumexp(x), torch.logsumexp(t, -1).numpy(), rtol=1e-12,
                               atol=1e-12)


def test_large_logits_do_not_overflow_and_rows_are_independent():
    x = np.array([[1000.0, 1001.0, 1002.0], [0.0, -1000.0, -2000.0]])
    p = nx.softmax(x)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p[0], [0.09003057, 0.24472847, 0.66524096], atol=1e-8)
    np.testing.assert_allclose(nx.log_softmax(x)[1], [0.0, -1000.0, -2000.0])


def test_softmax_axis_argument_and_input_untouched():
    x = np.array([[1.0, 2.0], [3.0, 5.0]])
    before = x.copy()
    np.testing.assert_allclose(nx.softmax(x, axis=0).sum(axis=0), [1.0, 1.0])
    np.testing.assert_array_equal(x, before)


def test_minus_inf_means_impossible():
    np.testing.assert_array_equal(nx.softmax([0.0, -np.inf, 0.0]), [0.5, 0.0, 0.5])
    with pytest.raises(ValueError, match="every entry"):
        nx.softmax([-np.inf, -np.inf])


def test_axis_is_checked_along_that_axis():
    # columns are the rows here: each column has a possible token, a row of -inf is fine
    x = np.array([[-np.inf, -np.inf], [0.0, 1.0]])
    np.testing.assert_array_equal(nx.softmax(x, axis=0), [[0.0, 0.0], [1.0, 1.0]])
    np.testing.assert_array_equal(nx.log_softmax(x, axis=0), [[-np.inf, -np.inf], [0.0, 0.0]])
    np.testing.assert_array_equal(nx.logsumexp(x, axis=0), [0.0, 1.0])
    np.testing.assert_array_equal(nx.softmax_with_temperature(x, 0, axis=0), [[0, 0], [1, 1]])
    for f in (nx.softmax, nx.log_softmax, nx.logsumexp,
              lambda a, axis: nx.softmax_with_temperature(a, 0, axis=axis)):
        with pytest.raises(ValueError, match=r"every entry of a row \(along axis 0\)"):
            f(x.T, axis=0)                              # column 0 is all -inf
        with pytest.raises(ValueError, match="at least one entry along axis 0"):
            f(np.zeros((0, 3)), axis=0)
        with pytest.raises(ValueError, match=r"axis must be in \[-2, 2\)"):
            f(x, axis=2)


def test_complex_logits_rejected():
    for f in (nx.softmax, nx.log_softmax, nx.logsumexp):
        with pytest.raises(TypeError, match="logits must be real numbers"):
            f(np.array([1.0 + 2.0j, 0.5]))


@pytest.mark.parametrize("bad", [[np.nan, 1.0], [np.inf, 0.0]])
def test_nan_and_plus_inf_rejected(bad):
    with pytest.raises(ValueError, match="logits"):
        nx.softmax(bad)


def test_scalar_and_non_numeric_rejected():
    with pytest.raises(ValueError, match="at least one dimension"):
        nx.softmax(3.0)
    with pytest.raises(TypeError, match="numeric"):
        nx.softmax(["a", "b"])


def test_temperature_zero_is_greedy_first_on_ties():
    x = np.array([[1.0, 3.0, 3.0], [-2.0, -5.0, -9.0]])
    np.testing.assert_array_equal(nx.softmax_with_temperature(x, 0), [[0, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("tau", [-1.0, -1e-9, float("nan"), float("inf")])
def test_bad_temperature_rejected(tau):
    with pytest.raises(ValueError, match="temperature"):
        nx.softmax_with_temperature(LOGITS, tau)


def test_temperature_type_checked():
    with pytest.raises(TypeError, match="temperature"):
        nx.softmax_with_temperature(LOGITS, True)


@pytest.mark.parametrize("tau", [1e-310, 5e-324])
def test_a_tiny_temperature_is_the_greedy_limit_not_an_overflow(tau):
    """logits / 1e-310 overflowed to +inf and the error blamed the logits, though the
    docstring allows any finite temperature >= 0: (logits - max) / T keeps the maxima at 0."""
    with np.errstate(over="raise", invalid="raise"):     # no RuntimeWarning either
        got = nx.softmax_with_temperature([[1.0, 2.0, 3.0], [4.0, 4.0, -1.0]], tau)
    np.testing.assert_array_equal(got, [[0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])


def test_temperature_sharpens_and_flattens():
    top = [nx.softmax_with_temperature(LOGITS, t)[3] for t in (0.25, 0.5, 1, 2, 10)]
    assert all(a > b for a, b in zip(top, top[1:], strict=False))


def test_cross_entropy_matches_torch():
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(7, 11)) * 3, rng.integers(0, 11, size=7)
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(targets))
    assert nx.cross_entropy(logits, targets) == pytest.approx(want.item(), rel=1e-12)
    assert nx.cross_entropy(np.zeros((3, 50)), [1, 2, 3]) == pytest.approx(math.log(50))


@pytest.mark.parametrize("logits,targets,match", [
    (np.zeros(5), [1], r"\(N, V\)"),
    (np.zeros((2, 5)), [1], "integer ids"),
    (np.zeros((2, 5)), [1.0, 2.0], "integer ids"),
    (np.zeros((2, 5)), [1, 5], r"\[0, 5\)"),
    (np.zeros((2, 5)), [-1, 0], r"\[0, 5\)"),
    # the mean of no positions was nan, with RuntimeWarnings (perplexity refuses empty input)
    (np.zeros((0, 3)), np.zeros(0, int), r"at least one row \(N >= 1\)"),
])
def test_cross_entropy_errors(logits, targets, match):
    with pytest.raises(ValueError, match=match):
        nx.cross_entropy(logits, targets)


def test_perplexity():
    assert nx.perplexity(np.log([0.5, 0.25, 0.125, 0.5])) == pytest.approx(2 ** 1.75)
    assert nx.perplexity(np.log(np.full(9, 1 / 50))) == pytest.approx(50.0)
    logits, targets = np.random.default_rng(1).normal(size=(5, 8)), np.arange(5)
    lp = nx.log_softmax(logits)[np.arange(5), targets]
    assert nx.perplexity(lp) == pytest.approx(math.exp(nx.cross_entropy(logits, targets)))


@pytest.mark.parametrize("bad", [[0.5, -1.0], [], [[-1.0]], [np.nan]])
def test_perplexity_rejects_non_logprobs(bad):
    with pytest.raises(ValueError, match="token_logprobs"):
        nx.perplexity(bad)
