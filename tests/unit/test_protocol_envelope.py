"""Signed envelopes: canonical bytes, tamper detection, clock window and replay guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest

from protocol.codec import decode, encode
from protocol.envelope import ReplayGuard, open_envelope, seal, signed_bytes, verify_envelope
from protocol.errors import AuthError, DecodeError, ProtocolError, ReasonCode
from protocol.examples import example_identity, example_messages
from protocol.identity import Identity
from protocol.limits import Limits
from protocol.messages import Heartbeat, Message, SignedEnvelope, Standby

HB = next(m for m in example_messages() if isinstance(m, Heartbeat))
NOW = 1_700_000_000.0

# Golden vector: example_identity() (private key 0x00..0x1f), nonce 0x00*16, ts NOW, this payload.
# The same vector is printed in docs/protocol.md for implementers in other languages.
GOLDEN_PAYLOAD = bytes.fromhex(
    "84a474797065a75374616e646279ad72657472795f61667465725f73cb403e000000000000"
    "a6726561736f6ea178b070726f746f636f6c5f76657273696f6e01"
)
GOLDEN_SIGNATURE = bytes.fromhex(
    "ec8b40a0ca17782ef252dc7e54041c30ac9d40dfbef84643dc27ebea6f02a850"
    "aad99565413d0e5dd3ff0f49d4a6c333d96840b4aba3af10ff42d6bbf85b8207"
)
GOLDEN_SIGNED_HEX = (
    "726f6c6c6f75742d737761726d2f656e76656c6f70652f763100"  # domain tag
    "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"  # signer
    "00000000000000000000000000000000"  # nonce
    "41d954fc40000000"  # ts as big-endian float64
)


def test_canonical_signed_bytes_golden_vector() -> None:
    ident = example_identity()
    expected = bytes.fromhex(GOLDEN_SIGNED_HEX) + GOLDEN_PAYLOAD
    assert signed_bytes(ident.public_key, bytes(16), NOW, GOLDEN_PAYLOAD) == expected
    env = seal(ident, Standby(retry_after_s=30.0, reason="x"), now=NOW, nonce=bytes(16))
    assert env.payload == GOLDEN_PAYLOAD
    assert env.signature == GOLDEN_SIGNATURE  # Ed25519 signatures are deterministic
    assert decode(GOLDEN_PAYLOAD) == Standby(retry_after_s=30.0, reason="x")


def test_seal_open_round_trip_and_expected_signer() -> None:
    ident = Identity.generate()
    env = decode(encode(seal(ident, HB, now=NOW)), SignedEnvelope)
    assert open_envelope(env, Heartbeat, now=NOW + 1, replay=ReplayGuard()) == HB
    assert open_envelope(env, Message, now=NOW, replay=None, expected_signer=ident.public_key) == HB
    with pytest.raises(AuthError) as info:
        open_envelope(env, now=NOW, replay=None, expected_signer=Identity.generate().public_key)
    assert info.value.code is ReasonCode.BAD_SIGNATURE


def test_signature_made_in_another_process_verifies_here(tmp_path: object) -> None:
    script = textwrap.dedent(
        """
        import sys
        from protocol.codec import encode
        from protocol.envelope import seal
        from protocol.examples import example_messages
        from protocol.identity import Identity
        from protocol.messages import Heartbeat
        hb = next(m for m in example_messages() if isinstance(m, Heartbeat))
        ident = Identity.generate()
        sys.stdout.write(ident.public_key.hex() + "\\n" + encode(seal(ident, hb, now=1.7e9)).hex())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    signer, frame_hex = bytes.fromhex(out[0]), bytes.fromhex(out[1])
    env = decode(frame_hex, SignedEnvelope)
    msg = open_envelope(env, Heartbeat, now=1.7e9, replay=ReplayGuard(), expected_signer=signer)
    assert msg == HB


def test_flipping_any_byte_of_a_signed_envelope_fails() -> None:
    ident = Identity.generate()
    data = encode(seal(ident, HB, now=NOW))
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            tampered = bytearray(data)
            tampered[i] ^= mask
            with pytest.raises(ProtocolError):
                env = decode(bytes(tampered), SignedEnvelope)
                open_envelope(
                    env, Heartbeat, now=NOW, replay=None, expected_signer=ident.public_key
                )


