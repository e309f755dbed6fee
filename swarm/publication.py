"""Building the chunks and the unsigned manifest of a version to publish: keyframe or delta.

Every version's manifest lists its full checkpoint (so any version can be fetched whole) and its
tensor list (names, dtypes, shapes, digests). A *delta version* also carries the delta against
the previous published version, its base (:mod:`protocol.delta`), which a peer that holds the
base fetches instead of the full checkpoint. A *keyframe* carries no delta. The builder publishes
a keyframe when

* there is no base (the first version, or the base is not held in full here),
* the tensor layout changed (other tensors, dtypes or shapes: no delta can say that),
* the delta would not be smaller than ``max_delta_ratio`` × the full checkpoint,
* ``keyframe_every`` > 0 and the base chain already has ``keyframe_every − 1`` deltas since the
  last keyframe, or
* the caller asks for one (``force_keyframe``: "on demand").

Because the full checkpoint is listed in every version, a keyframe is not needed to let a new
node in (it fetches the full checkpoint of the newest version) nor to bound anyone's work (a
peer never fetches more delta bytes than the full checkpoint), so periodic keyframes are off by
default: each one would make every peer that holds the base download the full checkpoint.

A *LoRA version* (``lora``: docs/protocol.md §8.6) is an adapter over a base model every peer
holds: its full part is the adapter file, a few MB, and it never travels as a delta (an adapter
changes in every element from one step to the next).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from protocol.delta import LayoutChanged, encode_delta, tensor_infos
from protocol.limits import DEFAULT_CHUNK_SIZE
from protocol.manifest import HashAlgorithm, build_manifest
from protocol.messages import DeltaInfo, LoraInfo, Manifest
from swarm.chunks import ChunkStore

logger = logging.getLogger(__name__)

DELTA_FILE = "delta.rsd"


@dataclass(frozen=True)
class PublishPolicy:
    """When versions travel as deltas (module docstring)."""

    #: every K-th version in a chain is a keyframe (1: never a delta); 0: only when needed
    keyframe_every: int = 0
    #: a delta of at least this fraction of the full checkpoint is published as a keyframe
    max_delta_ratio: float = 0.5
    #: zstd level of the delta records (1 is both faster and as small as higher levels on
    #: bf16 weight deltas; see docs/benchmarks.md)
    level: int = 1

    def __post_init__(self) -> None:
        if self.keyframe_every < 0:
            raise ValueError("keyframe_every must be >= 0 (0: keyframes only when needed)")
        if not 0.0 < self.max_delta_ratio <= 1.0:
            raise ValueError("max_delta_ratio must be in (0, 1]")


@dataclass(frozen=True)
class Built:
    """A version ready to be signed and seeded."""

    manifest: Manifest
    chunks: list[bytes]
    kind: Literal["keyframe", "delta", "lora"]
    reason: str  # why it is a keyframe ("" for a delta)
    full_bytes: int
    delta_bytes: int  # 0 for a keyframe
    changed_elements: int
    total_elements: int
    encode_s: float  # time spent on the tensor digests and the delta


@dataclass(frozen=True)
class Base:
    """The version a delta is computed against: its signed manifest and its full files."""

    manifest: Manifest
    files: Mapping[str, bytes]
    chain: int  # deltas between the last keyframe and this version (0: it is a keyframe)


def held_base(store: ChunkStore, version: int | None) -> Base | None:
    """``version`` as a delta base, if ``store`` holds its full checkpoint (None otherwise)."""
    entry = None if version is None else store.manifest(version)
    if entry is None or version is None or not store.is_complete(version):
        return None
    chain, m = 0, entry[1]
    while m.delta is not None and (prev := store.manifest(m.delta.base_version)) is not None:
        chain, m = chain + 1, prev[1]
    if m.delta is not None:  # the chain runs past what is held: count the missing link too
        chain += 1
    return Base(entry[1], store.load_files(version), chain)


class VersionBuilder:
    """Builds each published version as a keyframe or as a delta against the previous one."""

    def __init__(
        self,
        *,
        model_config_hash: str,
        tokenizer_hash: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        hash: HashAlgorithm = "blake3",
        policy: PublishPolicy | None = None,
    ) -> None:
        self.model_config_hash = model_config_hash
        self.tokenizer_hash = tokenizer_hash
        self.chunk_size = chunk_size
        self.hash: HashAlgorithm = hash
        self.policy = policy or PublishPolicy()

    def build(
        self,
        files: Mapping[str, bytes],
        *,
        version: int,
        parent_version: int | None,
        base: Base | None,
        created_at: float,
        expires_at: float,
        force_keyframe: bool = False,
        lora: LoraInfo | None = None,
    ) -> Built:
        """Chunks and unsigned manifest of ``version`` whose full checkpoint is ``files``
        (with ``lora``: the adapter files of a LoRA version over that base)."""
        if DELTA_FILE in files:
            raise ValueError(f"{DELTA_FILE!r} is reserved for the delta; rename that file")
        t0 = time.perf_counter()
        tensors = tensor_infos(files, self.hash)
        full = sum(len(f) for f in files.values())

        def manifest_of(
            all_files: Mapping[str, bytes], info: DeltaInfo | None
        ) -> tuple[Manifest, list[bytes]]:
            return build_manifest(
                all_files,
                version=version,
                parent_version=parent_version,
                model_config_hash=self.model_config_hash,
                tokenizer_hash=self.tokenizer_hash,
                created_at=created_at,
                expires_at=expires_at,
                chunk_size=self.chunk_size,
                hash=self.hash,
                tensors=tensors,
                delta=info,
                lora=lora,
            )

        if lora is not None:
            manifest, chunks = manifest_of(files, None)
            total = sum(math.prod(t.shape) for t in tensors)
            encode_s = time.perf_counter() - t0
            return Built(manifest, chunks, "lora", "", full, 0, 0, total, encode_s)
        reason, delta = self._keyframe_reason(base, version, force_keyframe), None
        if not reason and base is not None:
            try:
                delta = encode_delta(base.files, files, tensors, level=self.policy.level)
            except LayoutChanged as exc:
                reason = f"layout changed ({exc})"
            else:
                if len(delta.data) >= self.policy.max_delta_ratio * full:
                    ratio = len(delta.data) / full
                    reason = f"the delta is {ratio:.0%} of the full checkpoint"
        encode_s = time.perf_counter() - t0

        if reason or delta is None or base is None:
            manifest, chunks = manifest_of(files, None)
            total = sum(math.prod(t.shape) for t in tensors)
            return Built(
                manifest, chunks, "keyframe", reason or "no base", full, 0, 0, total, encode_s
            )
        info = DeltaInfo(
            base_version=base.manifest.version,
            base_root_hash=base.manifest.root_hash,
            files=[DELTA_FILE],
        )
        manifest, chunks = manifest_of({**files, DELTA_FILE: delta.data}, info)
        return Built(
            manifest,
            chunks,
            "delta",
            "",
            full,
            len(delta.data),
            delta.changed_elements,
            delta.total_elements,
            encode_s,
        )

    def _keyframe_reason(self, base: Base | None, version: int, force: bool) -> str:
        if force:
            return "asked for"
        if base is None:
            return "no base held"
        if base.manifest.version >= version:
            return f"base v{base.manifest.version} is not older"
        k = self.policy.keyframe_every
        if k == 1:
            return "deltas are off (keyframe_every = 1)"
        if k > 1 and base.chain + 1 >= k:
            return f"keyframe_every = {k}: {k - 1} deltas since the last keyframe"
        return ""
