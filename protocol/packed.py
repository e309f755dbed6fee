"""Packed token ids and log-probs: the compact wire form of long numeric sequences.

* token ids: little-endian ``uint32``, 4 bytes per token, no header;
* log-probs: little-endian IEEE-754 ``float32``, 4 bytes per value, no header, all finite.

Packing keeps rollout messages small and lets the decoder validate a whole sequence with one numpy
call instead of a Python loop. Re-exported from :mod:`protocol.messages`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from protocol.errors import ReasonCode, SchemaViolation

_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")


def pack_tokens(tokens: Sequence[int] | npt.NDArray[np.integer]) -> bytes:
    """Pack token ids (each in ``[0, 2**32)``) as little-endian uint32 bytes."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise SchemaViolation(ReasonCode.SCHEMA, "token ids must be a flat sequence of integers")
    if (arr.dtype.kind == "i" and int(arr.min()) < 0) or int(arr.max()) > 0xFFFFFFFF:
        raise SchemaViolation(ReasonCode.OUT_OF_RANGE, "token ids must be in [0, 2**32)")
    return arr.astype(_U32, copy=False).tobytes()


def tokens_array(data: bytes) -> npt.NDArray[np.uint32]:
    """View packed token bytes as a read-only uint32 array (no copy)."""
    check_packed("token_ids", data)
    return np.frombuffer(data, dtype=_U32)


def unpack_tokens(data: bytes) -> list[int]:
    """Unpack little-endian uint32 bytes into a list of token ids."""
    return tokens_array(data).tolist()  # type: ignore[no-any-return]  # Python ints


def pack_logprobs(logprobs: Sequence[float] | npt.NDArray[np.floating]) -> bytes:
    """Pack log-probs as little-endian float32 bytes; every value must be finite."""
    arr = np.asarray(logprobs, dtype=_F32)
    if arr.ndim != 1 and arr.size:
        raise SchemaViolation(ReasonCode.SCHEMA, "log-probs must be a flat sequence of floats")
    if not bool(np.isfinite(arr).all()):
        raise SchemaViolation(ReasonCode.NOT_FINITE, "log-probs contain NaN or infinity")
    return arr.reshape(-1).tobytes()


def logprobs_array(data: bytes) -> npt.NDArray[np.float32]:
    """View packed log-prob bytes as a read-only float32 array (no copy)."""
    check_packed("logprobs", data)
    return np.frombuffer(data, dtype=_F32)


def unpack_logprobs(data: bytes) -> list[float]:
    """Unpack little-endian float32 bytes into a list of Python floats."""
    return logprobs_array(data).tolist()  # type: ignore[no-any-return]  # Python floats


def check_packed(name: str, data: bytes) -> None:
    """Raise unless ``data`` is a whole number of 4-byte items."""
    if len(data) % 4:
        raise SchemaViolation(
            ReasonCode.MALFORMED, f"{name}: {len(data)} bytes is not a multiple of 4"
        )


def check_finite_f32(name: str, data: bytes) -> None:
    """Raise ``not_finite`` if packed float32 ``data`` holds NaN or infinity."""
    check_packed(name, data)
    if data and not bool(np.isfinite(np.frombuffer(data, dtype=_F32)).all()):
        raise SchemaViolation(ReasonCode.NOT_FINITE, f"{name}: contains NaN or infinity")
