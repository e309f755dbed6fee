"""Checkpoint manifests: split files into hashed chunks, sign, verify, reassemble.

A checkpoint version is a set of files (safetensors bytes). Files are taken in sorted name order and
each is cut into ``chunk_size`` pieces (the last piece of a file may be shorter; chunks never span
files). Each chunk is hashed (SHA-256 or BLAKE3, 32-byte digests), and the *root hash* binds the
ordered chunk list::

    H(b"rollout-swarm/manifest-root/v1\\0" + algorithm name + b"\\0"
      + for each chunk: u32be(index) + u16be(len(file)) + file (utf-8)
                        + u64be(offset) + u64be(size) + digest (32))

The manifest is signed by the coordinator key as a :class:`~protocol.messages.SignedEnvelope`;
nodes verify it against the *pinned* coordinator key, then verify each chunk independently as it
arrives (so a node can relay chunk k while fetching k+1).

A version has two *parts* in one chunk list: the **full** checkpoint (safetensors files) and,
for a delta version (``Manifest.delta``), the **delta** files that turn the base version's full
checkpoint into this one (:mod:`protocol.delta`). A receiver fetches one part or the other
(:func:`part_indices`); the full part always exists, so any version can be fetched whole.

A version is of one of three *kinds* (:func:`version_kind`): ``"full"`` (the full checkpoint
only, a keyframe), ``"delta"`` (``Manifest.delta``: a keyframe's files plus the delta) or
``"lora"`` (``Manifest.lora``: the full part is a LoRA adapter over the base model it names,
docs/protocol.md §8.6; never with a delta).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import blake3

from protocol.codec import decode
from protocol.envelope import seal, verify_envelope
from protocol.errors import ChunkHashMismatch, ManifestError, ReasonCode
from protocol.identity import Identity
from protocol.limits import DEFAULT_CHUNK_SIZE, DEFAULT_LIMITS, Limits
from protocol.messages import (
    PROTOCOL_VERSION,
    ChunkInfo,
    DeltaInfo,
    LoraInfo,
    Manifest,
    SignedEnvelope,
    TensorInfo,
)

__all__ = [
    "ROOT_DOMAIN",
    "HashAlgorithm",
    "Part",
    "build_manifest",
    "build_manifest_from_dir",
    "check_manifest",
    "chunk_digest",
    "delta_files",
    "part_indices",
    "part_size",
    "reassemble",
    "root_hash",
    "sign_manifest",
    "verify_chunk",
    "verify_manifest",
    "version_kind",
]

HashAlgorithm = Literal["sha256", "blake3"]
Part = Literal["full", "delta"]
VersionKind = Literal["full", "delta", "lora"]
ROOT_DOMAIN = b"rollout-swarm/manifest-root/v1\x00"
Buffer = bytes | bytearray | memoryview
_HASHERS: dict[str, Callable[[Buffer], bytes]] = {
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "blake3": lambda b: blake3.blake3(b).digest(),
}
_ENTRY = struct.Struct(">QQ")


def chunk_digest(algorithm: str, data: Buffer) -> bytes:
    """32-byte digest of ``data`` with ``algorithm`` ("sha256" or "blake3")."""
    try:
        return _HASHERS[algorithm](data)
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; use sha256 or blake3") from None


def root_hash(algorithm: str, chunks: Sequence[ChunkInfo]) -> bytes:
    """Digest over the ordered chunk list (see the module docstring for the exact bytes)."""
    parts = [ROOT_DOMAIN, algorithm.encode("ascii"), b"\x00"]
    for c in chunks:
        name = c.file.encode("utf-8")
        parts += [struct.pack(">IH", c.index, len(name)), name, _ENTRY.pack(c.offset, c.size)]
        parts.append(c.hash)
    return chunk_digest(algorithm, b"".join(parts))


def build_manifest(
    files: Mapping[str, bytes],
    *,
    version: int,
    parent_version: int | None,
    model_config_hash: str,
    tokenizer_hash: str,
    created_at: float,
    expires_at: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    hash: HashAlgorithm = "sha256",
    limits: Limits = DEFAULT_LIMITS,
    tensors: list[TensorInfo] | None = None,
    delta: DeltaInfo | None = None,
    lora: LoraInfo | None = None,
) -> tuple[Manifest, list[bytes]]:
    """Split ``files`` (name -> bytes) into chunks; return the unsigned manifest and the chunks.

    ``files`` holds the full checkpoint and, with ``delta``, the delta files it names;
    ``tensors`` is the full checkpoint's tensor list (:func:`protocol.delta.tensor_infos`);
    ``lora``: the full checkpoint is a LoRA adapter over that base (no delta then)."""
    if not files:
        raise ValueError("a checkpoint needs at least one file")
    if not 0 < chunk_size <= limits.chunk_size:
        raise ValueError(f"chunk_size must be in (0, {limits.chunk_size}] (Limits.chunk_size)")
    infos: list[ChunkInfo] = []
    chunks: list[bytes] = []
    for name in sorted(files):
        data = memoryview(files[name])
        if not data.nbytes:
            raise ValueError(f"file {name!r} is empty")
        for offset in range(0, data.nbytes, chunk_size):
            piece = bytes(data[offset : offset + chunk_size])
            infos.append(
                ChunkInfo(
                    index=len(infos),
                    file=name,
                    offset=offset,
                    size=len(piece),
                    hash=chunk_digest(hash, piece),
                )
            )
            chunks.append(piece)
    manifest = Manifest(
        version=version,
        parent_version=parent_version,
        model_config_hash=model_config_hash,
        tokenizer_hash=tokenizer_hash,
        hash_algorithm=hash,
        chunk_size=chunk_size,
        total_size=sum(c.size for c in infos),
        chunks=infos,
        root_hash=root_hash(hash, infos),
        created_at=created_at,
        expires_at=expires_at,
        tensors=tensors,
        delta=delta,
        lora=lora,
    )
    check_manifest(manifest, now=created_at, limits=limits)
    return manifest, chunks


def build_manifest_from_dir(
    path: str | Path,
    *,
    pattern: str = "*.safetensors",
    version: int,
    parent_version: int | None,
    model_config_hash: str,
    tokenizer_hash: str,
    created_at: float,
    expires_at: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    hash: HashAlgorithm = "sha256",
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[Manifest, list[bytes]]:
    """:func:`build_manifest` over the files matching ``pattern`` directly inside ``path``."""
    root = Path(path)
    files = {p.name: p.read_bytes() for p in sorted(root.glob(pattern)) if p.is_file()}
    if not files:
        raise ValueError(f"no files matching {pattern!r} in {root}")
    return build_manifest(
        files,
        version=version,
        parent_version=parent_version,
        model_config_hash=model_config_hash,
        tokenizer_hash=tokenizer_hash,
        created_at=created_at,
        expires_at=expires_at,
        chunk_size=chunk_size,
        hash=hash,
        limits=limits,
    )


def sign_manifest(manifest: Manifest, identity: Identity, now: float) -> SignedEnvelope:
    """Seal the manifest with the coordinator's identity."""
    return seal(identity, manifest, now=now)


