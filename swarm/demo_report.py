"""What ``swarm demo`` shows: the live view (rich), the end-of-run plot and summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol


class DemoOptions(Protocol):
    """The options of a demo run that the report shows (``swarm.demo.DemoOptions``)."""

    target: float
    nodes: int | None
    byzantine: int
    staleness: int | None


class Demo(Protocol):
    """What the report reads of a running demo (``swarm.demo.Demo``; a protocol, so this module
    does not import the demo that imports it)."""

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
        for col in ("time", "step", "version", "reward", "exact", "staleness", "idle",
                    "accepted", "rejected", "verify"):  # fmt: skip
            head.add_column(col, justify="right")
        head.add_row(
            f"{time.monotonic() - self.demo.t0:.0f}s",
            _fmt(s.get("trainer_step")),
            _fmt(s.get("policy_version")),
            _fmt(s.get("trainer_reward_mean")),
            _fmt(s.get("trainer_exact_match")),
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
