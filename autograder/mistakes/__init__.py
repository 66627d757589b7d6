"""The mistakes corpus: for every graded exercise, plausible wrong answers that must lose points.

Each day has a module `autograder/mistakes/<day>.py` with a list `MISTAKES` of `Mistake`s. A
mistake's `code` replaces the whole answer cell `grade_id` of that day's solution notebook; the
exercise's test cell must then score zero. tests/test_grading_proofs.py runs them all.

A mistake may also name, in `keeps`, later exercises that call the function it breaks: their
tests swap in the package's reference version, so with this mistake in place they must keep
full marks (one mistake, one charge).

A mistake may also give, in `says`, words its feedback must contain (case-insensitive): the
hint a student with exactly this bug reads must name this bug, not another one.

A day's module may also define `ALTERNATIVES`, a list of `Alternative`s: right answers written
another way than the solution (float64 or float32 where the markdown allows either, keyword
calls, another valid formula, a helper with a common name beside the answer). Each must keep
full marks: a test that takes one of them for a mistake fails a student who did nothing wrong.

A day's module may also define `EQUIVALENT_MUTANTS`, a dict from a mutant's key (see
autograder/mutants.py) to the one-line reason it computes the same thing as the solution.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    grade_id: str  # the answer cell this replaces
    name: str  # what a student got wrong, in a few words
    code: str  # the full replacement source of the answer cell
    keeps: tuple[str, ...] = ()  # later exercises that must keep full marks with this mistake
    says: str = ""  # words the feedback for this mistake must contain (case-insensitive)


@dataclass(frozen=True)
class Alternative(Mistake):
    """A right answer written another way: replaces the answer cell and must keep full marks
    (`name` says how it differs from the solution)."""


def _listed(day: str, name: str, default):
    """The day's module's `name` (`default` when the day has no corpus module yet)."""
    try:
        module = importlib.import_module(f"autograder.mistakes.{day}")
    except ModuleNotFoundError as err:
        if err.name == f"autograder.mistakes.{day}":
            return default
        raise
    return getattr(module, name, default)


def for_day(day: str) -> list[Mistake]:
    """The day's mistakes (an empty list when the day has no corpus module yet)."""
    return list(_listed(day, "MISTAKES", []))


def alternatives(day: str) -> list[Alternative]:
    """The day's right answers written another way (empty when it lists none)."""
    found = list(_listed(day, "ALTERNATIVES", []))
    wrong = [a for a in found if not isinstance(a, Alternative)]
    if wrong:
        raise TypeError(f"{day}: ALTERNATIVES must hold Alternative(...) entries, got {wrong!r}")
    return found


def equivalent_mutants(day: str) -> dict[str, str]:
    """The day's allow-list of equivalent mutants: key -> reason (empty when none)."""
    return dict(_listed(day, "EQUIVALENT_MUTANTS", {}))
