"""The trainer's collaborators built alone, without a Trainer: the learner step
(trainer/step.py), the checkpoint store (trainer/resume.py) and the publications
(trainer/publishing.py) advance and restore the counters (trainer/progress.py) they are handed,
and nothing else. Then the Trainer that composes them (once, with the parts it is given) and the
step report of the network process (trainer/network.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_recipe import EOS, make_rollouts

from policy.model import CharTokenizer, ModelSpec, build_model
from protocol.identity import Identity
from swarm.memtransport import InMemoryNetwork
from trainer.checkpoints import read_published
from trainer.config import TrainerConfig
from trainer.distributed import DistContext
from trainer.engine import Engine
from trainer.metrics import IdleClock, read_jsonl
from trainer.monitors import GradSpikeGuard, monitor_from_config
from trainer.network import StepReport
from trainer.progress import LearnerProgress, PendingRollouts, StepTiming
from trainer.publishing import Publications
from trainer.recipe import Trainer
from trainer.resume import CheckpointStore
from trainer.sources import InProcessSource, MemoryPublisher
from trainer.step import LearnerStep
from trainer.swarm_client import CoordinatorSource

torch.set_num_threads(1)
#: a lease stop token inside the test's completions (tokens 4-7, then EOS)
LEASE_STOP = 6


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
        progress=progress, pending=pending, timing=timing,
        monitor=monitor_from_config(cfg), spike_guard=GradSpikeGuard(None), on_step=callbacks,
    )  # fmt: skip
    seen: list[dict[str, Any]] = []
    callbacks.append(seen.append)  # added after construction: the list is shared, not copied
    before = [p.detach().clone() for p in model.parameters()]
    idle = IdleClock()  # the run's clock comes with the call
    rec = learner.train_step(make_rollouts(1, 2, 4, version=1), idle=idle)
    assert (progress.step, progress.version) == (1, 2)
    assert idle.busy_s == rec["step_time_s"] == rec["busy_s"]  # the same float, added to 0
    assert (rec["step"], rec["version"], rec["published_version"]) == (1, 2, 1)
    assert rec["publish_s"] == 0.25  # the recipe's figure, read from the progress it handed in
    # what the recipe counted before the step is reported once, then reset
    assert (rec["dropped_stale"], rec["dropped_uniform"]) == (3, 4)
    assert (pending.dropped_at_fetch, pending.uniform_rewards) == (0, [])
    assert timing.t_train_s == rec["step_time_s"] and rec["updates"] > 0
    assert seen == [rec]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_publications_alone_number_and_record_the_versions_they_hand_over(tmp_path: Path) -> None:
    cfg = TrainerConfig(out_dir=str(tmp_path / "run"))
    model = torch.nn.Linear(3, 2)
    progress = LearnerProgress(version=3)
    dist = DistContext()
    pubs = Publications(cfg, model, engine=Engine(dist), dist=dist, progress=progress)
    pubs.sync(7)  # never published here, the swarm holds v7: publish at once, as v8
    assert (progress.version, progress.published_version, pubs.first_due) == (8, None, True)
    publisher, idle = MemoryPublisher(), IdleClock()
    publisher.versions[9] = {}  # the swarm is further ahead still: v8 is refused, renumbered
    asyncio.run(pubs.publish_now(publisher, idle))
    assert sorted(publisher.versions) == [9, 10]
    assert set(publisher.versions[10]) == {"weight", "bias"}  # the model's weights
    assert (progress.version, progress.published_version, pubs.first_due) == (10, 10, False)
    assert read_published(tmp_path / "run") == 10
    assert progress.publish_s is not None and idle.totals()["idle_publish_s"] == progress.publish_s


def _tiny(tmp_path: Path, **kw: Any) -> TrainerConfig:
    base: dict[str, Any] = dict(
        out_dir=str(tmp_path / "run"), batch_prompts=2, group_size=4, minibatches=1
    )
    return TrainerConfig(**{**base, **kw})


def test_the_trainer_composes_its_parts_once(tmp_path: Path) -> None:
    """Issue 33: the step, the checkpoint store and the publications are built once, by the
    Trainer's constructor; a run hands the step its idle clock rather than building them again."""
    tr = Trainer.setup(_tiny(tmp_path, max_steps=1))
    learner, checkpoints, publications = tr.learner, tr.checkpoints, tr.publications
    source = InProcessSource(wait_s=0.05)
    source.put(make_rollouts(2, 2, 4, version=0))
    source.close()
    asyncio.run(tr.run(source, MemoryPublisher()))
    assert tr.step == 1
    assert tr.learner is learner and tr.checkpoints is checkpoints
    assert tr.publications is publications
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert row["busy_s"] == tr.idle.busy_s > 0  # the run's clock counted the step (same float)


