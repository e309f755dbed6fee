"""Registration: one read, a pure decision, room for a newcomer, one write.

:class:`RegistrationDesk` answers ``rswarm/register`` in one direction::

    register ─► load (ONE read: the node's row, its ban, its trust state when it asks for
    │           another backend/dtype, the node count when it is new, its unwritten last_seen)
    ├─► decide_registration (pure: signer, accepted dtype, ban in force, relabel interval;
    │     the row to write, the receipt, the relabelled trust state, whether to re-plan)
    ├─► new identity only: make_room (evict the longest-gone node that holds nothing, or
    │     refuse swarm_full) ─► VerificationBudget.admit_new (issue 35; not for a vouched node)
    ├─► record (ONE transaction: the node row, the trust row of a relabel or a vouch, the
    │     receipt)
    └─► re-plan when the plan's inputs changed ─► RegisterAck (the version leases name now)

:func:`decide_registration` is a function of the loaded :class:`RegistrationContext`, the
advert, the injected time and the configuration: ``tests/unit/test_registration.py`` tests it
without SQLite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator.admission import admission_refusal
from coordinator.config import CoordinatorConfig
from coordinator.errors import Rejection
from coordinator.liveness import Liveness
from coordinator.receipts import ReceiptLog
from coordinator.records import NodeRecord
from coordinator.reputation import Ban, ban_in_force
from coordinator.store import Store
from coordinator.trust import (
    PUT_SQL,
    TrustState,
    leases_to_floor,
    put_args,
    relabelled_state,
    trust_state,
    vouched_state,
)
from coordinator.verify_budget import VerificationBudget
from protocol.codec import encode
from protocol.errors import ReasonCode
from protocol.identity import fingerprint_of, parse_fingerprint
from protocol.messages import CapabilityAdvert, RegisterAck

__all__ = ["Registration", "RegistrationContext", "RegistrationDesk", "decide_registration"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistrationContext:
    """What a registration reads before it decides, loaded in one read
    (:meth:`RegistrationDesk.load`)."""

    #: the node's registration so far; None: a new identity
    node: NodeRecord | None
    #: its ban in force at the registration's time; None: none
    ban: Ban | None
    #: its trust state, loaded only when it asks for another backend/dtype (else None)
    trust: TrustState | None
    #: registered nodes, loaded only for a new identity (else None)
    registered: int | None
    #: its ``last_seen`` heard and not yet written (:meth:`Liveness.unwritten`; -inf: none)
    unwritten_seen: float
    #: nodes last heard from before this time are gone (:meth:`Liveness.horizon`)
    horizon: float
    #: listed in ``intake.vouched_nodes`` (its trust state is then loaded too)
    vouched: bool = False
    #: a strike or ban on record (loaded for a vouched node): the vouch no longer waives anything
    struck_before: bool = False


@dataclass(frozen=True)
class Registration:
    """The decision: what :meth:`RegistrationDesk.record` writes, and what follows."""

    #: the node row to upsert
    record: NodeRecord
    #: a new identity (room is made for it and the verification budget admits it first)
    new: bool
    #: the trust state to write: a relabelled node's (its clean history restarts), a vouched
    #: node's (probation waived); None: unchanged
    trust: TrustState | None
    #: the ``register`` receipt's body (a new identity or a relabel); None: no receipt
    receipt: dict[str, Any] | None
    #: the plan's inputs changed (a returning node, another price or throughput): re-plan
    replan: bool


def decide_registration(
    node_key: bytes,
    advert: CapabilityAdvert,
    ctx: RegistrationContext,
    now: float,
    config: CoordinatorConfig,
) -> Registration:
    """Admit ``advert`` for ``node_key`` on what was loaded, or raise the :class:`Rejection`:
    a signer other than the advert's node key (``schema``), a dtype the intake does not accept
    (no strike), a ban in force, a change of backend/dtype sooner than
    ``intake.registration_change_interval_s`` after the last (no strike, ``retry_after_s``)."""
    if advert.node_key != node_key:
        raise Rejection(ReasonCode.SCHEMA, "advert.node_key differs from the envelope signer")
    accepted = config.intake.accepted_dtypes
    if advert.dtype not in accepted:  # the calibration measures only these (issue 34)
        raise Rejection(
            ReasonCode.REGISTRATION_MISMATCH,
            f"dtype {advert.dtype} is not accepted here (intake.accepted_dtypes: "
            f"{', '.join(accepted)}); run the node in one of them",
            strike=False,
        )
    old = ctx.node
    if ctx.ban is not None:
        refusal = admission_refusal(node_key, old, ctx.ban, now)
        assert refusal is not None  # a ban in force always refuses
        raise refusal
    relabel = old is not None and (old.backend, old.dtype) != (advert.backend, advert.dtype)
    if relabel:
        assert old is not None and ctx.trust is not None  # loaded for a relabel
        _check_relabel(node_key, old, advert, ctx.trust, now, config)
    record = NodeRecord(
        node_key=node_key,
        fingerprint=fingerprint_of(node_key),
        advert=encode(advert),
        registered_at=old.registered_at if old else now,
        last_seen=now,
        tokens_per_s=old.tokens_per_s if old and old.tokens_per_s else advert.tokens_per_s or None,
        rollouts_per_s=old.rollouts_per_s if old and old.rollouts_per_s else None,
        price_per_hour=advert.price_per_hour,
        backend=advert.backend,
        dtype=advert.dtype,
        leases_completed=old.leases_completed if old else 0,
        leases_expired=old.leases_expired if old else 0,
    )
    trust = relabelled_state(ctx.trust, now) if relabel and ctx.trust is not None else None
    if ctx.vouched and not ctx.struck_before and ctx.trust is not None:
        waived = vouched_state(trust or ctx.trust, leases_to_floor(config.intake))
        trust = waived or trust
    receipt: dict[str, Any] | None = None
    if old is None or relabel:
        receipt = {
            "node": record.fingerprint,
            "held_to": f"{advert.backend}/{advert.dtype}",
            "previous": f"{old.backend}/{old.dtype}" if old is not None else None,
        }
        if ctx.vouched:
            receipt["vouched"] = True
    # Re-planning scans the whole swarm: only when the plan's inputs changed (a new or returning
    # node, another price or throughput), so repeated re-registrations stay cheap. A node never
    # seen before has no measured rate, so it cannot change the plan (unmeasured nodes are always
    # active); re-planning for each of 10,000 joining nodes would scan the swarm 10,000 times.
    # Its gauge count follows at the next tick.
    replan = old is not None and (
        max(old.last_seen, ctx.unwritten_seen) < ctx.horizon
        or old.price_per_hour != record.price_per_hour
        or old.tokens_per_s != record.tokens_per_s
    )
    return Registration(record, old is None, trust, receipt, replan)


def _check_relabel(
    node_key: bytes,
    old: NodeRecord,
    advert: CapabilityAdvert,
    trust: TrustState,
    now: float,
    config: CoordinatorConfig,
) -> None:
    """A registered node asks to be held to another backend/dtype: allowed at most every
    ``intake.registration_change_interval_s`` (logged; its clean history restarts)."""
    interval = config.intake.registration_change_interval_s
    wait = (trust.label_changed_at or old.registered_at) + interval - now
    if wait > 0:
        raise Rejection(
            ReasonCode.REGISTRATION_MISMATCH,
            f"registered as {old.backend}/{old.dtype}; a change to {advert.backend}/"
            f"{advert.dtype} is allowed in {wait:.0f}s (one change per {interval:.0f}s)",
            strike=False,
            retry_after_s=wait,
        )
    log.warning(
        "node %s re-registered as %s/%s (was %s/%s); its checks restart as for a new node",
        fingerprint_of(node_key), advert.backend, advert.dtype, old.backend, old.dtype,
    )  # fmt: skip


class RegistrationDesk:
    """Answers registrations (module docstring). ``replan`` re-plans the active set;
    ``lease_version`` is the version new leases name (the ack carries it)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        store: Store,
        clock: Callable[[], float],
        liveness: Liveness,
        budget: VerificationBudget,
        receipts: ReceiptLog,
        replan: Callable[[], object],
        lease_version: Callable[[], int | None],
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.liveness = liveness
        self.budget = budget
        self.receipts = receipts
        self.replan = replan
        self.lease_version = lease_version
        #: fingerprints of the nodes the operator vouches for (``intake.vouched_nodes``)
        self.vouched = frozenset(parse_fingerprint(f) for f in config.intake.vouched_nodes)

    def register(self, node_key: bytes, advert: CapabilityAdvert) -> RegisterAck:
        """Register (or re-register) ``node_key`` as ``advert`` describes it; a
        :class:`Rejection` says why not."""
        now = self.clock()
        ctx = self.load(node_key, advert, now)
        decision = decide_registration(node_key, advert, ctx, now, self.config)
        if decision.new:
            assert ctx.registered is not None  # loaded for a new identity
            registered = self.make_room(ctx.registered, now)
            if not ctx.vouched:  # a vouched node starts at the floor: no probation to book
                self.budget.admit_new(  # issue 35
                    node_key, advert.tokens_per_s or None, now, registered=registered
                )
        self.record(decision, now)
        if decision.replan:
            self.replan()
        return RegisterAck(
            node_fingerprint=decision.record.fingerprint,
            heartbeat_interval_s=self.liveness.interval_s,
            current_policy_version=self.lease_version(),
            server_time=now,
        )

    def load(self, node_key: bytes, advert: CapabilityAdvert, now: float) -> RegistrationContext:
        """The node's row and ban, its trust state if it asks for another backend/dtype, the
        node count if it is new, read under the connection lock (:class:`RegistrationContext`)."""
        store = self.store
        with store.locked():
            node = store.get_node(node_key)
            ban = store.get_ban(node_key)
            held_to = (advert.backend, advert.dtype)
            relabel = node is not None and (node.backend, node.dtype) != held_to
            vouched = fingerprint_of(node_key) in self.vouched
            row = store.trust_row(node_key) if relabel or vouched else None
            record = (relabel and row is None) or vouched
            struck = record and store.has_record(node_key)
            suspect = struck and row is None
            registered = store.node_count() if node is None else None
        return RegistrationContext(
            node,
            ban_in_force(ban, now),
            trust_state(row, suspect) if relabel or vouched else None,
            registered,
            self.liveness.unwritten(node_key),
            self.liveness.horizon(now),
            vouched=vouched,
            struck_before=struck,
        )

    def make_room(self, registered: int, now: float) -> int:
        """Keep the node table within ``max_nodes`` for a newcomer (``registered``: the nodes
        registered now): forget the longest-gone node that holds nothing (no active lease, no
        ban in force), or refuse the newcomer if there is none. Returns the nodes registered
        before the newcomer is."""
        cap = self.config.max_nodes
        if registered < cap:
            return registered
        self.liveness.flush()
        horizon = self.liveness.schedule.horizon_s(now)
        victim = self.store.evictable_node(now - horizon, now)
        if victim is None:
            raise Rejection(
                ReasonCode.SWARM_FULL,
                f"the swarm is full ({cap} registered nodes, all alive, holding leases or banned);"
                " try again later",
                retry_after_s=horizon,
            )
        self.store.delete_node(victim)
        self.liveness.forget(victim)
        log.info("node table full (%d): forgot %s, gone the longest", cap, fingerprint_of(victim))
        return registered - 1

    def record(self, decision: Registration, now: float) -> None:
        """Write the decision in one transaction: the node row, a relabel's trust row, the
        receipt."""
        node_key = decision.record.node_key
        with self.store.transaction():
            self.store.upsert_node(decision.record)
            if decision.trust is not None:
                self.store.execute(PUT_SQL, put_args(node_key, decision.trust))
            if decision.receipt is not None:
                self.receipts.append("register", decision.receipt, now)
