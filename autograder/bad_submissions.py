"""The bad-submission corpus: what students hand in that must not break grading.

Every case is built from day 01's solution (or its student release) by a small, readable edit,
and states the status and score the grader must give it. tests/test_autograder_term.py grades
the whole corpus in one batch next to two control students, proving each case is handled and
that no case changes anybody else's grade.

    python -m autograder.bad_submissions OUT_FOLDER [--port PORT]

writes the corpus as OUT_FOLDER/<student>/day01_logits/ (the layout `collect` imports).

Day 01 has 13 points: softmax 2, log_softmax 2, temperature 2, cross_entropy 2,
perplexity 2, q1 1, q2 1, q3 1. Cases break `perplexity` or `cross_entropy`, which no other
graded cell depends on, so the expected scores follow by subtraction.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat

from autograder.notebooks import nbgrader_meta, release_path, solution_path
from autograder.settings import REPO_ROOT

DAY = "day01_logits"
FULL = 13.0


@dataclass(frozen=True)
class Case:
    student: str
    what: str
    status: str  # the status the grader must report
    score: float  # the score the grader must give
    build: Callable[[Path, dict], None]  # writes the submission into the folder


def _solution() -> nbformat.NotebookNode:
    return nbformat.read(str(solution_path(DAY)), as_version=4)


def _with_answer(grade_id: str, source: str) -> nbformat.NotebookNode:
    nb = _solution()
    cell = next(c for c in nb.cells if nbgrader_meta(c).get("grade_id") == grade_id)
    cell.source = source
    return nb


def _write(nb, folder: Path, name: str = f"{DAY}.ipynb") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / name))


def _answer_case(grade_id: str, source: str) -> Callable[[Path, dict], None]:
    return lambda folder, ctx: _write(_with_answer(grade_id, source.format(**ctx)), folder)


def _edited_test_cell(folder: Path, ctx: dict) -> None:
    nb = _with_answer("perplexity", "def perplexity(token_logprobs):\n    return 1.0\n")
    cell = next(c for c in nb.cells if nbgrader_meta(c).get("grade_id") == "perplexity_tests")
    cell.source = "assert True"
    _write(nb, folder)


def _deleted_test_cell(folder: Path, ctx: dict) -> None:
    nb = _with_answer("perplexity", "def perplexity(token_logprobs):\n    return 1.0\n")
    nb.cells = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") != "perplexity_tests"]
    _write(nb, folder)


def _stripped_metadata(folder: Path, ctx: dict) -> None:
    nb = _solution()
    for cell in nb.cells:
        cell.metadata = {}
    _write(nb, folder)


def _renamed(folder: Path, ctx: dict) -> None:
    _write(_solution(), folder, "my homework (final).ipynb")


def _corrupt(folder: Path, ctx: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(nbformat.writes(_solution()))[: 5000]
    (folder / f"{DAY}.ipynb").write_text(text[len(text) // 2:])


def _nothing(folder: Path, ctx: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("I will hand it in tomorrow\n")


def _full_marks(folder: Path, ctx: dict) -> None:
    _write(_solution(), folder)


def _unsolved(folder: Path, ctx: dict) -> None:
    _write(nbformat.read(str(release_path(DAY)), as_version=4), folder)


PERPLEXITY_OK = """
def perplexity(token_logprobs):
    lp = np.asarray(token_logprobs, dtype=np.float64)
    if (lp > 0).any():
        raise ValueError("token_logprobs must be log-probabilities (<= 0)")
    return float(np.exp(-lp.mean()))
