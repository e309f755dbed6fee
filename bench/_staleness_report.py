"""Tables, figures and the monitor analysis of ``bench/staleness.py`` (results → docs)."""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from _report import write_section

ROOT = Path(__file__).resolve().parents[1]
#: steps before the peak (and after it, up to the next evaluation) read as "before a collapse".
PRE_WINDOW = (20, 10)
ROLL = 5  # the trainer's default warn_window

Group = dict[tuple[str, int, str], list[dict[str, Any]]]


def group_runs(results: list[dict[str, Any]]) -> Group:
    groups: Group = defaultdict(list)
    for r in results:
        s = r["spec"]
        groups[(s["task"], s["staleness"], s["option"])].append(r)
    return groups


def median_steps(runs: list[dict[str, Any]]) -> float:
    """Median steps to target over all seeds, a miss counting as +inf."""
    vals = [r["steps_to_target"] if r["steps_to_target"] is not None else math.inf for r in runs]
    return statistics.median(vals) if vals else math.inf


def _mean_monitor(runs: list[dict[str, Any]], key: str) -> float:
    per_run = []
    for r in runs:
        vals = [v for v in r["monitors"].get(key, []) if v is not None]
        if vals:
            per_run.append(sum(vals) / len(vals))
    return sum(per_run) / len(per_run) if per_run else math.nan


def _fmt_steps(x: float) -> str:
    return "✗" if math.isinf(x) else f"{x:.0f}"


def _spread(runs: list[dict[str, Any]]) -> str:
    hit = sorted(r["steps_to_target"] for r in runs if r["steps_to_target"] is not None)
    if not hit:
        return "–"
    return f"{hit[0]}–{hit[-1]}" if len(hit) > 1 else str(hit[0])


