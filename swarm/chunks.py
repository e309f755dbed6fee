"""On-disk store of checkpoint chunks, one directory per version, verified chunks only.

Layout::

    <root>/v000000000042/manifest.env          encoded SignedEnvelope(Manifest), as received
    <root>/v000000000042/chunks/000017.bin     chunk 17, written atomically (tmp file + rename)

A chunk is written only after it matches the manifest's hash (``protocol.manifest.verify_chunk``).
A seed (:meth:`ChunkStore.seed`) writes every chunk before the manifest, so a version it was
killed in the middle of is never seen: its directory has no manifest and is removed on the next
start. A downloader writes the manifest first (a download resumes from its verified chunks) and
readers ask :meth:`ChunkStore.is_complete` before loading.
A version has a full part and, for a delta version, a delta part (``protocol.manifest.Part``);
"complete" means the *full* part is held (the weights can be loaded); the delta part is held
only by peers that fetched it, and served like any chunk.
On restart :meth:`ChunkStore.open` re-verifies what is on disk and discards anything that does
not match, so a download resumes from the verified chunks. The store keeps the newest
``keep_versions`` versions (``S + 1`` in DESIGN.md §5); :meth:`ChunkStore.prune` removes the rest.
The manifest signature is *not* re-checked here: callers verify the envelope against the pinned
coordinator key before :meth:`put_manifest` and again when resuming.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from protocol.codec import decode, encode
from protocol.manifest import Part, part_indices, verify_chunk
from protocol.messages import Manifest, SignedEnvelope

logger = logging.getLogger(__name__)


def _unsigned_manifest(env: SignedEnvelope) -> Manifest:
    """The manifest inside ``env`` without checking the signature (see module docstring)."""
    return decode(env.payload, Manifest)


class ChunkStore:
    """Verified chunks of the last ``keep_versions`` checkpoint versions under ``root``."""

    def __init__(self, root: str | os.PathLike[str], *, keep_versions: int = 2) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.root = Path(root)
        self.keep_versions = keep_versions
        self.root.mkdir(parents=True, exist_ok=True)
        self._manifests: dict[int, tuple[SignedEnvelope, Manifest]] = {}
        # frozen: have() hands out the same object until the holdings change (a new set then)
        self._have: dict[int, frozenset[int]] = {}
        self._remove_unfinished()
        for version in self._versions_on_disk():
            self.open(version)

    # -- versions ------------------------------------------------------------------------------
    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:012d}"

    def _chunk_path(self, version: int, index: int) -> Path:
        return self._dir(version) / "chunks" / f"{index:06d}.bin"

    def _versions_on_disk(self) -> list[int]:
        out = []
        for p in self.root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and (p / "manifest.env").is_file():
                out.append(int(p.name[1:]))
        return sorted(out)

    def _remove_unfinished(self) -> None:
        """Delete version directories without a manifest: what a seed killed before writing
        it left (a downloader writes the manifest first, so it never leaves one)."""
        for p in self.root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and not (p / "manifest.env").exists():
                logger.warning("removing %s: a version whose seeding did not finish", p)
                shutil.rmtree(p, ignore_errors=True)

    def versions(self) -> list[int]:
        """Versions with a manifest in the store, ascending."""
        return sorted(self._manifests)

    def open(self, version: int) -> bool:
        """Load ``version`` from disk, keeping only chunks that verify. False if absent/corrupt."""
        path = self._dir(version) / "manifest.env"
        try:
            env = decode(path.read_bytes(), SignedEnvelope)
            manifest = _unsigned_manifest(env)
        except Exception as exc:  # any unreadable manifest file is discarded
            logger.warning("discarding unreadable manifest %s: %s", path, exc)
            shutil.rmtree(self._dir(version), ignore_errors=True)
            return False
        have: set[int] = set()
        chunk_dir = self._dir(version) / "chunks"
        for p in chunk_dir.glob("*"):
            index = int(p.stem) if p.suffix == ".bin" and p.stem.isdigit() else -1
            try:
                if not 0 <= index < len(manifest.chunks):
                    raise ValueError("not a chunk file of this manifest")
                verify_chunk(manifest, index, p.read_bytes())
                have.add(index)
            except Exception as exc:  # drop anything that does not verify
                logger.warning("discarding %s: %s", p, exc)
                p.unlink(missing_ok=True)
        self._manifests[version] = (env, manifest)
        self._have[version] = frozenset(have)
        return True

    def put_manifest(self, env: SignedEnvelope, manifest: Manifest) -> None:
        """Record a *verified* manifest (no-op if this version is already known)."""
        if manifest.version in self._manifests:
            return
        d = self._dir(manifest.version)
        (d / "chunks").mkdir(parents=True, exist_ok=True)
        self._atomic_write(d / "manifest.env", encode(env))
        self._manifests[manifest.version] = (env, manifest)
        self._have[manifest.version] = frozenset()

    def manifest(self, version: int) -> tuple[SignedEnvelope, Manifest] | None:
        """The stored (envelope, manifest) of ``version``, or None."""
        return self._manifests.get(version)

    def latest(self) -> int | None:
        """Newest version held, or None."""
        return max(self._manifests) if self._manifests else None

    # -- chunks --------------------------------------------------------------------------------
    def have(self, version: int) -> frozenset[int]:
        """Indices of the verified chunks of ``version`` held on disk (the same object until
        they change: callers may cache what they derive from it by identity)."""
        return self._have.get(version, frozenset())

    def is_complete(self, version: int, part: Part = "full") -> bool:
        """Every chunk of ``part`` (default: the full checkpoint) of ``version`` is held."""
        entry = self._manifests.get(version)
        if entry is None:
            return False
        wanted = part_indices(entry[1], part)
        return bool(wanted) and self._have[version].issuperset(wanted)

    def missing_bytes(self, version: int, part: Part = "full") -> int:
        """Bytes of ``part`` of ``version`` not held yet (0 without a manifest)."""
        entry = self._manifests.get(version)
        if entry is None:
            return 0
        have = self._have[version]
        chunks = entry[1].chunks
        return sum(chunks[i].size for i in part_indices(entry[1], part) if i not in have)

    def put_chunk(self, version: int, index: int, data: bytes) -> None:
        """Verify ``data`` against the manifest and keep it; raises ``ChunkHashMismatch``."""
        entry = self._manifests.get(version)
        if entry is None:
            raise KeyError(f"no manifest for version {version}; call put_manifest first")
        verify_chunk(entry[1], index, data)
        if index in self._have[version]:
            return
        self._atomic_write(self._chunk_path(version, index), data)
        self._have[version] |= {index}

    def get_chunk(self, version: int, index: int) -> bytes | None:
        """Bytes of a held chunk, or None."""
        if index not in self._have.get(version, ()):
            return None
        try:
            return self._chunk_path(version, index).read_bytes()
        except OSError:
            self._have[version] -= {index}
            return None

    def seed(self, env: SignedEnvelope, manifest: Manifest, chunks: Iterable[bytes]) -> None:
        """Store a whole version at once (the seed side); every chunk is verified first.

        The chunks go to disk before the manifest, which is written last (atomically): a seed
        killed half-way leaves a version directory without a manifest, which :meth:`open`
        ignores and the next start removes, never a version whose manifest lists parts that are
        not all in the store."""
        version = manifest.version
        data = list(chunks)
        if len(data) != len(manifest.chunks):
            raise ValueError(
                f"version {version}: {len(data)} chunks given, the manifest lists "
                f"{len(manifest.chunks)}"
            )
        for index, chunk in enumerate(data):
            verify_chunk(manifest, index, chunk)
        if version in self._manifests:  # already known (a download in progress): fill it in
            for index, chunk in enumerate(data):
                self.put_chunk(version, index, chunk)
            return
        (self._dir(version) / "chunks").mkdir(parents=True, exist_ok=True)
        for index, chunk in enumerate(data):
            self._atomic_write(self._chunk_path(version, index), chunk)
        self._atomic_write(self._dir(version) / "manifest.env", encode(env))
        self._manifests[version] = (env, manifest)
        self._have[version] = frozenset(range(len(data)))

    def load_files(
        self, version: int, part: Part = "full", *, verify: bool = True
    ) -> dict[str, bytes]:
        """Reassemble ``part`` (default: the full checkpoint) of ``version`` into
        ``{file name: bytes}``. ``verify=False`` skips re-hashing chunks that were verified when
        they were stored (for a caller that verifies what it derives from them itself)."""
        return {k: b"".join(v) for k, v in self._pieces(version, part, verify=verify).items()}

    def load_mutable(self, version: int, part: Part = "full") -> dict[str, bytearray]:
        """Like ``load_files(version, part, verify=False)``, as fresh ``bytearray`` s the caller
        may patch in place (:func:`protocol.delta.apply_delta`)."""
        entry = self._manifests.get(version)
        if entry is None or not self.is_complete(version, part):
            raise KeyError(f"the {part} part of version {version} is not complete in the store")
        chunks = entry[1].chunks
        indices = part_indices(entry[1], part)
        sizes: dict[str, int] = {}
        for i in indices:
            sizes[chunks[i].file] = chunks[i].offset + chunks[i].size
        out = {name: bytearray(size) for name, size in sizes.items()}
        for i in indices:  # read straight into place: one copy from the page cache
            c = chunks[i]
            try:
                with open(self._chunk_path(version, i), "rb") as f:
                    n = f.readinto(memoryview(out[c.file])[c.offset : c.offset + c.size])
            except OSError:
                n = -1
            if n != c.size:
                self._have[version] -= {i}
                raise KeyError(f"version {version}: chunk {i} vanished from disk")
        return out

    def _pieces(self, version: int, part: Part, *, verify: bool) -> dict[str, list[bytes]]:
        entry = self._manifests.get(version)
        if entry is None or not self.is_complete(version, part):
            raise KeyError(f"the {part} part of version {version} is not complete in the store")
        manifest = entry[1]
        out: dict[str, list[bytes]] = {}
        for i in part_indices(manifest, part):
            data = self.get_chunk(version, i)
            if data is None:
                raise KeyError(f"version {version}: chunk {i} vanished from disk")
            if verify:
                verify_chunk(manifest, i, data)
            out.setdefault(manifest.chunks[i].file, []).append(data)
        return out

    def prune(self, protect: Iterable[int] = ()) -> list[int]:
        """Drop all but the newest ``keep_versions`` versions (never ``protect``); list dropped."""
        keep = set(self.versions()[-self.keep_versions :]) | set(protect)
        dropped = [v for v in self.versions() if v not in keep]
        for v in dropped:
            shutil.rmtree(self._dir(v), ignore_errors=True)
            self._manifests.pop(v, None)
            self._have.pop(v, None)
        return dropped

    @staticmethod
    def _atomic_write(path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
