"""One measured window of a real ``swarm demo`` (shared by ``bench/capacity.py``).

Starts the demo's processes (:class:`swarm.shell.demo.Demo`: coordinator, trainer, N nodes on
127.0.0.1), waits until the learner has done ``warmup_steps`` steps, then measures for
``seconds``: the learner's idle fraction and its breakdown from the trainer's cumulative counters
(``metrics.jsonl``: ``wall_s``, ``busy_s``, ``idle_<cause>_s`` of the first and last step of the
window), and the coordinator's live capacity figures from ``/status`` every second (the rule's
prediction and the rates it was fed, averaged over the same window). Ends exactly its own
processes (by PID, through the demo).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _age import breakdown

from coordinator.status import CAPACITY_FIELDS
from swarm.shell.demo import Demo
from swarm.shell.demo_options import DemoOptions
from trainer.metrics import IDLE_CAUSES

STATUS_KEYS = (
    "plan_predicted_idle_frac",
    "plan_pool_idle_frac",
    "plan_required_rollouts_per_s",
    "plan_available_rollouts_per_s",
    "plan_t_train_s",
    "plan_t_train_cv",
    "plan_t_bcast_s",
    "plan_lease_lag_s",
    "plan_batch_rollouts",
    "plan_kappa",
    "plan_step_period_s",
    "plan_legacy_idle_frac",
)


@dataclass
class Window:
    """What one measured window gives."""

    nodes: int
    staleness: int
    overlap: bool
    seconds: float
    steps: int = 0
    #: measured over the window (fractions of wall time)
    idle: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    mean_step_s: float = 0.0
    t_train_s: float = 0.0
    dropped_stale: int = 0
    trained: int = 0
    #: the coordinator's figures, averaged over the window's status samples
    status: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    #: the last status sample's plan figures and per-node capacity maps (for the record)
    detail: dict[str, Any] = field(default_factory=dict)
    #: the rule's inputs averaged over the window's samples: ``plan_*`` scalars and, per node,
    #: the ``node_*`` capacity figures (see :func:`mean_figures`)
    figures: dict[str, Any] = field(default_factory=dict)
    loadavg: tuple[float, float] = (0.0, 0.0)
    error: str | None = None
    #: the per-rollout age breakdown of the window (``bench/_age.py``; needs the trainer's
    #: ``trace_rollouts``)
    age: dict[str, Any] = field(default_factory=dict)


def mean_figures(series: list[dict[str, Any]]) -> dict[str, Any]:
    """Window means of the rule's inputs: each ``plan_*`` scalar, and each node's capacity
    figures over the samples where the node had them. A node's generation rate μ is a ratio of
    means, as the coordinator's own book keeps it (coordinator/throughput.py): the samples per
    lease (μ·g of each status sample) averaged, over the lease time g averaged — the mean of μ
    times the mean of g would overstate what the node delivers per lease cycle when μ and g vary
    (by 2–3 % in the 1-node windows)."""
    out: dict[str, Any] = {}
    for key in STATUS_KEYS:
        values = [s[key] for s in series if isinstance(s.get(key), int | float)]
        out[key] = statistics.fmean(values) if values else None
    nodes: dict[str, dict[str, float]] = {}
    for key in CAPACITY_FIELDS:
        per_node: dict[str, list[float]] = {}
        for s in series:
            for fp, value in (s.get(key) or {}).items():
                if isinstance(value, int | float):
                    per_node.setdefault(fp, []).append(float(value))
        for fp, values in per_node.items():
            nodes.setdefault(fp, {})[key] = statistics.fmean(values)
    for fp, figs in nodes.items():
        pairs = [
            (float(mu), float(g))
            for s in series
            if isinstance(mu := (s.get("node_gen_rollouts_per_s") or {}).get(fp), int | float)
            and isinstance(g := (s.get("node_lease_s") or {}).get(fp), int | float)
            and g > 0
        ]
        if pairs:
            figs["node_gen_rollouts_per_s"] = statistics.fmean(mu * g for mu, g in pairs) / (
                statistics.fmean(g for _, g in pairs)
            )
    out["nodes"] = nodes
    return out


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def measure(
    nodes: int,
    staleness: int,
    *,
    seconds: float,
    overlap: bool = True,
    warmup_steps: int = 5,
    startup_s: float = 240.0,
    run_root: Path | None = None,
    trainer_overrides: dict[str, Any] | None = None,
) -> Window:
    """Run the demo and measure one window (see the module docstring)."""
    root = Path(run_root or tempfile.mkdtemp(prefix="capacity-"))
    run_dir = root / f"n{nodes}-s{staleness}-{'overlap' if overlap else 'serial'}"
    overrides = {"overlap": overlap, "idle_window_s": float(seconds)}
    overrides.update(trainer_overrides or {})
    opts = DemoOptions(
        nodes=nodes,
        staleness=staleness,
        target=1.0,
        time_limit=startup_s + seconds + 60.0,
        run_dir=run_dir,
        live=False,
        trainer_overrides=overrides,
    )
    out = Window(nodes=nodes, staleness=staleness, overlap=overlap, seconds=seconds)
    window: tuple[float, float] | None = None
    load0 = os.getloadavg()[0]
    demo = Demo(opts)
    metrics = run_dir / "trainer" / "metrics.jsonl"
    try:
        demo.start()
        deadline = time.monotonic() + startup_s
        while len(_rows(metrics)) < warmup_steps:
            demo.poll()
            if demo.done_reason() is not None or time.monotonic() > deadline:
                out.error = f"the learner did not reach {warmup_steps} steps in {startup_s:.0f} s"
                return out
            time.sleep(1.0)
        first = _rows(metrics)[-1]
        t_from = time.time()
        samples: list[dict[str, Any]] = []
        end = time.monotonic() + seconds
        series: list[dict[str, Any]] = []
        while time.monotonic() < end:
            status = demo.poll()
            samples.append({k: status.get(k) for k in STATUS_KEYS})
            series.append({k: status.get(k) for k in (*CAPACITY_FIELDS, *STATUS_KEYS)})
            time.sleep(1.0)
        t_to = time.time()
        rows = [r for r in _rows(metrics) if r["step"] > first["step"]]
        if not rows:
            out.error = "no learner step during the window"
            return out
        last = rows[-1]
        wall = last["wall_s"] - first["wall_s"]
        out.steps = len(rows)
        out.idle = 1.0 - (last["busy_s"] - first["busy_s"]) / wall
        out.breakdown = {
            c: (last[f"idle_{c}_s"] - first[f"idle_{c}_s"]) / wall for c in IDLE_CAUSES
        }
        out.breakdown["other"] = max(0.0, out.idle - sum(out.breakdown.values()))
        out.mean_step_s = wall / len(rows)
        out.t_train_s = statistics.fmean(r["step_time_s"] for r in rows)
        out.dropped_stale = sum(int(r["dropped_stale"]) for r in rows)
        out.trained = sum(int(r["admitted"]) for r in rows)
        for key in STATUS_KEYS:
            values = [s[key] for s in samples if isinstance(s.get(key), int | float)]
            if values:
                out.status[key] = statistics.fmean(values)
        out.samples = len(samples)
        out.figures = mean_figures(series)
        last = demo.status
        out.detail = {
            k: v
            for k, v in last.items()
            if k.startswith("plan") or k in CAPACITY_FIELDS or k.startswith("trainer_idle")
        }
        window = (t_from, t_to)
        return out
    finally:
        demo.stop()
        out.loadavg = (load0, os.getloadavg()[0])
        if window is not None and (overrides.get("trace_rollouts")):
            out.age = breakdown(run_dir, staleness, *window)
