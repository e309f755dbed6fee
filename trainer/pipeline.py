"""The learner's plumbing, kept off its critical path (docs/trainer.md, "The loop's plumbing").

* :class:`RolloutFeed` — fetches rollouts for the learner. In the background mode (the
  default, ``overlap = true``) a task keeps fetching into a bounded buffer while the learner
  trains, so the next batch is usually there when a step ends; otherwise it fetches on demand.
  Either way it drops rollouts already too stale to train on and tells the
  :class:`~trainer.metrics.IdleClock` why the learner waited: the coordinator had no more
  rollouts (``rollouts``), the rollouts it had were too stale (``stale``), or they were there and
  the fetch itself took the time (``fetch``).
* :class:`PublicationSlot` — at most one publication (serialise, hash, sign, seed) in flight in
  the background; the loop collects its outcome at a step boundary, and a publication that falls
  due while the previous one is still in flight waits for the next boundary after it landed (the
  learner does not block on it).

While the learner is blocked on an empty feed it says so: ``on_wanting(n)`` with the rollouts it
still needs for its batch (0 once it has some again). The coordinator's source sends that with
every fetch (``rollouts_wanted``), and the coordinator's lease backlog bound lets a node generate
while the learner starves instead of standing it by (docs/capacity.md, "The backlog bound").

Fetches pass the learner's version − S as ``min_version``, so a stale backlog is skipped by the
source (the coordinator's query) instead of travelling; the skipped ones (gaps in the dense
``seq``) count as dropped. A fetch is classified by what came back: fewer rollouts than asked
means the coordinator's queue of admissible rollouts ran dry (the long poll waited for new ones),
so the wait was for the swarm; a full page means rollouts were queued and the time went into the
fetch; a page of only stale rollouts is a stale backlog being skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from swarm.tasks import cancel_and_wait
from trainer.batch import Rollout
from trainer.metrics import IdleClock
from trainer.sources import RolloutSource

log = logging.getLogger(__name__)

#: How long :meth:`RolloutFeed.stop` waits for the background fetch to end (seconds); a fetch
#: still running then is logged and left (the run ends without it)
STOP_TIMEOUT_S = 10.0


class RolloutFeed:
    """Rollouts for the learner, fetched in the background or on demand (module docstring)."""

    def __init__(
        self,
        source: RolloutSource,
        *,
        after: int,
        page: int,
        capacity: int,
        admissible: Callable[[Rollout], bool],
        idle: IdleClock,
        background: bool = True,
        min_version: Callable[[], int | None] | None = None,
        trace: bool = False,
        on_wanting: Callable[[int], None] | None = None,
    ) -> None:
        if page < 1 or capacity < page:
            raise ValueError(f"RolloutFeed: need 1 <= page ({page}) <= capacity ({capacity})")
        self.source = source
        self.page = page
        self.capacity = capacity
        self.admissible = admissible
        self.min_version = min_version
        self.idle = idle
        self.background = background
        #: told the rollouts the learner waits for while it is blocked on an empty feed, then 0
        self.on_wanting = on_wanting
        #: highest seq fetched from the source (the next fetch asks for seq > cursor)
        self.cursor = after
        #: rollouts dropped here as too stale, not yet reported (see :meth:`take_dropped`)
        self._dropped = 0
        self._buffer: list[Rollout] = []
        self._arrived = asyncio.Event()
        self._space = asyncio.Event()
        self._finished = False
        self._interrupted = False
        self._error: BaseException | None = None
        self._cause = "rollouts"
        self._task: asyncio.Task[None] | None = None
        self.fetches = 0
        #: with ``trace`` (a dict): Unix time each admissible rollout arrived here, by seq (the
        #: learner pops what it trains; see ``TrainerConfig.trace_rollouts``)
        self.fetched_at: dict[int, float] | None = {} if trace else None

    # --- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.background and self._task is None:
            self._task = asyncio.create_task(self._fetch_loop(), name="trainer-rollout-feed")

    async def stop(self) -> None:
        """Cancel the background fetch and wait (bounded) for it to end. One cancel is not
        enough: in Python 3.11 ``asyncio.wait_for`` swallows a cancellation that races with its
        inner call completing (the transport's reads use it), the fetch then returns as if
        answered and the loop long-polls again; a plain ``await task`` waited on it for ever and
        a trainer that had made its ``max_steps`` never exited (test_real_tokenizer_swarm, about
        1 run in 4). :func:`swarm.tasks.cancel_and_wait` repeats the cancel until it lands."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task], timeout=STOP_TIMEOUT_S)

    # --- the learner's side ----------------------------------------------------------------------
    async def take(self, want: int, timeout: float) -> list[Rollout] | None:
        """Rollouts for the learner (up to ``want`` when fetching on demand, everything buffered in
        the background mode); waits up to ``timeout`` seconds for some to arrive and returns
        ``[]`` if none did, ``None`` once the source has ended and nothing is left."""
        if not self.background:
            t0 = time.monotonic()
            self._wanting(want)  # blocked on this fetch: it carries the figure
            try:
                got = await asyncio.wait_for(self._fetch_once(max(1, want)), timeout)
            except TimeoutError:
                got, self._cause = [], "rollouts"
            finally:
                self._wanting(0)
            self.idle.add_wait(time.monotonic() - t0, self._cause)
            if got is None:
                return None
            out, self._buffer = self._buffer, []
            return out
        self._raise_failure()
        if self._buffer:
            return self._hand_over()
        self._wanting(want)  # blocked: the fetches sent meanwhile say so
        try:
            return await self._wait_for_arrivals(timeout)
        finally:
            self._wanting(0)

    def _hand_over(self) -> list[Rollout]:
        out, self._buffer = self._buffer, []
        self._space.set()
        return out

    async def _wait_for_arrivals(self, timeout: float) -> list[Rollout] | None:
        mark = time.monotonic()
        deadline = mark + timeout
        while not self._buffer and not self._finished and not self._interrupted:
            self._arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
            now = time.monotonic()
            self.idle.add_wait(now - mark, self._cause)  # the fetch that woke us says why
            mark = now
            self._raise_failure()
        if not self._buffer:
            self.idle.add_wait(time.monotonic() - mark, self._cause)
            return None if self._finished else []
        return self._hand_over()

    def _wanting(self, n: int) -> None:
        if self.on_wanting is not None:
            self.on_wanting(max(0, n))

    def interrupt(self) -> None:
        """End the learner's current and later waits at once (the learner is stopping)."""
        self._interrupted = True
        self._arrived.set()

    def take_dropped(self) -> int:
        """Rollouts dropped as too stale since the last call."""
        n, self._dropped = self._dropped, 0
        return n

    # --- fetching --------------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        try:
            while True:
                while len(self._buffer) >= self.capacity:
                    self._space.clear()
                    await self._space.wait()
                if await self._fetch_once(self.page) is None:
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the learner at its next take()
            self._error = exc
        finally:
            self._finished = True
            self._arrived.set()

    async def _fetch_once(self, want: int) -> list[Rollout] | None:
        """One fetch from the source into the buffer; classifies it (module docstring)."""
        low = self.min_version() if self.min_version is not None else None
        items = await self.source.fetch(want, after=self.cursor, min_version=low)
        self.fetches += 1
        if items is None:
            self._finished = True
            return None
        fresh = []
        now = time.time()
        for r in items:
            if low is not None and r.seq > self.cursor + 1:
                # seqs are dense: the source skipped the ones in between as too stale
                self._dropped += r.seq - self.cursor - 1
            self.cursor = max(self.cursor, r.seq)
            if self.admissible(r):
                fresh.append(r)
                if self.fetched_at is not None:
                    self.fetched_at[r.seq] = now
            else:
                self._dropped += 1
        if len(items) < want:
            self._cause = "rollouts"
        elif not fresh:
            self._cause = "stale"
        else:
            self._cause = "fetch"
        self._buffer.extend(fresh)
        self._arrived.set()
        return fresh

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _observed(task: asyncio.Task[Any]) -> None:
    """Mark a publication's failure as seen: :meth:`PublicationSlot.collect` re-raises it, but a
    run cut short after the stop grace never collects, and asyncio would then print "Task
    exception was never retrieved" with a traceback when the task is freed."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("publication ended with %r", task.exception())


class PublicationSlot:
    """At most one publication in flight in the background (module docstring)."""

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        #: version being published, None when the slot is free
        self.version: int | None = None
        self.started_at = 0.0
        #: seconds the last finished publication took (weights copied -> publisher returned)
        self.last_s: float | None = None
        #: publications that fell due while the slot was busy (deferred to a later boundary)
        self.deferred = 0

    @property
    def busy(self) -> bool:
        return self._task is not None

    def defer(self) -> int:
        """Count a publication that fell due while this one is in flight; returns the count."""
        self.deferred += 1
        return self.deferred

    def start(self, version: int, work: Awaitable[Any]) -> None:
        if self._task is not None:
            raise RuntimeError(f"a publication (v{self.version}) is already in flight")
        self.version = version
        self.started_at = time.monotonic()
        self._task = asyncio.ensure_future(work)
        self._task.add_done_callback(_observed)

    def collect(self) -> int | None:
        """The version whose publication finished since the last call (None if none or still
        running); re-raises its failure."""
        task = self._task
        if task is None or not task.done():
            return None
        version = self.version
        self._task, self.version = None, None
        self.last_s = time.monotonic() - self.started_at
        task.result()
        return version

    async def wait_done(self) -> None:
        """Until the publication in flight (if any) has finished; :meth:`collect` takes it."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def wait(self) -> int | None:
        """Until the publication in flight (if any) has finished; then as :meth:`collect`."""
        await self.wait_done()
        return self.collect()
