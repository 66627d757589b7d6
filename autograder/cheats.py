"""The cheating corpus: submissions that fake their grade, and what our grader must make of them.

Every case scores full marks in nbgrader's own autograde (tests/test_integrity.py shows it, so
the corpus stays honest: a case that stock nbgrader already catches proves nothing). Under
`python -m autograder grade` each case must end with the stated status, score and evidence:

- prevented: the integrity guard restores what the cheat changed before the test cell runs,
  so the wrong answer loses its points (FULL - 2), and the submission is `flagged`;
- flagged: the cheat cannot be undone from outside (the student's own objects or output), so
  the points stand, but the submission is `flagged` with the evidence, for manual review.

    python -m autograder.cheats OUT_FOLDER

writes the corpus as OUT_FOLDER/<student>/<day>/ (the layout `collect` imports). Most cases
are day 01 (13 points; a cheat covers a wrong `perplexity`, worth 2); the comparison-override
case is day 02, whose pair-count tests compare dictionaries with ==.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat

from autograder.bad_submissions import PERPLEXITY_OK as CORRECT_PERPLEXITY
from autograder.notebooks import nbgrader_meta, solution_path

DAY = "day01_logits"
FULL = 13.0

# Checks its input like the right answer, but takes the mean log-probability as if it were in
# bits (2 ** x instead of e ** x): only the value checks fail.
WRONG_PERPLEXITY = """
def perplexity(token_logprobs):
    lp = np.asarray(token_logprobs, dtype=np.float64)
    if (lp > 0).any():
        raise ValueError("token_logprobs must be log-probabilities (<= 0)")
    return float(2.0 ** (-lp.mean()))
"""



@dataclass(frozen=True)
class Cheat:
    student: str
    day: str
    what: str
    outcome: str          # "prevented" or "flagged"
    score: float          # the score our grader must give
    full: float           # the day's maximum (what stock nbgrader gives)
    evidence: tuple[str, ...]   # evidence kinds that must be reported
    build: Callable[[Path], None]


def _solution(day: str = DAY) -> nbformat.NotebookNode:
    return nbformat.read(str(solution_path(day)), as_version=4)


def _cell(nb, grade_id: str):
    return next(c for c in nb.cells if nbgrader_meta(c).get("grade_id") == grade_id)


def _write(nb, folder: Path, day: str = DAY) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / f"{day}.ipynb"))


def _answer(source: str, grade_id: str = "perplexity") -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        nb = _solution()
        _cell(nb, grade_id).source = source
        _write(nb, folder)
    return build


def _extra_cell_before_test(answer: str, extra: str) -> Callable[[Path], None]:
    """The perplexity answer, then a cell of the student's own between it and its test."""
    def build(folder: Path) -> None:
        nb = _solution()
        cell = _cell(nb, "perplexity")
        cell.source = answer
        position = nb.cells.index(cell) + 1
        nb.cells.insert(position, nbformat.v4.new_code_cell(extra))
        _write(nb, folder)
    return build


def _always_equal_pair_counts(folder: Path) -> None:
    """Day 02: pair counts that miss the last pair, hidden behind an __eq__ that says yes to
    anything; the submission's train_bpe counts pairs its own (correct) way, so only the
    pair-count tests are at stake."""
    day = "day02_tokenizer"
    nb = _solution(day)
    _cell(nb, "get_pair_counts").source = '''
class Counts(dict):
    def __eq__(self, other):
        return True

def get_pair_counts(ids):
    counts = Counts()
    for pair in zip(ids, ids[1:-1]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts

def _pairs(ids):
    counts = {}
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts
'''
    train = _cell(nb, "train_bpe")
    assert "get_pair_counts(" in train.source
    train.source = train.source.replace("get_pair_counts(", "_pairs(")
    _write(nb, folder, day)


