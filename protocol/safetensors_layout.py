"""The layout of safetensors files, read from raw bytes (no torch): which tensor sits where.

A safetensors file is ``u64le(header_len) || header (JSON, header_len bytes) || data``; the header
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the start of the data section) plus an optional ``"__metadata__"`` map. Deltas
(:mod:`protocol.delta`) patch tensors in place, so they need each tensor's absolute byte range,
element width and element count; nothing here interprets the values.

Parsing is strict, since the same code reads files that peers produced: the header must be valid
JSON of the shape above, tensor ranges must lie inside the file, match dtype × shape, and not
overlap, and a tensor name may appear in one file only.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.errors import DeltaError, ReasonCode

__all__ = ["DTYPE_WIDTH", "TensorSpan", "header_bytes", "parse_layout", "tensor_spans"]

#: bytes per element of every safetensors dtype (sub-byte types are not supported here)
DTYPE_WIDTH: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header length


@dataclass(frozen=True, slots=True)
class TensorSpan:
    """Where one tensor's data lies: ``file[start:end]``, ``numel`` elements of ``width`` bytes."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first element in the file
    end: int  # absolute byte offset one past the last element

    @property
    def width(self) -> int:
        return DTYPE_WIDTH[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _bad(file: str, detail: str) -> DeltaError:
    return DeltaError(ReasonCode.DELTA_INVALID, f"{file}: not a usable safetensors file: {detail}")


def header_bytes(file: str, data: bytes | bytearray | memoryview) -> bytes:
    """The 8-byte length prefix and the JSON header of a safetensors file (everything before the
    tensor data)."""
    if len(data) < 8:
        raise _bad(file, f"{len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER or 8 + n > len(data):
        raise _bad(file, f"header length {n} does not fit the file ({len(data)} bytes)")
    return bytes(data[: 8 + n])


def parse_layout(file: str, data: bytes | bytearray | memoryview) -> list[TensorSpan]:
    """Every tensor of one safetensors file, in data order; raise ``delta_invalid`` if the file
    is not well formed."""
    head = header_bytes(file, data)
    try:
        header = json.loads(head[8:])
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(file, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(file, "header is not a JSON object")
    base = len(head)
    spans: list[TensorSpan] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (
            isinstance(entry, dict)
            and entry.get("dtype") in DTYPE_WIDTH
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"])
        ):
            raise _bad(file, f"tensor {name!r} has a malformed header entry")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        span = TensorSpan(name, file, entry["dtype"], shape, base + begin, base + end)
        if not 0 <= begin <= end or span.end > len(data):
            raise _bad(file, f"tensor {name!r} lies outside the file")
        if end - begin != span.numel * span.width:
            raise _bad(file, f"tensor {name!r}: {end - begin} bytes for {span.dtype} {list(shape)}")
        spans.append(span)
    spans.sort(key=lambda s: (s.start, s.end))
    for prev, cur in itertools.pairwise(spans):
        if cur.start < prev.end:
            raise _bad(file, f"tensors {prev.name!r} and {cur.name!r} overlap")
    return spans


def tensor_spans(files: Mapping[str, bytes | bytearray | memoryview]) -> dict[str, TensorSpan]:
    """Every tensor of a checkpoint (one or more safetensors files) by name; names are unique."""
    out: dict[str, TensorSpan] = {}
    for file in sorted(files):
        for span in parse_layout(file, files[file]):
            if span.name in out:
                raise _bad(file, f"tensor {span.name!r} also appears in {out[span.name].file}")
            out[span.name] = span
    return out
