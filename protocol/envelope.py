"""Signed envelopes and the replay guard.

An envelope wraps the MessagePack bytes of one message with the signer's public key, a random
16-byte nonce and a timestamp. The signature covers the *canonical signed bytes*::

    b"rollout-swarm/envelope/v1\\0" + signer (32) + nonce (16) + struct.pack(">d", ts) + payload

so the signature never depends on how the envelope map itself was encoded.

Receiver checks, cheapest first (:func:`open_envelope`): payload size for the expected type,
expected signer, timestamp within the accepted skew (``clock_skew``), signature (``bad_signature``),
nonce not seen within the window (``replayed``), then strict decoding of the payload.
"""

from __future__ import annotations

import heapq
import math
import os
import struct
from typing import Any, TypeVar, overload

import msgspec

from protocol.codec import decode, encode
from protocol.errors import AuthError, DecodeError, ReasonCode
from protocol.identity import Identity, fingerprint_of, short_fingerprint, verify_signature
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import PROTOCOL_VERSION, Message, SignedEnvelope

__all__ = [
    "DEFAULT_WINDOW_S",
    "ENVELOPE_DOMAIN",
    "ReplayGuard",
    "open_envelope",
    "seal",
    "signed_bytes",
    "verify_envelope",
]

T = TypeVar("T")
ENVELOPE_DOMAIN = b"rollout-swarm/envelope/v1\x00"
DEFAULT_WINDOW_S = 120.0
_TS = struct.Struct(">d")


def signed_bytes(signer: bytes, nonce: bytes, ts: float, payload: bytes) -> bytes:
    """The canonical bytes an envelope signature covers."""
    return b"".join((ENVELOPE_DOMAIN, signer, nonce, _TS.pack(ts), payload))


def seal(
    identity: Identity, msg: msgspec.Struct, *, now: float, nonce: bytes | None = None
) -> SignedEnvelope:
    """Sign ``msg`` with ``identity`` at time ``now`` (Unix seconds)."""
    nonce = os.urandom(16) if nonce is None else nonce
    if len(nonce) != 16:
        raise ValueError("nonce must be 16 bytes")
    if not math.isfinite(now):
        raise ValueError("now must be finite")
    payload = encode(msg)
    signature = identity.sign(signed_bytes(identity.public_key, nonce, now, payload))
    return SignedEnvelope(
        signer=identity.public_key, nonce=nonce, ts=now, payload=payload, signature=signature
    )


def verify_envelope(env: SignedEnvelope, expected_signer: bytes | None = None) -> None:
    """Check the signature (and optionally the signer) only; no clock or replay checks."""
    if env.protocol_version != PROTOCOL_VERSION:
        raise DecodeError(
            ReasonCode.UNSUPPORTED_VERSION, f"envelope protocol_version {env.protocol_version}"
        )
    if expected_signer is not None and env.signer != expected_signer:
        raise AuthError(
            ReasonCode.BAD_SIGNATURE,
            f"signed by {_short(env.signer)}, expected {_short(expected_signer)}",
        )
    if not verify_signature(
        env.signer, env.signature, signed_bytes(env.signer, env.nonce, env.ts, env.payload)
    ):
        raise AuthError(
            ReasonCode.BAD_SIGNATURE, f"signature does not verify for {_short(env.signer)}"
        )


