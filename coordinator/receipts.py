"""Receipts: an append-only, hash-chained log of verdicts, signed periodically by the coordinator.

Every rollout the trainer learns from is traceable: the ``verdict`` entry of its submission names
the lease, the node key, the policy version, what the node was held to, every check that ran with
its figures, the verdict and the ``seq`` range of the stored samples; a ``consumed`` entry names the
learner step whose report first covered its ``seq`` (trained on, or dropped as too stale). Other
entries: ``register`` (a node's first registration or a change of backend/dtype), ``flag`` (a reward
audit flag), ``withdrawn`` (a banned node's unconsumed rollouts removed from the trainer's feed)
and ``seal`` (a signature over the chain so far).

Entry ``n`` (``seq`` 1, 2, ...) is hashed as::

    hash_n = SHA-256( b"rollout-swarm/receipt/v1\\x00" || u64be(n) || hash_{n-1} || kind (ASCII)
                      || b"\\x00" || body )              hash_0 = 32 zero bytes

where ``body`` is the entry's canonical JSON (UTF-8, keys sorted, no spaces), stored as is. A
``seal`` entry's body holds ``sealed_seq``, ``sealed_hash`` (hex), ``signer`` (hex raw Ed25519
public key) and ``signature`` (hex) over ``b"rollout-swarm/receipt-seal/v1\\x00" ||
u64be(sealed_seq) || sealed_hash``. Entries are appended in the same SQLite transaction as the
state they describe.

:func:`verify_chain` recomputes every hash and link and checks every seal: an edited, inserted,
deleted or reordered entry breaks the chain at that entry; re-hashing the chain after an edit
breaks every later seal (the signature covers the old hash). Entries after the last seal are only
as trustworthy as the database file until the next seal (``receipts.seal_every`` /
``seal_interval_s``). ``swarm audit`` (:mod:`coordinator.audit_cli`) prints and verifies.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.store import Store
from protocol.identity import Identity, fingerprint_of, verify_signature

__all__ = [
    "ChainReport",
    "Entry",
    "ReceiptLog",
    "canonical",
    "entry_hash",
    "load_entries",
    "seal_message",
    "verify_chain",
]

DOMAIN = b"rollout-swarm/receipt/v1\x00"
SEAL_DOMAIN = b"rollout-swarm/receipt-seal/v1\x00"
GENESIS = bytes(32)
KINDS = frozenset({"verdict", "consumed", "register", "flag", "seal", "withdrawn"})

SCHEMA = """
CREATE TABLE IF NOT EXISTS receipts (
    seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, body BLOB NOT NULL, prev BLOB NOT NULL,
    hash BLOB NOT NULL, at REAL NOT NULL);
"""


def canonical(body: dict[str, Any]) -> bytes:
    """Canonical JSON of an entry body (sorted keys, no whitespace, UTF-8, no NaN)."""
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def entry_hash(seq: int, prev: bytes, kind: str, body: bytes) -> bytes:
    return hashlib.sha256(
        DOMAIN + seq.to_bytes(8, "big") + prev + kind.encode("ascii") + b"\x00" + body
    ).digest()


def seal_message(sealed_seq: int, sealed_hash: bytes) -> bytes:
    """The bytes a seal signs."""
    return SEAL_DOMAIN + sealed_seq.to_bytes(8, "big") + sealed_hash


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str
    body: bytes
    prev: bytes
    hash: bytes
    at: float

    def data(self) -> dict[str, Any]:
        value = json.loads(self.body)
        return value if isinstance(value, dict) else {}


class ReceiptLog:
    """Appends entries to the chain in the store; seals it with the coordinator key."""

    def __init__(
        self,
        store: Store,
        signer: Identity | None = None,
        *,
        seal_every: int = 64,
        seal_interval_s: float = 30.0,
    ) -> None:
        self.store = store
        self.signer = signer
        self.seal_every = seal_every
        self.seal_interval_s = seal_interval_s
        store.ensure_schema(SCHEMA)

    def head(self) -> tuple[int, bytes]:
        """``(seq, hash)`` of the last entry (``(0, 32 zero bytes)`` for an empty log)."""
        rows = self.store.query("SELECT seq, hash FROM receipts ORDER BY seq DESC LIMIT 1")
        return (int(rows[0][0]), bytes(rows[0][1])) if rows else (0, GENESIS)

    def append(self, kind: str, body: dict[str, Any], now: float) -> int:
        """Append one entry (call inside the transaction that commits what it describes)."""
        if kind not in KINDS:
            raise ValueError(f"unknown receipt kind {kind!r}")
        raw = canonical(body)
        with self.store.transaction():
            seq, prev = self.head()
            seq += 1
            digest = entry_hash(seq, prev, kind, raw)
            self.store.execute(
                "INSERT INTO receipts (seq, kind, body, prev, hash, at) VALUES (?,?,?,?,?,?)",
                (seq, kind, raw, prev, digest, now),
            )
        return seq

    def last_sealed(self) -> tuple[int, float]:
        """``(sealed seq, time of the seal)`` of the newest seal; ``(0, 0.0)`` if none."""
        rows = self.store.query(
            "SELECT body, at FROM receipts WHERE kind = 'seal' ORDER BY seq DESC LIMIT 1"
        )
        if not rows:
            return 0, 0.0
        return int(json.loads(rows[0][0])["sealed_seq"]), float(rows[0][1])

    def seal(self, now: float, *, force: bool = False) -> int | None:
        """Sign the chain's head if entries were added since the last seal and either
        ``seal_every`` of them are waiting, ``seal_interval_s`` passed, or ``force``; returns the
        seal's seq (None: nothing to seal, or no key)."""
        if self.signer is None:
            return None
        with self.store.transaction():
            seq, digest = self.head()
            sealed, at = self.last_sealed()
            waiting = seq - sealed - (1 if sealed else 0)  # the last seal entry itself
            if seq == 0 or waiting <= 0:
                return None
            if not force and waiting < self.seal_every and now - at < self.seal_interval_s:
                return None
            body = {
                "sealed_seq": seq,
                "sealed_hash": digest.hex(),
                "signer": self.signer.public_key.hex(),
                "signature": self.signer.sign(seal_message(seq, digest)).hex(),
            }
            return self.append("seal", body, now)

    def entries(self) -> list[Entry]:
        return _entries(self.store.query(f"SELECT {_COLS} FROM receipts ORDER BY seq"))


