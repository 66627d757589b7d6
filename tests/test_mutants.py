"""The mutation-testing tool (autograder/mutants.py) and the days' lists of equivalent mutants.

The mutants themselves are graded in tests/test_grading_proofs.py (a seeded sample per day, in
the same kernel walk as the mistakes corpus); the full run is `make mutants`.
"""

import ast
import re

import pytest

from autograder import mistakes
from autograder.mutants import (
    SAMPLE_PER_DAY,
    day_mutants,
    format_report,
    mutants_of,
    run_day,
    sample,
)
from tests.conftest import DAYS

CELL = '''def clip(x, lo, hi, *, dim=-1):
    """Clip docstring: never mutated 1 < 2."""
    ### BEGIN SOLUTION
    if lo > hi:
        raise ValueError(f"lo must be <= hi, got {lo} > {hi}")
    y = torch.sort(x, dim=dim, descending=True).values[:, :k + 1]
    total = (y * 2 - lo) / hi
    for i in range(n):
        total += i
    return total if x == 3 and not flag else None
    ### END SOLUTION


def untouched(a):
    return a < 1
'''


def _changes() -> dict[str, set[tuple[str, str]]]:
    found: dict[str, set[tuple[str, str]]] = {}
    for m in mutants_of("clip", CELL):
        found.setdefault(m.operator, set()).add((m.before, m.after))
    return found


def test_every_operator_the_tool_promises():
    got = _changes()
    assert ("if lo > hi:", "if lo >= hi:") in got["compare"]
    assert ("return total if x == 3 and not flag else None",
            "return total if x != 3 and not flag else None") in got["compare"]
    assert ("y = torch.sort(x, dim=dim, descending=True).values[:, :k + 1]",
            "y = torch.sort(x, dim=dim, descending=False).values[:, :k + 1]") in got["keyword"]
    assert ("y = torch.sort(x, dim=dim, descending=True).values[:, :k + 1]",
            "y = torch.sort(x, dim=dim).values[:, :k + 1]") in got["keyword"]
    assert ("total = (y * 2 - lo) / hi", "total = (y * 3 - lo) / hi") in got["number"]
    assert ("total = (y * 2 - lo) / hi", "total = (y / 2 - lo) / hi") in got["binop"]
    assert ("total = (y * 2 - lo) / hi", "total = (y * 2 + lo) / hi") in got["binop"]
    assert ("total += i", "total -= i") in got["augassign"]
    assert ("y = torch.sort(x, dim=dim, descending=True).values[:, :k + 1]",
            "y = torch.sort(x, dim=dim, descending=True).values[:, :(k + 1) - 1]") in got["slice"]
    assert ("for i in range(n):", "for i in range(n + 1):") in got["range"]
    assert ("return total if x == 3 and not flag else None",
            "return total if x == 3 or not flag else None") in got["boolop"]
    assert ("return total if x == 3 and not flag else None",
            "return total if x == 3 and flag else None") in got["not"]
    assert ('raise ValueError(f"lo must be <= hi, got {lo} > {hi}")', "pass") in got["raise"]
    assert ("if lo > hi:", "if False:") in got["guard"]


def test_only_the_solution_part_is_mutated_and_every_mutant_compiles():
    found = mutants_of("clip", CELL)
    assert len({m.code for m in found}) == len(found)
    for m in found:
        ast.parse(m.code)
        assert m.code != CELL
        assert m.code.split("### BEGIN SOLUTION")[0] == CELL.split("### BEGIN SOLUTION")[0]
        assert m.code.split("### END SOLUTION")[1] == CELL.split("### END SOLUTION")[1]
        assert "lo must be <= hi, got {lo} > {hi}" in m.code or m.operator == "raise"


def test_diff_shows_the_changed_line():
    m = next(m for m in mutants_of("clip", CELL) if m.after == "if lo >= hi:")
    diff = m.diff(CELL)
    assert "-    if lo > hi:" in diff and "+    if lo >= hi:" in diff
    assert m.key == "clip: if lo > hi: => if lo >= hi:"


@pytest.mark.parametrize("day", DAYS)
def test_allow_list_entries_match_current_mutants_and_give_a_reason(day):
    allowed = mistakes.equivalent_mutants(day)
    keys = {m.key for m in day_mutants(day)}
    stale = sorted(set(allowed) - keys)
    assert not stale, (f"{day}: EQUIVALENT_MUTANTS entries that match no mutant of the solution "
                       f"(the code changed; remove or update them): {stale}")
    unexplained = [k for k, reason in allowed.items() if len(reason.strip()) < 10]
    assert not unexplained, f"{day}: equivalent mutants need a one-line reason: {unexplained}"


@pytest.mark.parametrize("day", DAYS)
def test_sample_is_fixed_and_skips_equivalent_mutants(day):
    first, again = sample(day), sample(day)
    assert [m.key for m in first] == [m.key for m in again]
    assert len(first) <= SAMPLE_PER_DAY
    allowed = mistakes.equivalent_mutants(day)
    assert not [m.key for m in first if m.key in allowed]


@pytest.mark.slow
def test_run_day_kills_a_boundary_flip_and_reports_it():
    day = "day07_sampling"
    chosen = [m for m in day_mutants(day)
              if m.key == "top_p: keep_sorted = mass_before < p => keep_sorted = mass_before <= p"]
    assert len(chosen) == 1, "the nucleus boundary mutant is no longer generated"
    report = run_day(day, chosen)
    assert [r.killed for r in report.results] == [True], report.results
    text = format_report(report)
    assert "mutation score 100.0%" in text and "top_p" in text


def test_a_mutant_as_a_mistake_forgets_what_its_cell_defines():
    m = next(m for m in mutants_of("clip", CELL) if m.after == "if lo >= hi:")
    namespace = {"clip": "the solution's", "untouched": 1, "kept": 2}
    code = m.as_mistake().code
    exec(code.split("def clip")[0], namespace)  # the prelude only
    assert "clip" not in namespace and "untouched" not in namespace and namespace["kept"] == 2
    assert code.endswith(m.code)


def test_readme_mutation_table_matches_the_mutants_and_allow_lists():
    from autograder.settings import REPO_ROOT

    text = (REPO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (day\d\d_\w+) \| (\d+) \| (\d+) \|", text, re.M)
    assert rows, "README's mutation testing table is missing"
    for day, total, equivalent in rows:
        assert int(total) == len(day_mutants(day)), f"README: {day} mutant count is stale"
        assert int(equivalent) == len(mistakes.equivalent_mutants(day)), \
            f"README: {day} equivalent count is stale"
