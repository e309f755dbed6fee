"""docs/simulation.md: one generated section per scenario (tables and plots), plus the scaling one.

Each section sits between ``<!-- sim:NAME:start -->`` and ``<!-- sim:NAME:end -->``; a run replaces
only its own sections (the file is re-read right before writing), so the hand-written text around
them stays. Plots are PNG files next to the document (matplotlib, Agg backend).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from coordinator.sim.base import PoolNode
from coordinator.sim.calibration import Calibration
from coordinator.sim.costs import Figures
from coordinator.sim.results import PHASES, RunResult
from coordinator.sim.scenario import Scenario

DOC = Path(__file__).resolve().parents[2] / "docs" / "simulation.md"
OPS = ("heartbeat", "lease", "submit", "tick", "fetch", "register", "release", "publish")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "scenario"


def write_section(section: str, text: str, path: Path = DOC) -> None:
    """Replace (or append) ``section`` of ``path`` with ``text``."""
    start, end = f"<!-- sim:{section}:start -->", f"<!-- sim:{section}:end -->"
    body = f"{start}\n{text.strip()}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = path.read_text() if path.exists() else "# Simulation\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(current):
        updated = pattern.sub(lambda _m: body, current)
    else:
        updated = current.rstrip("\n") + "\n\n" + body + "\n"
    path.write_text(updated)


def _money(x: float) -> str:
    return "-" if x != x or x == float("inf") else f"{x:.3f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def pool_table(pool: Sequence[PoolNode], scenario: Scenario) -> str:
    by: dict[str, list[PoolNode]] = {}
    for p in pool:
        by.setdefault(p.gpu.name, []).append(p)
    lines = [
        "| GPU | class | nodes | price/h | tokens/s (catalogue) | nominal rollouts/s each | "
        "USD per 1k rollouts (nominal) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, nodes in sorted(by.items(), key=lambda kv: kv[0]):
        g = nodes[0].gpu
        tps = g.tokens_per_s(scenario.model.params_b)
        rate = tps / scenario.model.completion_tokens_mean
        per_k = g.price_per_hour / 3600 / rate * 1000 if rate else float("inf")
        lines.append(
            f"| {name} | {g.klass} | {len(nodes)} | {g.price_per_hour:.2f} | {tps:,.0f} | "
            f"{rate:.2f} | {per_k:.3f} |"
        )
    return "\n".join(lines)


def policy_table(results: Sequence[RunResult]) -> str:
    lines = [
        "| policy | nodes rented | paid nodes billed (mean) | accepted rollouts/h | swarm USD/h | "
        "USD per 1k accepted | USD per 1k trained (all billed) | learner idle | "
        "dropped too stale | lost to churn | bad trained | invariants |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        gen = max(1, r.generated)
        lines.append(
            f"| {r.policy} | {r.nodes} | {r.billed_nodes_mean:.0f} | "
            f"{r.accepted / r.window_h:,.0f} | {r.swarm_cost / r.window_h:.2f} | "
            f"{_money(1000 * r.cost_per_accepted)} | {_money(1000 * r.cost_per_trained)} | "
            f"{_pct(r.learner_idle)} | {_pct(r.dropped_stale / max(1, r.accepted_total))} | "
            f"{r.lost_to_churn:,} ({_pct(r.lost_to_churn / gen)}) | {r.bad_trained} | "
            f"{'ok' if r.ok else 'BROKEN'} |"
        )
    return "\n".join(lines)


def savings(results: Sequence[RunResult]) -> str:
    by = {r.policy: r for r in results}
    ca = by.get("cost_aware")
    if ca is None:
        return ""
    out = []
    for other in ("premium_colocated", "premium_only", "all_nodes", "fastest_first"):
        r = by.get(other)
        if r is None or not r.accepted or not r.trained:
            continue
        acc = 1 - ca.cost_per_accepted / r.cost_per_accepted
        trn = 1 - ca.cost_per_trained / r.cost_per_trained
        out.append(
            f"against {other}, cost-aware activation is {_cheaper(acc)} per accepted rollout "
            f"(rollout workers only) and {_cheaper(trn)} per trained rollout (all billed: "
            "workers, learner, verifiers)"
        )
    return "; ".join(out)


def _cheaper(x: float) -> str:
    return f"{x:.0%} cheaper" if x >= 0 else f"{-x:.0%} dearer"


def sweep_table(results: Sequence[RunResult]) -> str:
    lines = [
        "| run | accepted/h | trained/h | learner idle | mean staleness | dropped too stale | "
        "lost to churn | refused too stale | cheaters banned | bad trained | USD per 1k "
        "accepted | USD per 1k trained | invariants |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        n = sum(r.staleness.values())
        mean = sum(k * v for k, v in r.staleness.items()) / n if n else float("nan")
        gen = max(1, r.generated)
        lines.append(
            f"| {r.label} | {r.accepted / r.window_h:,.0f} | {r.trained / r.window_h:,.0f} | "
            f"{_pct(r.learner_idle)} | {mean:.2f} | "
            f"{_pct(r.dropped_stale / max(1, r.accepted_total))} | {_pct(r.lost_to_churn / gen)} | "
            f"{r.refused_too_stale:,} | {r.banned}/{r.cheaters} | {r.bad_trained} | "
            f"{_money(1000 * r.cost_per_accepted)} | {_money(1000 * r.cost_per_trained)} | "
            f"{'ok' if r.ok else 'BROKEN'} |"
        )
    return "\n".join(lines)


def cpu_table(r: RunResult) -> str:
    sim_s = r.hours * 3600
    lines = [
        "| coordinator operation | calls per simulated second | µs of CPU per call | "
        "share of the coordinator's CPU |",
        "|---|---:|---:|---:|",
    ]
    total = r.coordinator_cpu_s or 1e-12
    for op in OPS:
        if op not in r.coordinator_cpu:
            continue
        n, s = r.coordinator_cpu[op]
        lines.append(
            f"| {op} | {n / sim_s:,.2f} | {1e6 * s / max(1, n):,.0f} | {_pct(s / total)} |"
        )
    return "\n".join(lines)


def timeline_table(r: RunResult) -> str:
    """The run stretch by stretch: where the warm-up transient ends (measured window marked)."""
    lines = [
        "| minutes | accepted rollouts/s | learner steps | learner idle | submissions | mean "
        "wait for a verifier (s) | samples refused late | coordinator core busy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    warm = r.hours * 60 - r.window_h * 60
    for row in r.timeline:
        mark = "" if row["start_min"] >= warm - 1e-9 else " (warm-up)"
        lines.append(
            f"| {row['start_min']:.1f}–{row['end_min']:.1f}{mark} | "
            f"{row['accepted_per_s']:,.1f} | {row['steps']:.0f} | {_pct(row['learner_idle'])} | "
            f"{row['submissions']:,.0f} | {row['verify_wait_s']:.1f} | "
            f"{row['refused_late']:,.0f} | {_pct(row['coordinator_busy'])} |"
        )
    return "\n".join(lines)


def gpu_table(r: RunResult) -> str:
    """Where the run's worker bill goes, by GPU kind (:func:`coordinator.sim.results.gpu_figures`):
    its paid node-hours, what they bought (accepted, trained, dropped too stale) and the share of
    the paid time each phase of its leases took; what no phase covers is the time between leases
    (asking for the next one, an answer on its way). Empty when the run kept no such figures."""
    if not r.by_gpu:
        return ""
    lines = [
        "| GPU | nodes (with replacements) | paid node-hours | USD | accepted | trained | dropped "
        "too stale (of accepted) | USD per 1k trained (its bill) | generating | waiting for a "
        "version's download | loading it | transfers and round trips | waiting for the "
        "verdict | between leases |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, g in r.by_gpu.items():
        paid = g.get("billed_h", 0.0) * 3600.0
        if paid <= 0:  # unpaid volunteers: their time costs the run nothing
            continue
        shares = [g.get(k, 0.0) / paid for k in PHASES]
        accepted, trained = g.get("accepted", 0.0), g.get("trained", 0.0)
        per_k = f"{1e3 * g['cost'] / trained:.3f}" if trained else "–"
        dropped = g.get("dropped", 0.0) / accepted if accepted else 0.0
        lines.append(
            f"| {kind} | {g['nodes']:.0f} | {g['billed_h']:,.1f} | {g['cost']:,.2f} | "
            f"{accepted:,.0f} | {trained:,.0f} | {_pct(dropped)} | {per_k} | "
            + " | ".join(_pct(x) for x in shares)
            + f" | {_pct(max(0.0, 1.0 - sum(shares)))} |"
        )
    return "\n".join(lines)


def plots(name: str, results: Sequence[RunResult], out_dir: Path) -> list[str]:
    """Cost per policy, and staleness histograms of the runs; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    base = [r for r in results if r.label == "base"]
    if base:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        names = [r.policy for r in base]
        axes[0].bar(names, [1000 * r.cost_per_accepted for r in base], color="tab:blue")
        axes[0].set_ylabel("USD per 1k accepted rollouts")
        axes[0].set_title("swarm cost per accepted rollout")
        axes[1].bar(names, [1000 * r.cost_per_trained for r in base], color="tab:orange")
        axes[1].set_ylabel("USD per 1k trained rollouts")
        axes[1].set_title("cost per trained rollout, all billed")
        for ax in axes:
            ax.tick_params(axis="x", rotation=20)
        fig.tight_layout()
        fname = f"simulation-{slug(name)}-cost.png"
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    runs = [r for r in results if r.staleness]
    if runs:
        fig, ax = plt.subplots(figsize=(10, 3.6))
        width = 0.8 / len(runs)
        for i, r in enumerate(runs):
            total = sum(r.staleness.values())
            xs = sorted(r.staleness)
            label = r.policy if r.label == "base" else r.label
            ax.bar([x + i * width for x in xs], [r.staleness[x] / total for x in xs],
                   width=width, label=label)  # fmt: skip
        ax.set_xlabel("staleness Δ of trained rollouts (learner versions)")
        ax.set_ylabel("share of trained rollouts")
        ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        fname = f"simulation-{slug(name)}-staleness.png"
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    return files


