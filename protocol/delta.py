"""Sparse deltas between two versions of a checkpoint, on raw safetensors bytes (numpy, no torch).

At RL learning rates most bf16 weights keep every bit from one version to the next, so version v
can travel as "which elements changed, and how" against a base version b the receiver holds
(DESIGN.md §5). The normative description is docs/protocol.md §8.4–§8.5; in short::

    delta     = b"RSDELTA1" || u32be(n_records) || record*       (records in ascending tensor order)
    record    = u32be(tensor) || u8(encoding) || u64be(count) || u64be(raw_len) || u32be(body_len)
                || body
    body      = exactly one zstd frame whose header declares raw_len; it decompresses to
                positions || values
    positions = encoding 1 (gaps):   count gaps p_0, then p_i − p_{i−1} − 1, each a
                                     little-endian u32 (u64 when numel > 2^32), as byte planes
                encoding 2 (bitmap): ceil(numel / 8) bytes, element i changed ⇔ bit (i mod 8) of
                                     byte i // 8 (LSB first); bits past numel are 0
    values    = for each listed position, new element bytes XOR base element bytes (never all
                zero), stored as byte planes: byte 0 of every value, then byte 1, ...

``tensor`` indexes the version's signed tensor list (``Manifest.tensors``, ascending by name);
tensors without a record are unchanged. ``count`` ≥ 1 elements changed. The encoder compresses
both position encodings and keeps the shorter record (gaps on a tie). Byte planes put the bytes
that are almost always zero (high bytes of gaps and of XORs) next to each other, where zstd
compresses them to almost nothing. XOR rather
than the new value: a small update flips low mantissa bits only, so the XOR's high bytes are
almost all zero and compress to nearly nothing; both need the base, which a delta needs anyway.

A delta applies only where the base's files have the same names and the same safetensors
headers as the new version (same tensors, dtypes, shapes, offsets); the patched bytes are then
the new files, byte for byte. :func:`apply_delta` checks every bound before it allocates or
writes, and verifies each tensor it will hand out against the signed digest (``tensor digest``,
§8.4). Every refusal is a :class:`~protocol.errors.DeltaError` with a reason code.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import zstandard

from protocol.errors import DeltaError, ReasonCode
from protocol.messages import TensorInfo
from protocol.safetensors_layout import TensorSpan, header_bytes, tensor_spans

__all__ = [
    "MAGIC",
    "TENSOR_DOMAIN",
    "EncodedDelta",
    "LayoutChanged",
    "apply_delta",
    "encode_delta",
    "gap_width",
    "read_records",
    "tensor_digest",
    "tensor_infos",
]

MAGIC = b"RSDELTA1"
TENSOR_DOMAIN = b"rollout-swarm/tensor/v1\x00"
GAPS, BITMAP = 1, 2
_HEAD = struct.Struct(">IBQQI")  # tensor, encoding, count, raw_len, body_len
_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}

Buffer = bytes | bytearray | memoryview


class LayoutChanged(ValueError):
    """The two versions differ in files or tensor layout: no delta, publish a keyframe."""


# --- tensor digests ----------------------------------------------------------------------------
def tensor_digest(algorithm: str, dtype: str, shape: Sequence[int], data: Buffer) -> bytes:
    """``H(TENSOR_DOMAIN || dtype || 0x00 || u32be(ndim) || u64be(dim)* || data)`` (§8.4)."""
    prefix = [TENSOR_DOMAIN, dtype.encode("ascii"), b"\x00", struct.pack(">I", len(shape))]
    prefix += [struct.pack(">Q", d) for d in shape]
    hasher: Any
    if algorithm == "sha256":
        hasher = hashlib.sha256()
    elif algorithm == "blake3":  # large tensors on every core (blake3 splits the input)
        threads = blake3.blake3.AUTO if len(memoryview(data)) >= 1 << 20 else 1
        hasher = blake3.blake3(max_threads=threads)
    else:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; use sha256 or blake3")
    hasher.update(b"".join(prefix))
    hasher.update(data)
    digest: bytes = hasher.digest()
    return digest


def _span_digest(algorithm: str, span: TensorSpan, files: Mapping[str, Buffer]) -> bytes:
    view = memoryview(files[span.file])[span.start : span.end]
    return tensor_digest(algorithm, span.dtype, span.shape, view)


def tensor_infos(files: Mapping[str, Buffer], algorithm: str) -> list[TensorInfo]:
    """The signed tensor list of a checkpoint (ascending by name), digests included."""
    spans = tensor_spans(files)
    return [
        TensorInfo(
            name=name,
            dtype=s.dtype,  # type: ignore[arg-type]  # parse_layout only admits known dtypes
            shape=list(s.shape),
            hash=_span_digest(algorithm, s, files),
        )
        for name, s in sorted(spans.items())
    ]


# --- byte planes ------------------------------------------------------------------------------
def _planes(values: np.ndarray[Any, Any]) -> bytes:
    """Little-endian elements as byte planes: byte 0 of every element, then byte 1, ..."""
    width = values.dtype.itemsize
    if width == 1:
        return values.astype(np.uint8).tobytes()
    v = values.astype(_UINT[width], copy=False)
    return b"".join((v >> (8 * k)).astype(np.uint8).tobytes() for k in range(width))


def _from_planes(raw: np.ndarray[Any, np.dtype[np.uint8]], width: int) -> np.ndarray[Any, Any]:
    """Inverse of :func:`_planes` (shift-or of contiguous planes; all-zero planes skipped)."""
    planes = raw.reshape(width, raw.size // width)
    out: np.ndarray[Any, Any] = planes[0].astype(_UINT[width])
    for k in range(1, width):
        if planes[k].any():
            out |= planes[k].astype(_UINT[width]) << np.array(8 * k, dtype=_UINT[width])
    return out


def gap_width(numel: int) -> int:
    """Bytes per stored gap: 4 while every index fits in 32 bits, else 8."""
    return 4 if numel <= 1 << 32 else 8


# --- encoding -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncodedDelta:
    """An encoded delta and what it changes."""

    data: bytes
    changed: list[str]  # names of the tensors with at least one changed element
    changed_elements: int
    total_elements: int


def _elements(files: Mapping[str, Buffer], span: TensorSpan) -> np.ndarray[Any, Any]:
    return np.frombuffer(
        files[span.file], dtype=_UINT[span.width], count=span.numel, offset=span.start
    )


def encode_delta(
    base_files: Mapping[str, Buffer],
    new_files: Mapping[str, Buffer],
    tensors: Sequence[TensorInfo],
    *,
    level: int = 3,
) -> EncodedDelta:
    """The delta turning ``base_files`` into ``new_files``; ``tensors`` is the new version's signed
    tensor list. Raises :class:`LayoutChanged` when no delta can express the change."""
    if sorted(base_files) != sorted(new_files):
        raise LayoutChanged(f"files differ: {sorted(base_files)} vs {sorted(new_files)}")
    for name in new_files:
        if header_bytes(name, base_files[name]) != header_bytes(name, new_files[name]):
            raise LayoutChanged(f"{name}: safetensors header changed (tensors, dtypes or shapes)")
        if len(base_files[name]) != len(new_files[name]):
            raise LayoutChanged(f"{name}: size changed")
    spans = tensor_spans(new_files)
    if [t.name for t in tensors] != sorted(spans):
        raise ValueError("tensors is not the new version's tensor list (ascending by name)")
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    parts = [MAGIC, b""]
    changed: list[str] = []
    n_changed = 0
    for index, info in enumerate(tensors):
        span = spans[info.name]
        xor = _elements(base_files, span) ^ _elements(new_files, span)
        positions = np.flatnonzero(xor).astype(np.uint64)
        if not positions.size:
            continue
        values = xor[positions.astype(np.intp)]
        planes = _planes(values)
        gaps = np.diff(positions, prepend=np.uint64(0))
        gaps[1:] -= np.uint64(1)
        gap_dtype = np.uint32 if gap_width(span.numel) == 4 else np.uint64
        candidates = []
        for encoding in (GAPS, BITMAP):
            if encoding == GAPS:
                pos_bytes = _planes(gaps.astype(gap_dtype))
            else:
                bits = np.zeros(span.numel, dtype=bool)
                bits[positions.astype(np.intp)] = True
                pos_bytes = np.packbits(bits, bitorder="little").tobytes()
            raw = pos_bytes + planes
            body = compressor.compress(raw)
            head = _HEAD.pack(index, encoding, positions.size, len(raw), len(body))
            candidates.append(head + body)
        parts.append(min(candidates, key=len))  # gaps on a tie (min keeps the first)
        changed.append(info.name)
        n_changed += int(positions.size)
    parts[1] = struct.pack(">I", len(changed))
    total = sum(s.numel for s in spans.values())
    return EncodedDelta(b"".join(parts), changed, n_changed, total)


# --- decoding -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One decoded tensor record: element ``positions`` (ascending) and their XOR ``values``."""

    tensor: int
    positions: np.ndarray[Any, Any]
    values: np.ndarray[Any, Any]


