"""Does `swarm demo` at its default settings collapse? Runs it once per seed and reads the curves.

Not a test. Each run is the real local swarm (coordinator, trainer, 3 hf nodes: 5 processes), one
after another, with the demo's defaults and ``--seed K``. A run *collapses* when the exact match it
shows (the samples of the trainer's steps: its batches and, with ``filter_groups``, the
uniform-reward groups it left out; sampled by the nodes) falls by more than 0.3 below an earlier
reading that was at least 0.7 -- the definition of bench/staleness.py. Each seed's exact-match
curve and whether the trainer's stability warning was raised before a fall are reported.

    python bench/demo_collapse.py --seeds 0 1 2 3 4
    python bench/demo_collapse.py --seeds 0 1 2 3 4 \
        --demo-args=--trainer-set=filter_groups=false --tag vcpo-ess    # a variant

Writes the ``bench:demo-collapse`` section of docs/benchmarks.md and docs/demo_collapse.png
(with ``--tag T``: ``bench:demo-collapse-T`` and docs/demo_collapse_T.png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _report import write_section  # noqa: E402
from staleness import collapse_of  # noqa: E402

SECTION = "demo-collapse"


def run_demo(seed: int, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One `swarm demo` run; its curve and verdict."""
    t0 = time.monotonic()
    argv = [
        sys.executable,
        "-m",
        "swarm.shell.cli",
        "demo",
        "--no-live",
        "--seed",
        str(seed),
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    rows = []
    curve = run_dir / "curve.jsonl"
    if curve.is_file():
        rows = [json.loads(line) for line in curve.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("exact") is not None and r.get("step") is not None]
    steps = [int(r["step"]) for r in rows]
    exact = [float(r["exact"]) for r in rows]
    warned = [int(r["step"]) for r in rows if r.get("stability_warning")]
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return {
        "seed": seed,
        "rc": proc.returncode,
        "seconds": round(time.monotonic() - t0, 1),
        "steps": steps,
        "exact": exact,
        "collapse": collapse_of(steps, exact),
        "warned_steps": warned,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", default="runs/bench-demo-collapse")
    parser.add_argument(
        "--demo-args",
        nargs="*",
        action="extend",
        default=[],
        help="extra `swarm demo` flags; one starting with - as --demo-args=--flag=value",
    )
    parser.add_argument(
        "--tag",
        default="",
        help="a variant's name (with --demo-args): its own section of docs/benchmarks.md "
        "(bench:demo-collapse-TAG) and plot, beside the defaults'",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        run_dir = out / f"seed-{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        res = run_demo(seed, run_dir, args.demo_args)
        results.append(res)
        (out / "results.jsonl").open("a").write(json.dumps(res) + "\n")
        best = max(res["exact"], default=0.0)
        print(
            f"seed {seed}: rc {res['rc']}, {res['seconds']:.0f}s, {len(res['steps'])} steps, "
            f"best exact {best:.2f}, collapse {res['collapse']}, warnings at "
            f"{res['warned_steps'][:5]}",
            flush=True,
        )
    if not args.no_write:
        write(results, args)


def write(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        ax.plot(r["steps"], r["exact"], label=f"seed {r['seed']}", lw=1)
    ax.set(
        xlabel="learner step",
        ylabel="exact match (trainer batch)",
        ylim=(0, 1.02),
        title="swarm demo, " + (" ".join(args.demo_args) or "default settings"),
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    stem = f"demo_collapse_{args.tag}" if args.tag else "demo_collapse"
    fig.savefig(ROOT / "docs" / f"{stem}.png", dpi=100)
    plt.close(fig)
    n_col = sum(r["collapse"] is not None for r in results)
    variant = f" with `{' '.join(args.demo_args)}`" if args.demo_args else " at its defaults"
    lines = [
        f"## `swarm demo`{variant}: collapses (`bench/demo_collapse.py`)",
        "",
        f"`python bench/demo_collapse.py --seeds {' '.join(str(r['seed']) for r in results)}"
        + "".join(f" --demo-args={a}" for a in args.demo_args)
        + (f" --tag {args.tag}`" if args.tag else "`"),
        "",
        "Each seed is one real local swarm (coordinator, trainer, 3 `hf` nodes, separate "
        "processes) with the demo's defaults (S = 2, 32 prompts × 8, target exact 0.9; time "
        "limit 300 s unless `--time-limit` is given), run one after another on the shared "
        "2-core machine. Exact match = the trainer's batch (samples from policies at most S "
        "versions old; with `filter_groups` also the uniform groups the step left out). "
        "Collapse = a fall of more than 0.3 below an earlier reading ≥ 0.7. "
        f"**{n_col} of {len(results)} runs collapsed.**",
        "",
        "| seed | learner steps | best exact | reached 0.9 | collapse | stability warnings | "
        "wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        col = r["collapse"]
        col_txt = (
            f"{col['peak']:.2f} at step {col['peak_step']} → {col['trough']:.2f} at "
            f"{col['trough_step']}"
            if col
            else "none"
        )
        reached = "yes" if "reached exact match" in r["summary"] else "no"
        warned = r["warned_steps"]
        lines.append(
            f"| {r['seed']} | {r['steps'][-1] if r['steps'] else 0} | "
            f"{max(r['exact'], default=0):.2f} | {reached} | {col_txt} | "
            f"{len(warned)} steps{f' (first {warned[0]})' if warned else ''} | {r['seconds']:.0f} |"
        )
    lines += ["", f"![demo exact-match curves]({stem}.png)", ""]
    section = f"{SECTION}-{args.tag}" if args.tag else SECTION
    write_section(section, "\n".join(lines), ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
