"""Learning benchmark: GRPO with rollouts from policies S versions stale, per staleness correction.

Not a test. One *run* = one task × staleness S × correction option × seed, in process (no swarm):
the learner trains on batches sampled (by the ``hf`` backend) from the weights ``lag`` versions
back (``--lag fixed``: always S, the worst case admission allows; ``uniform``: 0..S per batch),
keeping the last S+1 versions. Every ``--eval-every`` steps the *current* policy is sampled on
fresh prompts (256 samples) and its exact-match rate recorded. A run ends ``--post-steps`` steps
after it first reaches ``--target`` (so that a collapse after the target is seen) or at the task's
step cap. A run *collapses* when its exact match falls by more than 0.3 below an earlier
evaluation that was at least 0.7.

    nice -n 5 python bench/staleness.py --jobs 2                       # the full matrix
    python bench/staleness.py --tasks reverse3 --S 0 4 --options tis off --seeds 0 1 --no-write

Finished runs are appended to a results file (``--results``, JSONL, one run per line keyed by its
settings) and skipped when the command runs again: an interrupted matrix continues where it
stopped. ``--report-only`` rebuilds the tables and figures from that file. Writes the
``bench:staleness`` section of docs/benchmarks.md, docs/staleness.png (steps to target against S)
and docs/staleness_curves.png (exact-match curves at S = 4 and 8).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the project before bench/: bench/protocol.py must not shadow the `protocol` package for the
# modules imported after this one (the unit tests import this file)
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from _staleness_report import WEIGHT_KEYS  # noqa: E402

SECTION = "staleness"

#: TIS: token-level truncated IS, min(π_prox/μ, 2) (AReaL's decoupled PPO); most options add to it
_TIS: dict[str, Any] = {"weight_mode": "truncate", "weight_level": "token", "weight_cap": 2.0}
#: the default: TIS with VCPO's learning-rate scaling by the sequence-level ESS
_VCPO: dict[str, Any] = {**_TIS, "ess_lr_scaling": True}
#: ... trained on informative groups only (vcpo-filter); the base of the KL-adaptive options
_FILTER: dict[str, Any] = {**_VCPO, "filter_groups": True}
#: the mismatch-driven schedule names target_step_kl off (as it was run), rate at most lr
_MKL: dict[str, Any] = {**_FILTER, "target_step_kl": None, "adaptive_lr_max": 1.0}

#: The corrections compared (TrainerConfig overrides); docs/trainer.md gives each one's source.
OPTIONS: dict[str, dict[str, Any]] = {
    "tis": {**_TIS},
    # sequence-level masked IS: the product ratio, the sequence dropped outside [1/2, 2] (MIS)
    "mis": {"weight_mode": "mask", "weight_level": "sequence", "weight_cap": 2.0},
    # geometric-mean rejection sampling, no IS weight: sequence kept iff ratio in [1/C, C]
    "geo-rs": {"weight_mode": "reject", "weight_level": "geometric", "weight_cap": 1.5},
    # IcePop: token ratio kept (weighted) inside [0.5, 5], masked outside
    "icepop": {
        "weight_mode": "mask",
        "weight_level": "token",
        "weight_cap": 5.0,
        "weight_cap_low": 0.5,
    },
    # M2PO: untruncated token weights thinned by the second-moment mask τ = 0.04
    "m2po": {"weight_mode": "raw", "weight_level": "token", "m2_threshold": 0.04},
    # TIS plus the gradient-spike guard (skip an update whose gradient norm is > 5× the median)
    "tis-guard": {**_TIS, "grad_spike_factor": 5.0},
    # VCPO's ESS step size (its baseline is not built)
    "vcpo-ess": {**_VCPO},
    # no correction (w = 1); the PPO clip against π_prox stays
    "off": {"weight_mode": "off"},
    # TIS plus the step rollback: a step that moved the policy > 1 nat/token is undone
    "rollback": {**_TIS, "max_step_kl": 1.0},
    # the default plus the step rollback
    "vcpo-rollback": {**_VCPO, "max_step_kl": 1.0},
    # the default with the entropy bonus only on informative samples, or at half the strength
    "vcpo-ent-informative": {**_VCPO, "entropy_groups": "informative"},
    "vcpo-ent-0.05": {**_VCPO, "entropy_coef": 0.05},
    # TIS, entropy bonus only on the tokens of samples with a non-zero advantage
    "ent-informative": {**_TIS, "entropy_groups": "informative"},
    # TIS with optimizer variants: no momentum (asynchrony already acts as momentum), a faster
    # second moment, a smaller step
    "beta1-0": {**_TIS, "adam_beta1": 0.0},
    "beta2-0.99": {**_TIS, "adam_beta2": 0.99},
    "lr-3e-4": {**_TIS, "lr": 3e-4},
    # the default trained on informative groups only (TrainerConfig.filter_groups, DAPO's dynamic
    # sampling): more prompts are sampled until the batch is full of informative groups (up to
    # filter_max_batches batches' worth, counted in the run's groups_sampled)
    "vcpo-filter": {**_VCPO, "filter_groups": True},
    # ... plus the step rollback at a tight bound: a step that moved the policy > 0.2 nat/token
    # on its own tokens is undone (the drift near the target is a run of 0.2-0.5 steps)
    "vcpo-filter-rollback": {**_VCPO, "filter_groups": True, "max_step_kl": 0.2},
    # ... leaving out only the solved groups (every sample at the full reward): a group stuck on
    # one wrong answer keeps its entropy bonus (TrainerConfig.filter_drop = "solved")
    "vcpo-filter-solved": {**_VCPO, "filter_groups": True, "filter_drop": "solved"},
    # the filters without VCPO's ESS step size: which of the default's two parts costs on the
    # harder task (reverse4)
    "tis-filter": {**_TIS, "filter_groups": True},
    "tis-filter-solved": {**_TIS, "filter_groups": True, "filter_drop": "solved"},
    # vcpo-filter with the KL-adaptive learning rate (trainer/adaptive_lr.py, rsl_rl's adaptive
    # schedule): each step's move held near 0.02 nat/token by scaling lr within [0.05, max] x.
    # max 1: never above lr (the trainer's default range); max 2 and 4 let it rise above lr
    "vcpo-filter-kl": {**_FILTER, "target_step_kl": 0.02, "adaptive_lr_max": 1.0},
    "vcpo-filter-kl2": {**_FILTER, "target_step_kl": 0.02, "adaptive_lr_max": 2.0},
    "vcpo-filter-kl4": {**_FILTER, "target_step_kl": 0.02, "adaptive_lr_max": 4.0},
    # ... a pilot at half the target (3 seeds)
    "vcpo-filter-kl4-0.01": {**_FILTER, "target_step_kl": 0.01, "adaptive_lr_max": 4.0},
    # the same schedule driven by the mismatch KL(μ‖π_prox) instead of the step's own move: no
    # forward pass, and no effect on fresh rollouts (S = 0 trains as vcpo-filter)
    "vcpo-filter-mkl": {**_MKL, "target_mismatch_kl": 0.05},
    "vcpo-filter-mkl-0.1": {**_MKL, "target_mismatch_kl": 0.1},
}
#: Settings under every option unless it names them (not part of a run's key): the options were
#: measured without group filtering before it became the trainer's default, and keep meaning that.
BENCH_BASE: dict[str, Any] = {"filter_groups": False}
# Every option names VCPO's step size explicitly (off unless the option is about it), so that what
# an option means -- and its key in the results file -- does not change with TrainerConfig's
# default (on since this benchmark chose `vcpo-ess`).
for _overrides in OPTIONS.values():
    _overrides.setdefault("ess_lr_scaling", False)

#: Per task: step cap, post-target window.
TASKS: dict[str, dict[str, int]] = {
    "reverse3": {"max_steps": 500, "post_steps": 50},
    "reverse4": {"max_steps": 1200, "post_steps": 50},
}
#: Order in which a matrix is worked through: the comparisons that matter most come first, so
#: that an interrupted matrix has them.
S_PRIORITY = (0, 4, 8, 2, 1, 6)
FIRST_SEEDS = 3

COLLAPSE_FROM = 0.7
COLLAPSE_DROP = 0.3
#: Step metrics kept per step of a run (the stability monitors).
MONITORS = (
    "mismatch_kl",
    "mismatch_m2",
    "ess_frac",
    "clip_frac",
    "mask_frac",
    "weight_modified_frac",
    "grad_norm",
    "entropy",
    "reward_mean",
    "step_kl",
    "lr_factor",
)


@dataclass(frozen=True)
class Spec:
    """One run's settings (its key in the results file)."""

    task: str
    staleness: int
    option: str
    overrides: dict[str, Any]
    seed: int
    max_steps: int
    post_steps: int
    eval_every: int
    target: float
    lag: str
    base: dict[str, Any]

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def collapse_of(steps: list[int], exact: list[float]) -> dict[str, Any] | None:
    """The first fall of more than COLLAPSE_DROP below an earlier evaluation ≥ COLLAPSE_FROM:
    ``{peak_step, peak, trough_step, trough}``, or None."""
    best_i = None
    for i, e in enumerate(exact):
        if best_i is not None and e < exact[best_i] - COLLAPSE_DROP:
            return {
                "peak_step": steps[best_i],
                "peak": exact[best_i],
                "trough_step": steps[i],
                "trough": e,
            }
        if e >= COLLAPSE_FROM and (best_i is None or e > exact[best_i]):
            best_i = i
    return None


