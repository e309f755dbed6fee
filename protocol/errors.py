"""Protocol errors and their stable reason codes.

Every malformed, forged, replayed or out-of-policy input that reaches the protocol layer is reported
as a :class:`ProtocolError` carrying a :class:`ReasonCode`. The codes are part of the wire contract
(they travel in :class:`protocol.messages.Reject`), so they never change meaning once released.

Hierarchy::

    Exception
    ├── ProtocolError                 .code: ReasonCode, .detail: str; str(e) == "<code>: <detail>"
    │   ├── DecodeError               frame_too_large, malformed, schema, unknown_field, not_finite,
    │   │   │                         too_long, out_of_range, unsupported_version
    │   │   └── SchemaViolation       (also a ValueError) raised by message __post_init__ checks;
    │   │                             msgspec turns it into a validation error during decode
    │   ├── AuthError                 bad_signature, replayed, clock_skew
    │   ├── ManifestError             manifest_invalid, lora_base_missing (a LoRA version over
    │   │   │                         a base model this receiver does not hold)
    │   │   ├── ChunkHashMismatch     chunk_hash_mismatch; .index and .file name the chunk
    │   │   └── DeltaError            delta_invalid, delta_mismatch, delta_base_missing,
    │   │                             delta_chain_gap: a delta version cannot be applied here
    │   └── TransportError            timeout, closed
    └── KeyFileError                  a local key file is unreadable, malformed or too permissive
                                      (a local configuration problem, not a peer's fault)

Codes used by other packages (coordinator verification, leases) are raised as plain
:class:`ProtocolError` with the matching code; :func:`error_for` picks the right subclass.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ReasonCode(StrEnum):
    """Stable, lowercase snake-case reason codes (wire values)."""

    # framing and decoding
    FRAME_TOO_LARGE = "frame_too_large"
    MALFORMED = "malformed"
    SCHEMA = "schema"
    UNKNOWN_FIELD = "unknown_field"
    NOT_FINITE = "not_finite"
    TOO_LONG = "too_long"
    OUT_OF_RANGE = "out_of_range"
    UNSUPPORTED_VERSION = "unsupported_version"
    # authentication
    BAD_SIGNATURE = "bad_signature"
    REPLAYED = "replayed"
    CLOCK_SKEW = "clock_skew"
    UNKNOWN_NODE = "unknown_node"
    BANNED = "banned"
    # leases
    UNKNOWN_LEASE = "unknown_lease"
    WRONG_NODE = "wrong_node"
    STALE_EPOCH = "stale_epoch"
    LEASE_EXPIRED = "lease_expired"
    INCOMPLETE_GROUP = "incomplete_group"
    # rollout verification
    UNKNOWN_VERSION = "unknown_version"
    TOO_STALE = "too_stale"
    VERSION_MISMATCH = "version_mismatch"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    LENGTH_EXCEEDED = "length_exceeded"
    BAD_TERMINATION = "bad_termination"
    LOGPROB_MISMATCH = "logprob_mismatch"
    SAMPLING_MISMATCH = "sampling_mismatch"
    REWARD_MISMATCH = "reward_mismatch"
    REGISTRATION_MISMATCH = "registration_mismatch"
    DUPLICATE = "duplicate"
    # checkpoints
    CHUNK_HASH_MISMATCH = "chunk_hash_mismatch"
    MANIFEST_INVALID = "manifest_invalid"
    VERSION_NOT_NEWER = "version_not_newer"
    DELTA_INVALID = "delta_invalid"
    DELTA_MISMATCH = "delta_mismatch"
    DELTA_BASE_MISSING = "delta_base_missing"
    DELTA_CHAIN_GAP = "delta_chain_gap"
    LORA_BASE_MISSING = "lora_base_missing"
    # transport and catch-all
    TIMEOUT = "timeout"
    CLOSED = "closed"
    SWARM_FULL = "swarm_full"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A protocol-level failure with a stable :class:`ReasonCode` and a one-line detail."""

    def __init__(self, code: ReasonCode | str, detail: str = "") -> None:
        self.code: ReasonCode = ReasonCode(code)
        self.detail: str = " ".join(detail.split())  # always one line
        super().__init__(f"{self.code.value}: {self.detail}")

    def __reduce__(self) -> tuple[Any, ...]:  # keep errors picklable (multiprocessing)
        return (type(self), (self.code.value, self.detail))


class DecodeError(ProtocolError):
    """The bytes are not a well-formed, schema-valid, supported message."""

    #: True only when the bytes were the payload of an envelope whose signature and nonce had
    #: verified (set by :func:`protocol.envelope.open_envelope`): the signer provably sent them.
    #: Size and version refusals come before the signature check and stay False.
    authenticated: bool = False


class SchemaViolation(DecodeError, ValueError):
    """A field-level rule broken inside a message (raised from ``__post_init__``)."""


class AuthError(ProtocolError):
    """An envelope's signature, freshness or nonce does not check out."""


class ManifestError(ProtocolError):
    """A checkpoint manifest is inconsistent, expired, or not signed by the pinned key."""


class ChunkHashMismatch(ManifestError):
    """A checkpoint chunk's bytes do not match the manifest; names the chunk."""

    def __init__(self, index: int, file: str, detail: str) -> None:
        self.index = index
        self.file = file
        super().__init__(ReasonCode.CHUNK_HASH_MISMATCH, detail)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.index, self.file, self.detail))


class DeltaError(ManifestError):
    """A delta version cannot be turned into verified full weights here (its bytes are
    malformed, its reconstruction does not hash to the signed digests, or its base is not
    available); the caller falls back to the full checkpoint."""


class TransportError(ProtocolError):
    """A frame could not be read or written in time or the stream closed."""


class KeyFileError(Exception):
    """A local Ed25519 key file is unusable; the message says how to fix it."""


_DECODE = {
    ReasonCode.FRAME_TOO_LARGE,
    ReasonCode.MALFORMED,
    ReasonCode.SCHEMA,
    ReasonCode.UNKNOWN_FIELD,
    ReasonCode.NOT_FINITE,
    ReasonCode.TOO_LONG,
    ReasonCode.OUT_OF_RANGE,
    ReasonCode.UNSUPPORTED_VERSION,
}
_AUTH = {ReasonCode.BAD_SIGNATURE, ReasonCode.REPLAYED, ReasonCode.CLOCK_SKEW}
_DELTA = {
    ReasonCode.DELTA_INVALID,
    ReasonCode.DELTA_MISMATCH,
    ReasonCode.DELTA_BASE_MISSING,
    ReasonCode.DELTA_CHAIN_GAP,
}
_TRANSPORT = {ReasonCode.TIMEOUT, ReasonCode.CLOSED}


def error_for(code: ReasonCode | str, detail: str) -> ProtocolError:
    """Build the most specific :class:`ProtocolError` subclass for ``code``."""
    rc = ReasonCode(code)
    if rc in _DECODE:
        return DecodeError(rc, detail)
    if rc in _AUTH:
        return AuthError(rc, detail)
    if rc in (ReasonCode.MANIFEST_INVALID, ReasonCode.LORA_BASE_MISSING):
        return ManifestError(rc, detail)
    if rc in _DELTA:
        return DeltaError(rc, detail)
    if rc in _TRANSPORT:
        return TransportError(rc, detail)
    return ProtocolError(rc, detail)