def _invalid(detail: str) -> DeltaError:
    return DeltaError(ReasonCode.DELTA_INVALID, detail)


def read_records(data: Buffer, tensors: Sequence[TensorInfo]) -> list[Record]:
    """Decode and bound-check every record of ``data`` against the signed ``tensors``."""
    from protocol.safetensors_layout import DTYPE_WIDTH

    view = memoryview(data)
    if len(view) < len(MAGIC) + 4 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise _invalid("does not start with the RSDELTA1 magic")
    (n,) = struct.unpack_from(">I", view, len(MAGIC))
    if n > len(tensors):
        raise _invalid(f"{n} records for {len(tensors)} tensors")
    pos, last = len(MAGIC) + 4, -1
    records: list[Record] = []
    for r in range(n):
        if pos + _HEAD.size > len(view):
            raise _invalid(f"truncated: record {r} of {n} starts past the end ({len(view)} bytes)")
        index, encoding, count, raw_len, body_len = _HEAD.unpack_from(view, pos)
        pos += _HEAD.size
        if not last < index < len(tensors):
            raise _invalid(f"record {r}: tensor {index} out of order or not in the tensor list")
        last = index
        info = tensors[index]
        width = DTYPE_WIDTH[info.dtype]
        numel = 1
        for d in info.shape:
            numel *= d
        where = f"record {r} ({info.name})"
        if not 1 <= count <= numel:
            raise _invalid(f"{where}: {count} changed elements of {numel}")
        if encoding == GAPS:
            expect = count * (gap_width(numel) + width)
        elif encoding == BITMAP:
            expect = (numel + 7) // 8 + count * width
        else:
            raise _invalid(f"{where}: unknown position encoding {encoding}")
        if raw_len != expect:
            raise _invalid(f"{where}: {raw_len} decompressed bytes, expected {expect}")
        if pos + body_len > len(view):
            raise _invalid(f"truncated: {where} needs {body_len} bytes, {len(view) - pos} left")
        raw = _decompress(view[pos : pos + body_len], raw_len, where)
        pos += body_len
        records.append(_record(index, encoding, count, numel, width, raw, where))
    if pos != len(view):
        raise _invalid(f"{len(view) - pos} bytes after the last record")
    return records