def tables(results: list[dict[str, Any]], options: list[str]) -> list[str]:
    """Markdown: per task a compact matrix (median steps, ratio to S = 0) and the detail table."""
    groups = group_runs(results)
    lines: list[str] = []
    tasks = sorted({k[0] for k in groups}, key=lambda t: (len(t), t))
    for task in tasks:
        s_values = sorted({k[1] for k in groups if k[0] == task})
        # the S = 0 runs every weight option shares (options that change more have their own)
        base_runs = [
            r
            for k, v in groups.items()
            if k[:2] == (task, 0) and _weights_only(groups, k[2])
            for r in v
        ]
        base = median_steps(base_runs) if base_runs else math.nan
        target = results[0]["spec"]["target"]
        lines += [
            f"#### {task}: median learner steps to exact ≥ {target} (× the S = 0 median; "
            "k ✗ = seeds that missed it; [n] = seeds)",
            "",
            "| option | " + " | ".join(f"S = {s}" for s in s_values) + " |",
            "|---|" + "---|" * len(s_values),
        ]
        for opt in options:
            cells = []
            own_base = groups.get((task, 0, opt))
            opt_base = median_steps(own_base) if own_base else base
            for s in s_values:
                runs = groups.get((task, s, opt)) or (
                    base_runs if s == 0 and _weights_only(groups, opt) else []
                )
                if not runs:
                    cells.append("")
                    continue
                med = median_steps(runs)
                # no ratio against an S = 0 that missed the target (it would read 0.00×)
                known = math.isfinite(med) and math.isfinite(opt_base) and opt_base > 0
                ratio = f" ({med / opt_base:.2f}×)" if known else ""
                miss = sum(r["steps_to_target"] is None for r in runs)
                cells.append(
                    f"{_fmt_steps(med)}{ratio}"
                    + (f", {miss} ✗" if miss else "")
                    + f" [{len(runs)}]"
                )
            lines.append(f"| {opt} | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"<details><summary>{task}: every setting (spread, final figures, weight health)"
            "</summary>",
            "",
            "| S | option | reached | median steps | spread | final exact | final reward | "
            "collapses | mean KL(μ‖π_prox) | mean ESS/n | mean mask frac | mean clip frac |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (t, s, opt), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if t != task:
                continue
            label = opt if s or not _weights_only(groups, opt) else f"{opt} (weight options: w ≡ 1)"
            lines.append(
                f"| {s} | {label} | {sum(r['steps_to_target'] is not None for r in runs)}/"
                f"{len(runs)} | {_fmt_steps(median_steps(runs))} | {_spread(runs)} | "
                f"{statistics.median(r['final_exact'] for r in runs):.2f} | "
                f"{statistics.median(r['final_reward'] for r in runs):.2f} | "
                f"{sum(r['collapse'] is not None for r in runs)} | "
                f"{_mean_monitor(runs, 'mismatch_kl'):.3f} | "
                f"{_mean_monitor(runs, 'ess_frac'):.3f} | "
                f"{_mean_monitor(runs, 'mask_frac'):.3f} | {_mean_monitor(runs, 'clip_frac'):.3f} |"
            )
        lines += ["", "</details>", ""]
    return lines


#: TrainerConfig keys that only change the behaviour weights: at S = 0 (μ = π_prox) an option
#: made of these alone trains exactly as any other, so the S = 0 runs of one stand for all
#: (VCPO's step-size factor depends on the weights' ESS only: 1 at S = 0).
WEIGHT_KEYS = frozenset({"weight_mode", "weight_level", "weight_cap", "weight_cap_low",
                         "m2_threshold", "staleness_decay", "ess_lr_scaling"})  # fmt: skip


def _weights_only(groups: Group, opt: str) -> bool:
    for (_t, _s, o), runs in groups.items():
        if o == opt:
            return set(runs[0]["spec"]["overrides"]) <= WEIGHT_KEYS
    return True


def _rolling(vals: list[float | None], n: int) -> list[float | None]:
    out: list[float | None] = []
    win: list[float] = []
    for v in vals:
        if v is not None:
            win.append(v)
        win = win[-n:]
        out.append(sum(win) / len(win) if len(win) == n else None)
    return out


def separation(bad: list[float], good: list[float], *, high_bad: bool) -> float:
    """AUC: the probability that a value from ``bad`` reads worse than one from ``good`` (ties
    count half): 0.5 = the figure does not tell them apart, 1.0 = a threshold separates them."""
    if not bad or not good:
        return math.nan
    ref = sorted(good)
    total = 0.0
    for v in bad:
        lo, hi = bisect.bisect_left(ref, v), bisect.bisect_right(ref, v)
        below, ties = lo, hi - lo
        total += (below if high_bad else len(ref) - hi) + 0.5 * ties
    return total / (len(bad) * len(ref))


MONITOR_SIDES = {  # figure -> True if high is bad
    "mismatch_kl": True,
    "ess_frac": False,
    "mask_frac": True,
    "clip_frac": True,
    "grad_norm": True,
}


def monitor_analysis(
    results: list[dict[str, Any]], thresholds: dict[str, float | None]
) -> list[str]:
    """For each monitor: its rolling mean just before collapses vs in runs that did not collapse.
    (At S = 0 the weight figures are trivially KL 0, ESS 1, mask 0; they still count as healthy.)"""
    collapsed = [r for r in results if r["collapse"]]
    healthy = [r for r in results if not r["collapse"]]
    lines = [
        f"All runs (S = 0 included): {len(collapsed)} collapsed, {len(healthy)} did not. Rolling "
        f"mean over {ROLL} steps; 'before a collapse' = the {PRE_WINDOW[0]} steps before the last "
        f"evaluation at the peak and the {PRE_WINDOW[1]} after it (the drop shows at the next "
        "evaluation); "
        "'healthy' = every step of a run that did not collapse, after its exact match first "
        "reached 0.7. 'AUC' compares every step before a collapse with every healthy step, in "
        "the runs at S > 0 only (at S = 0 the weight figures are trivially healthy): the "
        "chance that the step before a collapse reads worse (0.5: no signal; a threshold "
        "that warns before most collapses and seldom otherwise needs about 0.9 or more).",
        "",
        "| monitor | worst before each collapse (median) | healthy steps: 99th pct | threshold | "
        "collapses warned | healthy runs warned | healthy steps warned | AUC (S > 0) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fig, high_bad in MONITOR_SIDES.items():
        pre: list[float] = []
        pre_steps: list[float] = []  # every step of the windows, S > 0 (for the AUC)
        for r in collapsed:
            roll = _rolling(r["monitors"].get(fig, []), ROLL)
            peak = r["collapse"]["peak_step"]
            lo, hi = max(0, peak - PRE_WINDOW[0]), min(len(roll), peak + PRE_WINDOW[1])
            win = [v for v in roll[lo:hi] if v is not None]
            if win:
                pre.append(max(win) if high_bad else min(win))
                if r["spec"]["staleness"] > 0:
                    pre_steps.extend(win)
        healthy_vals: list[list[float]] = []
        healthy_stale: list[float] = []
        for r in healthy:
            first = next(
                (s for s, e in zip(r["curve_steps"], r["curve_exact"], strict=True) if e >= 0.7),
                None,
            )
            if first is None:
                continue
            roll = _rolling(r["monitors"].get(fig, []), ROLL)
            healthy_vals.append([v for v in roll[first - 1 :] if v is not None])
            if r["spec"]["staleness"] > 0:
                healthy_stale.extend(healthy_vals[-1])
        flat = sorted(v for vs in healthy_vals for v in vs)
        q = (
            (flat[int(0.99 * (len(flat) - 1))] if high_bad else flat[int(0.01 * (len(flat) - 1))])
            if flat
            else math.nan
        )
        thr = thresholds.get(fig)

        def bad(v: float, thr: float | None = thr, high_bad: bool = high_bad) -> bool:
            return thr is not None and (v > thr if high_bad else v < thr)

        warned = sum(bad(v) for v in pre)
        runs_warned = sum(any(bad(v) for v in vs) for vs in healthy_vals)
        steps_warned = sum(bad(v) for v in flat)
        lines.append(
            f"| {fig} | {statistics.median(pre) if pre else math.nan:.3g} | {q:.3g} | "
            f"{'–' if thr is None else thr} | {warned}/{len(pre)} | "
            f"{runs_warned}/{len(healthy_vals)} | {steps_warned / max(1, len(flat)):.1%} | "
            f"{separation(pre_steps, healthy_stale, high_bad=high_bad):.2f} |"
        )
    return lines


def plot(results: list[dict[str, Any]], options: list[str], docs: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_runs(results)
    tasks = sorted({k[0] for k in groups}, key=lambda t: (len(t), t))
    colors = {opt: f"C{i}" for i, opt in enumerate(options)}
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        cap = max(r["spec"]["max_steps"] for r in results if r["spec"]["task"] == task)
        base = [r for k, v in groups.items() if k[:2] == (task, 0) for r in v]
        for i, opt in enumerate(options):
            xs, ys, lo, hi = [], [], [], []
            for s in sorted({k[1] for k in groups if k[0] == task}):
                runs = base if s == 0 else groups.get((task, s, opt), [])
                if not runs:
                    continue
                med = median_steps(runs)
                hit = [r["steps_to_target"] for r in runs if r["steps_to_target"] is not None]
                y = cap if math.isinf(med) else med
                xs.append(s + (i - len(options) / 2) * 0.06)
                ys.append(y)
                lo.append(y - min(hit) if hit and not math.isinf(med) else 0)
                hi.append(max(hit) - y if hit and not math.isinf(med) else 0)
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker="o",
                ms=4,
                capsize=2,
                label=opt,
                color=colors[opt],
                alpha=0.85,
            )
        ax.axhline(cap, color="grey", lw=0.6, ls=":")
        ax.set(
            title=f"{task}: steps to target (median, min–max; cap = not reached)",
            xlabel="staleness S (rollouts exactly S versions old)",
            ylabel="learner steps",
        )
        ax.title.set_fontsize(9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "staleness.png", dpi=100)
    plt.close(fig)

    show_s = [s for s in (4, 8) if any(k[1] == s for k in groups)]
    if not show_s:
        return
    fig, axes = plt.subplots(
        len(tasks), len(show_s), figsize=(5.5 * len(show_s), 3.6 * len(tasks)), squeeze=False
    )
    for row, task in enumerate(tasks):
        for col, s in enumerate(show_s):
            ax = axes[row][col]
            for opt in options:
                runs = groups.get((task, s, opt), [])
                if not runs:
                    continue
                steps = sorted({x for r in runs for x in r["curve_steps"]})
                med = []
                for x in steps:
                    vals = []
                    for r in runs:  # a run that ended keeps its last evaluation
                        pts = [
                            e
                            for st, e in zip(r["curve_steps"], r["curve_exact"], strict=True)
                            if st <= x
                        ]
                        if pts:
                            vals.append(pts[-1])
                    med.append(statistics.median(vals))
                ax.plot(steps, med, color=colors[opt], label=opt, lw=1.2)
            ax.set(
                title=f"{task}, S = {s}: exact match, median of seeds",
                xlabel="learner step",
                ylim=(0, 1.02),
            )
            ax.title.set_fontsize(9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "staleness_curves.png", dpi=100)
    plt.close(fig)


def write_report(results: list[dict[str, Any]], args: argparse.Namespace, *, write: bool) -> None:
    from trainer.config import TrainerConfig

    if not results:
        print("no finished runs to report")
        return
    options = [o for o in args.options if any(r["spec"]["option"] == o for r in results)]
    cfg = TrainerConfig()
    thresholds = {
        "mismatch_kl": cfg.warn_mismatch_kl_above,
        "ess_frac": cfg.warn_ess_frac_below,
        "mask_frac": cfg.warn_mask_frac_above,
        "clip_frac": cfg.warn_clip_frac_above,
        "grad_norm": cfg.warn_grad_norm_above,
    }
    body = tables(results, options)
    mon = monitor_analysis(results, thresholds)
    print("\n".join([*body, "", *mon]), flush=True)
    if not write:
        return
    docs = ROOT / "docs"
    plot(results, options, docs)
    seeds = sorted({r["spec"]["seed"] for r in results})
    spec0 = results[0]["spec"]
    caps = ", ".join(
        sorted(
            {
                f"{r['spec']['task']} {r['spec']['max_steps']} steps (+{r['spec']['post_steps']} "
                "after the target)"
                for r in results
            }
        )
    )
    text = [
        "## Learning under staleness (`bench/staleness.py`)",
        "",
        "The full matrix (every option, S ∈ {0, 1, 2, 4, 6, 8}, 5 seeds, reverse3 and reverse4; "
        "resumable): `nice -n 5 python bench/staleness.py --jobs 2 --nice 5`. The tables below "
        f"hold the runs finished so far, reported by "
        f"`{' '.join(['python bench/staleness.py --report-only', *_argv(args)])}` "
        "(each run's figures do not depend on which others ran).",
        "",
        f"Embedded model from random init, {cfg.batch_prompts} prompts × {cfg.group_size} samples "
        f"per learner step, {cfg.minibatches} minibatches, AdamW lr {cfg.lr}, entropy "
        f"{cfg.entropy_coef}, PPO clip ε = {cfg.clip_eps} against π_prox. Rollouts are sampled "
        f"by the `hf` backend from the weights exactly S versions back ({spec0['lag']} lag, the "
        "worst case the admission rule allows). Exact match of the current policy on 256 fresh "
        f"samples every {spec0['eval_every']} steps; target {spec0['target']}; seeds {seeds}; "
        f"caps {caps}. 'final' = mean of the last 3 evaluations; a collapse = exact match "
        "falling more than 0.3 below an earlier evaluation ≥ 0.7. At S = 0 every weight "
        "option gives w ≡ 1, so S = 0 is run once per seed for them; an option that changes "
        "anything else is run at S = 0 too and its ratio is to its own S = 0. Every group "
        "is trained on (`filter_groups = false`) unless the option says otherwise. "
        "Options (docs/trainer.md): "
        + "; ".join(f"`{o}` = {_overrides(results, o)}" for o in options)
        + ".",
        "",
        *body,
        "![steps to target against S](staleness.png)",
        "",
        "![exact-match curves at S = 4 and 8](staleness_curves.png)",
        "",
        "#### What precedes a collapse (the `warn_*` thresholds of the trainer)",
        "",
        *mon,
        "",
    ]
    write_section("staleness", "\n".join(text), docs / "benchmarks.md")


def _overrides(results: list[dict[str, Any]], opt: str) -> str:
    ov = next(r["spec"]["overrides"] for r in results if r["spec"]["option"] == opt)
    return ", ".join(f"{k}={v}" for k, v in ov.items())


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["--tasks", *args.tasks, "--S", *map(str, args.S), "--seeds", *map(str, args.seeds)]
    out += ["--options", *args.options]
    if args.set:
        out += ["--set", *args.set]
    if args.results != "runs/bench-staleness/results.jsonl":
        out += ["--results", args.results]
    return out
