"""Measure what the coordinator's real code costs and write the simulation's calibration file.

Not a test. ``swarm simulate`` charges the coordinator's work as simulated time from
``coordinator/sim/calibration.json`` (:mod:`coordinator.sim.calibration`), never from a clock read
during a run, so that a seed gives the same run every time. This script measures, on this machine,
with ``time.process_time`` (best of several rounds, pinned to one core where the OS allows):

* the intake's per-token checks (:func:`coordinator.sim.costs.token_check_cost`, 2,048 tokens);
* opening a signed message (Ed25519 verify + strict decode, ``open_envelope``):
  a heartbeat, and a submission of 8 × 256 tokens (the difference, per token, is ``open_token_s``);
* each core call (``register``, ``heartbeat``, ``lease``, ``submit``, ``release``, ``fetch``,
  ``publish``): the mean CPU per call over a calibration run of the simulation itself
  (``--nodes`` nodes, ``--minutes`` simulated minutes of ``nodes100``'s settings);
* the tick without a re-plan, a re-plan (pool meeting the rule, and short of it) and the status
  document at two pool sizes (``bench/coord_scale.py``), as lines a + b·n; the status also at 50
  and ``NODE_MAPS_MAX`` nodes, where it still carries the per-node maps.

Run it on a quiet machine; the figures are machine-specific, and the file says where they came
from. ``--no-write`` prints the calibration instead of writing it.

    python bench/sim_calibrate.py [--sizes 1000 4000] [--nodes 100] [--minutes 5] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from coord_scale import measure  # noqa: E402

from coordinator.sim.calibration import (  # noqa: E402
    CALIBRATION,
    OPERATIONS,
    Calibration,
    write_calibration,
)
from coordinator.sim.costs import load_figures, token_check_cost  # noqa: E402
from coordinator.status import NODE_MAPS_MAX  # noqa: E402
from protocol.envelope import ReplayGuard, open_envelope, seal  # noqa: E402
from protocol.examples import rollout_submission  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import Heartbeat, MessageBase, RolloutSubmission  # noqa: E402

NOW = 1_700_000_000.0
SUB_TOKENS = 8 * 256


def open_cost(msg: MessageBase, n: int = 400, rounds: int = 5) -> float:
    """Least CPU seconds per :func:`open_envelope` of ``msg`` (fresh nonces every round)."""
    ident = Identity.generate()
    best = float("inf")
    for _ in range(rounds):
        envs = [seal(ident, msg, now=NOW) for _ in range(n)]
        guard = ReplayGuard()
        t0 = time.process_time()
        for env in envs:
            open_envelope(env, type(msg), now=NOW, replay=guard)
        best = min(best, (time.process_time() - t0) / n)
    return best


def op_costs(nodes: int, minutes: float) -> dict[str, float]:
    """Mean CPU seconds per core call over a calibration run of the simulation."""
    from coordinator.sim.calibration import Calibration as Cal
    from coordinator.sim.catalogue import load_catalogue
    from coordinator.sim.runner import run_one
    from coordinator.sim.scenario import load_scenario

    free = Cal(0.0, 0.0, 0.0, dict.fromkeys(OPERATIONS, 0.0), *([0.0] * 10))
    sc = load_scenario("nodes100", {"nodes": nodes, "hours": minutes / 60, "warmup_minutes": 0.5})
    r = run_one(sc, "cost_aware", load_catalogue(), load_figures(), calibration=free)
    out = {}
    for op in OPERATIONS:
        calls, cpu = r.coordinator_cpu.get(op, (0, 0.0))
        out[op] = cpu / calls if calls else 0.0
    return out


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of a + b·n through the first and last (n, cost) points, b and a clamped at 0."""
    (n1, c1), (n2, c2) = points[0], points[-1]
    b = max(0.0, (c2 - c1) / (n2 - n1)) if n2 != n1 else 0.0
    return max(0.0, c1 - b * n1), b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes",
        type=int,
        nargs=2,
        default=[1000, 4000],
        help=f"two pool sizes above NODE_MAPS_MAX ({NODE_MAPS_MAX}): the large-pool lines",
    )
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if min(args.sizes) <= NODE_MAPS_MAX or args.sizes[0] == args.sizes[1]:
        # at or below it the status carries per-node maps: a point of the other line
        ap.error(f"--sizes must be two different sizes above NODE_MAPS_MAX ({NODE_MAPS_MAX})")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    load = os.getloadavg()[0]
    token_s = token_check_cost(tokens=2048, repeats=20)
    hb = Heartbeat(peer_id="p", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)
    opened = open_cost(hb)
    sub: RolloutSubmission = rollout_submission(n_samples=8, n_tokens=256)
    per_token = max(0.0, (open_cost(sub) - opened) / SUB_TOKENS)
    ops = op_costs(args.nodes, args.minutes)
    scale = [measure(n, args.repeat) for n in args.sizes]
    small = [measure(n, args.repeat) for n in (50, NODE_MAPS_MAX)]  # status with per-node maps
    status_small = line([(m["nodes"], m["status_cold_s"]) for m in small])

    def fit(key: str) -> tuple[float, float]:
        return line([(m["nodes"], m[key]) for m in scale])

    tick, plan, short, status = (
        fit("tick_s"),
        fit("replan_meets_s"),
        fit("replan_short_s"),
        fit("status_cold_s"),
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    cal = Calibration(
        token_check_s=token_s, open_s=opened, open_token_s=per_token, op_s=ops,
        tick_s=tick[0], tick_node_s=tick[1], plan_s=plan[0], plan_node_s=plan[1],
        plan_short_s=short[0], plan_short_node_s=short[1], status_s=status[0],
        status_node_s=status[1], status_maps_max=NODE_MAPS_MAX, status_small_s=status_small[0],
        status_small_node_s=status_small[1],
        source=f"bench/sim_calibrate.py, {stamp}, {platform.machine()}, load {load:.1f}",
        meta={
            "sizes": args.sizes, "calibration_run_nodes": args.nodes,
            "calibration_run_minutes": args.minutes, "python": platform.python_version(),
            "scale": scale, "scale_small": small,
        },
    )  # fmt: skip
    text = json.dumps(cal.as_dict(), indent=1, sort_keys=True)
    if args.no_write:
        print(text)
    else:
        write_calibration(cal)
        print(f"wrote {CALIBRATION} (load average {load:.1f} at the start)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
