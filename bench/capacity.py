"""Capacity rule against measurement: real ``swarm demo`` runs, predicted vs measured learner idle.

Not a test. For each (nodes, S) of the grid a real demo (coordinator, trainer, N nodes: separate
processes on 127.0.0.1, ``bench/_demo_window.py``) is started, warmed up, then measured for
``--seconds``: the learner's idle fraction and where it went (the trainer's own counters), and
the idle fraction the coordinator's live plan predicts from the figures it measured in the same
run (``plan_predicted_idle_frac`` on ``/status``, averaged over the window's once-a-second
samples). The runs are sequential and ``nice``d; the load average of the shared machine is recorded
beside every row, since the learner's idle time depends on the CPU it gets.

``--compare`` runs one point twice, with the learner's plumbing overlapped (the default) and the
old serial loop (``overlap = false``), for the idle breakdown side by side.

Every run's figures are kept in ``docs/capacity-runs.json`` (``--render`` re-draws the docs from
it without running anything). Writes the ``bench:capacity`` section of docs/benchmarks.md, the
validation table and plot of docs/capacity.md (``docs/capacity-validation.png``).

    python bench/capacity.py                          # grid 1 2 3 4 6 nodes × S = 1 2 4, 60 s
    python bench/capacity.py --nodes 2 --staleness 2  # one point (merged into the runs file)
    python bench/capacity.py --compare --nodes 3 --staleness 2
    python bench/capacity.py --render
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _age import render as render_age  # noqa: E402
from _demo_window import measure  # noqa: E402
from _report import write_section  # noqa: E402

from coordinator.capacity import NodeCapacity, Pipeline, predicted_idle  # noqa: E402

RUNS = ROOT / "docs" / "capacity-runs.json"
CAPACITY_DOC = ROOT / "docs" / "capacity.md"
PLOT = ROOT / "docs" / "capacity-validation.png"
SECTION = "capacity"
#: the issue's target: predicted within this many percentage points of the measured idle
TARGET_PP = 5.0
#: the learner of these runs: one optimizer update per step (minibatches = 1), so that one demo
#: node on this CPU cannot keep up with it and the grid spans short and ample pools; every group
#: trained on (filter_groups off), so that B is the same in every window: with the filter the
#: rollouts a step consumes grow as the task gets solved (the coordinator follows them through
#: the trainer's batch_rollouts, but a 30-s window would mix regimes)
TRAINER = {"minibatches": 1, "trace_rollouts": True, "filter_groups": False}


def _key(w: dict[str, Any]) -> str:
    epochs, rep = w.get("epochs", 1), w.get("rep", 0)
    suffix = ("" if epochs == 1 else f"-e{epochs}") + ("-pair" if w.get("pair") else "")
    suffix += f"-r{rep}" if rep else ""
    return f"{w['nodes']}-{w['staleness']}-{'overlap' if w['overlap'] else 'serial'}{suffix}"


def load_runs() -> dict[str, dict[str, Any]]:
    if not RUNS.exists():
        return {}
    return {_key(w): w for w in json.loads(RUNS.read_text())}


def save_runs(runs: dict[str, dict[str, Any]]) -> None:
    ordered = sorted(
        runs.values(), key=lambda w: (not w["overlap"], w["staleness"], w["nodes"], w.get("rep", 0))
    )
    RUNS.write_text(json.dumps(ordered, indent=1) + "\n")


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def rule_on_window_means(w: dict[str, Any]) -> float | None:
    """The rule's predicted idle on the window means of its inputs, measured in the same run
    (per node: r, μ, g, o, d; the learner: T_train, B, κ; T_bcast; S)."""
    fig = w.get("figures") or {}
    t_train, batch = fig.get("plan_t_train_s"), fig.get("plan_batch_rollouts")
    kappa, t_bcast = fig.get("plan_kappa"), fig.get("plan_t_bcast_s")
    if not (t_train and batch and kappa) or t_bcast is None:
        return None
    cv = fig.get("plan_t_train_cv") or 0.0
    pipe = Pipeline(round(batch), t_train, kappa, t_bcast, w["staleness"], t_train_cv=cv)
    nodes = [
        NodeCapacity(
            fp,
            f["node_gen_rollouts_per_s"],
            reliability=f.get("node_reliability", 1.0),
            overhead_s=f.get("node_lease_overhead_s", 0.0),
            lease_s=f.get("node_lease_s"),
            load_s=f.get("node_load_delay_s", 0.0),
        )
        for fp, f in (fig.get("nodes") or {}).items()
        if f.get("node_gen_rollouts_per_s")
    ]
    return predicted_idle(nodes, pipe) if nodes else None


def _predicted(w: dict[str, Any]) -> float | None:
    return rule_on_window_means(w)


def _live(w: dict[str, Any]) -> float | None:
    value = w["status"].get("plan_predicted_idle_frac")
    return None if value is None else float(value)


def grid_rows(runs: dict[str, dict[str, Any]], rep: int | None = 0) -> list[dict[str, Any]]:
    """The grid's runs (overlapped loop, one update per step): repetition ``rep`` (None: all)."""
    rows = [
        w
        for w in runs.values()
        if w["overlap"] and not w.get("error") and w.get("epochs", 1) == 1 and not w.get("pair")
        and (rep is None or w.get("rep", 0) == rep)
    ]  # fmt: skip
    return sorted(rows, key=lambda w: (w["staleness"], w["nodes"], w.get("rep", 0)))


