"""The mistakes corpus: for every graded exercise, plausible wrong answers that must lose points.

Each day has a module `autograder/mistakes/<day>.py` with a list `MISTAKES` of `Mistake`s. A
mistake's `code` replaces the whole answer cell `grade_id` of that day's solution notebook; the
exercise's test cell must then score zero. tests/test_grading_proofs.py runs them all.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    grade_id: str  # the answer cell this replaces
    name: str  # what a student got wrong, in a few words
    code: str  # the full replacement source of the answer cell


def for_day(day: str) -> list[Mistake]:
    """The day's mistakes (an empty list when the day has no corpus module yet)."""
    try:
        module = importlib.import_module(f"autograder.mistakes.{day}")
    except ModuleNotFoundError as err:
        if err.name == f"autograder.mistakes.{day}":
            return []
        raise
    return list(module.MISTAKES)
