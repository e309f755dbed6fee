"""Bounded storage: accepted rollouts the learner has consumed leave the hot database.

A 2,048-token rollout is ~16 KB in the ``rollouts`` table (token ids and log-probs); at the
10,000-node scenario's ~500 rollouts/s that is ~30 GB an hour into one SQLite file, every row kept
forever although the learner reads each once. :class:`Retention` deletes a rollout once both hold:

* the learner has consumed it: its ``seq`` is at or below the cursor of the learner's last report
  (``meta.learner_cursor``, the one the ``consumed`` receipts name) — it was trained on or dropped
  as stale, and a banned node's withdrawal (:mod:`coordinator.submissions`) no longer needs it;
* it is older than the audit window (``retention_s`` after its acceptance): ``swarm audit
  --receipt SEQ`` can show its stored row until then.

What an audit needs afterwards stays in the receipt log (:mod:`coordinator.receipts`: the
verdict entry with lease, node, version, checks and figures, the ``seq`` range it stored, and the
``consumed`` entry of the learner step), which is not pruned here. ``rollouts_accepted`` keeps
counting the pruned rows (``meta.rollouts_pruned``), so ``/status`` and the queue depth do not
move. Deletion runs on the upkeep tick, at most every ``interval_s`` and ``batch`` rows at a time,
so a backlog never holds the database for long; SQLite reuses the freed pages, so the file stops
growing once the window is full (``bench/storage.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.store import Store

#: Default audit window: consumed rollouts are kept this long after their acceptance (seconds;
#: the coordinator's ``rollout_retention_s``).
RETENTION_S = 86_400.0


class Retention:
    """Prunes consumed rollouts past the audit window (module docstring)."""

    def __init__(
        self,
        store: Store,
        clock: Callable[[], float],
        *,
        retention_s: float = RETENTION_S,
        interval_s: float = 10.0,
        batch: int = 20_000,
    ) -> None:
        if not retention_s >= 0 or not interval_s >= 0 or batch < 1:
            raise ValueError("Retention: retention_s and interval_s must be >= 0, batch >= 1")
        self.store = store
        self.clock = clock
        self.retention_s = retention_s
        self.interval_s = interval_s
        self.batch = batch
        self._last = -float("inf")
        self.pruned = 0  # rows deleted by this process

    def tick(self) -> int:
        """Prune once ``interval_s`` has passed since the last run; returns the rows deleted."""
        now = self.clock()
        if now - self._last < self.interval_s:
            return 0
        self._last = now
        return self.prune(now)

    def prune(self, now: float) -> int:
        """Delete up to ``batch`` consumed rollouts accepted before ``now − retention_s``."""
        cursor = int(self.store.get_meta("learner_cursor") or 0)
        if cursor <= 0:
            return 0
        gone = self.store.prune_rollouts(cursor, now - self.retention_s, self.batch)
        self.pruned += gone
        return gone
