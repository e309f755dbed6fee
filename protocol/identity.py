"""Ed25519 identities: key files, fingerprints, signatures.

Key file format: PEM, PKCS#8, unencrypted, mode 0600 (owner read/write only). A key file that is
readable or writable by group or others is refused (:class:`~protocol.errors.KeyFileError`): such a
key may have leaked, so the fix (``chmod 600`` or a fresh key) is left to the operator.

Fingerprint: ``"ed25519:" + base32(sha256(public_key))``, lowercase, unpadded (52 characters after
the prefix). :func:`short_fingerprint` gives the first 12 for display.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import crypto_core_ed25519_is_valid_point, crypto_sign_open
from nacl.exceptions import CryptoError

from protocol.errors import KeyFileError

__all__ = [
    "FINGERPRINT_PREFIX",
    "Identity",
    "fingerprint_of",
    "parse_fingerprint",
    "short_fingerprint",
    "verify_signature",
]

FINGERPRINT_PREFIX = "ed25519:"
_FP_BODY_LEN = 52  # base32 of 32 bytes, unpadded
_B32_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")
_SHORT_LEN = 12


@functools.lru_cache(maxsize=1 << 16)
def fingerprint_of(public_key: bytes) -> str:
    """Fingerprint of a 32-byte raw Ed25519 public key: ``"ed25519:<52 base32 chars>"``.

    Memoised: the coordinator names a node's fingerprint on every rollout it hands the trainer."""
    if len(public_key) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    digest = hashlib.sha256(public_key).digest()
    return FINGERPRINT_PREFIX + base64.b32encode(digest).decode("ascii").rstrip("=").lower()


def short_fingerprint(fingerprint: str) -> str:
    """Display form: ``"ed25519:" + first 12 characters``."""
    return fingerprint[: len(FINGERPRINT_PREFIX) + _SHORT_LEN]


def parse_fingerprint(text: str) -> str:
    """Normalise user input to a full fingerprint; raise ``ValueError`` saying what is wrong.

    Accepts surrounding whitespace, any letter case and a missing ``ed25519:`` prefix.
    """
    body = text.strip().lower()
    body = body.removeprefix(FINGERPRINT_PREFIX)
    if len(body) != _FP_BODY_LEN or not set(body) <= _B32_ALPHABET:
        raise ValueError(
            f"{text.strip()!r} is not a node fingerprint: expected 'ed25519:' followed by "
            f"{_FP_BODY_LEN} base32 characters (a-z, 2-7), as printed by `swarm keygen` or "
            "`swarm coordinator launch`"
        )
    return FINGERPRINT_PREFIX + body


#: Messages up to this many bytes are verified by libsodium, longer ones by OpenSSL: libsodium is
#: ~2x faster on short messages (49-59 against 109-117 us here: what a coordinator verifies most,
#: heartbeats and lease requests), OpenSSL's SHA-512 ~2x faster on long ones (1.8 against 3.5 ms
#: a MB); the crossover, with the R check below, is near 128 KiB.
SODIUM_MAX_BYTES = 128 * 1024


@functools.lru_cache(maxsize=1 << 16)
def _key_ok(raw: bytes) -> bool:
    """A canonical encoding of a point of the main subgroup, not of small order (libsodium)."""
    return bool(crypto_core_ed25519_is_valid_point(raw))


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(raw)


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``.

    RFC 8032 with libsodium's refusals, whatever the length: a public key that is not a
    canonical point of the main subgroup or is of small order (the identity key with
    ``R`` = identity and ``S = 0`` "verifies" every message under bare RFC 8032), a small-order
    ``R``, a non-canonical ``S``. An honest signer never produces these. Short messages are
    verified by libsodium (``crypto_sign_open``), long ones (over :data:`SODIUM_MAX_BYTES`) by
    OpenSSL after the same checks of the key and of ``R``."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    key = bytes(public_key)
    if not _key_ok(key):
        return False
    try:
        if len(data) <= SODIUM_MAX_BYTES:
            crypto_sign_open(b"".join((signature, data)), key)
        else:
            # OpenSSL checks S < L and the equation; libsodium would also refuse a small-order R
            if not crypto_core_ed25519_is_valid_point(bytes(signature[:32])):
                return False
            _public_key(key).verify(bytes(signature), data)
    except (CryptoError, InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 key pair."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        """32-byte raw public key."""
        self.fingerprint: str = fingerprint_of(self.public_key)
        """``"ed25519:..."`` fingerprint of the public key."""

    def __repr__(self) -> str:
        return f"Identity({short_fingerprint(self.fingerprint)})"

    @property
    def short_fingerprint(self) -> str:
        return short_fingerprint(self.fingerprint)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity (not saved anywhere)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, seed: bytes) -> Identity:
        """Identity from a 32-byte raw private key (seed). For tests and test vectors."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        """64-byte Ed25519 signature of ``data``."""
        return self._key.sign(data)

    def private_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a key file; refuse it if it is readable or writable by group or others."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError as exc:
            raise KeyFileError(f"key file {p} does not exist") from exc
        except OSError as exc:
            raise KeyFileError(f"cannot open key file {p}: {exc.strerror}") from exc
        with os.fdopen(fd, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            if mode & 0o077:
                raise KeyFileError(
                    f"key file {p} has mode {mode:04o}, so other users may read it; "
                    f"run `chmod 600 {p}` if it never left your control, otherwise delete it "
                    "to create a new identity"
                )
            pem = f.read(64 * 1024)
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"key file {p} is not an unencrypted PEM private key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"key file {p} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at ``path``, or create it (mode 0600, parent directory 0700) if absent.

        Creation is atomic: the key is written to a temporary file and hard-linked into place,
        so two processes racing on the same path end up with the same identity.
        """
        p = Path(path)
        if p.exists():
            return cls.load(p)
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        identity = cls.generate()
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(identity.private_pem())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, p)
            except FileExistsError:
                return cls.load(p)  # another process won the race
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return identity