def test_a_part_cannot_be_replaced_after_construction(tmp_path: Path) -> None:
    """The collaborators hold the parts they were built with: swapping one on the Trainer would
    leave them training with the old one, so it is refused (build the Trainer with it)."""
    tr = Trainer.setup(_tiny(tmp_path))
    for part in ("config", "optimizer", "spike_guard", "stop_token_ids"):
        with pytest.raises(AttributeError):
            setattr(tr, part, getattr(tr, part))


def test_setup_builds_the_trainer_with_the_parts_it_is_given(tmp_path: Path) -> None:
    guard = GradSpikeGuard(3.0)
    tr = Trainer.setup(
        _tiny(tmp_path / "a"),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        spike_guard=guard,
        lease_stop_ids=[LEASE_STOP],
    )
    assert isinstance(tr.optimizer, torch.optim.SGD) and tr.optimizer.param_groups[0]["lr"] == 0.5
    assert tr.learner.optimizer is tr.optimizer and tr.checkpoints.optimizer is tr.optimizer
    assert tr.learner.spike_guard is guard and tr.checkpoints.spike_guard is guard
    assert tr.stop_token_ids == {LEASE_STOP, EOS}
    # the step trains each completion up to its first stop token: the lease's one too
    plain = Trainer.setup(_tiny(tmp_path / "b"))
    rollouts = make_rollouts(3, 2, 4, version=0)
    assert any(LEASE_STOP in r.completion_ids[:-1] for r in rollouts)
    cut, whole = tr.train_step(rollouts), plain.train_step(rollouts)
    assert 0 < cut["completion_tokens"] < whole["completion_tokens"]


def test_step_report_mirrors_each_step_into_the_stats_the_source_reports(tmp_path: Path) -> None:
    tr = Trainer.setup(_tiny(tmp_path, publish_every=3))
    net = InMemoryNetwork()
    source = CoordinatorSource(net.endpoint("trainer"), "coordinator", Identity.generate())
    report = StepReport(
        source, progress=tr.progress, pending=tr.pending, kappa=tr.config.kappa, max_staleness=2
    )
    tr.on_step.append(report)
    tr.published_version = 0
    rec = tr.train_step(make_rollouts(4, 2, 4, version=0))
    stats = source.stats
    assert (stats["step"], stats["version"], stats["published_version"]) == (1, 1, 0)
    assert stats["kappa"] == 3 and stats["rollout_cursor"] == tr.cursor
    assert stats["max_staleness"] == 2  # the coordinator's backlog bound counts at the learner's S
    assert stats["t_train_s"] == rec["t_train_s"] and stats["reward_mean"] == rec["reward_mean"]


def test_every_fetch_tells_the_coordinator_whether_the_learner_is_blocked() -> None:
    """CoordinatorSource sends ``rollouts_wanted`` with every fetch and report (the coordinator's
    backlog bound feeds a blocked learner), beside the step figures."""
    from protocol.codec import decode, encode
    from protocol.envelope import open_envelope
    from protocol.messages import FetchRollouts, RolloutBatch
    from protocol.rpc import FETCH

    asked: list[dict[str, Any]] = []

    async def scenario() -> None:
        net = InMemoryNetwork()
        trainer = Identity.generate()

        async def on_fetch(caller: str, request: bytes) -> bytes:
            msg = open_envelope(decode(request), FetchRollouts, now=time.time(), replay=None)
            asked.append(dict(msg.trainer_stats))
            return encode(RolloutBatch(rollouts=[], last_seq=msg.after_seq))

        await net.endpoint("coordinator").register(FETCH, on_fetch)
        source = CoordinatorSource(net.endpoint("trainer"), "coordinator", trainer, wait_s=0.0)
        source.stats = {"step": 3}
        assert await source.fetch(8, after=0) == []
        source.set_wanting(24)
        assert await source.fetch(8, after=0) == []
        await source.report()
        source.set_wanting(0)
        assert await source.fetch(8, after=0) == []

    asyncio.run(scenario())
    assert [a["rollouts_wanted"] for a in asked] == [0, 24, 24, 0]
    assert all(a["step"] == 3 for a in asked)
