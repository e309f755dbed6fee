"""Checkpoints of the learner: save, find the newest intact one, load, resume a run.

:class:`CheckpointStore` receives the model, optimizer, engine, ranks and the recipe's counters
it saves and restores as constructor arguments; :class:`trainer.recipe.Trainer` builds it. The
directories, ``published.json``, checksums and pruning are :mod:`trainer.checkpoints`; sharded
(several ranks) checkpoints are :mod:`trainer.dcp_checkpoint`.

Resuming falls back: :meth:`CheckpointStore.latest_checkpoint` takes the newest complete
checkpoint whose files match the sizes and CRC-32s its ``state.json`` recorded; one that does not
(a damaged or missing shard, a lost ``.metadata``) is skipped with a WARNING naming it and why,
and the previous one is taken. Only when none is left does the trainer refuse to start (rather
than start fresh beside checkpoints it could not read).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoints import (
    CHECKPOINT_DIR,
    atomic_write_json,
    checkpoint_problem,
    complete_checkpoints,
    file_manifest,
    install_checkpoint,
    prune_checkpoints,
    read_published,
)
from trainer.config import TrainerConfig
from trainer.dcp_checkpoint import (
    SHARDED_DIR,
    CheckpointFormatError,
    load_full_checkpoint,
    load_sharded,
    save_sharded,
)
from trainer.distributed import DistContext
from trainer.engine import Engine
from trainer.monitors import GradSpikeGuard
from trainer.progress import LearnerProgress, PendingRollouts

log = logging.getLogger(__name__)


class CheckpointStore:
    """Checkpoint I/O for the model and optimizer it is given, saving and restoring the recipe's
    counters (:class:`~trainer.progress.LearnerProgress`, the rollout cursor of
    :class:`~trainer.progress.PendingRollouts`, the spike guard's history) that it receives."""

    def __init__(
        self,
        config: TrainerConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        engine: Engine,
        dist: DistContext,
        progress: LearnerProgress,
        pending: PendingRollouts,
        spike_guard: GradSpikeGuard,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.engine = engine
        self.dist = dist
        #: the run's directory: checkpoints under ``checkpoints/``, ``published.json``
        self.out_dir = Path(config.out_dir)
        self.progress = progress
        self.pending = pending
        self.spike_guard = spike_guard

    def resume(self) -> Path | None:
        """Continue from ``out_dir``: load the newest intact checkpoint (returned), or, when the
        trainer was killed before its first checkpoint, continue the version numbers after the
        last one ``published.json`` records (the weights are lost, the numbers are not: a
        version already published must never name other weights). A collective: every rank
        resumes from what rank 0 finds (the same files on a shared filesystem).

        Raises:
            CheckpointFormatError: there are complete checkpoints, but none is intact."""
        latest, logged = self.dist.share((self.latest_checkpoint(), read_published(self.out_dir)))
        progress = self.progress
        if latest is not None:
            self.load_checkpoint(latest)
            log.info(
                "resumed from %s at step %d version %d", latest, progress.step, progress.version
            )
        elif logged is not None:
            progress.version = progress.published_version = logged
            log.info("no checkpoint to resume; continuing the version numbers after v%d", logged)
        return latest

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint whose files are intact (a ``.tmp`` one left by a crash
        mid-save is not complete). One that is not (a shard cut short, damaged or missing, a
        lost ``.metadata``, an unreadable ``state.json``: see
        :func:`~trainer.checkpoints.checkpoint_problem`) is skipped with a WARNING naming it
        and why, and the previous one is taken. None: there is no checkpoint. A collective:
        rank 0 checks (the same files on a shared filesystem) and every rank gets its answer.

        Raises:
            CheckpointFormatError: there are complete checkpoints, but none is intact."""
        found: tuple[Path | None, str | None] = (None, None)
        if self.dist.is_leader:
            found = self._newest_intact()
        path, error = self.dist.share(found)
        if error is not None:
            raise CheckpointFormatError(error)
        return path

    def _newest_intact(self) -> tuple[Path | None, str | None]:
        """(the newest intact checkpoint, None) or (None, why none is)."""
        root = self.out_dir / CHECKPOINT_DIR
        skipped: list[str] = []
        for path in reversed(complete_checkpoints(root)):
            problem = checkpoint_problem(path)
            if problem is None:
                if skipped:
                    log.warning(
                        "resuming from %s, the newest intact checkpoint (skipped: %s)",
                        path, "; ".join(skipped),
                    )  # fmt: skip
                return path, None
            log.warning(
                "checkpoint %s is damaged: %s; falling back to the previous complete one",
                path, problem,
            )  # fmt: skip
            skipped.append(f"{path.name}: {problem}")
        if skipped:
            return None, (
                f"no intact checkpoint under {root} ({'; '.join(skipped)}); move the directory "
                "away to start fresh"
            )
        return None, None

    def save_checkpoint(self, path: Path | None = None) -> Path:
        """Write weights, optimizer, step, version, published version, rollout cursor, the
        KL-adaptive factor, the gradient-spike guard's history and the rollback counter to a new
        directory; every file fsynced and listed with its size and CRC-32 in ``state.json``
        (fsynced too), then renamed into place (:func:`~trainer.checkpoints.install_checkpoint`:
        a checkpoint of the same step is replaced, never removed first); keep the last
        ``keep_checkpoints``.

        Sharded (several ranks), a collective: every rank writes its shards with
        ``torch.distributed.checkpoint`` (:mod:`trainer.dcp_checkpoint`) and checksums them,
        rank 0 the rest."""
        from safetensors.torch import save_model

        root = self.out_dir / CHECKPOINT_DIR
        final = path or root / f"step-{self.progress.step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        leader = self.dist.is_leader
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.engine.sharded:
            self.dist.barrier()  # the directory is fresh before any rank writes into it
            save_sharded(tmp / SHARDED_DIR, self.model, self.optimizer)
            # each rank checksums the files it wrote (DCP names them __<rank>_<n>.distcp)
            mine = sorted((tmp / SHARDED_DIR).glob(f"__{self.dist.rank}_*.distcp"))
            files: dict[str, list[int]] = {}
            for part in self.dist.all_gather_objects(file_manifest(mine, tmp)):
                files.update(part)
            if leader:
                files.update(file_manifest([tmp / SHARDED_DIR / ".metadata"], tmp))
        else:
            save_model(self.model, str(tmp / "model.safetensors"))
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            files = file_manifest([tmp / "model.safetensors", tmp / "optimizer.pt"], tmp)
        if leader:
            state = {
                "step": self.progress.step,
                "version": self.progress.version,
                "published_version": self.progress.published_version,
                "cursor": self.pending.cursor,
                "lr_factor": self.progress.lr_factor,
                "rollbacks": self.progress.rollbacks,
                "grad_norms": self.spike_guard.history,
                "world_size": self.dist.world_size,
                "files": files,
                "config": self.config.model_dump(),
            }
            atomic_write_json(tmp / "state.json", state)  # fsynced, and tmp/ with it
            install_checkpoint(tmp, final)
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

        saved = _saved_state(path)
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
        self.progress.step = saved["step"]
        published = saved["published_version"]
        logged = read_published(self.out_dir)
        if logged is not None:
            published = logged if published is None else max(published, logged)
        self.progress.published_version = published
        progress = self.progress
        progress.version = max(saved["version"], progress.published_version or 0, progress.version)
        self.pending.fetched = saved["cursor"]
        # the KL-adaptive schedule, the spike guard and the rollback count go on where they were
        # (checkpoints from before them: factor 1, no history, 0)
        self.progress.lr_factor = saved["lr_factor"]
        self.progress.rollbacks = saved["rollbacks"]
        self.spike_guard.restore(saved["grad_norms"])
        self.pending.groups.clear()


def _saved_state(path: Path) -> dict[str, Any]:
    """``state.json`` of the checkpoint ``path``, every field read and typed before anything is
    loaded (a bad file fails here, having changed nothing)."""
    state = json.loads((path / "state.json").read_text())
    published = state.get("published_version")
    return {
        "step": int(state["step"]),
        "version": int(state["version"]),
        "published_version": None if published is None else int(published),
        "cursor": int(state["cursor"]),
        "lr_factor": float(state.get("lr_factor", 1.0)),
        "rollbacks": int(state.get("rollbacks", 0)),
        "grad_norms": [float(n) for n in state.get("grad_norms", [])],
    }