def _informative(
    idx: list[int],
    rows: list[Any],
    batch: int,
    group: int,
    next_index: int,
    sample_more: Callable[[list[int], int], list[Any]],
    *,
    max_batches: int,
    min_groups: int,
    drop: str = "uniform",
) -> tuple[list[int], list[Any], int]:
    """``filter_groups`` as the trainer does it (:class:`trainer.filtering.GroupFilter`), on
    prompts sampled here: the groups of ``idx`` (row[3] is the reward) are offered, and
    ``batch`` more prompts sampled at a time until ``batch`` informative ones are in or
    ``max_batches`` batches' worth were looked at (then uniform groups fill up to
    ``min_groups``). Returns the prompt indices and rows of the batch and the prompts sampled
    beyond the first ``batch``."""
    from trainer.filtering import GroupFilter

    pick = GroupFilter(batch, max_batches, min_groups, drop)
    seen: dict[str, tuple[int, list[Any]]] = {}
    used = 0
    for k in range(max_batches):
        if k:
            idx = list(range(next_index + used, next_index + used + batch))
            rows = sample_more(idx, k)
            used += batch
        for j, i in enumerate(idx):
            g = rows[j * group : (j + 1) * group]
            seen[str(i)] = (i, g)
            pick.offer(str(i), [r[3] for r in g])
            if pick.done:
                break
        if pick.done:
            break
    train, _ = pick.chosen()
    return [seen[g][0] for g in train], [r for g in train for r in seen[g][1]], used


