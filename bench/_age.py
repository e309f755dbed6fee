"""Per-rollout age breakdown of one ``swarm demo`` run (shared by ``bench/capacity.py``).

Joins what the trainer traced (``trace_rollouts``: each step's start and end, and per trained
rollout its seq, policy version and when the trainer's feed received it) with what the
coordinator keeps anyway in its database (when each version's publication call arrived, each
lease's version, node and issue time, each rollout's acceptance time). Every process runs on one
machine, so Unix times compare. For a rollout of version u trained at learner version L = u + Δ:

    made      the step that made u ended (its weights exist at the trainer)
    published the coordinator recorded u's manifest (the trainer's publish call arrived)
    leasable  the first lease naming u was issued (leases name the newest version the coordinator
              holds in full: an upper bound on when it held u)
    issued    the lease this rollout came from was issued
    accepted  the coordinator accepted the result (load, generation, submission, verdict)
    fetched   the trainer's feed received it
    trained   the step that trained it started

so its age when trained splits into made→published, published→leasable, leasable→issued,
issued→accepted, accepted→fetched and fetched→trained. Leases are split into *switch* leases (the
node's first lease on u: the node loads u before it generates) and *repeat* leases (it holds u).

Every accepted rollout of the window is also checked against its deadline: the start of the
learner's step at version u + S, the last step that may train it. The share that arrived by then
is the measured counterpart of the rule's a_i.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

STAGES = (
    ("made→published", "made", "published"),
    ("published→leasable", "published", "leasable"),
    ("leasable→issued", "leasable", "issued"),
    ("issued→accepted", "issued", "accepted"),
    ("accepted→fetched", "accepted", "fetched"),
    ("fetched→trained", "fetched", "trained"),
)


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row.get("trace"), dict):
            rows.append(row)
    return rows


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def breakdown(
    run_dir: Path, staleness: int, t_from: float | None = None, t_to: float | None = None
) -> dict[str, Any]:
    """The age breakdown of the rollouts trained by steps starting in [t_from, t_to] (Unix
    time; default: the whole run) and the deadline check of the rollouts accepted in it."""
    steps = _steps(run_dir)
    if not steps:
        return {"error": "no traced step (run the trainer with trace_rollouts = true)"}
    lo = t_from if t_from is not None else steps[0]["trace"]["start"]
    hi = t_to if t_to is not None else steps[-1]["trace"]["end"]
    made = {int(s["version"]): float(s["trace"]["end"]) for s in steps}
    start_at = {int(s["version"]) - 1: float(s["trace"]["start"]) for s in steps}
    db = sqlite3.connect(f"file:{run_dir / 'coordinator' / 'state.sqlite'}?mode=ro", uri=True)
    try:
        published = dict(db.execute("SELECT version, created_at FROM versions").fetchall())
        leases = {
            lid: (int(v), float(issued), node)
            for lid, v, issued, node in db.execute(
                "SELECT lease_id, version, issued_at, node_key FROM leases"
            ).fetchall()
        }
        rollouts = {
            int(seq): (lid, int(v), float(at))
            for seq, lid, v, at in db.execute(
                "SELECT seq, lease_id, version, accepted_at FROM rollouts"
            ).fetchall()
        }
    finally:
        db.close()
    leasable: dict[int, float] = {}
    switch: set[str] = set()
    seen: set[tuple[bytes, int]] = set()
    for lid, (v, issued, node) in sorted(leases.items(), key=lambda kv: kv[1][1]):
        leasable[v] = min(leasable.get(v, issued), issued)
        if (node, v) not in seen:
            seen.add((node, v))
            switch.add(lid)

    stages: dict[str, list[float]] = defaultdict(list)
    lease_kind: dict[str, list[float]] = defaultdict(list)
    ages, deltas = [], []
    for s in steps:
        t = float(s["trace"]["start"])
        if not lo <= t <= hi:
            continue
        learner = int(s["version"]) - 1
        for seq, u, fetched in s["trace"]["rollouts"]:
            info = rollouts.get(int(seq))
            if info is None or u not in made or u not in published or fetched is None:
                continue
            lid, _, accepted = info
            _, issued, _ = leases[lid]
            ts = {
                "made": made[u],
                "published": published[u],
                "leasable": leasable.get(u, issued),
                "issued": issued,
                "accepted": accepted,
                "fetched": float(fetched),
                "trained": t,
            }
            for name, a, b in STAGES:
                stages[name].append(ts[b] - ts[a])
            lease_kind["switch" if lid in switch else "repeat"].append(accepted - issued)
            ages.append(t - made[u])
            deltas.append(learner - u)

    # deadline check: every rollout accepted in the window, of a version made in the run
    in_time = late = 0
    late_by: list[float] = []
    for _lid, u, accepted in rollouts.values():
        if not lo <= accepted <= hi or u not in made:
            continue
        deadline = start_at.get(u + staleness)
        if deadline is None:
            continue
        if accepted <= deadline:
            in_time += 1
        else:
            late += 1
            late_by.append(accepted - deadline)
    # the step period and the versions' spacing over the window
    window = [s for s in steps if lo <= s["trace"]["start"] <= hi]
    period = (
        (window[-1]["trace"]["start"] - window[0]["trace"]["start"]) / (len(window) - 1)
        if len(window) > 1
        else None
    )
    return {
        "trained": len(ages),
        "age_s": _mean(ages),
        "delta": _mean([float(d) for d in deltas]),
        "delta_hist": {str(k): deltas.count(k) for k in sorted(set(deltas))},
        "stages_s": {name: _mean(stages[name]) for name, _, _ in STAGES},
        "lease_s": {kind: _mean(v) for kind, v in lease_kind.items()},
        "lease_n": {kind: len(v) for kind, v in lease_kind.items()},
        "accepted": in_time + late,
        "in_time_frac": in_time / (in_time + late) if in_time + late else None,
        "late_by_s": _mean(late_by),
        "step_period_s": period,
    }


def render(b: dict[str, Any]) -> str:
    if b.get("error"):
        return str(b["error"])

    def f(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    parts = [f"{name} {f(v)}" for name, v in b["stages_s"].items()]
    return (
        f"trained {b['trained']}: age {f(b['age_s'])} s, Δ {b['delta']:.2f} {b['delta_hist']}; "
        + ", ".join(parts)
        + f"; lease issued→accepted switch {f(b['lease_s'].get('switch'))} s "
        f"({b['lease_n'].get('switch', 0)}), repeat {f(b['lease_s'].get('repeat'))} s "
        f"({b['lease_n'].get('repeat', 0)}); accepted {b['accepted']}, in time "
        f"{f(b['in_time_frac'])}, late by {f(b['late_by_s'])} s; step {f(b['step_period_s'])} s"
    )


if __name__ == "__main__":
    import sys

    print(render(breakdown(Path(sys.argv[1]), int(sys.argv[2]))))
