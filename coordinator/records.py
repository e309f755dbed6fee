"""Row types of the coordinator's SQLite store (plain frozen dataclasses) and their decoders, and
the submission pipeline's one-read context built of them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: ``verdicts.code`` of an acknowledged submission (anything else is a ReasonCode).
ACK = "ack"


@dataclass(frozen=True)
class LeaseRecord:
    """One lease as persisted; ``prompts`` are prompt indices in the task."""

    lease_id: str
    node_key: bytes
    epoch: int
    version: int
    prompts: tuple[int, ...]
    group_size: int
    max_new_tokens: int
    issued_at: float
    deadline: float
    state: str  # active | completed | expired | released
    closed_at: float | None = None
    tokens: int = 0
    samples: int = 0
    #: what the node was held to when the lease was issued (its registration); "" = unknown
    #: (a lease from before registrations were recorded: the node's current one applies)
    backend: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class NodeRecord:
    node_key: bytes
    fingerprint: str
    advert: bytes | None
    registered_at: float
    last_seen: float
    tokens_per_s: float | None = None
    rollouts_per_s: float | None = None
    price_per_hour: float | None = None
    backend: str = ""
    dtype: str = ""
    leases_completed: int = 0
    leases_expired: int = 0
    draining: bool = False

    @property
    def reliability(self) -> float:
        """Laplace-smoothed fraction of closed leases completed in time."""
        return (self.leases_completed + 1) / (self.leases_completed + self.leases_expired + 2)


@dataclass(frozen=True)
class RolloutRow:
    """One accepted sample; ``seq`` is its arrival order (0 before insertion)."""

    lease_id: str
    prompt_index: int
    sample_index: int
    node_key: bytes
    version: int
    prompt_id: str
    prompt_tokens: bytes  # packed little-endian uint32
    completion_tokens: bytes  # packed little-endian uint32
    logprobs: bytes  # packed little-endian float32
    finish_reason: str
    reward: float
    exact: bool
    accepted_at: float
    group_size: int
    seq: int = 0


#: One node's row of the ``trust`` table (:mod:`coordinator.trust` owns the table): clean_checks,
#: suspect, flagged_at, label_changed_at, clean_leases.
TrustRow = tuple[int, bool, float | None, float | None, int]
@dataclass(frozen=True)
class SubmissionContext:
    """Everything the submission pipeline's checks read, loaded in one read
    (:meth:`coordinator.submission_records.SubmissionRecords.load`); the checks
    (:mod:`coordinator.pipeline`) touch nothing else."""

    #: the sender's registration; None: not registered
    node: NodeRecord | None
    #: the sender's ban on record ``(bans so far, banned_until, reason)``; None: never banned
    ban: tuple[int, float, str] | None
    #: the lease the submission names; None: no such lease
    lease: LeaseRecord | None
    #: the verdict stored for these exact bytes (lease, digest); None: first time
    verdict: Verdict | None
    #: distinct verdicts stored for the lease
    verdicts: int
    #: ``{prompt_index: (state, holder lease_id)}`` of the lease's prompts ever issued
    prompt_states: Mapping[int, tuple[str, str]]
    #: every published version, oldest first
    versions: tuple[int, ...]
    #: the sender's trust row; None: it has none (new, or a suspect with ``has_record``)
    trust: TrustRow | None
    #: any strike or ban on record for the sender (read only when it has no trust row)
    has_record: bool
    #: ``{audit copy index: original prompt index}`` for the lease's audit copies
    originals: Mapping[int, int]

    @property
    def latest_version(self) -> int | None:
        return self.versions[-1] if self.versions else None


@dataclass(frozen=True)
class Verdict:
    """The answer given to one submission (replayed verbatim for an identical re-send)."""

    code: str  # ACK or a ReasonCode value
    detail: str
    accepted: int = 0
    duplicates: int = 0


NODE_COLS = (
    "node_key, fingerprint, advert, registered_at, last_seen, tokens_per_s, rollouts_per_s,"
    " price_per_hour, backend, dtype, leases_completed, leases_expired, draining"
)
NODE_MUTABLE = frozenset(
    {"fingerprint", "advert", "last_seen", "tokens_per_s", "rollouts_per_s", "price_per_hour",
     "backend", "dtype", "draining"}
)  # fmt: skip
LEASE_COLS = (
    "lease_id, node_key, epoch, version, prompts, group_size, max_new_tokens, issued_at, deadline,"
    " state, closed_at, tokens, samples, backend, dtype"
)
ROLLOUT_COLS = (
    "lease_id, prompt_index, sample_index, node_key, version, prompt_id, prompt_tokens,"
    " completion_tokens, logprobs, finish_reason, reward, exact, accepted_at, group_size, seq"
)


def node_from_row(r: tuple[Any, ...]) -> NodeRecord:
    return NodeRecord(
        bytes(r[0]), r[1], None if r[2] is None else bytes(r[2]), r[3], r[4], r[5], r[6], r[7],
        r[8], r[9], int(r[10]), int(r[11]), bool(r[12]),
    )  # fmt: skip


def lease_from_row(r: tuple[Any, ...]) -> LeaseRecord:
    return LeaseRecord(
        r[0], bytes(r[1]), int(r[2]), int(r[3]), tuple(json.loads(r[4])), int(r[5]), int(r[6]),
        float(r[7]), float(r[8]), r[9], r[10], int(r[11]), int(r[12]), str(r[13]), str(r[14]),
    )  # fmt: skip


def rollout_from_row(r: tuple[Any, ...]) -> RolloutRow:
    return RolloutRow(
        r[0], int(r[1]), int(r[2]), bytes(r[3]), int(r[4]), r[5], bytes(r[6]), bytes(r[7]),
        bytes(r[8]), r[9], float(r[10]), bool(r[11]), float(r[12]), int(r[13]), int(r[14]),
    )  # fmt: skip
