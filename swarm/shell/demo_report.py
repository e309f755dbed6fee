"""What ``swarm demo`` shows: the live view (rich), the end-of-run plot and summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol


class DemoOptions(Protocol):
    """The options of a demo run that the report shows (``swarm.shell.demo.DemoOptions``)."""

    target: float
    nodes: int | None
    byzantine: int
    staleness: int | None


class Demo(Protocol):
    """What the report reads of a running demo (``swarm.shell.demo.Demo``; a protocol, so this
    module does not import the demo that imports it)."""

    @property
    def opts(self) -> DemoOptions: ...

    status: dict[str, Any]
    t0: float
    run_dir: Path
    logs: Path
    curve: list[dict[str, Any]]
    reached_at: float | None
    coordinator: dict[str, Any]  # coordinator.json: http_url is the dashboard
    node_pages: dict[str, str]  # node name -> its status page URL

    def find_node_pages(self) -> dict[str, str]: ...


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


class LiveView:
    """A rich live table refreshed every second (plain log lines when disabled or not a TTY)."""

    def __init__(self, demo: Demo, *, enabled: bool) -> None:
        self.demo = demo
        self.enabled = enabled
        self._live: Any = None
        self._last_line = 0.0
        #: the last held-out evaluation printed (its version)
        self._eval_seen: int | None = None

    def __enter__(self) -> LiveView:
        if self.enabled:
            from rich.live import Live

            self._live = Live(self._render(), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self) -> None:
        new_pages = self.demo.find_node_pages()
        if new_pages and self._live is None:
            print(
                "node pages: " + ", ".join(f"{k} {v}" for k, v in sorted(new_pages.items())),
                flush=True,
            )
        s = self.demo.status
        version = s.get("trainer_eval_version")
        if isinstance(version, int) and version != self._eval_seen:
            self._eval_seen = version  # each new held-out score gets its own line
            line = f"held-out score: {heldout_line(s)}"
            if self._live is not None:
                self._live.console.print(line)
            else:
                print(line, flush=True)
        if self._live is not None:
            self._live.update(self._render())
        elif time.monotonic() - self._last_line > 5.0:
            self._last_line = time.monotonic()
            s = self.demo.status
            print(
                f"[{time.monotonic() - self.demo.t0:6.1f}s] step {_fmt(s.get('trainer_step'))} "
                f"v{_fmt(s.get('policy_version'))} reward {_fmt(s.get('trainer_reward_mean'))} "
                f"exact {_fmt(s.get('trainer_exact_match'))} "
                f"staleness {_fmt(s.get('trainer_staleness_mean'), '.2f')} "
                f"accepted {_fmt(s.get('rollouts_accepted'))} "
                f"verify {_fmt(s.get('verification_compute_frac'), '.1%')} "
                f"rejected {sum((s.get('rejected_by_reason') or {}).values()):.0f} | "
                f"{monitor_line(s)}",
                flush=True,
            )
            for fp, problem in sorted((s.get("node_problems") or {}).items()):
                print(f"  node {fp[:20]}…: {problem}", flush=True)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        s = self.demo.status
        head = Table(title=f"swarm demo — {self.demo.run_dir.name}", show_header=True)
        for col in ("time", "step", "version", "reward", "exact", "held-out", "staleness",
                    "idle", "accepted", "rejected", "verify"):  # fmt: skip
            head.add_column(col, justify="right")
        head.add_row(
            f"{time.monotonic() - self.demo.t0:.0f}s",
            _fmt(s.get("trainer_step")),
            _fmt(s.get("policy_version")),
            _fmt(s.get("trainer_reward_mean")),
            _fmt(s.get("trainer_exact_match")),
            heldout_line(s, short=True),
            _fmt(s.get("trainer_staleness_mean"), ".2f"),
            _fmt(s.get("trainer_idle_frac"), ".2f"),
            _fmt(s.get("rollouts_accepted")),
            _fmt(sum((s.get("rejected_by_reason") or {}).values()), ".0f"),
            _fmt(s.get("verification_compute_frac"), ".1%"),
        )
        health = Table(title="learning stability (trainer/monitors.py)", show_header=True)
        for col in ("ESS/n", "mismatch KL", "clip frac", "mask frac", "grad norm", "step KL",
                    "lr ×", "warning"):  # fmt: skip
            health.add_column(col, justify="right" if col != "warning" else "left")
        warning = s.get("trainer_stability_warning") or ""
        health.add_row(
            _fmt(s.get("trainer_ess_frac")),
            _fmt(s.get("trainer_mismatch_kl")),
            _fmt(s.get("trainer_clip_frac")),
            _fmt(s.get("trainer_mask_frac")),
            _fmt(s.get("trainer_grad_norm"), ".2f"),
            _fmt(s.get("trainer_step_kl")),
            _fmt(s.get("trainer_lr_factor"), ".2f"),
            f"[bold red]{warning}[/]" if warning else "ok",
        )
        nodes = Table(show_header=True)
        for col in ("node", "state", "tokens/s", "leases done", "check rate", "last seen"):
            nodes.add_column(col)
        states = s.get("node_states") or {}
        for fp, state in sorted(states.items()):
            nodes.add_row(
                fp[:20] + "…",
                state,
                _fmt((s.get("node_tokens_per_s") or {}).get(fp), ".0f"),
                _fmt((s.get("node_leases_completed") or {}).get(fp)),
                _fmt((s.get("node_check_rate") or {}).get(fp), ".2f"),
                f"{_fmt((s.get('node_last_seen_s') or {}).get(fp), '.1f')}s ago",
            )
        rejected = s.get("rejected_by_reason") or {}
        parts: list[Any] = [head, health, nodes]
        problems = s.get("node_problems") or {}
        if problems:  # a node failing over and over: say why instead of an empty "step -"
            from rich.text import Text

            for fp, problem in sorted(problems.items()):
                parts.append(Text(f"node {fp[:20]}…: {problem}", style="yellow"))
        dash = self.demo.coordinator.get("http_url")
        if dash:
            pages = ", ".join(f"{k} {v}" for k, v in sorted(self.demo.node_pages.items()))
            parts.append(f"dashboard: {dash}/" + (f"   node pages: {pages}" if pages else ""))
        if rejected:
            rej = Table(title="rejected by reason", show_header=True)
            rej.add_column("reason")
            rej.add_column("count", justify="right")
            for reason, count in sorted(rejected.items()):
                rej.add_row(reason, f"{count:.0f}")
            parts.append(rej)
        return Group(*parts)


def heldout_line(s: dict[str, Any], *, short: bool = False) -> str:
    """The latest held-out evaluation from a /status document: greedy accuracy with its 95%
    interval, pass@1, the base model's score; "-" before the first."""
    acc = s.get("trainer_eval_greedy_acc")
    if not isinstance(acc, int | float):
        return "-"
    v = s.get("trainer_eval_version")
    lo, hi = s.get("trainer_eval_greedy_lo"), s.get("trainer_eval_greedy_hi")
    ci = f"[{_fmt(lo, '.2f')}, {_fmt(hi, '.2f')}]"
    if short:
        return f"{acc:.2f} {ci} v{v}"
    return (
        f"v{v} greedy {acc:.3f} {ci} pass@1 {_fmt(s.get('trainer_eval_pass1'))} "
        f"({_fmt(s.get('trainer_eval_prompts'))} prompts, "
        f"{_fmt(s.get('trainer_eval_s'), '.0f')} s); "
        f"base v{_fmt(s.get('trainer_eval_base_version'))} greedy "
        f"{_fmt(s.get('trainer_eval_base_greedy_acc'))} pass@1 "
        f"{_fmt(s.get('trainer_eval_base_pass1'))}"
    )