def verify_manifest(
    env: SignedEnvelope, pinned_public_key: bytes, now: float, *, limits: Limits = DEFAULT_LIMITS
) -> Manifest:
    """Verify signature (by the pinned key), layout, root hash, limits and expiry.

    No replay or clock-skew check: manifests are legitimately re-served by peers long after
    signing; ``expires_at`` bounds their life instead. Raises ``bad_signature``,
    ``manifest_invalid`` or a decode code.
    """
    verify_envelope(env, expected_signer=pinned_public_key)
    manifest = decode(env.payload, Manifest, limits)
    check_manifest(manifest, now=now, limits=limits)
    return manifest


def check_manifest(manifest: Manifest, *, now: float, limits: Limits = DEFAULT_LIMITS) -> None:
    """Structural checks on an (already decoded) manifest; raise ``manifest_invalid``."""

    def bad(detail: str) -> ManifestError:
        return ManifestError(ReasonCode.MANIFEST_INVALID, f"v{manifest.version}: {detail}")

    if manifest.protocol_version != PROTOCOL_VERSION:
        raise bad(f"protocol_version {manifest.protocol_version}")
    if not math.isfinite(now) or not manifest.created_at <= manifest.expires_at:
        raise bad("expires_at precedes created_at")
    if now > manifest.expires_at:
        raise bad(f"expired at {manifest.expires_at:.0f} (now {now:.0f})")
    if manifest.parent_version is not None and manifest.parent_version >= manifest.version:
        raise bad(f"parent_version {manifest.parent_version} is not older")
    n = len(manifest.chunks)
    if not 0 < n <= limits.max_chunks:
        raise bad(f"{n} chunks, allowed 1..{limits.max_chunks}")
    if manifest.chunk_size > limits.chunk_size:
        raise bad(f"chunk_size {manifest.chunk_size} above this peer's {limits.chunk_size}")
    if manifest.total_size > limits.max_total_size:
        raise bad(f"total_size {manifest.total_size} above {limits.max_total_size}")
    file, expect_offset, total = "", 0, 0
    for i, c in enumerate(manifest.chunks):
        if c.index != i:
            raise bad(f"chunk at position {i} has index {c.index}")
        if c.file != file:  # a new file starts; files appear in strictly increasing name order
            if c.file <= file:
                raise bad(f"chunk {i}: file {c.file!r} out of order")
            file, expect_offset = c.file, 0
        elif manifest.chunks[i - 1].size != manifest.chunk_size:
            raise bad(f"chunk {i - 1} is short but not the last chunk of {file!r}")
        if c.offset != expect_offset or c.size > manifest.chunk_size:
            raise bad(f"chunk {i} ({c.file} @ {c.offset}, {c.size} bytes) breaks the layout")
        expect_offset += c.size
        total += c.size
    if total != manifest.total_size:
        raise bad(f"total_size {manifest.total_size} but chunks add up to {total}")
    if root_hash(manifest.hash_algorithm, manifest.chunks) != manifest.root_hash:
        raise bad("root hash does not match the chunk list")
    _check_parts(manifest, bad)


