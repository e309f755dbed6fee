"""The recipe across crashes and restarts: what a kill at the wrong moment leaves on disk or in the
swarm must not stop the restarted trainer, and its versions stay strictly monotonic.

The same faults with real processes: ``tests/integration/test_process_faults.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from test_trainer_recipe import make_rollouts

from trainer.config import TrainerConfig
from trainer.recipe import Trainer
from trainer.sources import InProcessSource, MemoryPublisher, VersionNotNewer

torch.set_num_threads(1)


def _trainer(tmp_path: Path, **kw: object) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=4, minibatches=1, **kw
    )  # type: ignore[arg-type]
    return Trainer.setup(cfg)


def _run(tr: Trainer, pub: MemoryPublisher, batches: int, version: int) -> None:
    """Run on ``batches`` fresh batches (their seqs follow the trainer's resumed cursor)."""
    source = InProcessSource(wait_s=0.05)
    rollouts = [r for b in range(batches) for r in make_rollouts(100 + b, 4, 4, version=version)]
    source.put([dataclasses.replace(r, seq=tr.cursor + 1 + i) for i, r in enumerate(rollouts)])
    source.close()
    asyncio.run(tr.run(source, pub))


def test_a_checkpoint_cut_short_by_a_crash_is_not_resumed_from(tmp_path: Path) -> None:
    tr = _trainer(tmp_path)
    tr.train_step(make_rollouts(1, 4, 4, version=0))
    good = tr.save_checkpoint()
    # Killed while saving step 2: the ``.tmp`` directory sorts after ``step-00000001``.
    partial = good.with_name("step-00000002.tmp")
    partial.mkdir()
    shutil.copy(good / "model.safetensors", partial / "model.safetensors")
    # ... and while removing an old checkpoint: a directory without state.json.
    (good.parent / "step-00000000").mkdir()
    tr2 = _trainer(tmp_path)
    assert (tr2.step, tr2.version) == (1, 1)
    tr2.train_step(make_rollouts(2, 4, 4, version=1))
    tr2.save_checkpoint()
    left = sorted(p.name for p in good.parent.iterdir())
    assert left == ["step-00000001", "step-00000002"]  # the leftovers were cleaned up


def test_a_resumed_optimizer_takes_the_new_config_learning_rate(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lr=5e-4)
    tr.train_step(make_rollouts(1, 4, 4, version=0))
    tr.save_checkpoint()
    assert [g["betas"] for g in tr.optimizer.param_groups] == [(0.9, 0.999)]
    # edited trainer.toml, then restart
    tr2 = _trainer(tmp_path, lr=1e-4, weight_decay=0.01, adam_beta1=0.5, adam_beta2=0.99)
    assert tr2.step == 1 and tr2.optimizer.state  # the moments came back...
    assert [(g["lr"], g["weight_decay"]) for g in tr2.optimizer.param_groups] == [(1e-4, 0.01)]
    assert [g["betas"] for g in tr2.optimizer.param_groups] == [(0.5, 0.99)]


def test_killed_before_the_first_checkpoint_keeps_counting_versions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "published.json").write_text(json.dumps({"version": 4}))
    tr = _trainer(tmp_path)  # no checkpoint: fresh weights, but v0..v4 name other weights
    assert (tr.step, tr.version, tr.published_version) == (0, 4, 4)


def test_a_coordinator_ahead_of_the_record_becomes_the_floor(tmp_path: Path) -> None:
    # The trainer published v3 (the coordinator recorded it) and was killed before
    # published.json and the step-3 checkpoint did: its record says v2.
    tr = _trainer(tmp_path, max_staleness=2)  # κ = 1
    pub = MemoryPublisher()
    _run(tr, pub, 2, version=0)
    assert sorted(pub.versions) == [0, 1, 2] and tr.published_version == 2
    pub.versions[3] = {}  # the lost publication
    tr2 = _trainer(tmp_path, max_staleness=2)
    assert tr2.published_version == 2
    tr2.sync_published(max(pub.versions))
    assert (tr2.version, tr2.published_version) == (3, 3)
    _run(tr2, pub, 1, version=3)
    assert sorted(pub.versions) == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / "run" / "published.json").read_text()) == {"version": 4}


@pytest.mark.parametrize(
    ("recorded", "latest", "first"),
    [(None, None, [0]), (None, 5, [6]), (3, None, [3]), (3, 1, [3]), (3, 3, [])],
)
def test_sync_publishes_at_once_when_the_swarm_lacks_our_weights(
    tmp_path: Path, recorded: int | None, latest: int | None, first: list[int]
) -> None:
    tr = _trainer(tmp_path)
    tr.version = recorded or 0
    tr.published_version = recorded
    tr.sync_published(latest)
    pub = MemoryPublisher()
    if latest is not None:
        pub.versions[latest] = {}
    _run(tr, pub, 0, version=0)
    assert sorted(v for v in pub.versions if v != latest) == first


def test_a_refused_publication_is_renumbered_strictly_newer(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, max_staleness=2)
    tr.published_version = 0  # resumed without asking the coordinator
    pub = MemoryPublisher()
    pub.versions[5] = {}
    _run(tr, pub, 1, version=0)
    assert sorted(pub.versions) == [5, 6] and (tr.version, tr.published_version) == (6, 6)
    with pytest.raises(VersionNotNewer, match="not newer than 6"):
        asyncio.run(pub.publish(6, {}))


class _SlowPublisher(MemoryPublisher):
    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()

    async def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.started.set()
        await asyncio.sleep(0.2)
        await super().publish(version, state_dict)


def test_a_stop_lets_the_publication_in_progress_finish_and_record_itself(
    tmp_path: Path,
) -> None:
    tr = _trainer(tmp_path, max_staleness=2)
    pub = _SlowPublisher()

    async def scenario() -> None:
        source = InProcessSource(wait_s=0.05)
        run = asyncio.create_task(tr.run(source, pub))
        await pub.started.wait()  # v0 is being published
        pub.started.clear()
        source.put(make_rollouts(7, 4, 4, version=0))
        await pub.started.wait()  # v1 is being published
        tr.request_stop()
        await asyncio.wait_for(run, 10)

    asyncio.run(scenario())
    assert sorted(pub.versions) == [0, 1]
    assert json.loads((tmp_path / "run" / "published.json").read_text()) == {"version": 1}
    tr2 = _trainer(tmp_path, max_staleness=2)
    assert (tr2.step, tr2.version, tr2.published_version) == (1, 1, 1)