def monitor_line(s: dict[str, Any]) -> str:
    """The trainer's stability monitors from a /status document, on one line."""
    warning = s.get("trainer_stability_warning") or ""
    return (
        f"ESS/n {_fmt(s.get('trainer_ess_frac'), '.2f')} KL {_fmt(s.get('trainer_mismatch_kl'))} "
        f"clip {_fmt(s.get('trainer_clip_frac'))} mask {_fmt(s.get('trainer_mask_frac'))} "
        f"|g| {_fmt(s.get('trainer_grad_norm'), '.2f')} step KL {_fmt(s.get('trainer_step_kl'))} "
        f"lr x{_fmt(s.get('trainer_lr_factor'), '.2f')}"
        + (f" WARNING: {warning}" if warning else "")
    )


def plot(demo: Demo) -> str | None:
    """``demo.png``: exact match, reward and staleness against wall time."""
    rows = [r for r in demo.curve if r.get("step") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, [r["exact"] for r in rows], label="exact match")
    ax1.plot(t, [r["reward"] for r in rows], label="mean reward")
    held = _heldout_points(rows)
    if held:  # the held-out greedy accuracy with its 95% interval, where each score arrived
        ht = [r["t"] for r in held]
        acc = [r["eval_greedy_acc"] for r in held]
        lo, hi = [r["eval_greedy_lo"] for r in held], [r["eval_greedy_hi"] for r in held]
        ax1.plot(ht, acc, "o-", color="tab:green", label="held-out greedy (95% CI)")
        ax1.fill_between(ht, lo, hi, color="tab:green", alpha=0.15)
    ax1.axhline(demo.opts.target, color="grey", linestyle="--", linewidth=0.8, label="target")
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("rate")
    ax1.legend(loc="lower right")
    ax1.set_title(f"swarm demo: {demo.opts.nodes} nodes, S={demo.opts.staleness}")
    ax2.plot(t, [r["staleness"] for r in rows], color="tab:red", label="mean staleness")
    ax2.axhline(demo.opts.staleness, color="grey", linestyle="--", linewidth=0.8, label="S")
    ax2.set_ylabel("versions")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    path = demo.run_dir / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _heldout_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve rows where a new held-out evaluation first appeared (one per version)."""
    out, seen = [], set()
    for r in rows:
        v = r.get("eval_version")
        if v is not None and v not in seen and r.get("eval_greedy_acc") is not None:
            seen.add(v)
            out.append(r)
    return out


def heldout_summary(s: dict[str, Any], curve: list[dict[str, Any]]) -> str:
    """One sentence on the held-out evaluation ("" when the run had none)."""
    acc = s.get("trainer_eval_greedy_acc")
    if not isinstance(acc, int | float):
        return ""
    held = _heldout_points(curve)
    best = max(held, key=lambda r: r["eval_greedy_acc"]) if held else None
    base = s.get("trainer_eval_base_greedy_acc")
    gain = f" ({acc - base:+.3f})" if isinstance(base, int | float) else ""
    return (
        f"Held-out greedy accuracy on {_fmt(s.get('trainer_eval_prompts'))} prompts: base "
        f"(v{_fmt(s.get('trainer_eval_base_version'))}) {_fmt(base)}, latest "
        f"(v{_fmt(s.get('trainer_eval_version'))}) {acc:.3f} [95% CI "
        f"{_fmt(s.get('trainer_eval_greedy_lo'))}, {_fmt(s.get('trainer_eval_greedy_hi'))}]{gain}"
        + (f", best {best['eval_greedy_acc']:.3f} at v{best['eval_version']}" if best else "")
        + f"; pass@1 base {_fmt(s.get('trainer_eval_base_pass1'))}, latest "
        f"{_fmt(s.get('trainer_eval_pass1'))}; one evaluation took "
        f"{_fmt(s.get('trainer_eval_s'), '.0f')} s. "
    )


def summarise(demo: Demo, reason: str) -> str:
    """One paragraph on the run (also written to ``summary.md`` with the figures as JSON)."""
    s = demo.status
    png = plot(demo)
    rows = [r for r in demo.curve if r.get("exact") is not None]
    first = rows[0]["exact"] if rows else None
    best = max((r["exact"] for r in rows), default=None)
    rejected = s.get("rejected_by_reason") or {}
    banned = s.get("nodes_banned") or []
    elapsed = time.monotonic() - demo.t0
    warnings = [r.get("stability_warning") for r in demo.curve if r.get("stability_warning")]
    warned, last_warning = len(warnings), (warnings[-1] if warnings else "")
    reached = (
        f"reached exact match {demo.opts.target:.2f} after {demo.reached_at:.0f}s"
        if demo.reached_at is not None
        else f"did not reach exact match {demo.opts.target:.2f}"
    )
    text = (
        f"swarm demo ended ({reason}) after {elapsed:.0f}s: {demo.opts.nodes} honest nodes"
        f"{f' and {demo.opts.byzantine} byzantine' if demo.opts.byzantine else ''}, S="
        f"{demo.opts.staleness}, {s.get('trainer_step') or 0} learner steps, policy version "
        f"{s.get('policy_version')}. Exact match went from {_fmt(first)} to a best of "
        f"{_fmt(best)} ({reached}); mean staleness at the end "
        f"{_fmt(s.get('trainer_staleness_mean'), '.2f')}. The coordinator accepted "
        f"{s.get('rollouts_accepted') or 0} rollouts and rejected "
        f"{sum(rejected.values()):.0f} submissions"
        f"{_reasons(rejected)}"
        f"; banned nodes: {len(banned)}. Verification re-scored "
        f"{s.get('verification_checks') or 0} leases in "
        f"{_fmt(s.get('verification_compute_s'), '.1f')} s, "
        f"{_fmt(s.get('verification_compute_frac'), '.1%')} of the learner's "
        f"{_fmt(s.get('trainer_compute_s'), '.1f')} s of compute. "
        f"{heldout_summary(s, demo.curve)}"
        f"Stability warnings on {warned} of {len(demo.curve)} learner steps seen"
        f"{f' (last: {last_warning})' if last_warning else ''}. "
        f"Plot: {png or 'none'}; logs: {demo.logs}."
    )
    figures = {
        "reason": reason,
        "elapsed_s": round(elapsed, 1),
        "reached_target_s": demo.reached_at,
        "final_status": s,
    }
    blob = json.dumps(figures, indent=2, default=str)
    (demo.run_dir / "summary.md").write_text(
        f"# swarm demo summary\n\n{text}\n\n```json\n{blob}\n```\n"
    )
    return text


def _reasons(rejected: dict[str, float]) -> str:
    if not rejected:
        return ""
    return " (" + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(rejected.items())) + ")"
