"""Learner metrics: one JSON line per step, Prometheus gauges, where the learner's time goes.

The JSONL file (``<out_dir>/metrics.jsonl``) is the record a run leaves; the gauges are for scraping
while it runs (a private :class:`~prometheus_client.CollectorRegistry`, so several trainers in one
process — tests — do not collide). Only rank 0 writes either.

Two kinds of line: one per learner step (no ``record`` key), and one per held-out evaluation
(``"record": "eval"``, :mod:`trainer.evaluation`), written from the evaluation's thread;
:func:`read_steps` and :func:`read_evals` read one kind each.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Step-metric keys exported as gauges ``trainer_<key>``.
GAUGE_KEYS: tuple[str, ...] = (
    "step",
    "version",
    "published_version",
    "reward_mean",
    "reward_full_frac",
    "loss",
    "entropy",
    "mismatch_kl",
    "out_of_support_frac",
    "weight_modified_frac",
    "mask_frac",
    "mismatch_m2",
    "ess_frac",
    "clip_frac",
    "grad_norm",
    "staleness_mean",
    "idle_frac",
    "idle_rollouts_frac",
    "idle_stale_frac",
    "idle_fetch_frac",
    "idle_publish_frac",
    "idle_checkpoint_frac",
    "idle_other_frac",
    "step_time_s",
    "t_train_s",
    "t_train_cv",
)

#: Held-out evaluation keys exported as gauges ``trainer_<key>`` (the latest evaluation).
EVAL_GAUGE_KEYS: tuple[str, ...] = (
    "eval_greedy_acc",
    "eval_greedy_lo",
    "eval_greedy_hi",
    "eval_pass1",
    "eval_s",
)


#: Why the learner was not training, in the order the breakdown lists them.
IDLE_CAUSES: tuple[str, ...] = ("rollouts", "stale", "fetch", "publish", "checkpoint")
#: What each cause means (docs/trainer.md, the ``idle_<cause>_frac`` metrics).
IDLE_CAUSE_HELP: dict[str, str] = {
    "rollouts": "waiting while the coordinator had no more rollouts to give (the swarm is short)",
    "stale": "fetching rollouts that turned out too stale to train on (a stale backlog)",
    "fetch": "waiting for a fetch while rollouts were queued (the fetch plumbing)",
    "publish": "blocked on publishing a version (serialise, hash, sign, seed)",
    "checkpoint": "saving a resumable checkpoint",
}


class IdleClock:
    """Where the learner's wall time goes: *busy* inside ``train_step``, *idle* everywhere else.

    Idle time is attributed to a cause (:data:`IDLE_CAUSES`) where the loop knows it; whatever is
    neither busy nor attributed (the loop's own bookkeeping) is idle too, as ``other``.
    :meth:`fraction` is the idle share over the last ``window_s`` seconds (from the latest
    :meth:`mark`, made once per step, at least that old), so a long start-up wait fades out;
    :meth:`totals` are the cumulative seconds since the clock started (a benchmark takes
    differences of two).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = 60.0) -> None:
        self._clock = clock
        self._start = clock()
        self.window_s = window_s
        self._busy = 0.0
        self._idle = dict.fromkeys(IDLE_CAUSES, 0.0)
        #: (time, busy, idle by cause) at each mark, oldest first, for the sliding window
        self._marks: deque[tuple[float, float, dict[str, float]]] = deque()

    def add_busy(self, seconds: float) -> None:
        self._busy += max(0.0, seconds)

    def add_wait(self, seconds: float, cause: str = "rollouts") -> None:
        if cause not in self._idle:
            raise ValueError(f"unknown idle cause {cause!r} (one of {', '.join(IDLE_CAUSES)})")
        self._idle[cause] += max(0.0, seconds)

    @property
    def idle_s(self) -> float:
        """Attributed idle seconds since the start (every cause)."""
        return sum(self._idle.values())

    @property
    def busy_s(self) -> float:
        return self._busy

    def totals(self) -> dict[str, float]:
        """Cumulative seconds since the start: ``wall_s``, ``busy_s``, ``idle_<cause>_s``."""
        out = {"wall_s": self._clock() - self._start, "busy_s": self._busy}
        out.update({f"idle_{k}_s": v for k, v in self._idle.items()})
        return out

    def mark(self) -> None:
        """Remember the counters now (call once per step) and forget marks beyond the window."""
        now = self._clock()
        self._marks.append((now, self._busy, dict(self._idle)))
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.window_s:
            self._marks.popleft()

    def _base(self) -> tuple[float, float, dict[str, float]]:
        """Where the window starts: the latest mark at least ``window_s`` old, or the start."""
        cutoff = self._clock() - self.window_s
        base: tuple[float, float, dict[str, float]] = (
            self._start, 0.0, dict.fromkeys(IDLE_CAUSES, 0.0)
        )  # fmt: skip
        for mark in self._marks:
            if mark[0] > cutoff:
                break
            base = mark
        return base

    def fraction(self) -> float:
        """Idle share of the wall time over the window: 1 − busy / wall."""
        t0, busy0, _ = self._base()
        wall = self._clock() - t0
        if wall <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (self._busy - busy0) / wall))

    def breakdown(self) -> dict[str, float]:
        """Idle share of the wall time by cause over the window, plus ``other`` (the rest)."""
        t0, _, idle0 = self._base()
        wall = self._clock() - t0
        if wall <= 0:
            return {**dict.fromkeys(IDLE_CAUSES, 0.0), "other": 0.0}
        out = {k: max(0.0, v - idle0[k]) / wall for k, v in self._idle.items()}
        out["other"] = max(0.0, self.fraction() - sum(out.values()))
        return out


