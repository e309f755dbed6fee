"""Fixtures shared by the integration tests (helpers live in :mod:`swarm_harness`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from swarm_harness import Proc


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """``swarm`` processes the test appends here are stopped (by PID) at its end, last first."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()
