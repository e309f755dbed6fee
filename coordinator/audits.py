"""Reward audits: the same prompt sampled by two nodes, and nodes whose rewards are improbably high.

Seeded replay proves *how* a checked sample was drawn; it cannot see a lease that was not checked,
and a node that submits the best of several draws or runs a better private model raises the reward
the learner sees. The audit compares rewards directly:

* **Re-issue.** When a group for prompt ``p`` is accepted, ``p`` is audited iff
  ``HMAC-SHA256(secret, "audit:p") / 2^64 < reward_audit.fraction`` (keyed-random: no node can tell
  which of its prompts are audited). An audit copy gets a fresh *negative* prompt index mapped to
  ``p``; it is leased like any re-queued prompt (first, to any node but the one that did ``p``), so
  the auditor cannot tell it from a prompt whose lease expired. Its group trains like any other.
* **Pairs.** When the audit copy's group is accepted, the pair (original node, auditor node, the two
  mean rewards, the two versions) is stored.
* **Test.** For a node ``X``, every pair it is in with versions at most ``max_version_gap`` apart
  gives ``d = mean_X − mean_other``; pairs with ``d = 0`` are dropped. Under honesty ``d > 0`` and
  ``d < 0`` are equally likely (the same prompt, the same sampling, the same distribution), so the
  count ``k`` of positive ``d`` among ``n`` is Binomial(n, ½) — a sign test, exact and free of any
  assumption on the reward's scale. ``X`` is tested when ``n`` first reaches ``min_pairs``,
  ``2·min_pairs``, ``4·min_pairs``, ...; the ``j``-th test (``j = 0, 1, ...``) flags ``X`` when
  ``P(Binomial(n, ½) ≥ k) ≤ alpha / 2^(j+1)``. The tests' levels sum to ``alpha``: over a node's
  whole life an honest node is flagged with probability at most ``alpha``.
* **Flag.** A flagged node becomes a suspect (:mod:`coordinator.trust`: every lease, every sample
  re-scored and replayed) and gets a ``flag`` receipt; it is not struck, since the test is
  statistical. Its test schedule continues.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.config import RewardAuditSection
from coordinator.store import Store

log = logging.getLogger(__name__)

AUDIT_COUNTER = "audit_counter"

SCHEMA = """
CREATE TABLE IF NOT EXISTS reward_pairs (
    prompt_index INTEGER PRIMARY KEY, node_a BLOB NOT NULL, node_b BLOB NOT NULL,
    version_a INTEGER NOT NULL, version_b INTEGER NOT NULL, mean_a REAL NOT NULL,
    mean_b REAL NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS reward_pairs_a ON reward_pairs (node_a);
CREATE INDEX IF NOT EXISTS reward_pairs_b ON reward_pairs (node_b);
CREATE TABLE IF NOT EXISTS audit_looks (node_key BLOB PRIMARY KEY, looks INTEGER NOT NULL);
"""


def sign_test_p(n: int, k: int) -> float:
    """``P(Binomial(n, ½) ≥ k)``, exactly."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2.0**n


@dataclass(frozen=True)
class AuditFlag:
    """A node flagged by the reward audit."""

    node_key: bytes
    pairs: int
    higher: int
    p_value: float
    level: float

    @property
    def detail(self) -> str:
        return (
            f"rewards above the other node's on {self.higher} of {self.pairs} audited prompts "
            f"(sign test p={self.p_value:.2g} <= {self.level:.2g})"
        )


@dataclass(frozen=True)
class AuditPair:
    """One ``reward_pairs`` row: an audit copy's group beside its original's."""

    prompt_index: int
    node_a: bytes
    node_b: bytes
    version_a: int
    version_b: int
    mean_a: float
    mean_b: float
    at: float


@dataclass(frozen=True)
class AuditBook:
    """What the audit step of one acceptance reads, loaded in the write transaction
    (:meth:`RewardAudits.book`); empty when the lease has no audit copy."""

    #: ``{audit index: (original's node, version, mean reward)}`` of the lease's audit copies
    sources: Mapping[int, tuple[bytes, int, float]] = field(default_factory=dict)
    #: every stored pair each node of ``looks`` is in
    pairs: tuple[AuditPair, ...] = ()
    #: ``{node: sign tests run so far}`` for the submitting node and the sources' nodes
    looks: Mapping[bytes, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AuditWork:
    """What an acceptance writes for the reward audit (:func:`audit_work`), in order."""

    #: originals to re-issue as audit copies: ``(prompt index, its group's mean reward)``
    reissues: tuple[tuple[int, float], ...] = ()
    #: pairs to store
    pairs: tuple[AuditPair, ...] = ()
    #: ``(node, sign tests run)`` after each test that ran
    looks: tuple[tuple[bytes, int], ...] = ()
    #: nodes the tests flag
    flags: tuple[AuditFlag, ...] = ()


def audit_work(
    book: AuditBook,
    config: RewardAuditSection,
    audited: Callable[[int], bool],
    *,
    node_key: bytes,
    version: int,
    rewards: Mapping[int, Sequence[float]],
    now: float,
) -> AuditWork:
    """The audit step of accepted groups ``{prompt index: rewards}`` (pure): re-issue an
    audited original, pair an audit copy with its original and run both nodes' scheduled sign
    tests (module docstring) on the stored pairs plus the new ones."""
    reissues: list[tuple[int, float]] = []
    pairs = list(book.pairs)
    new_pairs: list[AuditPair] = []
    looks = dict(book.looks)
    looked: list[tuple[bytes, int]] = []
    flags: list[AuditFlag] = []
    for index, group in sorted(rewards.items()):
        mean = sum(group) / len(group) if group else 0.0
        if index >= 0:
            if config.fraction > 0 and audited(index):
                reissues.append((index, mean))
            continue
        source = book.sources.get(index)
        if source is None:
            continue
        other, other_version, other_mean = source
        if all(p.prompt_index != index for p in pairs):  # INSERT OR IGNORE
            pair = AuditPair(index, other, node_key, other_version, version, other_mean, mean, now)
            pairs.append(pair)
            new_pairs.append(pair)
        for who in (other, node_key):
            d = [x for x in differences(pairs, who, config.max_version_gap) if x != 0.0]
            n_looks = looks.get(who, 0)
            if len(d) < config.min_pairs * 2**n_looks:
                continue
            looks[who] = n_looks + 1
            looked.append((who, n_looks + 1))
            flag = sign_test(d, who, n_looks, config.alpha)
            if flag is not None:
                flags.append(flag)
    return AuditWork(tuple(reissues), tuple(new_pairs), tuple(looked), tuple(flags))


def differences(pairs: Sequence[AuditPair], node_key: bytes, max_gap: int) -> list[float]:
    """``mean_X − mean_other`` of every comparable pair node ``X`` is in."""
    return [
        (p.mean_a - p.mean_b) if p.node_a == node_key else (p.mean_b - p.mean_a)
        for p in pairs
        if node_key in (p.node_a, p.node_b)
        and p.node_a != p.node_b
        and abs(p.version_a - p.version_b) <= max_gap
    ]


def sign_test(d: Sequence[float], node_key: bytes, looks: int, alpha: float) -> AuditFlag | None:
    """The node's ``looks``-th sign test on its nonzero differences ``d``: a flag when
    ``P(Binomial(n, ½) ≥ k) ≤ alpha / 2^(looks+1)``."""
    higher = sum(1 for x in d if x > 0)
    p = sign_test_p(len(d), higher)
    level = alpha / 2.0 ** (looks + 1)
    if p > level:
        return None
    flag = AuditFlag(node_key, len(d), higher, p, level)
    log.warning("reward audit flags node %s: %s", node_key.hex()[:16], flag.detail)
    return flag


PAIR_SQL = (
    "INSERT OR IGNORE INTO reward_pairs (prompt_index, node_a, node_b, version_a,"
    " version_b, mean_a, mean_b, at) VALUES (?,?,?,?,?,?,?,?)"
)
LOOKS_SQL = (
    "INSERT INTO audit_looks (node_key, looks) VALUES (?, ?) ON CONFLICT (node_key)"
    " DO UPDATE SET looks = excluded.looks"
)


class RewardAudits:
    """Audit copies, reward pairs and the per-node sign test (tables in the coordinator store)."""

    def __init__(self, store: Store, config: RewardAuditSection, secret: bytes) -> None:
        self.store = store
        self.config = config
        self.secret = secret
        store.ensure_schema(SCHEMA)

    def audited(self, prompt_index: int) -> bool:
        """Is prompt ``prompt_index`` re-issued to another node? (keyed by the secret)"""
        mac = hmac.new(self.secret, f"audit:{prompt_index}".encode(), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") / 2.0**64 < self.config.fraction

    def originals(self, indices: Sequence[int]) -> dict[int, int]:
        """``{audit index: original prompt index}`` for the audit copies among ``indices``."""
        return self.store.audit_originals(indices)

    def book(self, node_key: bytes, prompts: Sequence[int]) -> AuditBook:
        """What :func:`audit_work` reads for an acceptance by ``node_key`` of a lease with
        ``prompts`` (call inside the write transaction): the audit copies' sources, and the
        stored pairs and test counts of the nodes involved. Nothing is read for a lease without
        audit copies."""
        audit = [i for i in prompts if i < 0]
        if not audit:
            return AuditBook()
        marks = ",".join("?" * len(audit))
        rows = self.store.query(
            "SELECT prompt_index, source_node, version, mean FROM audits"
            f" WHERE prompt_index IN ({marks})",
            audit,
        )
        sources = {int(i): (bytes(n), int(v), float(m)) for i, n, v, m in rows}
        nodes = sorted({node_key, *(n for n, _, _ in sources.values())})
        marks = ",".join("?" * len(nodes))
        pairs = tuple(
            AuditPair(int(i), bytes(a), bytes(b), int(va), int(vb), float(ma), float(mb), float(t))
            for i, a, b, va, vb, ma, mb, t in self.store.query(
                "SELECT prompt_index, node_a, node_b, version_a, version_b, mean_a, mean_b, at"
                f" FROM reward_pairs WHERE node_a IN ({marks}) OR node_b IN ({marks})"
                " ORDER BY at, prompt_index",
                [*nodes, *nodes],
            )
        )
        looks = {
            bytes(k): int(n)
            for k, n in self.store.query(
                f"SELECT node_key, looks FROM audit_looks WHERE node_key IN ({marks})", nodes
            )
        }
        return AuditBook(sources, pairs, looks)

    def record(
        self, work: AuditWork, *, lease_id: str, node_key: bytes, version: int, now: float
    ) -> None:
        """Write ``work`` (call inside the transaction that stores the rollouts): each re-issued
        original gets the next audit index, then the pairs and the test counts."""
        with self.store.transaction():
            for index, mean in work.reissues:
                self._reissue(index, lease_id, node_key, version, mean, now)
            for p in work.pairs:
                self.store.execute(
                    PAIR_SQL,
                    (p.prompt_index, p.node_a, p.node_b, p.version_a, p.version_b, p.mean_a,
                     p.mean_b, p.at),
                )  # fmt: skip
            for who, looks in work.looks:
                self.store.execute(LOOKS_SQL, (who, looks))

    def _reissue(
        self, index: int, lease_id: str, node_key: bytes, version: int, mean: float, now: float
    ) -> None:
        audit_index = -self.store.next_counter(AUDIT_COUNTER)
        self.store.execute(
            "INSERT INTO audits (prompt_index, original, source_lease, source_node, version,"
            " mean, created_at) VALUES (?,?,?,?,?,?,?)",
            (audit_index, index, lease_id, node_key, version, mean, now),
        )
        self.store.execute(
            "INSERT INTO prompts (prompt_index, state, lease_id) VALUES (?, 'pending', ?)",
            (audit_index, lease_id),
        )

    def differences(self, node_key: bytes) -> list[float]:
        """``mean_X − mean_other`` of every comparable pair node ``X`` is in (oldest first)."""
        gap = self.config.max_version_gap
        rows = self.store.query(
            "SELECT node_a, mean_a, mean_b FROM reward_pairs WHERE (node_a = ? OR node_b = ?)"
            " AND node_a != node_b AND ABS(version_a - version_b) <= ? ORDER BY at, prompt_index",
            (node_key, node_key, gap),
        )
        return [(a - b) if bytes(node_a) == node_key else (b - a) for node_a, a, b in rows]

    def pair_counts(self) -> dict[bytes, int]:
        """Comparable audited pairs per node (for /status)."""
        out: dict[bytes, int] = {}
        for node_a, node_b in self.store.query("SELECT node_a, node_b FROM reward_pairs"):
            for k in (bytes(node_a), bytes(node_b)):
                out[k] = out.get(k, 0) + 1
        return out