CHEATS = [
    Cheat("rebinds-checks", DAY, "a wrong answer, and check_close / check_true redefined to "
          "do nothing", "prevented", FULL - 2, FULL, ("patched-checks",),
          _answer(WRONG_PERPLEXITY + "\ndef check_close(*args, **kwargs):\n    return None\n"
                  "\ncheck_true = check_close\n")),
    Cheat("patches-testing", DAY, "a wrong answer, and tinygpt.testing's failure helper "
          "patched to return", "prevented", FULL - 2, FULL, ("patched-module",),
          _answer(WRONG_PERPLEXITY + "\nimport tinygpt.testing\n"
                  "tinygpt.testing._fail = lambda message, hint: None\n")),
    Cheat("input-transformer", DAY, "a wrong answer, and an IPython input transformer that "
          "blanks its test cell", "prevented", FULL - 2, FULL, ("ipython-hooks",),
          _answer(WRONG_PERPLEXITY + '''
def _blank(lines):
    text = "".join(lines)
    return ["pass\\n"] if "perplexity(" in text and "check_close" in text else lines

get_ipython().input_transformers_cleanup.append(_blank)
''')),
    Cheat("pre-run-hook", DAY, "a wrong answer, and a pre_run_cell hook that swaps in "
          "tinygpt's finished perplexity before every cell", "prevented", FULL - 2, FULL,
          ("ipython-hooks",), _answer(WRONG_PERPLEXITY + '''
def _swap(info):
    import tinygpt.numerics
    get_ipython().user_ns["perplexity"] = tinygpt.numerics.perplexity

get_ipython().events.register("pre_run_cell", _swap)
''')),
    Cheat("shadows-allclose", DAY, "a wrong answer, and numpy.allclose replaced by a function "
          "that always says yes", "prevented", FULL - 2, FULL, ("patched-module",),
          _answer(WRONG_PERPLEXITY + "\nnp.allclose = lambda *args, **kwargs: True\n")),
    Cheat("swallows-errors", DAY, "a wrong answer, and an IPython AST transformer that wraps "
          "every later cell in try/except, so a failing check leaves no error", "prevented",
          FULL - 2, FULL, ("ipython-hooks",), _answer(WRONG_PERPLEXITY + '''
import ast

class _Forgive(ast.NodeTransformer):
    def visit_Module(self, node):
        handler = ast.ExceptHandler(type=ast.Name("Exception", ast.Load()), name=None,
                                    body=[ast.Pass()])
        node.body = [ast.Try(body=node.body or [ast.Pass()], handlers=[handler], orelse=[],
                             finalbody=[])]
        return ast.fix_missing_locations(node)

get_ipython().ast_transformers.append(_Forgive())
''')),
    Cheat("reference-copy", DAY, "a wrong answer, then a cell of its own that imports "
          "tinygpt's finished perplexity under the same name", "flagged", FULL, FULL,
          ("reference-copy",),
          _extra_cell_before_test(WRONG_PERPLEXITY, "from tinygpt.numerics import perplexity\n")),
    Cheat("always-equal", "day02_tokenizer", "a wrong pair count returned as a dict whose "
          "__eq__ is always True", "flagged", 19.0, 19.0, ("comparison-override",),
          _always_equal_pair_counts),
    Cheat("swaps-guard", DAY, "a wrong answer, numpy.allclose patched, and the grader's guard "
          "replaced in sys.modules by one that reports nothing", "flagged", FULL, FULL,
          ("guard-blocked", "patched-module"), _answer(WRONG_PERPLEXITY + '''
import json, sys, types
_m = sys.modules
_g = _m.get("_tinygpt" + "_guard")
if _g is not None:
    _m.update({"_tinygpt" + "_guard": types.SimpleNamespace(
        check=lambda *a: json.dumps({"evidence": []}))})
np.allclose = lambda *args, **kwargs: True
''')),
    Cheat("reads-history", DAY, "correct answers, but the code prints the kernel's input "
          "history (earlier hidden tests) into the output", "flagged", FULL, FULL,
          ("reads-tests",), _answer(CORRECT_PERPLEXITY + '''
for _source in list(_ih):
    print(_source[:200])
''')),
    Cheat("reads-notebook", DAY, "correct answers, but the code opens notebook files to look "
          "for the tests", "flagged", FULL, FULL, ("reads-tests",),
          _answer(CORRECT_PERPLEXITY + '''
import glob
for _name in glob.glob("**/*.ipynb", recursive=True):
    print(open(_name).read()[:200])
''')),
]


def build(out: Path) -> list[Cheat]:
    """Write every case to out/<student>/<day>/; returns the cases."""
    for cheat in CHEATS:
        cheat.build(out / cheat.student / cheat.day)
    return CHEATS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.cheats")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    for cheat in build(args.out):
        print(f"{cheat.student:<18} {cheat.day:<16} expect {cheat.outcome:<9} "
              f"{cheat.score:>4g}/{cheat.full:g}  {cheat.what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
