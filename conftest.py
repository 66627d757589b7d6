"""Repository-wide pytest setup (tests/conftest.py holds the fixtures): how pytest-xdist shares
the tests between its workers in `make test` (`--dist loadscope`).

Each day's checks (every test with a day among its parameters, `[day07_sampling]`) go to one
worker, so that the day's nbgrader run (the graded_days fixture) is done once; every other test
goes with its module, so that a module's fixtures (a server, the SmolLM2 model, a trained
checkpoint) start once. The long units go first: collection puts the `slow` tests (notebooks,
nbgrader, the bench smoke run: minutes each) ahead of the rest, and `make test` passes
--no-loadscope-reorder so that the workers take the units in that order (xdist's default
order, by number of tests, queues single long tests, up to 300 s each, last, where one keeps a
worker busy while the other idles).

xdist's own `--dist loadgroup` would do the grouping through `xdist_group` marks, but
pytest-xdist 3.8 marks a group by rewriting `item._nodeid`, which pytest 9.2 no longer reads (a
node id is `item._id`): every test became its own group, and each day's notebooks were graded
on both workers. The scheduler below groups by the node ids the workers report, which are
public. (nbval's notebooks run in their own pytest call with --dist loadfile.)
"""

from __future__ import annotations

import re

# a day's name among a test's parameters: "...::test_x[day07_sampling]", "[day03_positions-2]"
_DAY_PARAM = re.compile(r"\[(?:.*-)?(day\d\d_[a-z0-9_]+)(?:-.*)?\]$")


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its day, else its module (the file)."""
    found = _DAY_PARAM.search(nodeid)
    return found.group(1) if found else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DayOrModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return DayOrModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The slow tests first, each group in its collection order (see the module docstring)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