def test_tampered_fields_fail_signature_specifically() -> None:
    env = seal(Identity.generate(), HB, now=NOW)
    other = Identity.generate().public_key
    for change in [
        {"payload": encode(msgspec.structs.replace(HB, seq=6))},
        {"ts": NOW + 1},
        {"nonce": bytes(16)},
        {"signer": other},
    ]:
        with pytest.raises(AuthError) as info:
            verify_envelope(msgspec.structs.replace(env, **change))
        assert info.value.code is ReasonCode.BAD_SIGNATURE


def test_replay_refused_the_second_time() -> None:
    guard = ReplayGuard(window_s=60.0)
    env = seal(Identity.generate(), HB, now=NOW)
    open_envelope(env, Heartbeat, now=NOW, replay=guard)
    with pytest.raises(AuthError) as info:
        open_envelope(env, Heartbeat, now=NOW + 1, replay=guard)
    assert info.value.code is ReasonCode.REPLAYED
    # a fresh envelope for the same message (new nonce) is fine
    open_envelope(seal(Identity.generate(), HB, now=NOW), Heartbeat, now=NOW + 1, replay=guard)


@pytest.mark.parametrize("offset", [-60.001, 60.001, -1e6, 1e6])
def test_outside_time_window_refused(offset: float) -> None:
    env = seal(Identity.generate(), HB, now=NOW + offset)
    with pytest.raises(AuthError) as info:
        open_envelope(env, Heartbeat, now=NOW, replay=ReplayGuard(window_s=60.0))
    assert info.value.code is ReasonCode.CLOCK_SKEW
    assert "NTP" in str(info.value)


def test_replay_guard_evicts_by_time_and_stays_bounded() -> None:
    guard = ReplayGuard(window_s=10.0, max_entries=100)
    signer = bytes(32)
    for i in range(50):
        guard.check(signer, i.to_bytes(16, "big"), ts=NOW + i * 0.1, now=NOW + i * 0.1)
    assert len(guard) == 50
    guard.check(signer, b"\xff" * 16, ts=NOW + 20, now=NOW + 20)  # everything else expired
    assert len(guard) == 1
    assert guard.statistics()["evicted_by_time"] == 50
    # an old nonce is now outside the window: refused by the clock, not accepted again
    with pytest.raises(AuthError) as info:
        guard.check(signer, (0).to_bytes(16, "big"), ts=NOW, now=NOW + 20)
    assert info.value.code is ReasonCode.CLOCK_SKEW
    # even if the receiver's clock goes backwards, evicted nonces are not accepted again
    with pytest.raises(AuthError) as info:
        guard.check(signer, (0).to_bytes(16, "big"), ts=NOW, now=NOW + 1)
    assert info.value.code is ReasonCode.REPLAYED


def test_replay_guard_capacity_fails_closed() -> None:
    guard = ReplayGuard(window_s=100.0, max_entries=10)
    signer = bytes(32)
    for i in range(25):
        guard.check(signer, i.to_bytes(16, "big"), ts=NOW + i, now=NOW + 30)
        assert len(guard) <= 10
    assert guard.statistics()["evicted_by_capacity"] == 15
    for i in range(15):  # evicted nonces: refused (cannot prove they are new), never accepted
        with pytest.raises(AuthError) as info:
            guard.check(signer, i.to_bytes(16, "big"), ts=NOW + i, now=NOW + 30)
        assert info.value.code is ReasonCode.REPLAYED
    guard.check(signer, b"\x01" * 16, ts=NOW + 29, now=NOW + 30)  # newer than the floor: ok


def test_payload_size_checked_against_the_expected_type() -> None:
    env = seal(Identity.generate(), HB, now=NOW)
    with pytest.raises(DecodeError) as info:
        open_envelope(env, Heartbeat, now=NOW, replay=None, limits=Limits(control_frame=10))
    assert info.value.code is ReasonCode.FRAME_TOO_LARGE


def test_wrong_inner_type_is_a_schema_error() -> None:
    env = seal(Identity.generate(), HB, now=NOW)
    with pytest.raises(DecodeError) as info:
        open_envelope(env, Standby, now=NOW, replay=None)
    assert info.value.code is ReasonCode.SCHEMA
