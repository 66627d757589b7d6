"""Checks used by the course's test cells: each failure says what was expected, what came back,
and the mistake that most often causes it.

These compare a student's result with an expected one, so a test cell reads as "call your
function, then check what it returned"; check_raises alone calls the function itself, since the
exception is what it checks (with_reference wraps one for the test cell to call). Where the
call itself may raise on a test input, `inputs` wraps it so the error names the input's shape
and the rule that input checks. `grading()` tells a notebook that it runs to be graded, so
cells no test reads (timings, widgets, servers) can skip or shrink.

Imported in a notebook that is read (not graded), it also adds one line under the traceback of
a cell that stopped at an answer the student has not written yet (a notebook function still
raising the stub's bare NotImplementedError), naming that function: a demo cell that calls it
otherwise ends in a traceback through the package that does not say what to do.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import numbers
import os
import types
from collections.abc import Callable, Iterator

import numpy as np

GRADING_VARIABLE = "TINYGPT_GRADING"


def grading() -> bool:
    """True when the notebook runs to be graded, not read.

    The course's grader (autograder/sandbox.py) sets TINYGPT_GRADING=1 in the kernel's
    environment, and nbgrader itself sets NBGRADER_EXECUTION while it autogrades or validates,
    so stock `nbgrader autograde` counts too. TINYGPT_GRADING=0 forces reading mode. Notebooks
    use it to skip or shrink what no test reads (timing sweeps, widgets, servers): a widget
    created during a headless run can stall the run until the cell times out.
    """
    flag = os.environ.get(GRADING_VARIABLE)
    if flag is not None:
        if flag not in ("0", "1"):
            raise ValueError(f"{GRADING_VARIABLE} must be '0' or '1', got {flag!r}")
        return flag == "1"
    return bool(os.environ.get("NBGRADER_EXECUTION"))


def notebook_threads(preferred: int) -> int:
    """How many torch threads a notebook's timing cells should take: `preferred` for a reader,
    1 while grading (a grader's cores are shared), and never more than OMP_NUM_THREADS where
    whoever runs the notebook sets it (`make test` runs two notebooks at once on two cores with
    OMP_NUM_THREADS=1). Threads that wait on each other on a busy core make a cell several
    times slower: day 21's streaming run took 4.2 s on one thread and 11.4 s on two beside one
    busy process (AVX2 EPYC, 2 cores, 2026-11-28). An OMP_NUM_THREADS that is not a positive
    integer is ignored, as OpenMP ignores it."""
    if isinstance(preferred, bool) or not isinstance(preferred, int) or preferred < 1:
        raise ValueError(f"preferred must be an integer >= 1, got {preferred!r}")
    if grading():
        return 1
    cap = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if cap.isdigit() and int(cap) >= 1:
        return min(preferred, int(cap))
    return preferred


class CheckFailed(AssertionError):
    """A course check failed; the message teaches what to fix."""


def _fail(message: str, hint: str) -> None:
    raise CheckFailed(message + (f"\nHint: {hint}" if hint else ""))


def _short(array: np.ndarray) -> str:
    return np.array2string(np.asarray(array), precision=4, threshold=12, separator=", ")


def check_close(what: str, got, want, *, rtol: float = 1e-6, atol: float = 1e-8,
                hint: str = "") -> None:
    """Assert `got` has `want`'s shape and values (to rtol/atol). `what` names the call."""
    if got is None:
        _fail(f"{what} returned None: did you forget `return`?", hint)
    try:
        got_array = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        _fail(f"{what} should return numbers, got {type(got).__name__}: {got!r}", hint)
    want_array = np.asarray(want, dtype=np.float64)
    if got_array.shape != want_array.shape:
        _fail(f"{what} returned shape {got_array.shape}, expected {want_array.shape}.", hint)
    if not np.isfinite(got_array).all() and np.isfinite(want_array).all():
        _fail(f"{what} returned non-finite values {_short(got_array)}; expected "
              f"{_short(want_array)}.", hint)
    if not np.allclose(got_array, want_array, rtol=rtol, atol=atol, equal_nan=True):
        got_b, want_b = np.broadcast_arrays(got_array, want_array)
        with np.errstate(invalid="ignore"):                # inf - inf
            diff = np.abs(got_b - want_b)
        diff = np.where(np.isnan(diff), np.inf, diff)
        # report the element that fails worst (its difference minus what is allowed there, the
        # test np.allclose makes), not the largest difference, which may lie within tolerance;
        # the arrays print at 4 decimals, so a small difference needs its own line
        allowed_all = atol + rtol * np.abs(want_b)
        close = np.isclose(got_b, want_b, rtol=rtol, atol=atol, equal_nan=True)
        with np.errstate(invalid="ignore"):
            excess = np.where(close, -np.inf, np.nan_to_num(diff - allowed_all, nan=np.inf))
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        at = f" at index {tuple(int(i) for i in worst)}" if diff.ndim else ""
        allowed = allowed_all[worst]
        got_x, want_x = float(got_b[worst]), float(want_b[worst])
        _fail(f"{what} returned {_short(got_array)}, expected {_short(want_array)}.\n"
              f"Worst difference{at}: {diff[worst]:.3g} (got {got_x!r}, expected {want_x!r}; "
              f"allowed there: {allowed:.3g}).", hint)


def _float64(value) -> np.ndarray:
    detach = getattr(value, "detach", None)            # a torch tensor, on any device
    if detach is not None:
        value = detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def check_float32_error(what: str, got, reference, truth, *, factor: float = 2.0,
                        floor: float = 0.0, hint: str = "") -> tuple[float, float]:
    """Assert `got` is as close to `truth` as an independent float32 `reference` is.

    `truth` is the same computation in float64; `reference` is another float32 implementation
    of it (torch's, transformers', the plain loop's). The check is
    max|got - truth| <= factor * max|reference - truth| + floor, so the tolerance is measured
    on the machine that runs it: where another CPU's kernels sum in another order both errors
    move together, while a real bug lands far outside. `floor` covers a reference that happens
    to be exact. Returns the two errors (got's, reference's) so a test can print them.
    """
    truth64 = _float64(truth)
    got64, ref64 = _float64(got), _float64(reference)
    if got64.shape != truth64.shape or ref64.shape != truth64.shape:
        _fail(f"{what}: shapes differ: got {got64.shape}, reference {ref64.shape}, float64 "
              f"{truth64.shape}.", hint)
    err = float(np.abs(got64 - truth64).max(initial=0.0))
    ref_err = float(np.abs(ref64 - truth64).max(initial=0.0))
    if not err <= factor * ref_err + floor:             # also fails on NaN
        _fail(f"{what} is {err:.3g} from the float64 result, against {ref_err:.3g} for the "
              f"float32 reference (allowed: {factor:g} x {ref_err:.3g} + {floor:.3g}).", hint)
    return err, ref_err


def is_number(value) -> bool:
    """Whether a self-check answer is one real number: a Python int or float, a NumPy number
    (np.int64(3), np.float32(0.5), or a 0-d array) or a 0-d torch tensor (torch.tensor(3)), but
    never a bool (True is not an answer of 1), a complex number, a string or a sequence."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, numbers.Real):                  # int, float, NumPy's real scalars
        return True
    detach = getattr(value, "detach", None)              # a torch tensor
    if detach is not None and getattr(value, "ndim", None) == 0:
        is_complex = getattr(value, "is_complex", None)
        dtype = str(getattr(value, "dtype", ""))
        return not (is_complex is not None and is_complex()) and dtype != "torch.bool"
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.dtype.kind in "iuf"
    return False


def check_true(condition: bool, message: str, *, hint: str = "") -> None:
    """Assert `condition`; `message` says what was expected and what came back."""
    if not condition:
        _fail(message, hint)


def check_raises(exc_type: type[BaseException], fn: Callable, *args, what: str,
                 hint: str = "", **kwargs) -> BaseException:
    """Assert fn(*args, **kwargs) raises `exc_type`; returns the exception for further checks."""
    try:
        result = fn(*args, **kwargs)
    except exc_type as err:
        return err
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 (report which exception came instead)
        _fail(f"{what} should raise {exc_type.__name__}, but raised {type(err).__name__}: {err}",
              hint)
    _fail(f"{what} should raise {exc_type.__name__}, but returned {result!r}", hint)
    raise AssertionError("unreachable")


def describe(value) -> str:
    """A short description of a test input: a tensor's or array's shape and dtype, a list's
    length, or the repr of a small value."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"shape {tuple(int(n) for n in shape)}, {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, list | tuple) and len(value) > 6:
        return f"a {type(value).__name__} of length {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@contextlib.contextmanager
def inputs(call: str, rule: str, **values) -> Iterator[None]:
    """Name the test input when the student's code raises inside the block.

        with inputs("int4_linear(x, ...)", "x may have any leading dimensions", x=x):
            got = int4_linear(x, packed, scale, zero, 32)

    An exception from the block (not a failed check, not NotImplementedError, which means
    "not answered yet") becomes a CheckFailed that says which call raised what, the shape
    of each input (`values`) and the rule this input exercises, so that a torch error such
    as "self must be a matrix" reads together with "x had shape (2, 4, 96)".
    """
    try:
        yield
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as err:  # noqa: BLE001 (reported with the input that caused it)
        given = "; ".join(f"{name}: {describe(value)}" for name, value in values.items())
        raise CheckFailed(f"{call} raised {type(err).__name__}: {err}\nThe test's input: "
                          f"{given}.\nWhat this input checks: {rule}") from err


def answer_digest(question: str, answer: str) -> str:
    """A short fingerprint of a self-check answer, so test cells need not print the answer."""
    normalized = str(answer).strip().upper()
    return hashlib.sha256(f"tinygpt:{question}:{normalized}".encode()).hexdigest()[:16]


def check_choice(question: str, answer, digest: str, *, choices: str = "ABCD",
                 hint: str = "") -> None:
    """Assert a multiple-choice `answer` (one letter of `choices`) is the one `digest` encodes."""
    if not isinstance(answer, str) or answer.strip().upper() not in tuple(choices):
        _fail(f"{question}: answer with one letter of {', '.join(choices)} as a string, "
              f"got {answer!r}", "")
    if answer_digest(question, answer) != digest:
        _fail(f"{question}: {answer.strip().upper()!r} is not the answer.", hint)


def with_reference(fn: Callable, **references: Callable) -> Callable:
    """`fn` with the named functions it calls replaced by reference versions while it runs.

    A test of a function that composes earlier exercises (a sampling pipeline calling the
    filters) calls `with_reference(sampling_probs, top_k_filter=sampling.top_k_filter)(...)`,
    so a bug in an earlier exercise costs points in that exercise alone. During each call the
    names are swapped in the globals `fn` reads (its notebook's namespace, seen through any
    decorator such as torch.no_grad) and put back afterwards, also when the call raises.
    """
    inner = inspect.unwrap(fn)
    if not isinstance(inner, types.FunctionType):
        raise TypeError(f"with_reference needs a Python function, got {type(fn).__name__}")
    namespace = inner.__globals__
    missing = object()

    @functools.wraps(fn)
    def call(*args, **kwargs):
        saved = {name: namespace.get(name, missing) for name in references}
        namespace.update(references)
        try:
            return fn(*args, **kwargs)
        finally:
            for name, value in saved.items():
                if value is missing:
                    namespace.pop(name, None)
                else:
                    namespace[name] = value

    return call


# --------------------------------------------------------------------------------------------
# a cell that stopped at an unwritten answer says which one


def _in_notebook(filename: str) -> bool:
    """Whether code comes from a notebook cell (ipykernel's /tmp/ipykernel_PID/N.py files;
    IPython's own <ipython-input-N-...> names)."""
    return "ipykernel_" in filename or filename.startswith("<ipython-input")


def unwritten_answer(value: BaseException, tb) -> str | None:
    """The line to show under a NotImplementedError that is a stub's (no message, raised by
    code in a notebook cell), naming the function to write ("softmax()", "RMSNorm.forward()");
    None for any other error."""
    if not isinstance(value, NotImplementedError) or str(value) or tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    if not _in_notebook(frame.f_code.co_filename):
        return None                              # raised by a library, not by a stub
    name = frame.f_code.co_name
    if name == "<module>":
        return ("This answer is not written yet: replace `raise NotImplementedError()` with "
                "it and run the cell again.")
    owner = frame.f_locals.get("self")
    name = f"{type(owner).__name__}.{name}()" if owner is not None else f"{name}()"
    return (f"{name} is not written yet: its answer cell still says `raise "
            f"NotImplementedError()`. Write it, run that cell, then run this one again.")


def _explain_unwritten(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython's traceback, and under it the line `unwritten_answer` gives, if any (an IPython
    custom exception handler: it shows the traceback, as IPython's own handling would, and
    returns its lines)."""
    lines = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    line = unwritten_answer(value, tb)
    if line is not None:
        lines = [*lines, "\n" + line]
    shell._showtraceback(etype, value, lines)    # what ipykernel sends as the cell's error
    return lines


def _install_unwritten_hint() -> None:
    if grading():               # graded runs keep IPython's own handling, untouched
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "set_custom_exc"):
        shell.set_custom_exc((NotImplementedError,), _explain_unwritten)


_install_unwritten_hint()
