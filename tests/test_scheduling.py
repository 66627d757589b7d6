"""How `make test` shares the tests between its two xdist workers (the root conftest.py): each
day's checks on one worker (the day's nbgrader run happens once), every other module's tests
together (its fixtures start once)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    """The repository's conftest.py (`import conftest` finds tests/conftest.py first)."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scope_of = _root_conftest().scope_of


def test_a_day_parameter_names_the_scope_else_the_module():
    assert scope_of("tests/test_grading_proofs.py::test_solution_scores_full_marks"
                    "[day03_positions]") == "day03_positions"
    assert scope_of("tests/test_browser.py::test_widget[day07_sampling-slider]") == "day07_sampling"
    assert scope_of("tests/test_x.py::test_y[3-day12_bench]") == "day12_bench"
    assert scope_of("tests/test_real_model.py::test_logits_and_greedy_tokens_equal_transformers") \
        == "tests/test_real_model.py"
    assert scope_of("tests/test_quant.py::test_q[int8-day]") == "tests/test_quant.py"
    assert scope_of("tests/test_quant.py::TestQ::test_q[x]") == "tests/test_quant.py"


WORKER_LOG = """
import os, pytest

@pytest.fixture(autouse=True)
def _record(request):
    with open(os.environ["WHERE_LOG"], "a") as f:
        f.write(f"{request.node.nodeid} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""

SOME_TESTS = """
import pytest

@pytest.mark.parametrize("day", ["day01_logits", "day02_tokenizer", "day03_positions"])
@pytest.mark.parametrize("n", range(4))
def test_{name}(day, n):
    pass

@pytest.mark.parametrize("n", range(6))
def test_plain_{name}(n):
    pass
"""

A_SLOW_TEST = """

@pytest.mark.slow
def test_long():
    pass
"""


def test_two_workers_keep_each_day_and_each_module_together_slow_tests_first(tmp_path):
    """The real xdist run as `make test` starts it, with this repository's conftest.py: the
    grouping depends on how pytest and xdist name tests, which changed under it once (see
    conftest.py)."""
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text() + WORKER_LOG)
    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text(SOME_TESTS.replace("{name}", name)
                                                  + (A_SLOW_TEST if name == "c" else ""))
    log = tmp_path / "where.log"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "xdist", "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder",
                          "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "WHERE_LOG": str(log),
                              "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})   # xdist alone: quicker
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = log.read_text().splitlines()
    long_on = next(line.rsplit(" ", 1)[1] for line in lines if "::test_long " in line)
    first = next(line for line in lines if line.endswith(" " + long_on))
    assert "::test_long " in first, f"the slow test did not go first: {lines}"
    workers: dict[str, set[str]] = {}
    for line in lines:
        nodeid, worker = line.rsplit(" ", 1)
        workers.setdefault(scope_of(nodeid), set()).add(worker)
    assert set(workers) == {"day01_logits", "day02_tokenizer", "day03_positions",
                            "test_a.py", "test_b.py", "test_c.py"}, workers
    split = {scope: sorted(w) for scope, w in workers.items() if len(w) > 1}
    assert not split, f"scopes run on both workers: {split}"
    assert set().union(*workers.values()) == {"gw0", "gw1"}, "one worker did everything"
