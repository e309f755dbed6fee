"""What the dashboard draws over time: a bounded, in-memory history of the swarm and the learner.

Two series, both fed by :class:`~coordinator.status_board.StatusBoard`:

* **steps** -- one row per learner step, from the figures the trainer sends with each fetch
  (:meth:`StatusHistory.record_trainer`; a step reported twice is kept once): every finite number
  of the report (reward, exact match, ESS, mismatch KL, idle fraction, ...), whatever its name, so
  a figure the trainer adds later is drawable without a change here. The staleness histograms of
  the steps are summed into one for the whole run.
* **ticks** -- one row per upkeep tick (1 s), from the status snapshot
  (:meth:`StatusHistory.record_tick`): accepted rollouts and the intake rate, rejections by reason
  (cumulative), the policy version and how many nodes hold each recent version, queue depth,
  the capacity plan's numbers, nodes by state.

Memory is bounded: each series keeps at most ``capacity`` rows; when full, every second row of
its older half is dropped, so the whole run stays covered, older parts at a coarser resolution.
Rows carry a sequence number; ``/api/history?since=SEQ`` answers only the rows after it
(:meth:`StatusHistory.since`), and an ``epoch`` that changes when the coordinator restarts tells a
page to start over. The history starts with the coordinator process; the learner's full record is
the trainer's ``metrics.jsonl``.

Written from the event loop, read from the HTTP threads: every access holds one lock.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DecimatingBuffer", "StatusHistory"]

#: Learner-step rows kept (decimated beyond).
MAX_STEPS = 2000
#: Tick rows kept: half an hour at full resolution, then decimated.
MAX_TICKS = 1800
#: The intake rate is measured over this window (seconds).
RATE_WINDOW_S = 10.0


class DecimatingBuffer:
    """Rows (dicts with a ``seq``) in arrival order, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 4:
            raise ValueError(f"capacity must be at least 4, got {capacity}")
        self.capacity = capacity
        self.rows: list[dict[str, Any]] = []

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if len(self.rows) > self.capacity:
            half = len(self.rows) // 2
            # keep the first row (where the run starts) and every second one after it
            self.rows = self.rows[:half:2] + self.rows[half:]

    def after(self, seq: int) -> list[dict[str, Any]]:
        """Rows with a sequence number above ``seq`` (the newest rows are never decimated)."""
        i = len(self.rows)
        while i > 0 and self.rows[i - 1]["seq"] > seq:
            i -= 1
        return self.rows[i:]

    def __len__(self) -> int:
        return len(self.rows)


class StatusHistory:
    """The bounded time series behind ``/api/history`` (see the module docstring)."""

    def __init__(
        self,
        *,
        max_steps: int = MAX_STEPS,
        max_ticks: int = MAX_TICKS,
        rate_window_s: float = RATE_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.epoch = secrets.token_hex(6)
        self.clock = clock
        self.rate_window_s = rate_window_s
        self._lock = threading.Lock()
        self._seq = 0
        self._steps = DecimatingBuffer(max_steps)
        self._ticks = DecimatingBuffer(max_ticks)
        self._staleness: Counter[str] = Counter()
        self._last_step: int | None = None
        self._accepted: deque[tuple[float, float]] = deque()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def record_trainer(self, stats: Mapping[str, Any]) -> bool:
        """One learner step's report; False when it has no step number or was seen already."""
        step = stats.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return False
        with self._lock:
            if step == self._last_step:
                return False
            self._last_step = step
            row: dict[str, Any] = {"seq": self._next(), "t": round(self.clock(), 3)}
            for key, value in stats.items():
                if _number(value) is not None:
                    row[str(key)] = value
            row["step"] = step
            self._steps.append(row)
            hist = stats.get("staleness_hist")
            if isinstance(hist, Mapping):
                for delta, count in hist.items():
                    n = _number(count)
                    if n is not None and n > 0:
                        self._staleness[str(delta)] += int(n)
            return True

    def record_tick(self, status: Mapping[str, Any], holders: Mapping[int, int] | None) -> None:
        """One upkeep tick: ``status`` is the ``/status`` document, ``holders`` the nodes that
        hold each recent version in full (None: not counted yet)."""
        now = self.clock()
        accepted = _number(status.get("rollouts_accepted"))
        counts = status.get("node_counts")  # by state; present whatever the swarm's size
        states = status.get("node_states")
        if isinstance(counts, Mapping):
            by_state = Counter({str(k): int(v) for k, v in counts.items() if _number(v)})
        else:
            by_state = Counter(states.values()) if isinstance(states, Mapping) else Counter()
        rejected = status.get("rejected_by_reason")
        row: dict[str, Any] = {
            "t": round(now, 3),
            "accepted": accepted,
            "intake_per_s": self._intake_rate(now, accepted),
            "rejected": {
                str(k): v for k, v in (rejected or {}).items() if (_number(v) or 0) > 0
            } if isinstance(rejected, Mapping) else {},
            "version": status.get("policy_version"),
            "holders": None if holders is None else {str(v): n for v, n in holders.items()},
            "queue_depth": _number(status.get("queue_depth")),
            "nodes": dict(by_state),
        }  # fmt: skip
        for key, value in status.items():  # the capacity plan's figures, whatever they are
            if str(key).startswith("plan_") and _number(value) is not None:
                row[str(key)] = value
        with self._lock:
            row["seq"] = self._next()
            self._ticks.append(row)

    def _intake_rate(self, now: float, accepted: float | None) -> float | None:
        """Accepted rollouts per second over the last ``rate_window_s``."""
        if accepted is None:
            return None
        window = self._accepted
        window.append((now, accepted))
        while len(window) > 2 and now - window[1][0] >= self.rate_window_s:
            window.popleft()
        t0, a0 = window[0]
        if now - t0 <= 0:
            return None
        return round(max(0.0, accepted - a0) / (now - t0), 3)

    def since(self, seq: int | None = None, epoch: str | None = None) -> dict[str, Any]:
        """The rows after ``seq`` of history ``epoch``; everything kept when ``seq`` is None,
        ``epoch`` is another one (a restarted coordinator) or ``seq`` lies in the future."""
        with self._lock:
            full = seq is None or epoch != self.epoch or seq > self._seq
            after = -1 if full or seq is None else seq
            return {
                "epoch": self.epoch,
                "seq": self._seq,
                "full": full,
                "steps": list(self._steps.after(after)),
                "ticks": list(self._ticks.after(after)),
                "staleness_hist": dict(sorted(self._staleness.items(), key=_delta_order)),
            }


def _number(value: Any) -> float | None:
    """``value`` if it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _delta_order(item: tuple[str, int]) -> tuple[int, str]:
    key = item[0]
    return (int(key), key) if key.lstrip("-").isdigit() else (1 << 30, key)
