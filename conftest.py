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

nbval runs a notebook's cells as they are; collection then appends one cell of our own to each
notebook, which moves every widget the notebook drew to the ends of its controls in the same
kernel (tests/widget_probe.py says how and why).
"""

from __future__ import annotations

import re
from pathlib import Path

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


WIDGET_PROBE = Path(__file__).parent / "tests" / "widget_probe.py"
# how a notebook cell builds a widget with a function behind it (what the probe moves)
_WIDGET_CALL = re.compile(r"\binteract(?:ive_output)?\(")


def widget_probe_cell(parent):
    """An nbval item that runs tests/widget_probe.py after the notebook `parent`'s cells."""
    from collections import defaultdict

    import nbformat
    from nbval.plugin import IPyNbCell

    expected = sum(len(_WIDGET_CALL.findall(cell.source)) for cell in parent.nb.cells
                   if cell.cell_type == "code")
    source = (f"_probe = {{}}\nexec(compile(open({str(WIDGET_PROBE)!r}).read(), "
              f"{WIDGET_PROBE.name!r}, 'exec'), _probe)\n"
              f"_probe['probe_widgets'](expected={expected})\n")
    cells = sum(1 for cell in parent.nb.cells if cell.cell_type == "code")
    options = defaultdict(bool, check=False)
    return IPyNbCell.from_parent(parent, name="widget probe", cell_num=cells,
                                 cell=nbformat.v4.new_code_cell(source), options=options)


def pytest_collection_modifyitems(config, items):
    """The slow tests first, each group in its collection order (see the module docstring);
    a widget probe after each notebook's last cell."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    last_cell = {}
    for index, item in enumerate(items):
        if type(item).__name__ == "IPyNbCell":
            last_cell[item.parent] = index
    for parent, index in sorted(last_cell.items(), key=lambda pair: -pair[1]):
        items.insert(index + 1, widget_probe_cell(parent))
