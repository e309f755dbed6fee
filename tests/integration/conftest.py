"""Fixtures shared by the integration tests (helpers live in :mod:`swarm_harness`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from swarm_harness import Proc


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """``swarm`` processes the test appends here are stopped (by PID) at its end, last first."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.fixture
def topology() -> Iterator[Any]:
    """An empty :class:`swarm.netns.Topology`, removed at the end of the test (even on failure);
    the test is skipped, with the reason, where network namespaces cannot be created."""
    from swarm.netns import Topology, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with Topology() as topo:
        yield topo
