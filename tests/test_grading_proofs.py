"""The three proofs that grading works, for every day (SYLLABUS.md, section 4):

1. the solution notebook autogrades to full marks (real nbgrader, real gradebook, the notebook
   run as the instructor's grader runs it: sandboxed, with the integrity guard);
2. the generated student notebook, unsolved, scores zero on every graded cell;
3. every recorded mistake, substituted for the solution, loses its exercise's points, and every
   exercise has at least one recorded mistake; a mistake that names later exercises in `keeps`
   leaves them their full marks (one mistake, one charge); and a fixed, seeded sample of the
   day's mutants (autograder/mutants.py; the full run is `make mutants`) loses points too,
   unless listed as equivalent; while every right answer written another way (`ALTERNATIVES`)
   keeps full marks.
Plus: a correct answer whose code writes to stderr keeps its points, and every recorded
mistake's feedback names its own exercise (and no other exercise before it), and a mistake
that says what its hint must name (`says`) gets a hint that names it.
"""

import re

import pytest

from autograder import mistakes
from autograder.kernel import run_notebook_with_mistakes
from autograder.mutants import sample as mutant_sample
from autograder.notebooks import exercises, read, solution_path
from autograder.reports import answer_names, name_the_exercise
from tests.conftest import DAYS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("day", DAYS)
def test_solution_scores_full_marks(day, graded_days):
    grades = graded_days(day).grades["solution"]
    lost = [f"{g.grade_id}: {g.score}/{g.max_score}" for g in grades if g.score != g.max_score]
    assert grades and not lost, f"{day}: the solution lost points in nbgrader: {lost}"


@pytest.mark.parametrize("day", DAYS)
def test_unsolved_student_notebook_scores_zero(day, graded_days):
    grades = graded_days(day).grades["blank"]
    scored = [f"{g.grade_id}: {g.score}" for g in grades if g.score != 0]
    assert grades and not scored, f"{day}: the unsolved notebook scored points: {scored}"


@pytest.mark.parametrize("day", DAYS[:1])      # the day whose grading made the noisy copy
def test_stderr_from_correct_code_costs_nothing(day, graded_days):
    grades = graded_days(day).grades["noisy"]
    lost = [f"{g.grade_id}: {g.score}/{g.max_score}" for g in grades if g.score != g.max_score]
    assert not lost, f"a correct submission that writes to stderr lost points: {lost}"


@pytest.mark.parametrize("day", DAYS)
def test_every_mistake_loses_its_points(day):
    recorded = mistakes.for_day(day)
    missing = sorted({ex.grade_id for ex in exercises(read(solution_path(day)))}
                     - {m.grade_id for m in recorded})
    assert not missing, (f"{day}: exercises without a mistake in autograder/mistakes/{day}.py: "
                         f"{missing}")
    sampled = [m.as_mistake() for m in mutant_sample(day)]
    right = mistakes.alternatives(day)
    trials = run_notebook_with_mistakes(solution_path(day), recorded + sampled + right)
    correct_lost = [t for t in trials if (t.mistake is None or t.mistake in right)
                    and t.score != t.max_points]
    assert not correct_lost, f"{day}: correct answers lost points in the kernel run: " + "; ".join(
        f"{t.grade_id}{'' if t.mistake is None else ' written as ' + t.mistake.name} ({t.error})"
        for t in correct_lost)
    trials = [t for t in trials if t.mistake not in right]
    survived = [t for t in trials if t.mistake is not None and not t.keeps and t.score > 0]
    assert not survived, f"{day}: these mistakes kept their points (tests too weak): " + "; ".join(
        f"{t.grade_id}: {t.mistake.name}" for t in survived)
    nb = read(solution_path(day))
    names = {ex.grade_id: answer_names(nb.cells[ex.answer_index].source) for ex in exercises(nb)}
    misnamed = []
    for t in trials:
        if t.mistake is None or t.keeps or t.mistake not in recorded:
            continue
        shown = name_the_exercise(t.error, names[t.grade_id])     # as the feedback page shows it
        found = sorted((m.start(), grade_id) for grade_id, ns in names.items() for n in ns
                       for m in re.finditer(rf"\b{re.escape(n)}\b", shown))
        if not found or found[0][1] != t.grade_id:
            misnamed.append(f"{t.grade_id}: {t.mistake.name}: {shown[:120]!r}")
    assert not misnamed, (f"{day}: feedback that does not name its own exercise first: "
                          + "; ".join(misnamed))
    unnamed_bug = [f"{t.grade_id}: {t.mistake.name}: wants {t.mistake.says!r}, says "
                   f"{t.error[:300]!r}" for t in trials
                   if t.mistake is not None and not t.keeps and t.mistake.says
                   and t.mistake.says.lower() not in t.error.lower()]
    assert not unnamed_bug, (f"{day}: feedback that does not name the student's bug: "
                             + "; ".join(unnamed_bug))
    charged_twice = [t for t in trials if t.keeps and t.score != t.max_points]
    assert not charged_twice, (f"{day}: a mistake in an earlier exercise cost a later one its "
                               "points (swap in the reference version in its tests): " + "; ".join(
        f"{t.grade_id} with {t.mistake.grade_id}: {t.mistake.name} ({t.error})"
        for t in charged_twice))