_COLS = "seq, kind, body, prev, hash, at"


def _entries(rows: Iterable[Sequence[Any]]) -> list[Entry]:
    return [
        Entry(int(s), str(k), bytes(b), bytes(p), bytes(h), float(a)) for s, k, b, p, h, a in rows
    ]


def load_entries(db_path: str | Path) -> list[Entry]:
    """Every entry of the receipt log in a coordinator database, opened read-only."""
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give the coordinator's state.sqlite")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        have = conn.execute(
            "SELECT name FROM sqlite_master WHERE type='table' AND name='receipts'"
        ).fetchall()
        if not have:
            return []
        return _entries(conn.execute(f"SELECT {_COLS} FROM receipts ORDER BY seq").fetchall())
    finally:
        conn.close()


@dataclass
class ChainReport:
    """What :func:`verify_chain` found."""

    entries: int = 0
    seals: int = 0
    #: seq covered by the newest valid seal (0: none)
    sealed_seq: int = 0
    #: fingerprints of the keys that signed valid seals
    signers: set[str] = field(default_factory=set)
    #: one line per problem, naming the entry; empty = the chain verifies
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsealed(self) -> int:
        """Entries after the newest valid seal's coverage (the seal entry itself excluded)."""
        return max(0, self.entries - self.sealed_seq - (1 if self.seals else 0))


def verify_chain(entries: Sequence[Entry], public_key: bytes | None = None) -> ChainReport:
    """Recompute every hash and link and check every seal (against ``public_key`` when given,
    else against the key the seals name, which must be one key throughout)."""
    report = ChainReport(entries=len(entries))
    recomputed: dict[int, bytes] = {}
    prev = GENESIS
    for i, e in enumerate(entries):
        where = f"entry #{e.seq} ({e.kind})"
        if e.seq != i + 1:
            report.problems.append(f"{where}: expected seq {i + 1} (an entry is missing)")
        if e.prev != prev:
            report.problems.append(f"{where}: does not link to the previous entry's hash")
        digest = entry_hash(e.seq, e.prev, e.kind, e.body)
        if digest != e.hash:
            report.problems.append(f"{where}: stored hash does not match its content (edited)")
        recomputed[e.seq] = digest
        prev = e.hash
        if e.kind == "seal":
            _check_seal(e, recomputed, public_key, report)
    return report


def _check_seal(
    e: Entry, recomputed: dict[int, bytes], public_key: bytes | None, report: ChainReport
) -> None:
    where = f"seal #{e.seq}"
    try:
        data = e.data()
        sealed_seq = int(data["sealed_seq"])
        sealed_hash = bytes.fromhex(str(data["sealed_hash"]))
        signer = bytes.fromhex(str(data["signer"]))
        signature = bytes.fromhex(str(data["signature"]))
    except (ValueError, KeyError, TypeError) as exc:
        report.problems.append(f"{where}: malformed ({exc})")
        return
    report.seals += 1
    if public_key is not None and signer != public_key:
        report.problems.append(f"{where}: signed by {fingerprint_of(signer)}, not the given key")
        return
    if report.signers and fingerprint_of(signer) not in report.signers:
        report.problems.append(f"{where}: signed by another key ({fingerprint_of(signer)})")
        return
    if recomputed.get(sealed_seq) != sealed_hash:
        report.problems.append(
            f"{where}: covers entry #{sealed_seq}, whose hash is no longer what was signed"
        )
        return
    if not verify_signature(signer, signature, seal_message(sealed_seq, sealed_hash)):
        report.problems.append(f"{where}: signature does not verify")
        return
    report.signers.add(fingerprint_of(signer))
    report.sealed_seq = max(report.sealed_seq, sealed_seq)