def run_one(spec: Spec) -> dict[str, Any]:
    """Train one run; returns its record (JSON-ready)."""
    import torch

    from coordinator.tasks import make_task
    from node.backends.base import GenerationRequest, SamplingConfig
    from node.backends.hf import HFBackend
    from policy.model import CharTokenizer, ModelSpec, build_model
    from trainer.batch import Rollout
    from trainer.config import TrainerConfig
    from trainer.recipe import Trainer

    torch.set_num_threads(1)
    task = make_task(spec.task)
    tok = CharTokenizer()
    max_new = int(spec.task.removeprefix("reverse")) + 2
    cfg = TrainerConfig(
        max_staleness=spec.staleness,
        seed=spec.seed,
        out_dir="/nonexistent-unused",
        resume=False,
        **{**BENCH_BASE, **spec.base, **spec.overrides},
    )
    model = build_model(ModelSpec(), seed=spec.seed)
    trainer = Trainer(cfg, model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    behaviour = HFBackend(ModelSpec(), device="cpu", model=build_model(ModelSpec(), seed=spec.seed))
    evaluator = HFBackend(ModelSpec(), device="cpu", model=build_model(ModelSpec(), seed=spec.seed))

    def sample(backend: HFBackend, indices: list[int], group: int, seed: int) -> list[Any]:
        problems = [task.problem(i) for i in indices]
        prompts = [tok.encode_prompt(p.prompt) for p in problems]
        reqs = [
            GenerationRequest(p, group, seed * 1_000_003 + i)
            for p, i in zip(prompts, indices, strict=True)
        ]
        outs = backend.generate(reqs, SamplingConfig(max_new_tokens=max_new))
        rows = []
        for prob, prompt, samples in zip(problems, prompts, outs, strict=True):
            for s in samples:
                done = s.finish_reason == "stop"
                text = tok.decode(s.token_ids)
                rows.append(
                    (
                        prompt,
                        list(s.token_ids),
                        list(s.logprobs),
                        task.reward(prob, text, done),
                        task.exact(prob, text, done),
                    )
                )
        return rows

    history: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=spec.staleness + 1)
    history.append((0, trainer.state_dict_for_publish()))
    rng = random.Random(spec.seed)
    monitors: dict[str, list[float | None]] = {k: [] for k in MONITORS}
    curve_s: list[int] = []
    curve_e: list[float] = []
    curve_r: list[float] = []
    reached: int | None = None
    secs: float | None = None
    t0 = time.monotonic()
    prompt_index = 0
    groups_sampled = 0
    step = 0
    while step < spec.max_steps and (reached is None or step < reached + spec.post_steps):
        lag = spec.staleness if spec.lag == "fixed" else rng.randint(0, spec.staleness)
        version, weights = history[max(0, len(history) - 1 - lag)]
        behaviour.load_state_dict(version, weights)
        idx = list(range(prompt_index, prompt_index + cfg.batch_prompts))
        prompt_index += cfg.batch_prompts
        rows = sample(behaviour, idx, cfg.group_size, spec.seed + 7919 * step)
        groups_sampled += cfg.batch_prompts
        if cfg.filter_groups:
            idx, rows, used = _informative(
                idx, rows, cfg.batch_prompts, cfg.group_size, prompt_index,
                lambda more, k, step=step: sample(behaviour, more, cfg.group_size,
                                                  spec.seed + 7919 * step + 104729 * k),
                max_batches=cfg.filter_max_batches, min_groups=cfg.minibatches,
                drop=cfg.filter_drop,
            )  # fmt: skip
            prompt_index += used
            groups_sampled += used
        rollouts = [
            Rollout(
                group_id=f"g{idx[k // cfg.group_size]}",
                prompt_ids=p,
                completion_ids=c,
                behaviour_logprobs=lp,
                policy_version=version,
                reward=r,
            )
            for k, (p, c, lp, r, _) in enumerate(rows)
        ]
        m = trainer.train_step(rollouts)
        history.append((trainer.version, trainer.state_dict_for_publish()))
        for k in MONITORS:
            v = m.get(k)
            monitors[k].append(round(float(v), 6) if isinstance(v, int | float) else None)
        step += 1
        if step % spec.eval_every == 0:
            evaluator.load_state_dict(trainer.version, history[-1][1])
            ev = sample(evaluator, [10_000_000 + 256 * step + i for i in range(64)], 4, 99 + step)
            exact = sum(1 for row in ev if row[4]) / len(ev)
            curve_s.append(step)
            curve_e.append(exact)
            curve_r.append(round(sum(row[3] for row in ev) / len(ev), 4))
            if exact >= spec.target and reached is None:
                reached, secs = step, time.monotonic() - t0
    tail = curve_e[-3:] or [0.0]
    tail_r = curve_r[-3:] or [0.0]
    return {
        "key": spec.key(),
        "spec": asdict(spec),
        "steps_to_target": reached,
        "seconds_to_target": secs,
        "steps_run": step,
        "groups_sampled": groups_sampled,
        "seconds": round(time.monotonic() - t0, 1),
        "final_exact": sum(tail) / len(tail),
        "final_reward": sum(tail_r) / len(tail_r),
        "collapse": collapse_of(curve_s, curve_e),
        "curve_steps": curve_s,
        "curve_exact": curve_e,
        "curve_reward": curve_r,
        "monitors": monitors,
    }


