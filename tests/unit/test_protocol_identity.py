"""Ed25519 identities: key files, fingerprints, signatures."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import KeyFileError
from protocol.identity import (
    SODIUM_MAX_BYTES,
    Identity,
    fingerprint_of,
    parse_fingerprint,
    short_fingerprint,
    verify_signature,
)


def test_key_file_is_created_0600_and_reloads_to_the_same_identity(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    again = Identity.load_or_create(path)
    assert again.fingerprint == first.fingerprint
    assert Identity.load(path).public_key == first.public_key
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp files left


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_permissive_key_file_is_refused_with_a_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "node.key"
    Identity.load_or_create(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Identity.load_or_create(path)


def test_garbage_and_missing_key_files(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        Identity.load(tmp_path / "missing.key")
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        Identity.load(bad)


def test_fingerprint_format_and_parsing() -> None:
    ident = Identity.from_private_bytes(bytes(32))
    fp = ident.fingerprint
    assert fp == fingerprint_of(ident.public_key)
    assert fp.startswith("ed25519:") and len(fp) == 8 + 52
    assert fp[8:].isalnum() and fp == fp.lower()
    assert short_fingerprint(fp) == fp[:20] == ident.short_fingerprint
    assert parse_fingerprint(f"  {fp.upper()} ") == fp
    assert parse_fingerprint(fp[8:]) == fp
    for bad in ["", "ed25519:abc", fp + "a", fp[:-1] + "1", "rsa:" + fp[8:]]:
        with pytest.raises(ValueError, match="not a node fingerprint"):
            parse_fingerprint(bad)
    assert Identity.generate().fingerprint != fp


def test_sign_and_verify() -> None:
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    assert len(sig) == 64 and len(ident.public_key) == 32
    assert verify_signature(ident.public_key, sig, b"hello")
    assert not verify_signature(ident.public_key, sig, b"hellO")
    assert not verify_signature(Identity.generate().public_key, sig, b"hello")
    assert not verify_signature(ident.public_key[:31], sig, b"hello")
    assert not verify_signature(ident.public_key, sig[:63], b"hello")


def test_verify_follows_rfc8032_and_refuses_small_order_forgeries() -> None:
    """RFC 8032 §7.1 TEST 1 verifies; a small-order public key (the identity point, with
    R = identity and S = 0, "verifies" any message under bare RFC 8032 and OpenSSL) and a
    non-canonical S (S + L, the same point equation) are refused (libsodium's checks)."""
    pk = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    sig = bytes.fromhex(
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e"
        "39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )
    assert verify_signature(pk, sig, b"")
    assert not verify_signature(pk, sig, b"\x00")
    identity = bytes([1]) + bytes(31)
    assert not verify_signature(identity, identity + bytes(32), b"any message at all")
    L = 2**252 + 27742317777372353535851937790883648493
    s = int.from_bytes(sig[32:], "little")
    assert not verify_signature(pk, sig[:32] + (s + L).to_bytes(32, "little"), b"")


def _sign_with_identity_r(seed: bytes, message: bytes) -> tuple[bytes, bytes]:
    """(public key, signature with R = the identity point and S = k·a): only the key's owner
    can make it, bare RFC 8032 (OpenSSL) accepts it, libsodium refuses it."""
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    public = Identity(Ed25519PrivateKey.from_private_bytes(seed)).public_key
    r_enc = bytes([1]) + bytes(31)
    k = int.from_bytes(hashlib.sha512(r_enc + public + message).digest(), "little") % L_ORDER
    return public, r_enc + (k * a % L_ORDER).to_bytes(32, "little")


L_ORDER = 2**252 + 27742317777372353535851937790883648493


@pytest.mark.parametrize("size", [100, SODIUM_MAX_BYTES + 1])
def test_both_verification_paths_refuse_the_same_forgeries(size: int) -> None:
    """Short messages go to libsodium, long ones to OpenSSL after libsodium's checks of the
    key and R: an honest signature verifies on both, a tampered message, a small-order key
    and a small-order R are refused on both (OpenSSL alone accepts the last two)."""
    message = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ident = Identity.generate()
    sig = ident.sign(message)
    assert verify_signature(ident.public_key, sig, message)
    assert verify_signature(ident.public_key, sig, memoryview(message))
    assert not verify_signature(ident.public_key, sig, message[:-1] + b"\x01")
    small = bytes([1]) + bytes(31)
    assert not verify_signature(small, small + bytes(32), message)
    Ed25519PublicKey.from_public_bytes(small).verify(small + bytes(32), message)  # OpenSSL: ok
    public, forged_r = _sign_with_identity_r(bytes(range(32)), message)
    Ed25519PublicKey.from_public_bytes(public).verify(forged_r, message)  # OpenSSL: ok
    assert not verify_signature(public, forged_r, message)
