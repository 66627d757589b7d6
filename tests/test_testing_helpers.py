"""tinygpt.testing: the checks behind every test cell must fail, and fail with a useful message."""

import numpy as np
import pytest

from tinygpt.testing import (
    GRADING_VARIABLE,
    CheckFailed,
    answer_digest,
    check_choice,
    check_close,
    check_float32_error,
    check_raises,
    check_true,
    grading,
    inputs,
    is_number,
    notebook_threads,
)


def test_check_close_passes_and_fails_with_teaching_message():
    check_close("f(x)", [1.0, 2.0], np.array([1.0, 2.0]))
    with pytest.raises(CheckFailed, match=r"f\(x\) returned \[1\., 3\.\], expected \[1\., 2\.\]"
                                          r"\.\nWorst difference at index \(1,\): 1 \(got 3\.0, "
                                          r"expected 2\.0; allowed there: 2\.01e-06\)\.\nHint: h"):
        check_close("f(x)", [1.0, 3.0], [1.0, 2.0], hint="h")


def test_check_close_shows_a_difference_the_printed_arrays_hide():
    # 4 printed decimals make these two look equal; the message gives the difference's size
    with pytest.raises(CheckFailed, match=r"Worst difference at index \(0,\): 0\.0002 "
                                          r"\(got 0\.5002, expected 0\.5;"):
        check_close("f(x)", [0.5002, 1.0], [0.5, 1.0], rtol=0, atol=1e-6)


def test_check_close_names_the_element_that_fails_not_the_largest_difference():
    # index 0 differs by 5e-7, inside its allowance (1e-6 x 1.0); index 1 differs by only 1e-7,
    # but its allowance is 1e-8 + 1e-6 x 0.001: that is the element to show
    with pytest.raises(CheckFailed, match=r"Worst difference at index \(1,\): 1e-07 \(got "
                                          r"0\.0010001, expected 0\.001; allowed there: 1\.1e-08"):
        check_close("x", [1.0000005, 0.0010001], [1.0, 0.001])
    # an infinity that matches is not a failure; a nan where a number was expected is
    with pytest.raises(CheckFailed, match=r"at index \(1,\): inf \(got nan, expected 2\.0"):
        check_close("y", [np.inf, np.nan], [np.inf, 2.0])
    with pytest.raises(CheckFailed, match=r"at index \(0,\): inf \(got 1\.0, expected inf"):
        check_close("z", [1.0, np.inf], [np.inf, np.inf])


def test_is_number_takes_any_real_number_but_no_bool():
    import torch

    for value in (3, 3.0, np.int64(3), np.float32(0.5), np.array(2.5), np.arange(64, 80).sum(),
                  torch.tensor(3), torch.tensor(0.25, dtype=torch.float64)):
        assert is_number(value), value
    for value in (True, np.bool_(False), torch.tensor(True), "3", [3], np.array([3]),
                  torch.tensor([3]), 1j, np.complex128(1), None):
        assert not is_number(value), value


@pytest.mark.parametrize("got,match", [
    (None, "returned None: did you forget `return`"),
    ([1.0, 2.0, 3.0], r"returned shape \(3,\), expected \(2,\)"),
    ([np.nan, 1.0], "non-finite"),
    ("abc", "should return numbers"),
])
def test_check_close_diagnoses(got, match):
    with pytest.raises(CheckFailed, match=match):
        check_close("f(x)", got, [1.0, 2.0])


def test_check_close_scalar_has_no_index():
    with pytest.raises(CheckFailed) as info:
        check_close("g()", 2.0, 1.0)
    assert "index" not in str(info.value)


def test_check_true_and_raises():
    check_true(True, "never shown")
    with pytest.raises(CheckFailed, match="bad thing"):
        check_true(False, "bad thing")
    err = check_raises(ValueError, int, "x", what="int('x')")
    assert isinstance(err, ValueError)
    with pytest.raises(CheckFailed, match="should raise ValueError, but returned 3"):
        check_raises(ValueError, int, "3", what="int('3')")
    with pytest.raises(CheckFailed, match="but raised TypeError"):
        check_raises(ValueError, int, None, what="int(None)")


def test_check_raises_lets_not_implemented_through():
    def stub():
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        check_raises(ValueError, stub, what="stub()")


def test_check_choice():
    digest = answer_digest("Q9", "c")
    check_choice("Q9", " C ", digest)
    with pytest.raises(CheckFailed, match="'B' is not the answer"):
        check_choice("Q9", "B", digest)
    with pytest.raises(CheckFailed, match="one letter"):
        check_choice("Q9", 3, digest)
    assert answer_digest("Q1", "B") != answer_digest("Q2", "B")