def _worker(spec: Spec, nice: int) -> dict[str, Any]:
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    return run_one(spec)


def _open(path: Path, mode: str) -> Any:
    """The results file; a ``.gz`` one (the committed docs/staleness-runs.jsonl.gz) is read and
    appended to as gzip (each append a gzip member)."""
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, mode, encoding="utf-8")
    return path.open(mode, encoding="utf-8")


def load_results(path: Path) -> dict[str, dict[str, Any]]:
    """Finished runs by key (a torn last line, from a kill mid-write, is ignored)."""
    out: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return out
    for line in _open(path, "rt").read().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        out[rec["key"]] = rec
    return out


def build_specs(args: argparse.Namespace, base: dict[str, Any]) -> list[Spec]:
    specs = []
    for task in args.tasks:
        caps = TASKS.get(task, {"max_steps": args.max_steps or 1000, "post_steps": 100})
        max_steps = args.max_steps or caps["max_steps"]
        post = args.post_steps if args.post_steps is not None else caps["post_steps"]
        for s in args.S:
            # At S = 0 the behaviour policy is π_prox itself: every weight option gives w ≡ 1
            # (up to rounding), so S = 0 is run once per seed for them (the first one named);
            # options that change something else (optimizer, entropy, rollback) run their own.
            options = args.options
            if s == 0 and not args.s0_all:
                weight_only = [o for o in args.options if set(OPTIONS[o]) <= WEIGHT_KEYS]
                options = weight_only[:1] + [o for o in args.options if o not in weight_only]
            for opt in options:
                for seed in args.seeds:
                    specs.append(
                        Spec(
                            task=task,
                            staleness=s,
                            option=opt,
                            overrides=dict(OPTIONS[opt]),
                            seed=seed,
                            max_steps=max_steps,
                            post_steps=post,
                            eval_every=args.eval_every,
                            target=args.target,
                            lag=args.lag,
                            base=base,
                        )
                    )
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--S", type=int, nargs="+", default=[0, 1, 2, 4, 6, 8])
    parser.add_argument("--options", nargs="+", default=list(OPTIONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--max-steps", type=int, default=None, help="override the task's cap")
    parser.add_argument("--post-steps", type=int, default=None, help="override the task's")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--s0-all", action="store_true", help="run every option at S = 0 (e.g. optimizer variants)"
    )
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--lag", choices=["fixed", "uniform"], default="fixed")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (at most 2 here)")
    parser.add_argument("--nice", type=int, default=0, help="raise the workers' niceness by this")
    parser.add_argument("--set", nargs="*", default=[], help="TrainerConfig key=value for all runs")
    parser.add_argument(
        "--define",
        nargs="*",
        default=[],
        help="extra options NAME:key=value,key=value (pilot variants)",
    )
    parser.add_argument("--results", default="runs/bench-staleness/results.jsonl")
    parser.add_argument("--report-only", action="store_true", help="no runs; report the file")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    for d in args.define:
        name, _, body = d.partition(":")
        OPTIONS[name] = dict(_kv(kv) for kv in body.split(",") if kv)
    unknown = [o for o in args.options if o not in OPTIONS]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
    base = dict(_kv(kv) for kv in args.set)
    path = ROOT / args.results if not Path(args.results).is_absolute() else Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = build_specs(args, base)
    done = load_results(path)
    todo = [s for s in specs if s.key() not in done]
    print(
        f"{len(specs)} runs, {len(specs) - len(todo)} already in {path}, {len(todo)} to do",
        flush=True,
    )
    if todo and not args.report_only:
        _run_pool(todo, path, done, args)
    from _staleness_report import write_report

    results = [done[s.key()] for s in specs if s.key() in done]
    write_report(results, args, write=not args.no_write)


