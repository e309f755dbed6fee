"""Learner metrics: one JSON line per step, Prometheus gauges, the learner's idle fraction.

The JSONL file (``<out_dir>/metrics.jsonl``) is the record a run leaves; the gauges are for scraping
while it runs (a private :class:`~prometheus_client.CollectorRegistry`, so several trainers in one
process — tests — do not collide). Only rank 0 writes either.
"""

from __future__ import annotations

import json
import math
import time
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
    "weight_modified_frac",
    "mask_frac",
    "mismatch_m2",
    "ess_frac",
    "clip_frac",
    "grad_norm",
    "staleness_mean",
    "idle_frac",
    "step_time_s",
)


class IdleClock:
    """Learner idle fraction = time spent waiting for rollouts / wall time since start."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._idle = 0.0

    def add_wait(self, seconds: float) -> None:
        self._idle += max(0.0, seconds)

    @property
    def idle_s(self) -> float:
        return self._idle

    def fraction(self) -> float:
        wall = self._clock() - self._start
        return self._idle / wall if wall > 0 else 0.0


class MetricsWriter:
    """Appends step records to a JSONL file and mirrors them into Prometheus gauges."""

    def __init__(
        self, path: Path | None, *, max_staleness: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.path = path
        self.registry = registry if registry is not None else CollectorRegistry()
        self._fh: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a", encoding="utf-8")
        self._gauges = {
            k: Gauge(f"trainer_{k}", f"trainer step metric {k}", registry=self.registry)
            for k in GAUGE_KEYS
        }
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
        trained = record.get("admitted")
        if isinstance(trained, int | float) and trained > 0:
            self._trained.inc(float(trained))
        if self._fh is not None:
            self._fh.write(json.dumps(dict(record), sort_keys=True) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: Path) -> list[dict[str, object]]:
    """All records of a metrics file (for reports and tests)."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