@overload
def open_envelope(
    env: SignedEnvelope,
    type_: type[T],
    *,
    now: float,
    replay: ReplayGuard | None,
    expected_signer: bytes | None = None,
    max_skew_s: float | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> T: ...
@overload
def open_envelope(
    env: SignedEnvelope,
    type_: Any = ...,
    *,
    now: float,
    replay: ReplayGuard | None,
    expected_signer: bytes | None = None,
    max_skew_s: float | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Any: ...
def open_envelope(
    env: SignedEnvelope,
    type_: Any = Message,
    *,
    now: float,
    replay: ReplayGuard | None,
    expected_signer: bytes | None = None,
    max_skew_s: float | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Any:
    """Verify ``env`` and decode its payload as ``type_``.

    ``max_skew_s`` bounds ``|now - env.ts|``; it defaults to the replay guard's window (or
    :data:`DEFAULT_WINDOW_S` without a guard) and may not exceed the guard's window, since nonces
    are only remembered that long. Raises ProtocolError: ``frame_too_large``, ``bad_signature``,
    ``clock_skew``, ``replayed``, or any decode code for the payload (then with
    ``DecodeError.authenticated`` set: only those may be held against the signer).
    """
    window = replay.window_s if replay is not None else DEFAULT_WINDOW_S
    skew = window if max_skew_s is None else max_skew_s
    if replay is not None and skew > replay.window_s:
        raise ValueError("max_skew_s may not exceed the replay guard's window")
    max_len = limits.max_frame(type_)
    if len(env.payload) > max_len:
        raise DecodeError(
            ReasonCode.FRAME_TOO_LARGE, f"payload of {len(env.payload)} bytes, limit {max_len}"
        )
    _check_clock(env.ts, now, skew)
    verify_envelope(env, expected_signer)
    if replay is not None:
        replay.check(env.signer, env.nonce, env.ts, now)
    try:
        return decode(env.payload, type_, limits)
    except DecodeError as exc:
        exc.authenticated = True  # past the signature: the signer really sent these bytes
        raise


def _check_clock(ts: float, now: float, skew: float) -> None:
    if not abs(now - ts) <= skew:
        raise AuthError(
            ReasonCode.CLOCK_SKEW,
            f"timestamp is {ts - now:+.1f}s from the receiver's clock, accepted ±{skew:g}s; "
            "check that both clocks are synchronised (NTP)",
        )


def _short(public_key: bytes) -> str:
    return short_fingerprint(fingerprint_of(public_key)) if len(public_key) == 32 else "?"


class ReplayGuard:
    """Remembers (signer, nonce) pairs for ``window_s`` seconds past their timestamp.

    Memory is bounded by ``max_entries``. Entries are evicted by time (timestamp older than
    ``now - window_s``: such envelopes fail the clock check anyway) or, when full, oldest first.
    Every eviction raises a floor: envelopes whose timestamp is not above the newest evicted
    timestamp are refused as ``replayed``, since their nonce can no longer be checked. So the
    guard may refuse a fresh message under a flood but never accepts a replay.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_entries: int = 262_144) -> None:
        if not window_s > 0 or max_entries < 1:
            raise ValueError("window_s must be > 0 and max_entries >= 1")
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: set[bytes] = set()
        self._heap: list[tuple[float, bytes]] = []
        self._floor = -math.inf
        self._evicted_by_time = 0
        self._evicted_by_capacity = 0

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, signer: bytes, nonce: bytes, ts: float, now: float) -> None:
        """Record the pair or raise ``clock_skew`` / ``replayed``."""
        _check_clock(ts, now, self.window_s)
        self._evict_older_than(now - self.window_s)
        key = signer + nonce
        if ts <= self._floor:
            raise AuthError(
                ReasonCode.REPLAYED,
                f"timestamp {ts:.3f} is at or below the replay floor {self._floor:.3f}",
            )
        if key in self._seen:
            raise AuthError(
                ReasonCode.REPLAYED, f"nonce {nonce.hex()} from {_short(signer)} already seen"
            )
        self._seen.add(key)
        heapq.heappush(self._heap, (ts, key))
        while len(self._seen) > self.max_entries:
            self._pop()
            self._evicted_by_capacity += 1

    def _evict_older_than(self, cutoff: float) -> None:
        while self._heap and self._heap[0][0] < cutoff:
            self._pop()
            self._evicted_by_time += 1

    def _pop(self) -> None:
        ts, key = heapq.heappop(self._heap)
        self._seen.discard(key)
        self._floor = max(self._floor, ts)

    def statistics(self) -> dict[str, float]:
        """Snapshot: entries held, evictions by time and by capacity, current floor."""
        return {
            "entries": len(self._seen),
            "evicted_by_time": self._evicted_by_time,
            "evicted_by_capacity": self._evicted_by_capacity,
            "floor": self._floor,
        }