def _run_pool(
    todo: list[Spec], path: Path, done: dict[str, dict[str, Any]], args: argparse.Namespace
) -> None:
    """Run ``todo`` on ``--jobs`` processes, longest-expected first; append each result."""

    def rank(s: Spec) -> tuple[int, bool, int, int]:
        # three seeds of every (S, option) cell, S in S_PRIORITY order, before the other seeds
        prio = S_PRIORITY.index(s.staleness) if s.staleness in S_PRIORITY else len(S_PRIORITY)
        task = list(TASKS).index(s.task) if s.task in TASKS else len(TASKS)
        return (task, s.seed >= FIRST_SEEDS, prio, s.seed)

    todo = sorted(todo, key=rank)
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        running: dict[Future[dict[str, Any]], Spec] = {}
        queue = list(todo)
        while queue or running:
            while queue and len(running) < max(1, args.jobs):
                spec = queue.pop(0)
                running[pool.submit(_worker, spec, args.nice)] = spec
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                spec = running.pop(fut)
                rec = fut.result()
                with _open(path, "at") as fh:
                    fh.write(json.dumps(rec) + "\n")
                done[rec["key"]] = rec
                n = len(todo) - len(queue) - len(running)
                col = rec["collapse"]
                print(
                    f"[{time.monotonic() - t0:7.0f}s {n}/{len(todo)}] {spec.task} "
                    f"S={spec.staleness} {spec.option} seed {spec.seed}: target at "
                    f"{rec['steps_to_target']} "
                    f"({rec['steps_run']} steps, {rec['seconds']:.0f}s), final exact "
                    f"{rec['final_exact']:.2f}{' COLLAPSE ' + json.dumps(col) if col else ''}",
                    flush=True,
                )


def _kv(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    for conv in (int, float):
        try:
            return key, conv(value)
        except ValueError:
            pass
    if value in ("true", "false"):
        return key, value == "true"
    return key, None if value == "none" else value


if __name__ == "__main__":
    main()