def repeat_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Grid points run more than once (``--repeat``): each run's predicted and measured idle,
    and the rule against the mean of the measurements (one 30 s window is a noisy sample)."""
    points: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for w in grid_rows(runs, rep=None):
        if _predicted(w) is not None:
            points.setdefault((w["staleness"], w["nodes"]), []).append(w)
    points = {k: v for k, v in points.items() if len(v) > 1}
    if not points:
        return []
    lines = [
        "| nodes | S | runs: predicted / measured idle % | mean predicted % | mean measured % "
        "| Δ pp | measured spread pp |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    deltas, spreads = [], []
    for (s, n), ws in sorted(points.items()):
        pred = [100 * _predicted(w) for w in ws]  # type: ignore[operator]
        meas = [100 * w["idle"] for w in ws]
        delta = sum(pred) / len(pred) - sum(meas) / len(meas)
        deltas.append(abs(delta))
        spreads.append(max(meas) - min(meas))
        each = ", ".join(f"{p:.1f} / {m:.1f}" for p, m in zip(pred, meas, strict=True))
        lines.append(
            f"| {n} | {s} | {each} | {sum(pred) / len(pred):.1f} | {sum(meas) / len(meas):.1f} "
            f"| {delta:+.1f} | {spreads[-1]:.1f} |"
        )
    inside = sum(d <= TARGET_PP for d in deltas)
    lines += [
        "",
        f"On the means of the runs: {inside} of {len(deltas)} points within {TARGET_PP:.0f} "
        f"percentage points; largest gap {max(deltas):.1f} pp; mean |Δ| "
        f"{sum(deltas) / len(deltas):.1f} pp. The measured idle of one point differed between "
        f"its runs by {statistics.median(spreads):.1f} pp (median), up to {max(spreads):.1f}.",
    ]
    return lines


def validation_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes | S | κ | load avg | steps | T_train s | step s | Σρ / (B/T_train) | "
        "predicted idle % | live plan % | measured idle % | Δ pp | rollouts | fetch | publish "
        "| other |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in grid_rows(runs):
        st, b = w["status"], w["breakdown"]
        pred = _predicted(w)
        ratio = "–"
        need, have = st.get("plan_required_rollouts_per_s"), st.get("plan_available_rollouts_per_s")
        if need and have is not None:
            ratio = f"{have / need:.2f}"
        delta = "–" if pred is None else f"{100 * (pred - w['idle']):+.1f}"
        kappa = st.get("plan_kappa")
        lines.append(
            f"| {w['nodes']} | {w['staleness']} | {'–' if kappa is None else int(kappa)} | "
            f"{w['loadavg'][0]:.0f} → {w['loadavg'][1]:.0f} | {w['steps']} | "
            f"{w['t_train_s']:.2f} | {w['mean_step_s']:.2f} | {ratio} | {_pct(pred)} | "
            f"{_pct(_live(w))} | {_pct(w['idle'])} | {delta} | "
            f"{_pct(b.get('rollouts', 0) + b.get('stale', 0))} | "
            f"{_pct(b.get('fetch'))} | {_pct(b.get('publish'))} | "
            f"{_pct(b.get('checkpoint', 0) + b.get('other', 0))} |"
        )
    return lines


def headroom_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Runs of a slower learner (``--epochs`` > 1), for the issue's second target: a pool
    that meets the rule with 20 % headroom keeps the learner ≤ 5 % idle."""
    rows = [
        w
        for w in runs.values()
        if w.get("epochs", 1) != 1 and w["overlap"] and not w.get("error") and not w.get("pair")
    ]
    if not rows:
        return []
    lines = [
        "| nodes | S | epochs | T_train s | step s | Σρ / (B/T_train) | predicted idle % | "
        "measured idle % | rollouts | fetch | publish | other |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in sorted(rows, key=lambda w: (w["staleness"], w["nodes"])):
        st, b = w["status"], w["breakdown"]
        need, have = st.get("plan_required_rollouts_per_s"), st.get("plan_available_rollouts_per_s")
        ratio = f"{have / need:.2f}" if need and have is not None else "–"
        lines.append(
            f"| {w['nodes']} | {w['staleness']} | {w['epochs']} | {w['t_train_s']:.2f} | "
            f"{w['mean_step_s']:.2f} | {ratio} | {_pct(_predicted(w))} | {_pct(w['idle'])} | "
            f"{_pct(b.get('rollouts', 0) + b.get('stale', 0))} | {_pct(b.get('fetch'))} | "
            f"{_pct(b.get('publish'))} | {_pct(b.get('checkpoint', 0) + b.get('other', 0))} |"
        )
    return lines


def age_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per point: where a trained rollout's age went (``bench/_age.py``), and what became of
    the rollouts accepted in the window (in time for their last step, and used)."""
    rows = [w for w in grid_rows(runs) if (w.get("age") or {}).get("trained")]
    if not rows:
        return []
    stages = list(rows[0]["age"]["stages_s"])
    lines = [
        "| nodes | S | step s | age s | mean Δ | "
        + " | ".join(stages)
        + " | lease switch / repeat s | accepted in time % | of those trained % |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(stages) + "---|---:|---:|",
    ]
    for w in rows:
        a = w["age"]
        lease = a.get("lease_s") or {}
        in_time = a.get("in_time_frac")
        used = (
            100 * a["trained"] / (a["accepted"] * in_time)
            if in_time and a.get("accepted")
            else None
        )
        lines.append(
            f"| {w['nodes']} | {w['staleness']} | {a['step_period_s']:.2f} | {a['age_s']:.2f} | "
            f"{a['delta']:.2f} | "
            + " | ".join(f"{a['stages_s'][k]:.2f}" for k in stages)
            + f" | {lease.get('switch', 0):.2f} / {lease.get('repeat', 0):.2f} | "
            f"{'–' if in_time is None else f'{100 * in_time:.0f}'} | "
            f"{'–' if used is None else f'{min(100.0, used):.0f}'} |"
        )
    return lines


def verdict(runs: dict[str, dict[str, Any]]) -> str:
    rows = [w for w in grid_rows(runs) if _predicted(w) is not None]
    if not rows:
        return "No run yet."
    deltas = [abs(100 * (_predicted(w) - w["idle"])) for w in rows]  # type: ignore[operator]
    inside = sum(d <= TARGET_PP for d in deltas)
    worst = max(rows, key=lambda w: abs(_predicted(w) - w["idle"]))  # type: ignore[operator]
    return (
        f"{inside} of {len(rows)} points within {TARGET_PP:.0f} percentage points; largest gap "
        f"{max(deltas):.1f} pp ({worst['nodes']} nodes, S = {worst['staleness']}); mean |Δ| "
        f"{sum(deltas) / len(deltas):.1f} pp."
    )


def compare_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    pairs = []
    for w in runs.values():
        if not w["overlap"] and not w.get("error") and w.get("pair"):
            other = runs.get(_key({**w, "overlap": True}))
            if other and not other.get("error"):
                pairs.append((other, w))
    if not pairs:
        return []
    lines = [
        "| nodes | S | epochs | loop | load avg | steps/min | idle % | rollouts | stale | "
        "fetch | publish | other |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = sorted(pairs, key=lambda p: (p[0].get("epochs", 1), p[0]["staleness"], p[0]["nodes"]))
    for on, off in order:
        for w, name in ((off, "serial (overlap = false)"), (on, "overlapped (default)")):
            b = w["breakdown"]
            lines.append(
                f"| {w['nodes']} | {w['staleness']} | {w.get('epochs', 1)} | {name} | "
                f"{w['loadavg'][0]:.0f} → "
                f"{w['loadavg'][1]:.0f} | {60 * w['steps'] / w['seconds']:.1f} | "
                f"{_pct(w['idle'])} | {_pct(b.get('rollouts'))} | {_pct(b.get('stale'))} | "
                f"{_pct(b.get('fetch'))} | {_pct(b.get('publish'))} | "
                f"{_pct(b.get('checkpoint', 0) + b.get('other', 0))} |"
            )
    return lines


def plot(runs: dict[str, dict[str, Any]]) -> bool:
    rows = [w for w in grid_rows(runs) if _predicted(w) is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    lim = max(0.1, max(max(w["idle"], _predicted(w) or 0) for w in rows) * 1.1)
    xs = [0.0, lim]
    ax.plot(xs, xs, color="#444", lw=1, label="predicted = measured")
    ax.fill_between(xs, [x - 0.05 for x in xs], [x + 0.05 for x in xs], color="#ccc", alpha=0.5,
                    label="±5 percentage points")  # fmt: skip
    for s, color in zip(
        sorted({w["staleness"] for w in rows}),
        ("#1c7ed6", "#e8590c", "#2f9e44", "#9c36b5"),
        strict=False,
    ):
        pts = [w for w in rows if w["staleness"] == s]
        ax.scatter([w["idle"] for w in pts], [_predicted(w) for w in pts], color=color,
                   label=f"S = {s}", zorder=3)  # fmt: skip
        for w in pts:
            ax.annotate(str(w["nodes"]), (w["idle"], _predicted(w) or 0), fontsize=8,
                        xytext=(4, 2), textcoords="offset points")  # fmt: skip
    ax.set_xlim(0, lim)
    ax.set_ylim(0, lim)
    ax.set_xlabel("measured learner idle fraction (swarm demo)")
    ax.set_ylabel("predicted by the capacity rule (same run's figures)")
    ax.set_title("Capacity rule vs measurement (labels: nodes)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return True


def conditions(runs: dict[str, dict[str, Any]]) -> str:
    seconds = sorted({int(w["seconds"]) for w in runs.values()})
    loads = [w["loadavg"][i] for w in runs.values() for i in (0, 1)]
    load = f"{min(loads):.0f}–{max(loads):.0f}" if loads else "?"
    return (
        f"`swarm demo` processes on 127.0.0.1 of one machine with {os.cpu_count()} CPUs (the "
        f"demo's own processes load it; 1-minute load average {load} during the runs), Python "
        f"{platform.python_version()}; embedded model and task (reverse3), B = 256 (32 prompts × "
        f"8), trainer with one optimizer update per step (`minibatches = 1`), S and κ = max(1, "
        f"S − 1) as in the demo, every node free (all active). Each point: warm-up of 5 learner "
        f"steps, then a {'/'.join(map(str, seconds))} s window; the runs are sequential. "
        "Measured idle = 1 − (time in `train_step`) / wall time over the window, from the "
        "trainer's cumulative counters. Predicted = `predicted_idle` of coordinator/capacity.py on "
        "the window means of its inputs as the coordinator measured them in the same run "
        "(sampled from `/status` once a second: per node r, μ, g, o, d; the trainer's smoothed "
        "T_train and B; κ as published; T_bcast); *live plan* = the mean of the coordinator's own "
        "`plan_predicted_idle_frac` over the window (its running figures swing with every lease, "
        "so the mean of its predictions is not the prediction of the means). The breakdown "
        "columns are shares of wall time: *rollouts* "
        "(the coordinator had no admissible rollout to give, incl. stale), *fetch*, *publish*, "
        "*other* (checkpoints and the loop's own bookkeeping: the rule does not model these)."
    )


def render(runs: dict[str, dict[str, Any]]) -> None:
    has_plot = plot(runs)
    table = validation_table(runs)
    compare = compare_table(runs)
    ages = age_table(runs)
    age_text = []
    if ages:
        age_text = [
            "",
            "Where a trained rollout's age went (seconds, means over the rollouts trained in the "
            "window; `bench/_age.py`: the trainer's `trace_rollouts` joined with the "
            "coordinator's database), and what became of the rollouts accepted in the window:",
            "",
            *ages,
        ]
    repeats = repeat_table(runs)
    if repeats:
        age_text += [
            "",
            "The grid run again (`--repeat 1`, same code, the machine as quiet): each point's runs "
            "and the rule against their mean:",
            "",
            *repeats,
        ]
    headroom = headroom_table(runs)
    if headroom:
        age_text += [
            "",
            "A slower learner (`--epochs`: passes over each batch, `ppo_epochs`), for the "
            "target *learner idle ≤ 5 % when the pool meets the rule with 20 % headroom*:",
            "",
            *headroom,
        ]
    text = [
        f"<!-- bench:{SECTION}:start -->",
        "## Capacity rule against measurement (`bench/capacity.py`)",
        "",
        conditions(runs),
        "",
        *table,
        "",
        verdict(runs),
        *age_text,
    ]
    if compare:
        text += [
            "",
            "The learner's plumbing, serial loop against the overlapped one (same code, "
            "`overlap` off/on, back to back):",
            "",
            *compare,
        ]
    text.append(f"<!-- bench:{SECTION}:end -->")
    write_section(SECTION, "\n".join(text))
    doc = [
        "<!-- bench:capacity-validation:start -->",
        conditions(runs),
        "",
        *table,
        "",
        verdict(runs),
    ]
    if has_plot:
        doc += ["", "![predicted vs measured learner idle](capacity-validation.png)"]
    doc += age_text
    doc.append("<!-- bench:capacity-validation:end -->")
    write_section("capacity-validation", "\n".join(doc), path=CAPACITY_DOC)


def run_point(
    nodes: int,
    s: int,
    *,
    overlap: bool,
    seconds: float,
    root: Path,
    epochs: int = 1,
    pair: bool = False,
    rep: int = 0,
) -> dict[str, Any]:
    print(f"-- {nodes} nodes, S = {s}, overlap {overlap}, epochs {epochs}: load "
          f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    t0 = time.monotonic()
    w = measure(nodes, s, seconds=seconds, overlap=overlap, run_root=root,
                trainer_overrides={**TRAINER, "ppo_epochs": epochs})  # fmt: skip
    # a --compare pair is kept apart from the validation grid (the two loops back to back)
    run = {**dataclasses.asdict(w), "epochs": epochs, "pair": pair, "rep": rep}
    (root / f"{_key(run)}.json").write_text(json.dumps(run, indent=1))
    pred = rule_on_window_means(run)
    print(
        f"   {time.monotonic() - t0:.0f} s: idle {_pct(w.idle)} % (predicted {_pct(pred)} %, "
        f"live plan {_pct(w.status.get('plan_predicted_idle_frac'))} %), "
        f"{w.steps} steps, breakdown "
        + ", ".join(f"{k} {_pct(v)}" for k, v in w.breakdown.items())
        + (f"; ERROR {w.error}" if w.error else ""),
        flush=True,
    )
    if w.age:
        print("   age: " + render_age(w.age), flush=True)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--compare", action="store_true", help="also run the serial loop")
    ap.add_argument("--epochs", type=int, default=1,
                    help="passes over each batch per learner step (ppo_epochs; > 1: a slower "
                    "learner, the headroom table)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=0,
                    help="store these runs as repetition N (> 0) of the grid, beside the main "
                    "runs (0, the tables' figures): the repeat table compares them")  # fmt: skip
    ap.add_argument("--render", action="store_true", help="only re-draw the docs from the runs")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    args = ap.parse_args()
    runs = load_runs()
    if not args.render:
        root = Path(tempfile.mkdtemp(prefix="capacity-bench-"))
        for s in args.staleness:
            for n in args.nodes:
                modes = [True, False] if args.compare else [True]
                for overlap in modes:
                    w = run_point(n, s, overlap=overlap, seconds=args.seconds, root=root,
                                  epochs=args.epochs, pair=args.compare,
                                  rep=args.repeat)  # fmt: skip
                    if args.no_write:
                        continue
                    runs[_key(w)] = w
                    save_runs(runs)
    if args.no_write:
        print("\n".join(validation_table(runs)))
        return 0
    render(runs)
    print("\n".join(validation_table(runs)))
    print(verdict(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
