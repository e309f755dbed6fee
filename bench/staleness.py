"""Learning benchmark: GRPO on the embedded task with rollouts from policies S versions stale.

Not a test. For each setting the learner trains on batches sampled (by the ``hf`` backend) from the
weights ``lag`` versions back (``--lag fixed``: always S, the worst case admission allows;
``--lag uniform``: uniform in 0..S per batch), keeping a queue of the last S+1 weight versions.
Every ``--eval-every`` steps the *current* policy is sampled on fresh prompts (temperature 1) and
its exact-match rate recorded; "steps to 0.9" is the first evaluation at ≥ 0.9.

    python bench/staleness.py                # S = 0, 2, 4 staleness-aware, S = 4 weighting off
    python bench/staleness.py --seeds 0 1 2  # more seeds

Writes docs/staleness.png and the ``bench:staleness`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_section  # noqa: E402

from coordinator.tasks import ReverseTask  # noqa: E402
from node.backends.base import GenerationRequest, SamplingConfig  # noqa: E402
from node.backends.hf import HFBackend  # noqa: E402
from policy.model import CharTokenizer, ModelSpec, build_model  # noqa: E402
from trainer.batch import Rollout  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.recipe import Trainer  # noqa: E402

SECTION = "staleness"


@dataclass
class Setting:
    label: str
    staleness: int
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    setting: Setting
    seed: int
    steps_to_target: int | None
    seconds_to_target: float | None
    curve_steps: list[int]
    curve_exact: list[float]
    batch_reward: list[float]
    final_exact: float
    mean_kl: float
    mean_modified: float
    mean_ess_frac: float


def _sample(
    backend: HFBackend,
    task: ReverseTask,
    tok: CharTokenizer,
    indices: list[int],
    group: int,
    seed: int,
    max_new: int,
) -> list[tuple[list[int], list[int], list[float], float, bool]]:
    """(prompt ids, completion ids, log-probs, reward, exact) for ``group`` samples per index."""
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
            finished = s.finish_reason == "stop"
            text = tok.decode(s.token_ids)
            rows.append(
                (
                    prompt,
                    list(s.token_ids),
                    list(s.logprobs),
                    task.reward(prob, text, finished),
                    task.exact(prob, text, finished),
                )
            )
    return rows


def run_setting(
    setting: Setting,
    seed: int,
    *,
    max_steps: int,
    eval_every: int,
    target: float,
    lag_mode: str,
    out_dir: Path,
) -> Result:
    task = ReverseTask(3)
    tok = CharTokenizer()
    cfg = TrainerConfig(
        max_staleness=setting.staleness,
        seed=seed,
        out_dir=str(out_dir / f"{setting.label}-{seed}".replace(" ", "_")),
        resume=False,
        **setting.overrides,
    )
    model = build_model(ModelSpec(), seed=seed)
    trainer = Trainer(cfg, model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    behaviour = HFBackend(ModelSpec(), device="cpu", model=build_model(ModelSpec(), seed=seed))
    evaluator = HFBackend(ModelSpec(), device="cpu", model=build_model(ModelSpec(), seed=seed))
    history: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=setting.staleness + 1)
    history.append((0, trainer.state_dict_for_publish()))
    rng = random.Random(seed)
    max_new = task.length + 2
    steps_at: int | None = None
    secs_at: float | None = None
    curve_s: list[int] = []
    curve_e: list[float] = []
    rewards: list[float] = []
    kls: list[float] = []
    mods: list[float] = []
    esss: list[float] = []
    t_start = time.monotonic()
    prompt_index = 0
    for step in range(max_steps):
        lag = setting.staleness if lag_mode == "fixed" else rng.randint(0, setting.staleness)
        version, weights = history[max(0, len(history) - 1 - lag)]
        behaviour.load_state_dict(version, weights)
        idx = list(range(prompt_index, prompt_index + cfg.batch_prompts))
        prompt_index += cfg.batch_prompts
        rows = _sample(behaviour, task, tok, idx, cfg.group_size, seed + 7919 * step, max_new)
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
        rewards.append(m["reward_mean"])
        kls.append(m["mismatch_kl"])
        mods.append(m["weight_modified_frac"])
        esss.append(m["ess_frac"])
        if (step + 1) % eval_every == 0:
            evaluator.load_state_dict(trainer.version, history[-1][1])
            eval_idx = [10_000_000 + 256 * step + i for i in range(64)]
            ev = _sample(evaluator, task, tok, eval_idx, 4, 99 + step, max_new)
            exact = sum(1 for row in ev if row[4]) / len(ev)
            curve_s.append(step + 1)
            curve_e.append(exact)
            if exact >= target and steps_at is None:
                steps_at = step + 1
                secs_at = time.monotonic() - t_start
                if len(curve_e) >= 1:
                    break
    return Result(
        setting=setting,
        seed=seed,
        steps_to_target=steps_at,
        seconds_to_target=secs_at,
        curve_steps=curve_s,
        curve_exact=curve_e,
        batch_reward=rewards,
        final_exact=curve_e[-1] if curve_e else 0.0,
        mean_kl=sum(kls) / max(1, len(kls)),
        mean_modified=sum(mods) / max(1, len(mods)),
        mean_ess_frac=sum(esss) / max(1, len(esss)),
    )


def default_settings() -> list[Setting]:
    return [
        Setting("S=0", 0),
        Setting("S=2", 2),
        Setting("S=4", 4),
        Setting("S=4 weighting off", 4, {"weight_mode": "off"}),
    ]


def plot(results: list[Result], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, str] = {}
    for res in results:
        label = res.setting.label
        color = colors.setdefault(label, f"C{len(colors)}")
        kw = {"label": label} if res.seed == results[0].seed else {}
        ax1.plot(res.curve_steps, res.curve_exact, color=color, alpha=0.8, **kw)
        ax2.plot(
            range(1, len(res.batch_reward) + 1), res.batch_reward, color=color, alpha=0.6, **kw
        )
    ax1.axhline(target, color="grey", lw=0.8, ls="--")
    ax1.set(xlabel="learner step", ylabel="exact match (current policy)", ylim=(0, 1.02))
    ax2.set(xlabel="learner step", ylabel="mean reward of the (stale) batch", ylim=(0, 1.02))
    ax1.legend()
    ax1.set_title("reverse3, 32 prompts × 8, rollouts S versions stale")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--lag", choices=["fixed", "uniform"], default="fixed")
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides key=value (all)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--out", default="runs/bench-staleness")
    args = parser.parse_args()
    torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    for kv in args.set:
        key, value = kv.split("=", 1)
        extra[key] = _parse_value(value)
    settings = [s for s in default_settings() if not args.only or s.label in args.only]
    results: list[Result] = []
    for s in settings:
        s.overrides = {**extra, **s.overrides}
        for seed in args.seeds:
            res = run_setting(
                s,
                seed,
                max_steps=args.max_steps,
                eval_every=args.eval_every,
                target=args.target,
                lag_mode=args.lag,
                out_dir=ROOT / args.out,
            )
            results.append(res)
            print(
                f"{s.label:>20} seed {seed}: steps to {args.target}: {res.steps_to_target} "
                f"({_fmt(res.seconds_to_target)} s), final exact {res.final_exact:.2f}, "
                f"KL {res.mean_kl:.4f}, modified {res.mean_modified:.3f}, "
                f"ESS/n {res.mean_ess_frac:.3f}",
                flush=True,
            )
    if args.no_write:
        return
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    plot(results, docs / "staleness.png", args.target)
    write_section(SECTION, report(results, args), docs / "benchmarks.md")


def report(results: list[Result], args: argparse.Namespace) -> str:
    cfg = TrainerConfig()
    lines = [
        "## Learning under staleness (`bench/staleness.py`)",
        "",
        f"Task reverse3 (embedded model, random init), {cfg.batch_prompts} prompts × "
        f"{cfg.group_size} samples per step, rollouts sampled by the `hf` backend from the weights "
        f"S versions back ({args.lag} lag), trainer defaults otherwise (weight_mode="
        f"{cfg.weight_mode}, C={cfg.weight_cap}, minibatches={cfg.minibatches}, "
        f"ε={cfg.clip_eps}, entropy {cfg.entropy_coef}, AdamW lr {cfg.lr}). Exact match of the "
        f"current policy on 256 fresh samples every {args.eval_every} steps; cap "
        f"{args.max_steps} steps. Wall time is on a shared 2-core machine, one thread.",
        "",
        f"| setting | seed | steps to exact ≥ {args.target} | seconds | last exact | "
        "mean KL(μ‖π_prox) | mean frac. modified | mean ESS/n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.setting.label} | {r.seed} | {r.steps_to_target or 'not reached'} | "
            f"{_fmt(r.seconds_to_target)} | {r.final_exact:.2f} | {r.mean_kl:.4f} | "
            f"{r.mean_modified:.3f} | {r.mean_ess_frac:.3f} |"
        )
    lines += ["", "![staleness curves](staleness.png)", ""]
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def _parse_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text in ("true", "false"):
        return text == "true"
    return None if text == "none" else text


if __name__ == "__main__":
    main()
