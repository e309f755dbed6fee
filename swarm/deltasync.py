"""Getting a version's full checkpoint, by delta when that moves fewer bytes (DESIGN.md §5).

:meth:`VersionSync.fetch` is what :meth:`swarm.broadcast.BroadcastNode.download` runs, so the
delta path is the default for every peer (nodes, the coordinator, benchmark receivers):

1. fetch and verify the version's signed manifest (pinned coordinator key);
2. **plan**: walk the delta chain down (version v's delta names its base b and b's root hash;
   b's manifest names its own base, ...) while a version this peer holds in full could still be
   reached, and price each way in bytes still to fetch (chunks already held are free):
   "the deltas from a held version up to v", "the full checkpoint of some u on the chain (the
   newest keyframe, say) + the deltas from u up to v", "the full checkpoint of v". The cheapest
   wins. The walk stops at a held version, at a keyframe, at a base no peer serves a manifest for
   (a gap), at ``max_chain`` links, or once the deltas alone weigh more than the full checkpoint;
3. **run** it: fetch a full part if the plan starts with one; then for each delta, fetch its
   chunks (verified, relayed and announced like any chunk), apply it to the base's files and
   check every tensor against the signed digests (:func:`protocol.delta.apply_delta`), then
   store the result as that version's full part, each chunk hash checked again on the way in:
   the reconstruction equals the signed full checkpoint bit for bit before anything is loaded,
   served or used as the next base;
4. if a delta plan fails (its base is gone or differs, its bytes are malformed, it reconstructs
   wrongly, a chain manifest or delta chunk is unavailable), the reason is logged and kept in
   :attr:`VersionSync.refusals`, and the full checkpoint is fetched instead.

Who is blamed: a peer that serves a delta chunk that is truncated, oversized or altered is
caught at the chunk, before anything is applied, by the chunk hash in the signed manifest, and
scored down and shunned like any bad chunk (:mod:`swarm.fetcher`); the chunk is fetched
elsewhere. A delta whose *signed* bytes do not apply or do not reconstruct the signed digests
can only come from the publisher (relays forward verified chunks before they apply them), so it
costs no relay its score: it is refused with its reason and the full checkpoint is used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.delta import apply_delta
from protocol.errors import ChunkHashMismatch, DeltaError, ReasonCode
from protocol.manifest import Part, part_indices
from protocol.messages import Manifest, SignedEnvelope
from swarm.errors import BroadcastError, ChunkUnavailable, ManifestUnavailable

if TYPE_CHECKING:
    from swarm.chunks import ChunkStore
    from swarm.fetcher import ProgressFn
    from swarm.holders import HolderAnnouncer

logger = logging.getLogger(__name__)


class Downloader(Protocol):
    """What a :class:`VersionSync` needs of :class:`swarm.broadcast.Downloader`."""

    store: ChunkStore

    async def fetch_manifest(
        self, version: int | None, sources: Sequence[str]
    ) -> tuple[SignedEnvelope, Manifest]: ...

    async def fetch_part(
        self,
        env: SignedEnvelope,
        manifest: Manifest,
        seeds: Sequence[str],
        part: Part,
        *,
        on_progress: ProgressFn | None = None,
    ) -> None: ...


Files = Mapping[str, bytes | bytearray]
"""A version's full checkpoint, file name -> bytes (a ``bytearray`` when rebuilt from a delta)."""

Step = tuple[SignedEnvelope, Manifest, Part]
"""One download of a plan: (signed manifest, manifest, part to fetch)."""


@dataclass(frozen=True)
class Refusal:
    """Why the delta path was not taken (or failed) for ``version``."""

    version: int
    code: ReasonCode
    detail: str


@dataclass(frozen=True)
class Fetched:
    """What :meth:`VersionSync.fetch` did for one version."""

    version: int
    path: str  # "held", "full", "delta" (deltas from a held base) or "chain" (full part + deltas)
    fetched_bytes: int  # bytes the plan expected to fetch
    full_bytes: int  # size of the version's full checkpoint


