"""Constrained field types and the base classes of every wire message.

The aliases carry msgspec ``Meta`` constraints, so limits are enforced while decoding, before a
message object exists. Floats are typed :data:`Finite` (NaN and infinities fail the bounds check and
are reported as ``not_finite``); narrower ranges are checked in ``__post_init__`` and reported as
``out_of_range``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocol import limits as L
from protocol.errors import ReasonCode, SchemaViolation

PROTOCOL_VERSION = 1

# --- constrained field types --------------------------------------------------------------------
Finite = Annotated[float, Meta(ge=-L.MAX_FLOAT, le=L.MAX_FLOAT)]  # NaN/inf -> not_finite
U32 = Annotated[int, Meta(ge=0, le=L.MAX_U32)]
U64 = Annotated[int, Meta(ge=0, le=L.MAX_I64)]  # non-negative, fits msgpack int64
Id = Annotated[str, Meta(min_length=1, max_length=L.MAX_ID_LEN)]
Name = Annotated[str, Meta(max_length=L.MAX_NAME_LEN)]
Text = Annotated[str, Meta(max_length=L.MAX_TEXT_LEN)]
HexDigest = Annotated[str, Meta(max_length=L.MAX_ID_LEN, pattern=r"^[0-9a-f]*$")]
PublicKey = Annotated[bytes, Meta(min_length=32, max_length=32)]
Digest = Annotated[bytes, Meta(min_length=32, max_length=32)]
FileName = Annotated[str, Meta(max_length=L.MAX_NAME_LEN, pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")]
Slug = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
PackedTokens = Annotated[bytes, Meta(max_length=L.MAX_PACKED_LEN)]  # little-endian uint32
PackedLogprobs = Annotated[bytes, Meta(max_length=L.MAX_PACKED_LEN)]  # little-endian float32
Blob = Annotated[bytes, Meta(max_length=L.MAX_BLOB_LEN)]
Dtype = Literal["float32", "float16", "bfloat16"]
SafetensorsDtype = Literal[
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "I64", "U64", "F64",
]  # fmt: skip
FinishReason = Literal["eos", "stop", "length"]
Reachability = Literal["public", "relayed", "private", "unknown"]
"""public: dialable (measured); relayed: via a relay; private: measured not dialable (behind NAT,
download-only); unknown: not measured."""
Scalar = bool | int | Finite | Text | None
StatusValue = (
    bool
    | int
    | Finite
    | Text
    | None
    | Annotated[list[Scalar], Meta(max_length=L.MAX_STATUS_KEYS)]
    | Annotated[dict[Name, Scalar], Meta(max_length=L.MAX_STATUS_KEYS)]
)


def check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise SchemaViolation(ReasonCode.OUT_OF_RANGE, f"{name}={value} not in [{lo}, {hi}]")


class WireStruct(msgspec.Struct, forbid_unknown_fields=True):
    """Untagged nested struct."""


class MessageBase(msgspec.Struct, forbid_unknown_fields=True, tag=True, kw_only=True):
    """Top-level message: tagged with its class name, carries ``protocol_version``."""

    protocol_version: int = PROTOCOL_VERSION
    """Wire protocol version; receivers reject anything but PROTOCOL_VERSION."""

    def __post_init__(self) -> None:
        if self.protocol_version != PROTOCOL_VERSION:
            raise SchemaViolation(
                ReasonCode.UNSUPPORTED_VERSION,
                f"protocol_version {self.protocol_version} (this peer speaks {PROTOCOL_VERSION})",
            )