def _check_parts(manifest: Manifest, bad: Callable[[str], ManifestError]) -> None:
    """The tensor list and the delta part (docs/protocol.md §8.4-§8.5)."""
    tensors = manifest.tensors
    if tensors is not None:
        for a, b in itertools.pairwise(tensors):
            if a.name >= b.name:
                raise bad(f"tensors not strictly ascending by name at {b.name!r}")
    delta = manifest.delta
    if manifest.lora is not None and delta is not None:
        raise bad("a LoRA version cannot also be a delta")
    if delta is None:
        return
    if tensors is None:
        raise bad("a delta version must list its tensors")
    if delta.base_version >= manifest.version:
        raise bad(f"delta base v{delta.base_version} is not older")
    for earlier, later in itertools.pairwise(delta.files):
        if earlier >= later:
            raise bad(f"delta files not strictly ascending at {later!r}")
    files = {c.file for c in manifest.chunks}
    if missing := [f for f in delta.files if f not in files]:
        raise bad(f"delta file {missing[0]!r} has no chunks")
    if files <= set(delta.files):
        raise bad("no full checkpoint files besides the delta")


def version_kind(manifest: Manifest) -> VersionKind:
    """``"lora"``, ``"delta"`` or ``"full"`` (module docstring)."""
    if manifest.lora is not None:
        return "lora"
    return "delta" if manifest.delta is not None else "full"


def delta_files(manifest: Manifest) -> frozenset[str]:
    """Names of the delta files of ``manifest`` (empty for a keyframe)."""
    return frozenset(manifest.delta.files) if manifest.delta is not None else frozenset()


def part_indices(manifest: Manifest, part: Part) -> list[int]:
    """Chunk indices of the ``"full"`` checkpoint or of the ``"delta"`` (empty for a keyframe)."""
    names = delta_files(manifest)
    want_delta = part == "delta"
    return [c.index for c in manifest.chunks if (c.file in names) == want_delta]


def part_size(manifest: Manifest, part: Part) -> int:
    """Bytes of one part of ``manifest``."""
    return sum(manifest.chunks[i].size for i in part_indices(manifest, part))


def verify_chunk(manifest: Manifest, index: int, data: Buffer) -> None:
    """Raise :class:`ChunkHashMismatch` (naming the chunk) unless ``data`` is chunk ``index``."""
    if not 0 <= index < len(manifest.chunks):
        raise ManifestError(
            ReasonCode.MANIFEST_INVALID,
            f"v{manifest.version} has no chunk {index} ({len(manifest.chunks)} chunks)",
        )
    info = manifest.chunks[index]
    where = f"chunk {index} of v{manifest.version} ({info.file} @ offset {info.offset})"
    if len(data) != info.size:
        raise ChunkHashMismatch(
            index, info.file, f"{where}: {len(data)} bytes, expected {info.size}"
        )
    digest = chunk_digest(manifest.hash_algorithm, data)
    if digest != info.hash:
        raise ChunkHashMismatch(
            index,
            info.file,
            f"{where}: {manifest.hash_algorithm} {digest.hex()[:16]}…, "
            f"expected {info.hash.hex()[:16]}…",
        )


def reassemble(
    manifest: Manifest, chunks: Sequence[bytes] | Mapping[int, bytes]
) -> dict[str, bytes]:
    """Verify every chunk and concatenate them back into ``{file name: bytes}``."""
    parts: dict[str, list[bytes]] = {}
    for info in manifest.chunks:
        try:
            data = chunks[info.index]
        except (IndexError, KeyError):
            raise ManifestError(
                ReasonCode.MANIFEST_INVALID, f"chunk {info.index} of v{manifest.version} missing"
            ) from None
        verify_chunk(manifest, info.index, data)
        parts.setdefault(info.file, []).append(data)
    return {name: b"".join(p) for name, p in parts.items()}
