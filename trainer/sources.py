"""Where the learner's rollouts come from and where its versions go.

* :class:`RolloutSource` — the learner's input: verified rollouts past a cursor (``seq``), with
  a floor on their policy version. ``swarm trainer run`` uses the coordinator client
  (:class:`trainer.swarm_client.CoordinatorSource`); :class:`InProcessSource` is fed by hand.
* :class:`Publisher` — receives each published version. ``swarm trainer run`` uses
  :class:`trainer.swarm_client.SwarmPublisher`; :class:`MemoryPublisher` keeps them in memory. A
  publisher that already holds a version at least as new refuses with :class:`VersionNotNewer`, and
  :class:`~trainer.recipe.Trainer` renumbers past it (see :mod:`trainer.recipe`).

The in-process pair serves tests, benchmarks and single-process demos.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from torch import Tensor

from trainer.batch import Rollout


class RolloutSource(Protocol):
    """Where verified rollouts come from (the coordinator client, or :class:`InProcessSource`)."""

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Rollout] | None:
        """Up to ``max_items`` rollouts with ``seq > after`` and, with ``min_version``, a policy
        version of at least that (older ones are skipped; may wait; ``[]`` when none arrived in
        the source's own wait time); ``None`` when the source is finished for good."""
        ...


class VersionNotNewer(ValueError):
    """A publisher refused ``version``: the swarm already has ``latest`` >= it."""

    def __init__(self, version: int, latest: int) -> None:
        super().__init__(f"version {version} is not newer than {latest}, the latest published")
        self.version = version
        self.latest = latest


class Publisher(Protocol):
    """Receives each published version (the coordinator's checkpoint seeder, or a test double).
    Raises :class:`VersionNotNewer` when it already holds a version >= ``version``."""

    async def publish(self, version: int, state_dict: Mapping[str, Tensor]) -> None: ...


class InProcessSource:
    """A :class:`RolloutSource` fed by :meth:`put` (tests, benchmarks, single-process demos)."""

    def __init__(self, wait_s: float = 1.0) -> None:
        self._items: list[Rollout] = []
        self._event = asyncio.Event()
        self._closed = False
        self._wait_s = wait_s
        self._next_seq = 1

    def put(self, rollouts: Sequence[Rollout]) -> None:
        """Append rollouts; a rollout without a cursor (``seq == 0``) gets the next one."""
        for r in rollouts:
            if r.seq == 0:
                r = dataclasses.replace(r, seq=self._next_seq)
            self._next_seq = max(self._next_seq, r.seq + 1)
            self._items.append(r)
        self._event.set()

    def close(self) -> None:
        self._closed = True
        self._event.set()

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Rollout] | None:
        def ready() -> list[Rollout]:
            low = -1 if min_version is None else min_version
            return [r for r in self._items if r.seq > after and r.policy_version >= low]

        found = ready()
        if not found and not self._closed:
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), timeout=self._wait_s)
            except TimeoutError:
                return []
            found = ready()
        if not found and self._closed:
            return None
        return found[:max_items]


class MemoryPublisher:
    """A :class:`Publisher` that keeps every published state dict (tests, benchmarks)."""

    def __init__(self) -> None:
        self.versions: dict[int, dict[str, Tensor]] = {}

    async def publish(self, version: int, state_dict: Mapping[str, Tensor]) -> None:
        if self.versions and version <= max(self.versions):
            raise VersionNotNewer(version, max(self.versions))
        self.versions[version] = dict(state_dict)