class VersionSync:
    """Plans and runs the download of one version's full checkpoint (module docstring)."""

    def __init__(
        self,
        downloader: Downloader,
        *,
        announcer: HolderAnnouncer | None = None,
        max_chain: int = 16,
    ) -> None:
        self.downloader = downloader
        self.store = downloader.store
        self.announcer = announcer
        self.max_chain = max_chain
        #: every refused or failed delta path, oldest first (bounded)
        self.refusals: list[Refusal] = []
        #: the last fetch's outcome
        self.last: Fetched | None = None
        # Fetches run concurrently (the coordinator fetches every version as it is published,
        # and a version nobody serves yet must not hold up the next one); two of them may meet
        # on the same link of a chain, which is applied and stored once.
        self._applying: dict[int, asyncio.Lock] = {}

    async def fetch(
        self, version: int | None, seeds: Sequence[str], *, on_progress: ProgressFn | None = None
    ) -> Files:
        """The verified full checkpoint of ``version`` (None = newest the seeds have)."""
        env, manifest = await self.downloader.fetch_manifest(version, seeds)
        v, full = manifest.version, self._missing(manifest, "full")
        if self.store.is_complete(v):
            self.last = Fetched(v, "held", 0, full)
            return self.store.load_files(v)
        steps, cost, path = await self._plan(env, manifest, seeds)
        files: Files | None = None
        if path != "full":
            try:
                files = await self._run(steps, seeds, on_progress)
            except (DeltaError, ChunkUnavailable, ManifestUnavailable) as exc:
                # a link of the chain that no peer serves is a gap, like a missing manifest
                code = exc.code if isinstance(exc, DeltaError) else ReasonCode.DELTA_CHAIN_GAP
                self._refuse(v, code, f"{path} path failed: {exc}")
        if files is None:
            path, cost = "full", full
            await self.downloader.fetch_part(env, manifest, seeds, "full", on_progress=on_progress)
            files = self.store.load_files(v)
        self.last = Fetched(v, path, cost, full)
        self.store.prune(protect={v})
        oldest = min(self.store.versions(), default=v)
        for u in [u for u, lock in self._applying.items() if u < oldest and not lock.locked()]:
            del self._applying[u]
        return files

    # -- planning ------------------------------------------------------------------------------
    def _missing(self, manifest: Manifest, part: Part) -> int:
        have = self.store.have(manifest.version)
        return sum(manifest.chunks[i].size for i in part_indices(manifest, part) if i not in have)

    async def _plan(
        self, env: SignedEnvelope, manifest: Manifest, seeds: Sequence[str]
    ) -> tuple[list[Step], int, str]:
        """The cheapest way to the full part of ``manifest``: (steps, bytes, path)."""
        best: tuple[list[Step], int, str] = (
            [(env, manifest, "full")],
            self._missing(manifest, "full"),
            "full",
        )
        v = manifest.version
        held = [u for u in self.store.versions() if self.store.is_complete(u)]
        # versions with some chunks here (a resumed download) can be a cheaper start too
        started = [u for u in self.store.versions() if self.store.have(u)]
        chain: list[Step] = []  # deltas from v downwards
        deltas = 0
        cur_env, cur = env, manifest
        while cur.delta is not None:
            base = cur.delta.base_version
            if len(chain) >= self.max_chain:
                self._refuse(v, ReasonCode.DELTA_CHAIN_GAP, f"chain longer than {self.max_chain}")
                break
            chain.append((cur_env, cur, "delta"))
            deltas += self._missing(cur, "delta")
            if deltas >= best[1]:
                break  # the deltas alone already cost more than the best way found
            entry = self.store.manifest(base)
            if base in held and entry is not None:
                if entry[1].root_hash == cur.delta.base_root_hash:
                    best = (chain[::-1], deltas, "delta")
                else:
                    self._refuse(
                        v,
                        ReasonCode.DELTA_BASE_MISSING,
                        f"v{cur.version}'s delta is against another v{base} than the "
                        "one held here (root hashes differ)",
                    )
                break
            if not any(u <= base for u in started):
                self._refuse(
                    v,
                    ReasonCode.DELTA_BASE_MISSING,
                    f"v{cur.version}'s delta needs v{base}, which is not held here "
                    "(nor any older version)",
                )
                break
            try:
                base_env, base_m = await self.downloader.fetch_manifest(base, seeds)
            except BroadcastError as exc:
                self._refuse(
                    v,
                    ReasonCode.DELTA_CHAIN_GAP,
                    f"no manifest of v{base} (base of v{cur.version}): {exc}",
                )
                break
            if base_m.root_hash != cur.delta.base_root_hash:
                self._refuse(
                    v,
                    ReasonCode.DELTA_CHAIN_GAP,
                    f"the manifest of v{base} served is not the base v{cur.version}'s "
                    "delta names (root hashes differ)",
                )
                break
            via_full = deltas + self._missing(base_m, "full")
            if via_full < best[1]:
                best = ([(base_env, base_m, "full"), *chain[::-1]], via_full, "chain")
            cur_env, cur = base_env, base_m
        return best

    def _refuse(self, version: int, code: ReasonCode, detail: str) -> None:
        logger.warning(
            "v%d: not by delta (%s: %s); fetching the full checkpoint", version, code.value, detail
        )
        self.refusals = [*self.refusals[-63:], Refusal(version, code, detail)]

    # -- running -------------------------------------------------------------------------------
    async def _run(
        self, steps: list[Step], seeds: Sequence[str], on_progress: ProgressFn | None
    ) -> Files:
        files: Files = {}
        for env, manifest, part in steps:
            v = manifest.version
            await self.downloader.fetch_part(env, manifest, seeds, part, on_progress=on_progress)
            if part == "delta":
                async with self._applying.setdefault(v, asyncio.Lock()):
                    if self.store.is_complete(v):  # another fetch applied it meanwhile
                        files = self.store.load_files(v)
                    else:
                        files = await asyncio.to_thread(self._apply, manifest)
                if self.announcer is not None:
                    self.announcer.update(v, self.store.have(v), len(manifest.chunks))
        if steps[-1][2] == "full":  # pragma: no cover - a plan ends with its target's delta
            files = self.store.load_files(steps[-1][1].version)
        return files

    def _apply(self, manifest: Manifest) -> dict[str, bytearray]:
        """Apply the (held) delta part of ``manifest`` to its (held) base and store the result
        as the full part; return the full files. Raises :class:`DeltaError`."""
        assert manifest.delta is not None and manifest.tensors is not None
        v, base = manifest.version, manifest.delta.base_version
        entry = self.store.manifest(base)
        if entry is None or not self.store.is_complete(base):
            raise DeltaError(ReasonCode.DELTA_BASE_MISSING, f"v{v}: base v{base} is not held")
        if entry[1].root_hash != manifest.delta.base_root_hash:
            raise DeltaError(
                ReasonCode.DELTA_BASE_MISSING,
                f"v{v}: the v{base} held here is not the delta's base",
            )
        full = part_indices(manifest, "full")
        ends: dict[str, int] = {}
        for i in full:
            c = manifest.chunks[i]
            ends[c.file] = c.offset + c.size
        try:
            base_files = self.store.load_mutable(base)
        except KeyError as exc:  # pruned or lost from disk since the plan was made
            raise DeltaError(ReasonCode.DELTA_BASE_MISSING, f"v{v}: {exc}") from None
        if sorted(base_files) != sorted(ends):
            raise DeltaError(
                ReasonCode.DELTA_MISMATCH,
                f"v{v} has files {sorted(ends)}, base v{base} {sorted(base_files)}",
            )
        pieces = self.store.load_files(v, "delta", verify=False)  # verified on arrival
        delta = b"".join(pieces[name] for name in sorted(pieces))
        new, _changed = apply_delta(
            base_files,
            delta,
            manifest.tensors,
            manifest.hash_algorithm,
            base_tensors=entry[1].tensors,
            in_place=True,
        )
        for name, data in new.items():
            if len(data) != ends[name]:
                raise DeltaError(
                    ReasonCode.DELTA_MISMATCH,
                    f"v{v}: {name} is {len(data)} bytes, signed {ends[name]}",
                )
        have = self.store.have(v)
        try:
            for i in full:
                if i not in have:
                    c = manifest.chunks[i]
                    self.store.put_chunk(v, i, bytes(new[c.file][c.offset : c.offset + c.size]))
        except ChunkHashMismatch as exc:
            raise DeltaError(
                ReasonCode.DELTA_MISMATCH,
                f"v{v}: reconstruction differs from the signed checkpoint: {exc.detail}",
            ) from None
        logger.info(
            "v%d: applied the delta against v%d (%d tensors changed)", v, base, len(_changed)
        )
        return new