"""

CASES = [
    Case("control-full", "a correct submission", "graded", FULL, _full_marks),
    Case("control-blank", "the unsolved release", "graded", 0.0, _unsolved),
    Case("infinite-loop", "an infinite loop in an answer", "timeout", FULL - 2, _answer_case(
        "perplexity", "def perplexity(token_logprobs):\n    while True:\n        pass\n")),
    Case("ignores-sigint", "an infinite loop that ignores SIGINT", "timeout", 8.0, _answer_case(
        "perplexity", "import signal\n\ndef perplexity(token_logprobs):\n"
                      "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "    while True:\n        pass\n")),
    Case("os-exit", "os._exit in an answer", "crashed", 6.0, _answer_case(
        "cross_entropy", "import os\n\ndef cross_entropy(logits, targets):\n    os._exit(3)\n")),
    Case("segfault", "a segmentation fault", "crashed", 6.0, _answer_case(
        "cross_entropy", "import ctypes\n\ndef cross_entropy(logits, targets):\n"
                         "    return ctypes.string_at(0)\n")),
    Case("memory-bomb", "allocates far more memory than allowed", "memory-limit", FULL - 2,
         _answer_case("perplexity", "def perplexity(token_logprobs):\n"
                                    "    hoard = [np.empty(2**27) for _ in range(4096)]  # 4 TiB\n"
                                    "    return len(hoard)\n")),
    Case("sys-exit", "sys.exit in an answer cell", "graded", FULL - 2, _answer_case(
        "perplexity", "import sys\nsys.exit(0)\n" + PERPLEXITY_OK)),
    Case("edited-test", "a wrong answer with its test cell edited to `assert True`", "graded",
         FULL - 2, _edited_test_cell),
    Case("deleted-test", "a wrong answer with its test cell deleted", "repaired", FULL - 2,
         _deleted_test_cell),
    Case("stripped-metadata", "correct answers pasted into a notebook without nbgrader "
                              "metadata", "repaired", FULL, _stripped_metadata),
    Case("renamed", "a correct notebook under another file name", "graded", FULL, _renamed),
    Case("corrupt-json", "a truncated, invalid JSON file", "invalid", 0.0, _corrupt),
    Case("nothing", "a folder without a notebook", "missing", 0.0, _nothing),
    Case("huge-output", "prints 100 MB", "graded", FULL, _answer_case(
        "perplexity", "print('x' * 100_000_000)\n" + PERPLEXITY_OK)),
    Case("stderr-warning", "correct, but warns on stderr on every call", "graded", FULL,
         _answer_case("perplexity", "import warnings\n" + PERPLEXITY_OK.replace(
             "    lp = ", "    warnings.warn('a harmless warning', UserWarning)\n    lp = "))),
    Case("reads-solutions", "tries to read solutions/", "blocked", FULL - 2, _answer_case(
        "perplexity", "SECRET = open({solutions!r}).read()\n" + PERPLEXITY_OK)),
    Case("reads-gradebook", "tries to read the gradebook", "blocked", FULL - 2, _answer_case(
        "perplexity", "SECRET = open({gradebook!r}, 'rb').read()\n" + PERPLEXITY_OK)),
    Case("network", "opens a network connection", "blocked", FULL - 2, _answer_case(
        "perplexity", "import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                      "timeout=3).sendall(b'stolen answers')\n" + PERPLEXITY_OK)),
    Case("writes-outside", "writes into the tinygpt package", "blocked", FULL - 2, _answer_case(
        "perplexity", "open({package!r}, 'w').write('hacked = True')\n" + PERPLEXITY_OK)),
]


def build(out: Path, root: Path = REPO_ROOT, port: int = 9) -> list[Case]:
    """Write every case to out/<student>/day01_logits/; returns the cases."""
    ctx = {"solutions": str(root / "solutions" / DAY / f"{DAY}.ipynb"),
           "gradebook": str(root / "gradebook.db"), "port": port,
           "package": str(REPO_ROOT / "tinygpt" / "hacked.py")}
    for case in CASES:
        case.build(out / case.student / DAY, copy.deepcopy(ctx))
    return CASES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.bad_submissions")
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=9, help="loopback port the network case "
                                                            "tries (nothing should reach it)")
    args = parser.parse_args(argv)
    for case in build(args.out, port=args.port):
        print(f"{case.student:<18} expect {case.status:<12} {case.score:>4g}  {case.what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
