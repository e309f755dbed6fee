"""The coordinator service's periodic chores: the tick and the DHT records.

:class:`Upkeep` runs one task: every ``tick_s`` the ``tick`` callable (the core's expiries and
re-planning, then the /status snapshot), every ``RECORD_TTL_S / 3`` the ``publish_records``
coroutine (the coordinator's address and latest version in the DHT), and at once after
:meth:`Upkeep.records_soon` (a publication).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from swarm.tasks import cancel_and_wait

log = logging.getLogger(__name__)

TICK_S = 1.0
RECORD_TTL_S = 60.0


class Upkeep:
    """The tick and the DHT records, in one named task (see the module docstring)."""

    def __init__(
        self,
        *,
        tick: Callable[[], None],
        publish_records: Callable[[], Awaitable[None]],
        tick_s: float = TICK_S,
        records_every_s: float = RECORD_TTL_S / 3,
    ) -> None:
        self._tick = tick
        self._publish_records = publish_records
        self._tick_s = tick_s
        self._records_every_s = records_every_s
        self._records_soon = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def records_soon(self) -> None:
        """Refresh the DHT records now (a version was published), not at the next period."""
        self._records_soon.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="coordinator-upkeep")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def run(self) -> None:
        """Every tick_s: ``tick``; the DHT records every records_every_s, and at once after a
        publication (:meth:`records_soon`). A publication does not move the tick: the figures it
        reads are per-lease averages with a short memory, and read right after every publication
        (versions come more often than once a second in the demos) they saw only the leases of
        mid-period, never the slower ones just after a version switch — the 1-node S = 4 plan
        over-stated the node by ~10 % (docs/capacity.md)."""
        last_records = 0.0
        next_tick = time.monotonic()
        while True:
            # Each chore in its own try: one failing must not starve the others.
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick_s
                try:
                    self._tick()
                except Exception:  # upkeep must survive a bad tick; the error is logged in full
                    log.exception("coordinator upkeep failed; retrying next tick")
            if self._records_soon.is_set() or time.time() - last_records > self._records_every_s:
                self._records_soon.clear()
                try:
                    await self._publish_records()
                    last_records = time.time()
                except Exception as exc:  # DHT hiccup: retried on the next tick
                    log.warning("could not refresh DHT records: %s", exc)
            with contextlib.suppress(TimeoutError):
                wait = max(0.0, next_tick - time.monotonic())
                await asyncio.wait_for(self._records_soon.wait(), wait)
