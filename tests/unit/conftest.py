"""The unit tier under pytest-xdist (``./dev test`` runs it with ``-n 2 --dist loadgroup``).

``loadgroup`` hands out single tests, so the two workers stay evenly loaded to the end, except
tests marked ``xdist_group``, which one worker runs together. A module-, class- or
session-scoped fixture of the test tree (a model built once, a simulation run once for several
tests) would be built again on each worker that runs a test of that module, so every test that
uses one is put in its module's group: such a fixture is built once, as in a serial run. Without
xdist (``-n 0``, a chosen test, no plugin) the mark is inert.
"""

from __future__ import annotations

import pytest


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture of the test tree wider than one test (a plugin's
    session-wide fixtures, e.g. pytest-asyncio's, are per process anyway)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        fixturedef.scope != "function" and fixturedef.baseid.startswith("tests/")
        for fixturedefs in info.name2fixturedefs.values()
        for fixturedef in fixturedefs
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
