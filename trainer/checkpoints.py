"""The trainer's files under ``out_dir``: its checkpoint directories and ``published.json``.

``out_dir/checkpoints/step-NNNNNNNN/`` is one checkpoint, written by
:meth:`trainer.resume.CheckpointState.save_checkpoint` into ``step-NNNNNNNN.tmp`` and renamed
into place when complete, so a crash mid-save leaves a ``.tmp`` directory that is never taken for a
checkpoint (:func:`complete_checkpoints`). What a checkpoint directory holds (``state.json``
beside the weights and optimizer state, single-process or sharded) is the Trainer's and
:mod:`trainer.dcp_checkpoint`'s business.

``out_dir/published.json`` records the last version handed to a publisher. It is written after
every publication, so a trainer killed before its next checkpoint still never reuses a published
version number (:func:`read_published` on resume).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from swarm.files import atomic_write_text

#: the directory of checkpoints inside ``out_dir``.
CHECKPOINT_DIR = "checkpoints"
#: the record of the last published version inside ``out_dir``.
PUBLISHED_FILE = "published.json"


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-*`` directories under ``root`` that a save finished (renamed into place), oldest
    first. A ``step-N.tmp`` directory is what a crash during
    :meth:`~trainer.resume.CheckpointState.save_checkpoint` leaves behind; it sorts after
    ``step-N`` and must never be taken for the newest."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.name.startswith("step-")
        and not p.name.endswith(".tmp")
        and (p / "state.json").is_file()
    )


def prune_checkpoints(root: Path, keep: int) -> None:
    """Remove everything under ``root`` but the newest ``keep`` complete checkpoints, including
    what a crash left behind: a ``.tmp`` save, or an old checkpoint whose removal was cut short."""
    kept = set(complete_checkpoints(root)[-keep:])
    for old in root.glob("step-*"):
        if old not in kept and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def read_published(out_dir: Path) -> int | None:
    """The version recorded in ``published.json`` (None if there is none)."""
    path = out_dir / PUBLISHED_FILE
    return int(json.loads(path.read_text())["version"]) if path.is_file() else None


def write_published(out_dir: Path, version: int) -> None:
    """Record ``version`` as the last published one in ``published.json``, atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / PUBLISHED_FILE, {"version": version})


def atomic_write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` whole, renamed into place (:mod:`swarm.files`)."""
    atomic_write_text(path, json.dumps(dict(data), sort_keys=True, indent=1))