def scenario_section(
    scenario: Scenario,
    source: str,
    pool: Sequence[PoolNode],
    results: Sequence[RunResult],
    figures: Figures,
    calibration: Calibration,
    out_dir: Path | None,
    command: str,
) -> str:
    """The scenario's section; plots are written into ``out_dir`` (None: none, ``--no-write``).
    Everything but the measured CPU and wall times is a function of the scenario, its seed and
    the calibration: the same command prints the same tables."""
    base = [r for r in results if r.label == "base"]
    sweeps = [r for r in results if r.label != "base"]
    lrn, m = scenario.learner, scenario.model
    wall = sum(r.wall_s for r in results)
    cpu = sum(r.cpu_s for r in results)
    hours = sum(r.hours for r in results)
    parts = [
        f"## {scenario.name}",
        "",
        f"`{command}` (scenario `{source}`, seed {scenario.seed}). {len(results)} runs, "
        f"{hours:g} simulated hours in {wall / 60:.1f} min wall-clock ({cpu / 60:.1f} CPU-min; "
        f"the machine is shared, so CPU time is the steadier figure). Measured window: after "
        f"{scenario.warmup_minutes:g} min of warm-up.",
        "",
        f"Learner: B = {lrn.batch_rollouts} rollouts per step (G = {lrn.group_size}), "
        f"T_train = {lrn.step_s:g} s, S = {lrn.staleness_bound}, κ = {lrn.kappa}, "
        f"{lrn.price_per_hour:g} USD/h. Model: {m.params_b:g}B parameters "
        f"({m.checkpoint_bytes / 1e9:.1f} GB per full checkpoint, a new version ships "
        f"{m.version_fraction:.0%} of it), completions {m.completion_tokens_mean:g} tokens on "
        f"average (cap {m.completion_tokens_max}). Churn {scenario.churn.per_hour:g}/node/h, "
        f"cheaters {scenario.byzantine.fraction:.0%}, {_check_rates(scenario)}, "
        f"{scenario.verification.workers} intake verifier(s) at "
        f"{scenario.verification.verifier_tflops:g} TFLOP/s and "
        f"{scenario.verification.price_per_hour:g} USD/h each. Figures: {figures.source}; "
        f"coordinator costs from coordinator/sim/calibration.json ({calibration.source}: "
        f"open {1e6 * calibration.open_s:.0f} µs per message, per-token checks "
        f"{1e6 * calibration.token_check_s:.2f} µs, re-plan "
        f"{1e3 * calibration.plan_node_s * 1000:.1f} ms and status "
        f"{1e3 * calibration.status_node_s * 1000:.1f} ms per 1,000 nodes).",
        "",
        "Pool (the whole marketplace; `fastest_first` and `premium_only` rent part of it, "
        "`premium_colocated` the same nodes as `premium_only` as the learner's own trusted "
        "cluster: nothing re-scored, no verifier billed):",
        "",
        pool_table(pool, scenario),
        "",
    ]
    if base:
        parts += ["### Policies", "", policy_table(base), ""]
        line = savings(base)
        if line:
            parts += [line + ".", ""]
        ca = next((r for r in base if r.policy == "cost_aware"), base[0])
        parts += [f"Planner at the end of the `{ca.policy}` run: {ca.plan}", ""]
    if sweeps:
        parts += ["### One axis at a time (policy `cost_aware`)", "", sweep_table(sweeps), ""]
    for fname in plots(scenario.name, results, out_dir) if out_dir is not None else []:
        parts += [f"![{fname}]({fname})", ""]
    if base:
        ca = next((r for r in base if r.policy == "cost_aware"), base[0])
        parts += [
            f"### Over time, warm-up included (`{ca.policy}` run)",
            "",
            timeline_table(ca),
            "",
            f"Coordinator core (calibrated costs): busy {_pct(ca.coordinator_utilisation)} of "
            f"the run, a message waited {1e3 * ca.coordinator_wait_mean_s:.1f} ms for it on "
            f"average and {ca.coordinator_backlog_max_s:.2f} s at most.",
            "",
        ]
        bill = gpu_table(ca)
        if bill:
            parts += [
                f"### Where the worker bill goes (`{ca.policy}` run, measured window, by GPU kind)",
                "",
                bill,
                "",
                "Phases are shares of the paid time: the part of the paid nodes' leases inside "
                "the measured window (unpaid volunteers' rollouts count in a kind's accepted and "
                "trained, not in its phases). A node is paid from its first lease until it is "
                "stood by, leaves or is banned.",
                "",
            ]
        parts += [
            f"### Coordinator CPU (`{ca.policy}` run, {ca.nodes} nodes; measured, varies run "
            "to run)",
            "",
            cpu_table(ca),
            "",
            f"Coordinator CPU per accepted rollout: {ca.cpu_per_accepted_ms:.3f} ms "
            f"({ca.coordinator_cpu_s:.1f} s for {ca.accepted_total:,} rollouts). Simulation "
            f"speed: {ca.sim_hours_per_wall_minute:.2f} simulated hours per wall-clock minute, "
            f"{ca.sim_hours_per_cpu_minute:.2f} per CPU-minute. Intake verifiers busy "
            f"{_pct(ca.verify_utilisation)}, mean wait for a verifier "
            f"{ca.queue_wait_mean_s:.1f} s, "
            f"{ca.spot_checked:,} submissions re-scored. Mean time from a version's publication "
            f"to a node holding it: {ca.dissemination_s:.0f} s (coordinator's T_bcast estimate "
            f"{ca.t_bcast_estimate:.1f} s). Verdicts: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(ca.verdicts.items()))
            + ".",
            "",
        ]
    broken = [(r, k, d) for r in results for k, (ok, d) in r.invariants.items() if not ok]
    if broken:
        parts += ["Invariants that did not hold:", ""]
        parts += [f"- {r.policy} {r.label}: **{k}**: {d}" for r, k, d in broken]
        parts.append("")
    return "\n".join(parts)


def _check_rates(scenario: Scenario) -> str:
    """The intake's re-scoring rates in force (the coordinator's defaults unless overridden)."""
    from coordinator.config import IntakeSection

    intake = IntakeSection.model_validate(scenario.coordinator.get("intake", {}))
    new = getattr(intake, "new_node_check_rate", None)  # issue 12's adaptive rate
    floor = f"spot-check fraction {intake.spot_check_fraction:g}"
    return floor if new is None else f"check rate {new:g} for new nodes, decaying to a {floor}"
