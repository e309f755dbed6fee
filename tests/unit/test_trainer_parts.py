"""The trainer's collaborators built alone, without a Trainer: the learner step
(trainer/step.py) and the checkpoint store (trainer/resume.py) advance and restore the counters
(trainer/progress.py) they are handed, and nothing else."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from test_trainer_recipe import make_rollouts

from policy.model import CharTokenizer, ModelSpec, build_model
from trainer.config import TrainerConfig
from trainer.distributed import DistContext
from trainer.engine import Engine
from trainer.metrics import IdleClock
from trainer.monitors import GradSpikeGuard, monitor_from_config
from trainer.progress import LearnerProgress, PendingRollouts, StepTiming
from trainer.resume import CheckpointStore
from trainer.step import LearnerStep

torch.set_num_threads(1)


def _store(
    cfg: TrainerConfig, model: torch.nn.Module, progress: LearnerProgress, pending: PendingRollouts
) -> tuple[CheckpointStore, torch.optim.Optimizer, GradSpikeGuard]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    guard = GradSpikeGuard(5.0)
    dist = DistContext()
    store = CheckpointStore(
        cfg, model, optimizer, engine=Engine(dist), dist=dist, progress=progress,
        pending=pending, spike_guard=guard,
    )  # fmt: skip
    return store, optimizer, guard


def test_a_checkpoint_store_alone_saves_and_restores_what_it_was_handed(tmp_path: Path) -> None:
    cfg = TrainerConfig(out_dir=str(tmp_path / "run"), lr=0.01)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    progress = LearnerProgress(step=3, version=5, published_version=4, lr_factor=0.5, rollbacks=2)
    made = make_rollouts(0, 1, 2, version=4)
    rollouts = [dataclasses.replace(r, seq=seq) for seq, r in zip((7, 8), made, strict=True)]
    pending = PendingRollouts(fetched=9, groups={"g": rollouts})
    store, optimizer, guard = _store(cfg, model, progress, pending)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # moments to save
    guard.restore([1.0, 2.0])
    path = store.save_checkpoint()
    assert path.name == "step-00000003"  # named by the progress it was handed

    fresh_model = torch.nn.Linear(3, 2)
    fresh_progress, fresh_pending = LearnerProgress(), PendingRollouts(groups={"x": rollouts})
    fresh, fresh_opt, fresh_guard = _store(cfg, fresh_model, fresh_progress, fresh_pending)
    assert fresh.latest_checkpoint() == path
    fresh.load_checkpoint(path)
    # published.json was never written: the checkpoint's own published version stands
    assert fresh_progress == LearnerProgress(
        step=3, version=5, published_version=4, lr_factor=0.5, rollbacks=2
    )
    # the cursor: seq 7 was still waiting, so everything up to 6 is done; groups are refetched
    assert (fresh_pending.fetched, fresh_pending.groups) == (6, {})
    assert fresh_guard.history == [1.0, 2.0]
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)  # the same bytes written and read back
    saved_moments = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved_moments)


def test_a_learner_step_alone_advances_the_counters_it_was_handed(tmp_path: Path) -> None:
    cfg = TrainerConfig(out_dir=str(tmp_path / "run"), batch_prompts=2, group_size=4, minibatches=1)
    model = build_model(ModelSpec(path=cfg.model_path, dtype=cfg.dtype), seed=cfg.seed)
    tok = CharTokenizer()
    progress = LearnerProgress(version=1, published_version=1, publish_s=0.25)
    pending = PendingRollouts(dropped_at_fetch=3, uniform_rewards=[1.0] * 4)
    timing = StepTiming()
    dist = DistContext()
    callbacks: list[Any] = []
    learner = LearnerStep(
        cfg, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), engine=Engine(dist),
        dist=dist, pad_token_id=tok.pad_token_id, stop_token_ids=frozenset({tok.eos_token_id}),
        progress=progress, pending=pending, timing=timing, idle=IdleClock(),
        monitor=monitor_from_config(cfg), spike_guard=GradSpikeGuard(None), on_step=callbacks,
    )  # fmt: skip
    seen: list[dict[str, Any]] = []
    callbacks.append(seen.append)  # added after construction: the list is shared, not copied
    before = [p.detach().clone() for p in model.parameters()]
    rec = learner.train_step(make_rollouts(1, 2, 4, version=1))
    assert (progress.step, progress.version) == (1, 2)
    assert (rec["step"], rec["version"], rec["published_version"]) == (1, 2, 1)
    assert rec["publish_s"] == 0.25  # the recipe's figure, read from the progress it handed in
    # what the recipe counted before the step is reported once, then reset
    assert (rec["dropped_stale"], rec["dropped_uniform"]) == (3, 4)
    assert (pending.dropped_at_fetch, pending.uniform_rewards) == (0, [])
    assert timing.t_train_s == rec["step_time_s"] and rec["updates"] > 0
    assert seen == [rec]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
