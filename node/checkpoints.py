"""The node's policy-version manager: fetch, verify, load, and never roll back (DESIGN.md §5).

:meth:`CheckpointManager.ensure` makes version ``v`` the backend's weights:

1. refuse ``v`` if it is older than the highest version this node ever accepted (kept on disk in
   ``<state_dir>/accepted-version.json``, written atomically), so a restart cannot be talked into
   a rollback; re-loading the accepted version itself after a restart is allowed;
2. download it through :meth:`swarm.broadcast.BroadcastNode.download` (peer-assisted: chunks
   are relayed to other nodes while the rest arrive; the node keeps serving the versions it holds);
3. verify again here, independently of the download path: the manifest envelope against the
   *pinned* coordinator key, its layout and expiry, and every chunk hash of the returned files;
4. convert with :func:`swarm.checkpoint_io.files_to_state_dict` (safetensors only, never pickle)
   and call ``backend.load_state_dict`` with ``changed``: the tensors whose signed digests differ
   from the loaded version's (None = all; :meth:`CheckpointManager.changed_tensors`), so a
   backend can update only those; only then record ``v`` as accepted.

Step 2 fetches a delta version as its delta when this node holds the base (the version it runs,
usually), else the full checkpoint; either way what comes back was verified bit for bit against
the signed manifest (:mod:`swarm.deltasync`).

A LoRA version (``Manifest.lora``, docs/protocol.md §8.6) is refused with ``lora_base_missing``
unless the backend's base model has the fingerprint it names (checked on the stored manifest
before any download when it is here already, and before loading); its adapter goes to
``backend.load_adapter``, which holds the last ``keep_adapters`` (S + 1) adapters over the one
loaded base. A lease at a version whose adapter is held is a switch (``activate_adapter``): no
download, no reload, and no rollback check (that version was accepted when it was the newest).

The chunk store keeps the newest ``keep_versions`` (``S + 1``) versions. The pinned key is given
as a fingerprint; the raw public key is taken from the first manifest (on disk or from a seed)
whose signer has exactly that fingerprint.

Failures::

    CheckpointError
    ├── CheckpointRefused               (also a ProtocolError) bad_signature, manifest_invalid,
    │                                   chunk_hash_mismatch, version_not_newer, lora_base_missing:
    │                                   do not retry as is
    └── CheckpointUnavailable           no peer could provide the version in time: retry later
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from protocol.errors import ProtocolError, ReasonCode
from protocol.manifest import part_indices, part_size, verify_chunk, verify_manifest
from protocol.messages import Manifest
from swarm.broadcast import BroadcastNode
from swarm.deltasync import Files
from swarm.errors import BroadcastError, ManifestUnavailable

__all__ = [
    "ACCEPTED_FILE",
    "AcceptedVersion",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointRefused",
    "CheckpointUnavailable",
]

log = logging.getLogger(__name__)

ACCEPTED_FILE = "accepted-version.json"


class CheckpointError(Exception):
    """A policy version could not be loaded; nothing was loaded."""


class CheckpointRefused(CheckpointError, ProtocolError):
    """A version failed verification or would be a rollback (``.code``); do not retry as is."""


class CheckpointUnavailable(CheckpointError):
    """The version could not be obtained from any peer in time (retry later)."""


class AcceptedVersion:
    """Highest accepted version per pinned coordinator key, persisted atomically."""

    def __init__(self, path: Path, coordinator_fingerprint: str) -> None:
        self.path = path
        self.fingerprint = coordinator_fingerprint

    def _read_all(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # Refuse to guess: an unreadable record could hide a higher version (rollback risk).
            raise RuntimeError(
                f"{self.path} is unreadable ({exc}); restore it or delete it deliberately"
            ) from exc
        versions = data.get("accepted", {}) if isinstance(data, dict) else {}
        return {k: int(v) for k, v in versions.items() if isinstance(v, int)}

    def get(self) -> int | None:
        """The highest version accepted from the pinned coordinator, or None."""
        return self._read_all().get(self.fingerprint)

    def set(self, version: int) -> None:
        """Record ``version`` (never lowers the record); atomic and durable."""
        data = self._read_all()
        if data.get(self.fingerprint, -1) >= version:
            return
        data[self.fingerprint] = version
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": 1, "accepted": data}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        with contextlib.suppress(OSError):  # make the rename itself durable
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class CheckpointManager:
    """Loads verified policy versions into ``backend`` (see the module docstring)."""

    def __init__(
        self,
        broadcast: BroadcastNode,
        backend: Any,
        *,
        state_dir: Path,
        coordinator_fingerprint: str,
        seeds: Callable[[], Sequence[str]],
        clock: Callable[[], float] = time.time,
        download_timeout_s: float = 600.0,
        progress: bool = True,
        keep_adapters: int = 5,
    ) -> None:
        self.broadcast = broadcast
        self.backend = backend
        self.fingerprint = coordinator_fingerprint
        self.accepted = AcceptedVersion(Path(state_dir) / ACCEPTED_FILE, coordinator_fingerprint)
        self.seeds = seeds
        self.clock = clock
        self.download_timeout_s = download_timeout_s
        self.progress = progress
        self.keep_adapters = keep_adapters
        #: lease switches to a LoRA adapter already held (no download, no reload)
        self.switches = 0
        self._lock = asyncio.Lock()
        self._key: bytes | None = None
        self.loads = 0
        self.last_load_s: float | None = None

    @property
    def highest_accepted(self) -> int | None:
        return self.accepted.get()

    @property
    def loaded_version(self) -> int | None:
        v = self.backend.loaded_version
        return None if v is None else int(v)

    async def ensure(self, version: int) -> None:
        """Make ``version`` the loaded weights, or raise (nothing loaded on failure)."""
        if self.loaded_version == version:
            # Loaded already: do not queue behind a prefetch of a newer version holding the lock
            # (a lease on the loaded version waited for a 2 s download in the capacity demos).
            # Only this method loads, and the node runs one lease at a time.
            return
        async with self._lock:
            if self.loaded_version == version:
                return
            holds = getattr(self.backend, "holds_adapter", None)  # duck-typed test backends
            if holds is not None and holds(version):  # accepted before, held in memory: a switch
                await asyncio.to_thread(self.backend.activate_adapter, version)
                self.switches += 1
                log.debug("switched to the held LoRA adapter of policy v%d", version)
                return
            highest = self.highest_accepted
            if highest is not None and version < highest:
                raise CheckpointRefused(
                    ReasonCode.VERSION_NOT_NEWER,
                    f"v{version} is older than v{highest}, the newest version this node "
                    "accepted; refusing to roll back",
                )
            t0 = time.monotonic()
            key = await self._pinned_key(version)
            stored = self.broadcast.store.manifest(version)
            if stored is not None:  # refused before any download when it cannot be used here
                self._check_base(stored[1])
            files = await self._download(version)
            manifest = self._verify(version, key, files)
            self._check_base(manifest)
            from swarm.checkpoint_io import files_to_state_dict

            state_dict = await asyncio.to_thread(files_to_state_dict, files)
            changed = None if manifest.lora is not None else self.changed_tensors(version)
            if manifest.lora is not None:
                await asyncio.to_thread(self._load_adapter, version, state_dict, manifest)
            else:
                await asyncio.to_thread(
                    self.backend.load_state_dict, version, state_dict, changed=changed
                )
            self.accepted.set(version)
            self.loads += 1
            self.last_load_s = time.monotonic() - t0
            fetched = self.broadcast.sync.last
            log.info(
                "loaded policy v%d (%d bytes; %s, %d bytes fetched; %s) in %.2f s",
                version,
                part_size(manifest, "full"),
                fetched.path if fetched is not None else "?",
                fetched.fetched_bytes if fetched is not None else 0,
                f"LoRA adapter, rank {manifest.lora.rank}, over the loaded base"
                if manifest.lora is not None
                else f"{'all' if changed is None else len(changed)} tensors changed",
                self.last_load_s,
            )

    async def prefetch(self, version: int) -> None:
        """Download and verify ``version`` without loading it (the chunks are relayed meanwhile);
        a later :meth:`ensure` then finds them on disk."""
        async with self._lock:
            highest = self.highest_accepted
            if self.broadcast.store.is_complete(version) or (
                highest is not None and version <= highest
            ):
                return
            key = await self._pinned_key(version)
            self._verify(version, key, await self._download(version))

    def changed_tensors(self, version: int) -> frozenset[str] | None:
        """Names of the tensors of ``version`` whose signed digests differ from those of the
        loaded version (both manifests held here); None when that cannot be told (nothing
        loaded, a manifest without a tensor list, or tensors gone or renamed)."""
        loaded = self.loaded_version
        store = self.broadcast.store
        old = None if loaded is None else store.manifest(loaded)
        new = store.manifest(version)
        if old is None or new is None or old[1].tensors is None or new[1].tensors is None:
            return None
        before = {t.name: t for t in old[1].tensors}
        after = {t.name: t for t in new[1].tensors}
        if before.keys() != after.keys():
            return None
        return frozenset(n for n, t in after.items() if t != before[n])

    def _check_base(self, manifest: Manifest) -> None:
        """Refuse (``lora_base_missing``) a LoRA version over a base this backend does not hold."""
        lora = manifest.lora
        if lora is None:
            return
        fingerprint = getattr(self.backend, "base_fingerprint", None)
        ours = fingerprint() if fingerprint is not None else None
        if ours is None or ours.split(":", 1)[-1] != lora.base_model:
            have = "no LoRA support" if ours is None else f"base {ours.split(':', 1)[-1][:16]}…"
            raise CheckpointRefused(
                ReasonCode.LORA_BASE_MISSING,
                f"v{manifest.version} is a LoRA adapter over base model "
                f"{lora.base_model[:16]}…, this node's backend has {have}; start the node with "
                "that base model (model_path; `swarm model import` prints its fingerprint)",
            )

    def _load_adapter(self, version: int, state_dict: Any, manifest: Manifest) -> None:
        from policy.lora import LoraError

        assert manifest.lora is not None
        try:
            self.backend.load_adapter(
                version,
                state_dict,
                rank=manifest.lora.rank,
                alpha=manifest.lora.alpha,
                keep=self.keep_adapters,
            )
        except LoraError as exc:  # signed, but does not fit the base: nothing was loaded
            raise CheckpointRefused(ReasonCode.MANIFEST_INVALID, f"v{version}: {exc}") from exc

    # -- steps ---------------------------------------------------------------------------------
    async def _pinned_key(self, version: int) -> bytes:
        """Raw public key of the pinned fingerprint, from a stored or fetched manifest signer."""
        if self._key is not None:
            return self._key
        from swarm.pinned import resolve_pinned_key

        try:
            key = await resolve_pinned_key(
                self.fingerprint, version, store=self.broadcast.store,
                transport=self.broadcast.server.transport, seeds=self.seeds(),
            )  # fmt: skip
        except ManifestUnavailable as exc:
            raise CheckpointUnavailable(f"{exc}; check coordinator_key") from exc
        return self._adopt_key(key)

    def _adopt_key(self, key: bytes) -> bytes:
        self._key = key
        self.broadcast.downloader.pinned_key = key  # the downloader verifies with it from now on
        return key

    async def _download(self, version: int) -> Files:
        seeds = list(self.seeds())
        progress = _Progress(version) if self.progress else None
        files: Files | None = None
        try:
            async with asyncio.timeout(self.download_timeout_s):
                files = await self.broadcast.download(
                    version, seeds, on_progress=progress.update if progress else None
                )
            return files
        except TimeoutError as exc:
            raise CheckpointUnavailable(
                f"v{version} not downloaded within {self.download_timeout_s:.0f} s "
                "(raise download_timeout_s or check the seeds)"
            ) from exc
        except BroadcastError as exc:
            raise CheckpointUnavailable(str(exc)) from exc
        except ProtocolError as exc:
            raise CheckpointRefused(exc.code, exc.detail) from exc
        except OSError as exc:  # disk full or unwritable while storing chunks: retry later
            raise CheckpointUnavailable(
                f"v{version}: cannot store the checkpoint under {self.broadcast.store.root}: "
                f"{exc}; free disk space or fix the state directory"
            ) from exc
        finally:
            if progress is not None:
                progress.close(complete=files is not None)

    def _verify(self, version: int, key: bytes, files: Files) -> Manifest:
        """Check the manifest signature (pinned key) and every chunk of ``files``."""
        entry = self.broadcast.store.manifest(version)
        if entry is None:
            raise CheckpointRefused(ReasonCode.MANIFEST_INVALID, f"v{version}: manifest missing")
        try:
            manifest = verify_manifest(entry[0], key, self.clock())
            if manifest.version != version:
                raise CheckpointRefused(
                    ReasonCode.MANIFEST_INVALID,
                    f"asked for v{version}, manifest says v{manifest.version}",
                )
            full = [manifest.chunks[i] for i in part_indices(manifest, "full")]
            names = {c.file for c in full}
            if set(files) != names:
                raise CheckpointRefused(
                    ReasonCode.MANIFEST_INVALID,
                    f"v{version}: files {sorted(files)} differ from the manifest's {sorted(names)}",
                )
            for c in full:
                data = memoryview(files[c.file])
                verify_chunk(manifest, c.index, data[c.offset : c.offset + c.size])
            for name in names:
                end = max(c.offset + c.size for c in full if c.file == name)
                if len(files[name]) != end:
                    raise CheckpointRefused(
                        ReasonCode.MANIFEST_INVALID, f"v{version}: {name} has trailing bytes"
                    )
        except CheckpointRefused:
            raise
        except ProtocolError as exc:
            raise CheckpointRefused(exc.code, exc.detail) from exc
        return manifest


class _Progress:
    """A rich progress bar on a terminal; a start and an end log line otherwise."""

    def __init__(self, version: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.version = version
        console = Console(stderr=True)
        self._bar = Progress(
            f"v{version}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self._task: Any = None
        self._t0 = time.monotonic()
        self._total = 0
        log.info("downloading policy v%d", version)

    def update(self, done: int, total: int) -> None:
        if self._task is None:
            self._bar.start()
            self._task = self._bar.add_task("download", total=total)
        self._total = total
        self._bar.update(self._task, completed=done, total=total)

    def close(self, *, complete: bool) -> None:
        """End the bar; the 'downloaded' line only for a download that completed (a failed one
        is reported by the caller, with its reason)."""
        self._bar.stop()
        if complete and self._total:
            log.info(
                "downloaded policy v%d: %d bytes in %.2f s",
                self.version,
                self._total,
                time.monotonic() - self._t0,
            )
