"""Cost-aware activation checked: a simulated pool of priced nodes on the real coordinator logic.

Not a test. A pool of priced GPU nodes (a small catalogue: generation rate, price per hour,
round trips, version-load delay; prices not proportional to speed) feeds a learner through the
real coordinator core (``tests/unit/pipeline_sim.py``: real leases, standby answers, intake,
staleness refusals, per-node measurements and plan) on a fake clock. Three ways to choose the
active nodes, same pool, same learner, same target (B/T_train with the coordinator's headroom):

* **planner** — every node joins and the coordinator's activation decides (cheapest sufficient
  set by measured admissible rate; the rest on standby, unpaid);
* **everyone** — activation off, every node works and is paid;
* **fastest-first** — only the fastest nodes join, by generation rate, until their admissible
  rates (the rule's, on the catalogue figures) reach the target.

Figures over the measured window: cost, rollouts accepted and trained, learner idle, cost per
accepted and per trained rollout. Writes the ``bench:activation`` section of docs/benchmarks.md
and the ``bench:activation`` section of docs/capacity.md.

    python bench/activation.py [--seconds 120] [--warmup 30] [--seed 0] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests" / "unit"))

from _report import write_section  # noqa: E402
from pipeline_sim import PipelineSim, SimLearner, SimNode, SimResult  # noqa: E402

from coordinator.capacity import NodeCapacity, Pipeline, node_rate  # noqa: E402

CAPACITY_DOC = ROOT / "docs" / "capacity.md"


@dataclass(frozen=True)
class Kind:
    name: str
    rate: float  # samples per second of generation
    price: float  # USD per hour
    overhead_s: float
    load_s: float


#: prices loosely after 2025 community-cloud listings; rates for a small model, in proportion
CATALOGUE = (
    Kind("rtx3090", 200.0, 0.22, 0.05, 0.3),
    Kind("rtx4090", 300.0, 0.35, 0.05, 0.3),
    Kind("l4", 160.0, 0.40, 0.05, 0.5),
    Kind("a100", 520.0, 1.20, 0.04, 0.2),
    Kind("h100", 820.0, 2.40, 0.04, 0.2),
    Kind("t4-spot", 70.0, 0.11, 0.08, 1.0),
)
LEARNER = SimLearner(batch=256, t_train=0.5, kappa=1, staleness_bound=2, t_bcast=0.2)
HEADROOM = 0.2
MAX_PROMPTS = 8  # 64 samples per lease (G = 8)


def pool(seed: int, size: int) -> list[SimNode]:
    rng = random.Random(seed)
    kinds = [rng.choice(CATALOGUE) for _ in range(size)]
    return [
        SimNode(f"{k.name}-{i:02d}", k.rate, k.overhead_s, k.load_s, price=k.price)
        for i, k in enumerate(kinds)
    ]


def fastest_first(nodes: list[SimNode]) -> list[SimNode]:
    """The fastest nodes by generation rate until the rule's admissible rates reach the target."""
    pipe = Pipeline(LEARNER.batch, LEARNER.t_train, LEARNER.kappa, LEARNER.t_bcast,
                    LEARNER.staleness_bound)  # fmt: skip
    target = LEARNER.batch / LEARNER.t_train * (1 + HEADROOM)
    chosen: list[SimNode] = []
    total = 0.0
    for n in sorted(nodes, key=lambda n: -n.rate):
        if total >= target:
            break
        lease_s = MAX_PROMPTS * 8 / n.rate
        cap = NodeCapacity(n.name, n.rate, n.price, overhead_s=n.overhead_s, lease_s=lease_s,
                           load_s=n.load_s)  # fmt: skip
        chosen.append(n)
        total += node_rate(cap, pipe)
    return chosen


def fresh(nodes: list[SimNode]) -> list[SimNode]:
    return [SimNode(n.name, n.rate, n.overhead_s, n.load_s, price=n.price) for n in nodes]


def run(nodes: list[SimNode], *, activation: bool, seconds: float, warmup: float,
        seed: int) -> SimResult:  # fmt: skip
    sim = PipelineSim(fresh(nodes), LEARNER, max_prompts=MAX_PROMPTS, activation=activation,
                      headroom=HEADROOM, seed=seed)  # fmt: skip
    return asyncio.run(sim.run(seconds, warmup=warmup))


def report(rows: list[tuple[str, int, SimResult]], size: int, args: argparse.Namespace) -> str:
    base = next(r for name, _, r in rows if name == "everyone")
    lines = [
        "<!-- bench:activation:start -->",
        "## Cost-aware activation (`bench/activation.py`)",
        "",
        f"A pool of {size} priced nodes drawn (seed {args.seed}) from "
        + ", ".join(
            f"{k.name} ({k.rate:g} rollouts/s, ${k.price:.2f}/h, load {k.load_s:g} s)"
            for k in CATALOGUE
        )
        + f"; a learner taking B = {LEARNER.batch} rollouts per {LEARNER.t_train:g} s step "
        f"(S = {LEARNER.staleness_bound}, κ = {LEARNER.kappa}, T_bcast = {LEARNER.t_bcast:g} s); "
        "between them the real coordinator core (`tests/unit/pipeline_sim.py`: leases, standby, "
        f"intake, staleness refusals, measured figures, plan; headroom {HEADROOM:.0%}) on a fake "
        f"clock. Figures over {args.seconds:g} simulated seconds after a {args.warmup:g} s "
        "warm-up; a standby node is not paid.",
        "",
        "| choice | nodes working | cost $/h | accepted rollouts/s | trained rollouts/s | "
        "learner idle % | $ per 1M accepted | $ per 1M trained | vs everyone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, working, r in rows:
        per_hour = r.cost / r.seconds * 3600
        per_acc = r.cost / r.accepted * 1e6 if r.accepted else float("inf")
        rel = r.cost_per_rollout / base.cost_per_rollout
        lines.append(
            f"| {name} | {working} | {per_hour:.2f} | {r.accepted / r.seconds:,.0f} | "
            f"{r.trained / r.seconds:,.0f} | {100 * r.measured_idle:.1f} | {per_acc:.2f} | "
            f"{r.cost_per_rollout * 1e6:.2f} | {rel:.2f}× |"
        )
    lines.append("<!-- bench:activation:end -->")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    nodes = pool(args.seed, args.size)
    rows: list[tuple[str, int, SimResult]] = []
    for name in ("planner", "everyone", "fastest-first"):
        t0 = time.monotonic()
        if name == "planner":
            r = run(nodes, activation=True, seconds=args.seconds, warmup=args.warmup,
                    seed=args.seed)  # fmt: skip
            working = r.active
        elif name == "everyone":
            r = run(nodes, activation=False, seconds=args.seconds, warmup=args.warmup,
                    seed=args.seed)  # fmt: skip
            working = len(nodes)
        else:
            chosen = fastest_first(nodes)
            r = run(chosen, activation=False, seconds=args.seconds, warmup=args.warmup,
                    seed=args.seed)  # fmt: skip
            working = len(chosen)
        rows.append((name, working, r))
        print(f"{name}: {working} nodes, cost {r.cost:.4f} $, trained {r.trained}, accepted "
              f"{r.accepted}, idle {100 * r.measured_idle:.1f} % ({time.monotonic() - t0:.0f} s, "
              f"load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    text = report(rows, len(nodes), args)
    print(text)
    if not args.no_write:
        write_section("activation", text)
        write_section("activation", text.replace("## Cost-aware", "### Cost-aware"),
                      path=CAPACITY_DOC)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
