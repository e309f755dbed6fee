"""The recipe across crashes and restarts: what a kill at the wrong moment leaves on disk or in the
swarm must not stop the restarted trainer, and its versions stay strictly monotonic.

The same faults with real processes: ``tests/integration/test_process_faults.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_recipe import make_rollouts

from trainer.config import TrainerConfig
from trainer.dcp_checkpoint import CheckpointFormatError
from trainer.distributed import DistContext
from trainer.engine import Engine
from trainer.monitors import GradSpikeGuard
from trainer.progress import LearnerProgress, PendingRollouts
from trainer.recipe import Trainer
from trainer.resume import CheckpointStore
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


# ---------------------------------------------------------------- damaged checkpoints (issue 36)
def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    tr = _trainer(tmp_path)
    tr.train_step(make_rollouts(1, 4, 4, version=0))
    first = tr.save_checkpoint()
    tr.train_step(make_rollouts(2, 4, 4, version=1))
    return first, tr.save_checkpoint()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: _flip_a_byte(p / "model.safetensors"), "model.safetensors does not match"),
        (lambda p: (p / "optimizer.pt").write_bytes(b"cut"), "optimizer.pt has 3 bytes where"),
        (lambda p: (p / "optimizer.pt").unlink(), "optimizer.pt is missing"),
        (lambda p: (p / "state.json").write_text("{"), "state.json is unreadable"),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, why: str
) -> None:
    first, second = _two_checkpoints(tmp_path)
    damage(second)
    with caplog.at_level(logging.WARNING, logger="trainer.resume"):
        tr = _trainer(tmp_path)
    assert (tr.step, tr.version) == (1, 1)
    said = [r.getMessage() for r in caplog.records]
    assert any(str(second) in m and why in m and "falling back" in m for m in said), said
    assert any(m.startswith(f"resuming from {first}") for m in said), said
    # the next checkpoint of step 2 replaces the damaged one
    tr.train_step(make_rollouts(3, 4, 4, version=1))
    assert tr.save_checkpoint() == second and _trainer(tmp_path).step == 2


def test_a_sharded_checkpoint_without_its_metadata_is_not_resumed_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # (real 2-rank checkpoints losing .metadata or a shard: tests/integration/test_trainer_fsdp.py)
    _, second = _two_checkpoints(tmp_path)
    (second / "model.safetensors").unlink()
    (second / "sharded").mkdir()
    (second / "sharded" / "__0_0.distcp").write_bytes(b"shard")
    with caplog.at_level(logging.WARNING, logger="trainer.resume"):
        assert _trainer(tmp_path).step == 1
    assert any("sharded/.metadata is missing" in r.getMessage() for r in caplog.records)


def test_no_intact_checkpoint_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    first, second = _two_checkpoints(tmp_path)
    _flip_a_byte(first / "optimizer.pt")
    (second / "optimizer.pt").unlink()
    with pytest.raises(CheckpointFormatError, match="no intact checkpoint under") as err:
        _trainer(tmp_path)
    assert "\n" not in str(err.value) and "step-00000001: optimizer.pt does not match" in str(
        err.value
    )


def test_saving_a_step_again_replaces_it_only_once_the_new_one_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tr = _trainer(tmp_path)
    tr.train_step(make_rollouts(1, 4, 4, version=0))
    saved = tr.save_checkpoint()
    tr.lr_factor = 0.5  # what the second save of step 1 records
    assert tr.save_checkpoint() == saved
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]  # no .old, no .tmp
    assert json.loads((saved / "state.json").read_text())["lr_factor"] == 0.5
    # killed while saving step 1 a third time, just before the new directory is renamed into
    # place: the previous save of step 1 is still there to resume from
    real_replace = os.replace

    def crash_on_install(src: Any, dst: Any) -> None:
        if str(src).endswith(".tmp") and Path(src).is_dir():
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_install)
    tr.lr_factor = 0.25
    with pytest.raises(KeyboardInterrupt):
        tr.save_checkpoint()
    monkeypatch.setattr(os, "replace", real_replace)
    again = _trainer(tmp_path)
    assert (again.step, again.lr_factor) == (1, 0.5)


def test_state_json_and_the_rename_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the checkpoint store alone, over a small module: writing it is what is checked here
    cfg = TrainerConfig(out_dir=str(tmp_path / "run"))
    model = torch.nn.Linear(3, 2)
    dist = DistContext()
    store = CheckpointStore(
        cfg, model, torch.optim.AdamW(model.parameters()), engine=Engine(dist), dist=dist,
        progress=LearnerProgress(step=1, version=1), pending=PendingRollouts(),
        spike_guard=GradSpikeGuard(None),
    )  # fmt: skip
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        events.append(("rename", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = store.save_checkpoint()
    tmp = f"{final}.tmp"
    synced = [p for op, p in events if op == "fsync"]
    assert any(p.startswith(f"{tmp}/.state.json.") for p in synced)  # the file, before its rename
    state_renamed = events.index(("rename", f"{tmp}/state.json"))
    assert ("fsync", tmp) in events[state_renamed:]  # ...and its directory after it
    installed = events.index(("rename", str(final)))
    assert ("fsync", str(final.parent)) in events[installed:]  # the rename into place
    for name in ("model.safetensors", "optimizer.pt"):
        assert f"{tmp}/{name}" in synced


def test_a_restart_keeps_the_spike_guards_history_and_the_rollback_count(tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(lr=0.05, max_step_kl=1e-6, grad_spike_factor=50.0)
    tr = _trainer(tmp_path, **kw)
    for i in range(2):
        tr.train_step(make_rollouts(10 + i, 4, 4, version=i))
    norms = tr.spike_guard.history
    assert tr.rollbacks == 2 and len(norms) == 2  # one update per step (minibatches = 1)
    tr.save_checkpoint()
    again = _trainer(tmp_path, **kw)
    assert again.rollbacks == 2 and again.spike_guard.history == pytest.approx(norms, rel=1e-12)
    rec = again.train_step(make_rollouts(12, 4, 4, version=2))
    assert rec["rollbacks"] == 3 and len(again.spike_guard.history) == 3