class MetricsWriter:
    """Appends step records to a JSONL file and mirrors them into Prometheus gauges."""

    def __init__(
        self, path: Path | None, *, max_staleness: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.path = path
        self.registry = registry if registry is not None else CollectorRegistry()
        #: the step thread and the evaluation thread both write lines
        self._lock = threading.Lock()
        self._fh: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a", encoding="utf-8")
        self._gauges = {
            k: Gauge(f"trainer_{k}", f"trainer step metric {k}", registry=self.registry)
            for k in GAUGE_KEYS + EVAL_GAUGE_KEYS
        }
        self._eval_version = Gauge(
            "trainer_eval_version", "version of the latest held-out evaluation",
            registry=self.registry,
        )  # fmt: skip
        self._staleness = Histogram(
            "trainer_rollout_staleness",
            "Δ = trainer version − rollout version of rollouts received",
            buckets=[float(b) for b in range(max_staleness + 2)],
            registry=self.registry,
        )
        self._dropped = Counter(
            "trainer_rollouts_dropped_stale",
            "rollouts not trained on because Δ > S",
            registry=self.registry,
        )
        self._uniform = Counter(
            "trainer_rollouts_dropped_uniform",
            "rollouts not trained on because every sample of their group got the same reward "
            "(filter_groups)",
            registry=self.registry,
        )
        self._trained = Counter(
            "trainer_rollouts_trained", "rollouts trained on", registry=self.registry
        )

    def write(self, record: Mapping[str, object]) -> None:
        """Record one step: the JSON line and the gauges/histogram/counters."""
        for key, gauge in self._gauges.items():
            value = record.get(key)
            if isinstance(value, int | float) and math.isfinite(float(value)):
                gauge.set(float(value))
        hist = record.get("staleness_hist")
        if isinstance(hist, Mapping):
            for delta, count in hist.items():
                for _ in range(int(count)):
                    self._staleness.observe(float(delta))
        dropped = record.get("dropped_stale")
        if isinstance(dropped, int | float) and dropped > 0:
            self._dropped.inc(float(dropped))
        uniform = record.get("dropped_uniform")
        if isinstance(uniform, int | float) and uniform > 0:
            self._uniform.inc(float(uniform))
        trained = record.get("admitted")
        if isinstance(trained, int | float) and trained > 0:
            self._trained.inc(float(trained))
        self._append(record)

    def write_eval(self, record: Mapping[str, object]) -> None:
        """Record one held-out evaluation (``"record": "eval"``) and its gauges."""
        for key in EVAL_GAUGE_KEYS:
            value = record.get(key)
            if isinstance(value, int | float) and math.isfinite(float(value)):
                self._gauges[key].set(float(value))
        version = record.get("version")
        if isinstance(version, int):
            self._eval_version.set(version)
        self._append({**record, "record": "eval"})

    def _append(self, record: Mapping[str, object]) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.write(json.dumps(dict(record), sort_keys=True) + "\n")
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def read_jsonl(path: Path) -> list[dict[str, object]]:
    """All records of a metrics file (for reports and tests)."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_steps(path: Path) -> list[dict[str, object]]:
    """The learner-step records of a metrics file (the held-out evaluations left out)."""
    return [r for r in read_jsonl(path) if "record" not in r]


def read_evals(path: Path) -> list[dict[str, object]]:
    """The held-out evaluation records of a metrics file, in the order they finished."""
    return [r for r in read_jsonl(path) if r.get("record") == "eval"]