def _decompress(body: memoryview, raw_len: int, where: str) -> bytes:
    """Exactly one zstd frame that declares (and holds) ``raw_len`` bytes; nothing after it."""
    try:
        declared = zstandard.frame_content_size(body)
        if declared != raw_len:
            raise _invalid(f"{where}: zstd frame declares {declared} bytes, record says {raw_len}")
        obj = zstandard.ZstdDecompressor().decompressobj()
        raw: bytes = obj.decompress(body)
        if not obj.eof or obj.unused_data or len(raw) != raw_len:
            raise _invalid(f"{where}: zstd body is truncated, has trailing bytes or the wrong size")
        return raw
    except zstandard.ZstdError as exc:
        raise _invalid(f"{where}: zstd body does not decompress ({exc})") from None


def _record(
    index: int, encoding: int, count: int, numel: int, width: int, raw: bytes, where: str
) -> Record:
    buf = np.frombuffer(raw, dtype=np.uint8)
    pos_len = len(raw) - count * width
    if encoding == GAPS:
        gaps = _from_planes(buf[:pos_len], gap_width(numel))
        if int(gaps.max()) >= numel:
            raise _invalid(f"{where}: position gap beyond the tensor")
        # p_i = sum of the first i+1 gaps + i; exact in int64 while count * numel < 2^63
        positions = np.cumsum(gaps, dtype=np.uint64).astype(np.int64, copy=False)
        positions += np.arange(count, dtype=np.int64)
    else:
        bits = np.unpackbits(buf[:pos_len], bitorder="little")
        if bits[numel:].any():
            raise _invalid(f"{where}: bitmap has bits set past element {numel}")
        positions = np.flatnonzero(bits[:numel])
        if positions.size != count:
            raise _invalid(f"{where}: bitmap marks {positions.size} elements, record says {count}")
    # Gaps give strictly increasing positions unless the sum overflowed, which only a tensor of
    # more than 2^31 elements allows (count * numel >= 2^63): check the order there.
    if numel > 1 << 31 and count > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        raise _invalid(f"{where}: positions are not strictly increasing")
    if int(positions[-1]) >= numel:
        raise _invalid(f"{where}: position {int(positions[-1])} beyond {numel} elements")
    values = _from_planes(buf[pos_len:], width)
    if not bool(values.all()):
        raise _invalid(f"{where}: a listed element does not change (zero XOR)")
    return Record(index, positions.astype(np.intp, copy=False), values)


