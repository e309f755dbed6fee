"""The trainer's files under ``out_dir``: its checkpoint directories and ``published.json``.

``out_dir/checkpoints/step-NNNNNNNN/`` is one checkpoint, written by
:meth:`trainer.resume.CheckpointStore.save_checkpoint` into ``step-NNNNNNNN.tmp``, every file
fsynced, and renamed into place when complete (:func:`install_checkpoint`), so a crash mid-save
leaves a ``.tmp`` directory that is never taken for a checkpoint (:func:`complete_checkpoints`).
Saving a step that already has a checkpoint (a stop right after a periodic save) never removes
the old one before the new one is in place: the old directory is renamed ``step-N.old``, the new
one renamed into place, the parent directory fsynced, and only then is ``step-N.old`` removed; a
crash between the two renames leaves ``step-N.old``, which counts as step N while no ``step-N``
exists. What a checkpoint directory holds (``state.json`` beside the weights and optimizer
state, single-process or sharded) is the Trainer's and :mod:`trainer.dcp_checkpoint`'s
business; ``state.json`` lists every other file with its size and CRC-32 (``files``), so that a
resume can tell a damaged checkpoint from a good one (:func:`checkpoint_problem`) and fall back
to the previous one.

``out_dir/published.json`` records the last version handed to a publisher. It is written after
every publication, so a trainer killed before its next checkpoint still never reuses a published
version number (:func:`read_published` on resume).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: the directory of checkpoints inside ``out_dir``.
CHECKPOINT_DIR = "checkpoints"
#: the record of the last published version inside ``out_dir``.
PUBLISHED_FILE = "published.json"
#: suffix of a checkpoint directory that a re-save of its step is replacing.
OLD_SUFFIX = ".old"
#: the DCP directory inside a sharded checkpoint (:mod:`trainer.dcp_checkpoint`).
_SHARDED = "sharded"
_STEP = re.compile(r"step-(\d+)(\.old)?")


def complete_checkpoints(root: Path) -> list[Path]:
    """The checkpoints under ``root`` that a save finished (renamed into place), oldest first.

    A ``step-N.tmp`` directory is what a crash during
    :meth:`~trainer.resume.CheckpointStore.save_checkpoint` leaves behind and is never one; a
    ``step-N.old`` (a crash while a re-save of step N replaced it) stands for step N while no
    complete ``step-N`` exists. Complete means renamed into place with its ``state.json``; whether
    its files are intact is :func:`checkpoint_problem`'s question."""
    if not root.is_dir():
        return []
    by_step: dict[int, Path] = {}
    for p in root.iterdir():
        m = _STEP.fullmatch(p.name)
        if m is None or not (p / "state.json").is_file():
            continue
        step = int(m.group(1))
        if m.group(2) is None or step not in by_step:  # step-N wins over step-N.old
            by_step[step] = p
    return [by_step[k] for k in sorted(by_step)]


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
    """Write ``data`` to ``path`` whole and durably: a temporary file in the same directory,
    fsynced, renamed into place, and the directory fsynced (so the rename survives a power
    loss, not only a crash of this process)."""
    text = json.dumps(dict(data), sort_keys=True, indent=1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: the names in it, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path, *, chunk: int = 16 << 20) -> int:
    """CRC-32 of a file's bytes (zlib; about 2.5 GB/s on one core)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def file_manifest(paths: Iterable[Path], base: Path) -> dict[str, list[int]]:
    """``{path relative to base: [size in bytes, CRC-32]}`` of ``paths``, each fsynced first."""
    out: dict[str, list[int]] = {}
    for p in paths:
        fsync_path(p)
        out[p.relative_to(base).as_posix()] = [p.stat().st_size, file_crc32(p)]
    return out


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with the checkpoint directory ``path`` (None: nothing found), in a few
    words: ``state.json`` unreadable, a file it needs missing (the sharded ``.metadata``
    included), or a file whose size or CRC-32 differs from what ``state.json`` recorded when it
    was written. Reads every file once (checkpoints from before the checksums: presence only)."""
    try:
        state = json.loads((path / "state.json").read_text())
        files = state.get("files") if isinstance(state, dict) else None
        if not isinstance(state, dict) or not {"step", "version", "cursor"} <= state.keys():
            return "state.json lacks step, version or cursor"
    except (OSError, ValueError) as exc:
        return f"state.json is unreadable ({type(exc).__name__})"
    if (path / _SHARDED).is_dir():
        needed = [f"{_SHARDED}/.metadata"]
    else:
        needed = ["model.safetensors", "optimizer.pt"]
    for rel in needed:
        if not (path / rel).is_file():
            return f"{rel} is missing"
    for rel, (size, crc) in sorted((files or {}).items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if (actual := f.stat().st_size) != size:
            return f"{rel} has {actual} bytes where {size} were written"
        if file_crc32(f) != crc:
            return f"{rel} does not match the CRC-32 recorded when it was written"
    return None


def install_checkpoint(tmp: Path, final: Path) -> None:
    """Rename the complete checkpoint ``tmp`` to ``final``; an existing ``final`` (the same step
    saved again) is renamed ``final.old`` first and removed only once the new one is in place
    and the parent directory fsynced."""
    fsync_path(tmp)
    old = final.with_name(final.name + OLD_SUFFIX)
    if final.exists():
        if old.exists():  # a leftover: final is there, so it is not the only copy of the step
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)
