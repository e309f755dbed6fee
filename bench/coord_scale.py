"""What one coordinator's planner and status cost at 1,000 and 10,000 nodes (CPU time, one core).

Not a test. A real :class:`~coordinator.core.Coordinator` on an in-memory store gets N registered,
heartbeating nodes whose throughput the coordinator has measured (each node's figures folded in
as an accepted lease would), priced from a small catalogue. Then, with ``time.process_time``:

* ``replan``: :meth:`Coordinator.replan` (the planner's inputs brought up to date,
  :func:`~coordinator.capacity.plan_pool`), once with a learner the pool can feed ("meets") and
  once with one it cannot ("short"); before each (not timed) the clock moves on 5 s, every node
  heartbeats and :data:`CHURN` of them complete a lease, as between two re-plans of a running
  coordinator; then the same with the clock moved past the predictions' age limit (a
  prediction made afresh, at most once a minute), and the pre-issue-35 re-plan from the store
  (:meth:`ActiveSet.plan_from_scratch`);
* ``status``: :func:`coordinator.status.build_status` (the ``/status`` document the service builds
  every tick), cold (after a change) and warm (nothing changed);
* ``tick``: :meth:`Coordinator.tick` without a re-plan (liveness flush and the count of the nodes
  alive that sets the heartbeat interval, expiries).

The figures are the best of ``--repeat`` calls (the machine is shared; CPU time still moves with
cache pressure). ``bench/sim_calibrate.py`` uses :func:`build_core` and :func:`measure` for the
simulation's calibration file.

    python bench/coord_scale.py [--nodes 1000 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator.config import parse_config  # noqa: E402
from coordinator.core import Coordinator  # noqa: E402
from coordinator.planner_inputs import PREDICT_MAX_AGE_S  # noqa: E402
from coordinator.store import Store  # noqa: E402
from coordinator.tasks import ReverseTask  # noqa: E402
from policy.model import CharTokenizer  # noqa: E402
from protocol.messages import CapabilityAdvert, GpuInfo, Heartbeat  # noqa: E402

#: (tokens/s, USD/h) of the catalogue the nodes are drawn from (coordinator/sim/gpus.toml, 4B)
KINDS = ((700.0, 0.08), (1600.0, 0.20), (2100.0, 0.35), (1100.0, 0.50), (4800.0, 1.40))
TOKENS = 2048  # tokens per rollout
#: leases each node has completed when the bench starts (its reliability (done + 1)/(done + 2))
LEASES_DONE = 20
#: share of the nodes completing a lease between two re-plans (5 s of ~30 s leases)
CHURN = 1 / 6


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def build_core(n: int, *, seed: int = 0, batch: int = 4096) -> tuple[Coordinator, Clock]:
    """A coordinator with ``n`` registered, live, measured nodes (activation on)."""
    clock = Clock()
    cfg = parse_config(
        {
            "db_path": ":memory:",
            "max_nodes": max(10_000, 2 * n),
            "capacity": {"batch_rollouts": batch, "t_train_s": 16.0, "activation": True},
        },
        source="bench/coord_scale.py",
    )
    core = Coordinator(
        cfg, store=Store(":memory:"), task=ReverseTask(seed=seed), tokenizer=CharTokenizer(),
        clock=clock,
    )  # fmt: skip
    rng = random.Random(seed)
    hb = Heartbeat(peer_id="p", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)
    for i in range(n):
        key = rng.randbytes(32)
        tps, price = KINDS[i % len(KINDS)]
        tps *= rng.lognormvariate(0.0, 0.2)
        advert = CapabilityAdvert(
            peer_id=f"p{i}", node_key=key,
            gpus=[GpuInfo(name="gpu", memory_bytes=24 << 30, compute_capability="8.9", count=1)],
            cpu=None, backend="vllm", dtype="bfloat16", tokens_per_s=tps, rollouts_per_s=0.0,
            price_per_hour=price, policy_version=None, reachability="public",
            software_version="bench", expires_at=clock.t + 600.0,
        )  # fmt: skip
        core.register(key, advert)
        core.heartbeat(key, hb)
        samples = 16
        gen = samples * TOKENS / tps
        for version in (1, 2):  # two leases: the second one measures a version switch
            core.throughput.record(
                key, samples=samples, version=version, generate_s=gen, load_s=8.0,
                overhead_s=0.5, observed_s=gen + 8.5,
            )  # fmt: skip
    core.store.execute("UPDATE nodes SET leases_completed = ?", (LEASES_DONE,))
    core.flush_liveness()
    return core, clock


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Least CPU seconds of ``repeat`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def churn(
    core: Coordinator, clock: Clock, share: float, rng: random.Random, wait: float = 5.0
) -> None:
    """What the coordinator sees between two re-plans: the clock moves on ``wait`` seconds,
    every node heartbeats, ``share`` of them complete a lease (their figures and their lease
    count change)."""
    clock.t += wait
    keys = [bytes.fromhex(i) for i in core.plan.active + core.plan.standby] if core.plan else []
    for key in keys:
        core.liveness.saw(key, clock.t)
    for key in rng.sample(keys, int(share * len(keys))):
        fig = core.throughput.get(key)
        gen = fig.lease_s * rng.lognormvariate(0.0, 0.05) if fig else 10.0
        core.throughput.record(
            key, samples=16, version=2, generate_s=gen, load_s=0.0, overhead_s=0.5,
            observed_s=gen + 0.5,
        )  # fmt: skip
        core.store.bump_node(key, "leases_completed")


def measure(n: int, repeat: int = 3) -> dict[str, float]:
    """CPU seconds of a re-plan (meets / short; the steady state, after :func:`churn`, and with
    the predictions made afresh), the pre-issue-35 re-plan from the store, a status build
    (cold / warm) and a plain tick."""
    from coordinator.status import build_status

    core, clock = build_core(n)
    rng = random.Random(1)
    out: dict[str, float] = {"nodes": float(n)}
    plan = core.replan()  # size the learner to half of what the pool gives: the pool meets it
    feed = max(1, int(plan.available * core.t_train_s / 2))

    def replan(batch: int, *, share: float = CHURN, fresh: bool = False) -> float:
        """Best of ``repeat`` re-plans for a learner of ``batch``, each after a churn (and, with
        ``fresh``, past the predictions' age limit); the churn is not timed."""
        core.batch_rollouts = batch
        core.replan()
        best = float("inf")
        for _ in range(repeat):
            churn(core, clock, share, rng, PREDICT_MAX_AGE_S if fresh else 5.0)
            core.flush_liveness()
            t0 = time.process_time()
            core.replan()
            best = min(best, time.process_time() - t0)
        return best

    out["replan_meets_s"] = replan(feed)
    meets = bool(core.plan and core.plan.meets_rule)
    out["replan_meets_fresh_s"] = replan(feed, fresh=True)
    out["replan_short_s"] = replan(10**9)  # no pool feeds this learner: the planner is short
    short = bool(core.plan and not core.plan.meets_rule)
    out["replan_short_fresh_s"] = replan(10**9, fresh=True)
    core.batch_rollouts = feed
    out["replan_scratch_s"] = best_of(core.active.plan_from_scratch, repeat)
    core.replan()

    def status() -> None:
        build_status(core, fingerprint="f", peer_id="p", started_at=clock.t, trainer_stats={},
                     broadcast=None)  # fmt: skip

    def cold() -> None:
        clock.t += 1.0  # the clock moved: the per-second document is stale
        status()

    out["status_cold_s"] = best_of(cold, repeat)
    out["status_warm_s"] = best_of(status, repeat)
    core._planned_at = clock.t + 1e9  # no re-plan inside the tick
    out["tick_s"] = best_of(core.tick, repeat)
    core.close()
    if not (meets and short):
        raise SystemExit(f"bench/coord_scale.py: the {n}-node pool did not give both plans")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10_000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(
        "| nodes | replan, meets (ms) | replan, short (ms) | replan, meets, fresh predictions (ms)"
        " | replan, short, fresh predictions (ms) | replan from the store (ms) |"
        " build_status cold (ms) | build_status warm (ms) | tick without re-plan (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = ("replan_meets_s", "replan_short_s", "replan_meets_fresh_s", "replan_short_fresh_s",
            "replan_scratch_s", "status_cold_s", "status_warm_s", "tick_s")  # fmt: skip
    for n in args.nodes:
        m = measure(n, args.repeat)
        print(f"| {n:,} | " + " | ".join(f"{1e3 * m[k]:.1f}" for k in keys) + " |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