# --- applying -----------------------------------------------------------------------------------
def apply_delta(
    base_files: Mapping[str, Buffer],
    data: Buffer,
    tensors: Sequence[TensorInfo],
    algorithm: str,
    *,
    base_tensors: Sequence[TensorInfo] | None = None,
    in_place: bool = False,
) -> tuple[dict[str, bytearray], list[str]]:
    """Apply ``data`` to ``base_files`` (the verified full files of the base version).

    ``tensors`` is the new version's signed tensor list, ``algorithm`` its manifest's hash.
    Returns the new files and the names of the changed tensors, after checking that every
    tensor of the result hashes to its signed digest: changed tensors are hashed; an unchanged
    one is accepted when ``base_tensors`` (the base's signed list) has the same digest, else
    hashed too. Raises ``delta_invalid`` (malformed bytes), ``delta_mismatch`` (the base does
    not have the new version's layout, or a reconstructed tensor has the wrong digest).
    With ``in_place``, base files given as ``bytearray`` are patched rather than copied (saves
    a copy of the checkpoint; after a refusal their content is undefined).
    """
    spans = tensor_spans(base_files)
    by_name = {t.name: t for t in tensors}
    if sorted(spans) != list(by_name) or len(by_name) != len(tensors):
        raise DeltaError(
            ReasonCode.DELTA_MISMATCH,
            f"the base holds {len(spans)} tensors, the version lists {len(tensors)} others",
        )
    for name, span in spans.items():
        info = by_name[name]
        if info.dtype != span.dtype or tuple(info.shape) != span.shape:
            raise DeltaError(
                ReasonCode.DELTA_MISMATCH,
                f"tensor {name}: base is {span.dtype} {list(span.shape)}, the version lists "
                f"{info.dtype} {info.shape}",
            )
    records = read_records(data, tensors)
    out = {
        name: buf if in_place and isinstance(buf, bytearray) else bytearray(buf)
        for name, buf in base_files.items()
    }
    changed: list[str] = []
    for rec in records:
        name = tensors[rec.tensor].name
        span = spans[name]
        target = np.frombuffer(
            out[span.file], dtype=_UINT[span.width], count=span.numel, offset=span.start
        )
        target[rec.positions] ^= rec.values
        changed.append(name)
    base_digest = {t.name: t.hash for t in base_tensors or ()}
    done = set(changed)
    for info in tensors:
        if info.name not in done and base_digest.get(info.name) == info.hash:
            continue  # unchanged bytes of a verified base with the same signed digest
        got = _span_digest(algorithm, spans[info.name], out)
        if got != info.hash:
            raise DeltaError(
                ReasonCode.DELTA_MISMATCH,
                f"tensor {info.name}: reconstruction hashes to {got.hex()[:16]}…, "
                f"signed {info.hash.hex()[:16]}…",
            )
    return out, changed
