"""The chunk store never shows a version a seed did not finish (issue 36 item 7).

A trainer killed while seeding a delta version left, in a fresh-clone run, a seed store holding the
manifest of v3 while its delta part was incomplete (``KeyError: the delta part of version 3 is not
complete in the store``). Here the kill is reproduced deterministically: the store's file writes
fail from the N-th on (as a SIGKILL stops them), for every N a seed makes, and the store reopened
on the same directory must hold either nothing of that version or all of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from protocol.identity import Identity
from protocol.manifest import part_indices, sign_manifest
from swarm.checkpoint_io import cast_floats, state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.publication import VersionBuilder, held_base


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not an Exception: no handler catches it)."""


class KillAt:
    """A stand-in for ``ChunkStore._atomic_write`` that raises :class:`Killed` at write ``n``."""

    def __init__(self, n: int, write: Callable[[Path, bytes], None]) -> None:
        self.n, self.write, self.done = n, write, 0

    def __call__(self, path: Path, data: bytes) -> None:
        if self.done == self.n:
            raise Killed
        self.write(path, data)
        self.done += 1


def _files(step: int) -> dict[str, bytes]:
    gen = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(96, 64, generator=gen), "b.bias": torch.randn(64, generator=gen)}
    for _ in range(1, step + 1):  # a few bf16 elements change per step: v2 is a delta
        w["a.weight"] = w["a.weight"] + 1e-4 * torch.randn(96, 64, generator=gen)
    return state_dict_to_files(cast_floats(w, "bfloat16"))


def _seeded_store(root: Path) -> tuple[ChunkStore, list[tuple[object, object, list[bytes]]]]:
    """A store holding v1 (a keyframe) and the signed v2 (a delta against it), not yet seeded."""
    signer = Identity.generate()
    builder = VersionBuilder(model_config_hash="ab", tokenizer_hash="cd", chunk_size=2048)
    store = ChunkStore(root, keep_versions=10)
    out = []
    for step in (1, 2):
        now = time.time()
        built = builder.build(
            _files(step), version=step, parent_version=step - 1 or None,
            base=held_base(store, step - 1), created_at=now, expires_at=now + 600,
        )  # fmt: skip
        env = sign_manifest(built.manifest, signer, now)
        out.append((env, built.manifest, built.chunks))
        if step == 1:
            store.seed(env, built.manifest, built.chunks)
    return store, out


def test_a_seed_killed_at_any_write_leaves_no_half_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, versions = _seeded_store(tmp_path / "ref")
    env, manifest, chunks = versions[1]
    assert manifest.delta is not None and part_indices(manifest, "delta"), "v2 must be a delta"
    writes = len(chunks) + 1  # every chunk and the manifest
    real_write = ChunkStore._atomic_write
    torn: list[int] = []  # kills after which v2 was visible before all its parts were in
    leftover: list[int] = []  # kills after which the unfinished v2 directory stayed on disk
    for killed_at in range(writes + 1):  # killed before the 1st ... after the last write
        root = tmp_path / f"kill-{killed_at}"
        store = ChunkStore(root, keep_versions=10)
        store.seed(*versions[0])

        monkeypatch.setattr(
            ChunkStore, "_atomic_write", staticmethod(KillAt(killed_at, real_write))
        )
        with contextlib.suppress(Killed):
            store.seed(env, manifest, chunks)
        monkeypatch.setattr(ChunkStore, "_atomic_write", staticmethod(real_write))

        reopened = ChunkStore(root, keep_versions=10)  # the next start, on the same directory
        if reopened.manifest(2) is None:
            assert killed_at < writes, "the seed finished, yet v2 is not in the store"
            assert reopened.versions() == [1]
            if (root / "v000000000002").exists():
                leftover.append(killed_at)
        else:
            if killed_at < writes:
                torn.append(killed_at)
            else:
                for part in ("full", "delta"):
                    assert reopened.is_complete(2, part)
                    reopened.load_files(2, part)
        # whatever happened, seeding it again (the trainer's next start) completes it
        reopened.seed(env, manifest, chunks)
        assert reopened.is_complete(2, "full") and reopened.is_complete(2, "delta")
    assert torn == [], f"v2 visible with parts missing after a kill at writes {torn} of {writes}"
    assert leftover == [], f"the unfinished v2 directory kept after kills at writes {leftover}"


def test_seed_refuses_a_wrong_chunk_count_and_a_bad_chunk_before_writing(tmp_path: Path) -> None:
    store, versions = _seeded_store(tmp_path)
    env, manifest, chunks = versions[1]
    with pytest.raises(ValueError, match=r"chunks given, the manifest lists"):
        store.seed(env, manifest, chunks[:-1])
    bad = [bytes([chunks[0][0] ^ 1]) + chunks[0][1:], *chunks[1:]]
    with pytest.raises(Exception, match=r"(?i)hash"):
        store.seed(env, manifest, bad)
    assert store.manifest(2) is None and not (tmp_path / "v000000000002").exists()
