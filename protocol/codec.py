"""MessagePack codec and length-prefixed framing with hard limits.

* :func:`encode` / :func:`decode`: one message <-> MessagePack bytes (msgspec, typed, strict).
* :func:`frame`, :func:`read_frame`, :func:`write_frame`: a frame is a 4-byte big-endian unsigned
  length followed by that many bytes of one encoded message. The length is checked against the
  caller's maximum *before* the body is read, so a peer cannot make us buffer more than the limit.

This module is the one boundary where msgspec, Unicode, asyncio and OS errors are translated:
:func:`decode` and :func:`read_frame` raise only :class:`~protocol.errors.ProtocolError`.
"""

from __future__ import annotations

import asyncio
import re
import struct
from typing import Any, TypeVar, overload

import msgspec

from protocol.errors import (
    DecodeError,
    ProtocolError,
    ReasonCode,
    TransportError,
    error_for,
)
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import PROTOCOL_VERSION, Message

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_FRAME_LEN",
    "Limits",
    "decode",
    "encode",
    "frame",
    "read_frame",
    "write_frame",
]

T = TypeVar("T")
MAX_FRAME_LEN = 0xFFFF_FFFF  # the largest length a 4-byte prefix can express
_HEADER = struct.Struct(">I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_CODE_PREFIX = re.compile(r"^([a-z_]+): (.*)$", re.S)
_MAX_FLOAT_BOUND = re.compile(r"Expected `float` [<>]= -?1\.7976931348623157e\+308")


class _VersionProbe(msgspec.Struct):
    """Lenient view of a top-level map: only looks at ``protocol_version``."""

    protocol_version: Any = None


def encode(msg: msgspec.Struct) -> bytes:
    """Encode one message as MessagePack bytes (no frame header)."""
    return _ENCODER.encode(msg)


@overload
def decode(data: bytes, type_: type[T], limits: Limits = ...) -> T: ...
@overload
def decode(data: bytes, type_: Any = ..., limits: Limits = ...) -> Any: ...
def decode(data: bytes, type_: Any = Message, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode ``data`` as ``type_`` (a message class or union, default: any :data:`Message`).

    Raises :class:`~protocol.errors.DecodeError` (a ProtocolError) for every malformed, oversized,
    schema-violating or unsupported-version input, and nothing else.
    """
    max_len = limits.max_frame(type_)
    if len(data) > max_len:
        raise DecodeError(
            ReasonCode.FRAME_TOO_LARGE, f"{len(data)} bytes exceeds the {max_len}-byte limit"
        )
    decoder = _DECODERS.get(type_)
    if decoder is None:
        decoder = _DECODERS[type_] = msgspec.msgpack.Decoder(type_)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise (
            _not_one_object(data) or _unsupported_version(data) or _from_validation(str(exc))
        ) from exc
    except (msgspec.DecodeError, UnicodeError, ValueError, TypeError, OverflowError) as exc:
        raise DecodeError(ReasonCode.MALFORMED, f"not valid MessagePack: {exc}") from exc
    except RecursionError as exc:
        raise DecodeError(ReasonCode.MALFORMED, "nesting too deep") from exc


def _not_one_object(data: bytes) -> ProtocolError | None:
    """On a failed decode, report bytes that are not exactly one MessagePack object (trailing
    bytes, truncation, a reserved byte, nesting too deep) as ``malformed`` before any schema
    problem the typed decoder met first (docs/protocol.md §2, "Which code wins"). ``Raw`` only
    walks the structure: nothing is allocated, however large the frame."""
    try:
        msgspec.msgpack.decode(data, type=msgspec.Raw)
    except RecursionError:
        return DecodeError(ReasonCode.MALFORMED, "nesting too deep")
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
        return DecodeError(ReasonCode.MALFORMED, f"not valid MessagePack: {exc}")
    return None


def _unsupported_version(data: bytes) -> ProtocolError | None:
    """On a failed decode, report a foreign protocol_version rather than its symptoms."""
    try:
        version = msgspec.msgpack.decode(data, type=_VersionProbe).protocol_version
    except (msgspec.MsgspecError, UnicodeError, ValueError, TypeError, RecursionError):
        return None
    if isinstance(version, int) and version != PROTOCOL_VERSION:
        return DecodeError(
            ReasonCode.UNSUPPORTED_VERSION,
            f"protocol_version {version} (this peer speaks {PROTOCOL_VERSION})",
        )
    return None


def _from_validation(message: str) -> ProtocolError:
    """Map a msgspec validation message to a stable reason code."""
    m = _CODE_PREFIX.match(message)
    if m and m.group(1) in ReasonCode.__members__.values():
        return error_for(m.group(1), m.group(2))  # raised by a __post_init__ check
    if message.startswith("Object contains unknown field"):
        code = ReasonCode.UNKNOWN_FIELD
    elif _MAX_FLOAT_BOUND.match(message):
        code = ReasonCode.NOT_FINITE
        where = message.partition(" - ")[2]
        message = "NaN or infinity where a finite number is required"
        message += f" - {where}" if where else ""
    elif "of length <=" in message:
        code = ReasonCode.TOO_LONG
    elif message.startswith(("Expected `int` >=", "Expected `int` <=")):
        code = ReasonCode.OUT_OF_RANGE
    elif message.startswith("Invalid value") and "$.type`" in message:
        message = "unknown message type: " + message
        code = ReasonCode.SCHEMA
    else:
        code = ReasonCode.SCHEMA
    return DecodeError(code, message)


def frame(data: bytes) -> bytes:
    """Prefix ``data`` with its 4-byte big-endian length."""
    if len(data) > MAX_FRAME_LEN:
        raise DecodeError(ReasonCode.FRAME_TOO_LARGE, f"{len(data)} bytes cannot be framed")
    return _HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes:
    """Read one frame body; the whole frame must arrive within ``timeout`` seconds.

    Raises ``frame_too_large`` (before reading the body), ``malformed`` (empty frame),
    ``timeout``, or ``closed`` (the stream ended; detail says whether mid-frame).
    """
    got_header = False
    try:
        async with asyncio.timeout(timeout):
            (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            got_header = True
            if length > max_bytes:
                raise DecodeError(
                    ReasonCode.FRAME_TOO_LARGE,
                    f"peer announced a {length}-byte frame, the limit is {max_bytes}",
                )
            if length == 0:
                raise DecodeError(ReasonCode.MALFORMED, "empty frame")
            return await reader.readexactly(length)
    except TimeoutError as exc:
        raise TransportError(ReasonCode.TIMEOUT, f"no complete frame within {timeout:g}s") from exc
    except asyncio.IncompleteReadError as exc:
        where = "mid-frame" if got_header or exc.partial else "at a frame boundary"
        raise TransportError(ReasonCode.CLOSED, f"stream closed {where}") from exc
    except (ConnectionError, OSError) as exc:
        raise TransportError(ReasonCode.CLOSED, f"stream failed: {exc}") from exc


async def write_frame(writer: asyncio.StreamWriter, data: bytes, timeout: float) -> None:
    """Write one frame and wait (at most ``timeout`` seconds) until it is flushed."""
    if len(data) > MAX_FRAME_LEN:
        raise DecodeError(ReasonCode.FRAME_TOO_LARGE, f"{len(data)} bytes cannot be framed")
    try:
        writer.write(_HEADER.pack(len(data)))
        writer.write(data)
        await asyncio.wait_for(writer.drain(), timeout)
    except TimeoutError as exc:
        raise TransportError(
            ReasonCode.TIMEOUT, f"peer did not accept {len(data)} bytes within {timeout:g}s"
        ) from exc
    except (ConnectionError, OSError) as exc:
        raise TransportError(ReasonCode.CLOSED, f"stream failed: {exc}") from exc