def _earlier():
    return 1


def _later():
    return _earlier() + 1


def test_with_reference_swaps_names_for_the_call_only():
    from tinygpt.testing import with_reference

    swapped = with_reference(_later, _earlier=lambda: 10)
    assert swapped() == 11 and _later() == 2        # the original is untouched afterwards

    def boom():
        raise KeyError("x")

    failing = with_reference(_later, _earlier=boom)
    with pytest.raises(KeyError):
        failing()
    assert _later() == 2                              # restored after an exception too
    with pytest.raises(TypeError, match="Python function"):
        with_reference(len, _earlier=boom)


@pytest.mark.parametrize("env,expected", [
    ({}, False),
    ({"NBGRADER_EXECUTION": "autograde"}, True),     # stock nbgrader autograde
    ({"NBGRADER_EXECUTION": "validate"}, True),
    ({GRADING_VARIABLE: "1"}, True),                 # the course's grader (sandbox.py)
    ({GRADING_VARIABLE: "0", "NBGRADER_EXECUTION": "autograde"}, False),  # forced reading mode
])
def test_grading_mode_reads_the_graders_environment(monkeypatch, env, expected):
    for name in (GRADING_VARIABLE, "NBGRADER_EXECUTION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert grading() is expected


def test_grading_mode_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv(GRADING_VARIABLE, "yes")
    with pytest.raises(ValueError, match=GRADING_VARIABLE):
        grading()


def test_inputs_names_the_input_shape_and_the_rule():
    torch = pytest.importorskip("torch")
    x = torch.zeros(2, 4, 96)
    with pytest.raises(CheckFailed) as err:
        with inputs("int4_linear(x, ...)", "x may have any number of leading dimensions", x=x,
                    group_size=32):
            torch.mm(x, torch.zeros(96, 3))          # raises: "self must be a matrix"
    text = str(err.value)
    assert "int4_linear(x, ...) raised RuntimeError" in text and "matrix" in text
    assert "x: shape (2, 4, 96), float32" in text and "group_size: 32" in text
    assert "x may have any number of leading dimensions" in text
    assert isinstance(err.value.__cause__, RuntimeError)


def test_inputs_lets_failed_checks_and_unanswered_exercises_through():
    with pytest.raises(CheckFailed, match="^own message$"):
        with inputs("f(x)", "rule", x=1):
            raise CheckFailed("own message")
    with pytest.raises(NotImplementedError):
        with inputs("f(x)", "rule", x=1):
            raise NotImplementedError
    with inputs("f(x)", "rule", x=1):   # nothing raised: nothing reported
        pass


def test_check_float32_error_measures_both_against_float64():
    import torch

    truth = torch.linspace(-3, 3, 101, dtype=torch.float64).exp()
    reference = truth.float()                               # float32 rounding only
    summed = (truth.float() * 3 - truth.float() * 2)        # another order: a few ulps off
    err, ref_err = check_float32_error("f()", summed, reference, truth, factor=8)
    assert 0 < ref_err <= err <= 8 * ref_err
    with pytest.raises(CheckFailed, match=r"f\(\) is 0\.0[0-9]+ from the float64 result, "
                                          r"against [0-9.e-]+ for the float32 reference"):
        check_float32_error("f()", reference * (1 + 1e-3), reference, truth)   # a real bug
    with pytest.raises(CheckFailed, match="float64 result"):
        check_float32_error("f()", torch.full_like(reference, float("nan")), reference, truth)
    with pytest.raises(CheckFailed, match="shapes differ"):
        check_float32_error("f()", reference[:3], reference, truth)
    assert check_float32_error("f()", truth, truth, truth) == (0.0, 0.0)


@pytest.mark.parametrize("grading_flag,omp,preferred,want", [
    ("0", None, 2, 2),        # a reader's lab: what the notebook asks for
    ("1", None, 2, 1),        # grading: one thread
    ("1", "4", 2, 1),
    ("0", "1", 2, 1),         # make test: OMP_NUM_THREADS=1 caps it
    ("0", "4", 2, 2),         # a cap above the wish changes nothing
    ("0", "3,1", 8, 3),       # OpenMP's nested list: the outer level counts
    ("0", "0", 2, 2),         # not a positive integer: ignored, as OpenMP does
    ("0", "many", 2, 2),
])
def test_notebook_threads(monkeypatch, grading_flag, omp, preferred, want):
    monkeypatch.setenv(GRADING_VARIABLE, grading_flag)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert notebook_threads(preferred) == want


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_notebook_threads_names_a_bad_argument(bad):
    with pytest.raises(ValueError, match="preferred must be an integer >= 1"):
        notebook_threads(bad)
