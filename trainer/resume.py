"""Checkpoints of the learner: save, find the newest, load (a mixin of the trainer).

:class:`CheckpointState` is a mixin of :class:`trainer.recipe.Trainer`, which sets the state
declared below in its ``__init__``. The directories, ``published.json`` and pruning are
:mod:`trainer.checkpoints`; sharded (several ranks) checkpoints are :mod:`trainer.dcp_checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from trainer.batch import Rollout
from trainer.checkpoints import (
    CHECKPOINT_DIR,
    atomic_write_json,
    complete_checkpoints,
    prune_checkpoints,
    read_published,
)
from trainer.config import TrainerConfig
from trainer.dcp_checkpoint import (
    SHARDED_DIR,
    load_full_checkpoint,
    load_sharded,
    save_sharded,
)
from trainer.distributed import DistContext
from trainer.engine import Engine


class CheckpointState:
    """Checkpoint I/O and the resumable rollout cursor, as a mixin of
    :class:`~trainer.recipe.Trainer` (which sets every attribute below in its ``__init__``)."""

    config: TrainerConfig
    model: torch.nn.Module
    engine: Engine
    dist: DistContext
    optimizer: torch.optim.Optimizer
    out_dir: Path
    step: int
    version: int
    published_version: int | None
    lr_factor: float
    #: highest rollout ``seq`` fetched; see :attr:`cursor` for the resumable one.
    _fetched: int
    #: fetched rollouts waiting for their group to complete, by group id
    _pending: dict[str, list[Rollout]]

    @property
    def cursor(self) -> int:
        """Resumable cursor: every rollout with ``seq ≤ cursor`` was trained on or dropped."""
        pending = [r.seq for g in self._pending.values() for r in g]
        return min(pending) - 1 if pending else self._fetched

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (a ``.tmp`` one left by a crash mid-save is not)."""
        done = complete_checkpoints(self.out_dir / CHECKPOINT_DIR)
        return done[-1] if done else None

    def save_checkpoint(self, path: Path | None = None) -> Path:
        """Write weights, optimizer, step, version, published version and rollout cursor to a new
        directory (atomically renamed into place); keep the last ``keep_checkpoints``.

        Sharded (several ranks), a collective: every rank writes its shards with
        ``torch.distributed.checkpoint`` (:mod:`trainer.dcp_checkpoint`), rank 0 the rest."""
        from safetensors.torch import save_model

        root = self.out_dir / CHECKPOINT_DIR
        final = path or root / f"step-{self.step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        leader = self.dist.is_leader
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.engine.sharded:
            self.dist.barrier()  # the directory is fresh before any rank writes into it
            save_sharded(tmp / SHARDED_DIR, self.model, self.optimizer)
        else:
            save_model(self.model, str(tmp / "model.safetensors"))
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        if leader:
            state = {
                "step": self.step,
                "version": self.version,
                "published_version": self.published_version,
                "cursor": self.cursor,
                "lr_factor": self.lr_factor,
                "world_size": self.dist.world_size,
                "config": self.config.model_dump(),
            }
            atomic_write_json(tmp / "state.json", state)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            if path is None:
                prune_checkpoints(root, self.config.keep_checkpoints)
        self.dist.barrier()  # no rank goes on (to read it, or to the next save) before it is done
        return final

    def load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`. The version becomes
        ``max(saved version, last published version)`` so it never goes back. The optimizer's
        moments come back; its learning rate, weight decay and β2 are this run's config's.

        Any number of ranks loads any checkpoint: a sharded one is resharded by
        ``torch.distributed.checkpoint``; a single-process one is split over the ranks."""
        from safetensors.torch import load_file, load_model

        state = json.loads((path / "state.json").read_text())
        if (path / SHARDED_DIR).is_dir():
            load_sharded(path / SHARDED_DIR, self.model, self.optimizer)
        elif self.engine.sharded:
            opt_state = torch.load(path / "optimizer.pt", weights_only=True)
            model_state = load_file(str(path / "model.safetensors"))
            load_full_checkpoint(self.model, self.optimizer, model_state, opt_state)
        else:
            load_model(self.model, str(path / "model.safetensors"))
            opt_state = torch.load(path / "optimizer.pt", weights_only=True)
            self.optimizer.load_state_dict(opt_state)
        for group in self.optimizer.param_groups:  # the config wins over the saved values
            group["lr"] = self.config.lr
            group["weight_decay"] = self.config.weight_decay
            group["betas"] = (self.config.adam_beta1, self.config.adam_beta2)
        self.step = int(state["step"])
        published = state.get("published_version")
        logged = read_published(self.out_dir)
        if logged is not None:
            published = logged if published is None else max(int(published), logged)
        self.published_version = None if published is None else int(published)
        self.version = max(int(state["version"]), self.published_version or 0, self.version)
        self._fetched = int(state["cursor"])
        # the KL-adaptive schedule goes on where it was (checkpoints from before it: factor 1)
        self.lr_factor = float(state.get("lr_factor", 1.0))
        self._pending.clear()
