"""Repository-wide pytest setup (tests/conftest.py holds the fixtures)."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (--dist loadgroup), keep each day's checks on one worker, so that
    the day's nbgrader run (the graded_days fixture) is done once. Runs before xdist reads the
    groups. (nbval's notebooks run in their own pytest call with --dist loadfile.)"""
    for item in items:
        if getattr(item, "callspec", None) is not None and "day" in item.callspec.params:
            item.add_marker(pytest.mark.xdist_group(item.callspec.params["day"]))
