"""The lease state machine (DESIGN.md §6), persisted in the store, with an injected clock.

A lease hands one node a batch of prompt indices, each to be sampled ``G`` times at one policy
version, with a deadline and a fencing epoch (a counter that only grows; each lease gets a new one).

States::

    active ──all its prompts done──► completed
      │  └────deadline passed──────► expired   (prompts not yet done are re-queued)
      └──────node drains────────────► released (prompts re-queued at once)

Prompt choice is the coordinator's: re-queued prompts first (lowest index first), then fresh indices
from a persistent, monotonically increasing cursor; a lease never holds one problem twice (an
audit copy beside its original). A prompt index yields **at most one accepted
group**, whichever valid result arrives first from a lease that was issued that prompt:

* a late result of an *expired* lease is accepted for the prompts nobody has completed yet and
  that were not re-issued (once: the prompts are then marked done). A prompt re-issued to a newer
  lease is fenced: the newer lease's epoch holds it, and the late result for it is refused with
  ``stale_epoch`` (no strike: a slow node is not a dishonest one). Prompts completed elsewhere
  answer ``lease_expired``;
* a *released* lease's results are refused (``lease_expired``): the node gave the work back;
* an identical re-sent submission gets the stored verdict (see :mod:`coordinator.core`).

Lease size follows the node's measured throughput: ``n = target_lease_s · tokens_per_s / (G · L)``
prompts (L = max_new_tokens), clamped to [1, max_prompts_per_lease] and to what one submission
frame can carry if every sample runs to L tokens, and the deadline is
``now + max(min_deadline_s, min(max_deadline_s, deadline_slack · n · G · L / tokens_per_s))``
(tokens_per_s taken within [1e-3, 1e9]: adverts are untrusted). Everything lives in
SQLite, so a coordinator killed with SIGKILL resumes: outstanding leases are honoured until their
deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.config import LeaseSection
from coordinator.errors import Rejection
from coordinator.store import LeaseRecord, NodeRecord, Store
from protocol.errors import ReasonCode
from protocol.limits import DEFAULT_LIMITS, SUBMISSION_OVERHEAD, worst_case_submission_bytes

log = logging.getLogger(__name__)

Clock = Callable[[], float]
CURSOR = "prompt_cursor"
#: Domain label of the keyed lease-seed derivation (docs/protocol.md §11.1).
SEED_LABEL = b"rollout-swarm/lease-seed/"
#: Bounds on the throughput used for sizing (tokens/s): beyond them an advert is not believed.
MIN_TOKENS_PER_S = 1e-3
MAX_TOKENS_PER_S = 1e9
EPOCH = "fencing_epoch"


def holder_refusal(
    lease: LeaseRecord | None, node_key: bytes, lease_id: str, epoch: int
) -> Rejection | None:
    """Why ``node_key`` may not act on lease ``lease_id`` at ``epoch`` (``lease`` is its record,
    None if there is none); None: it holds it."""
    if lease is None:
        return Rejection(ReasonCode.UNKNOWN_LEASE, f"no lease {lease_id!r}; request a new one")
    if lease.node_key != node_key:
        return Rejection(ReasonCode.WRONG_NODE, f"lease {lease_id} belongs to another node")
    if lease.epoch != epoch:
        return Rejection(
            ReasonCode.STALE_EPOCH,
            f"lease {lease_id} has epoch {lease.epoch}, the request carries {epoch}",
        )
    if lease.state == "released":
        return Rejection(ReasonCode.LEASE_EXPIRED, f"lease {lease_id} was released by its node")
    return None


def undone_prompts(
    lease: LeaseRecord, states: Mapping[int, tuple[str, str]]
) -> tuple[set[int], set[int]]:
    """Prompts of ``lease`` not done yet, given their ``{index: (state, holder)}``: (still held
    by it, held by a newer lease). A prompt without a state row counts as done."""
    held: set[int] = set()
    fenced: set[int] = set()
    for p in lease.prompts:
        state, holder = states.get(p, ("done", ""))
        if state != "done":
            (held if holder == lease.lease_id else fenced).add(p)
    return held, fenced


def open_prompts_of(lease: LeaseRecord, states: Mapping[int, tuple[str, str]]) -> set[int]:
    """Prompts of ``lease`` for which a result is still accepted (:meth:`LeaseManager.open_prompts`
    on loaded prompt states)."""
    if lease.state == "released":
        return set()
    return undone_prompts(lease, states)[0]


def newest_servable(recent: Sequence[int], servable: Callable[[int], bool] | None) -> int | None:
    """The version new leases name: the newest of ``recent`` (the newest published versions,
    newest first, at most S + 1 of them) that is ``servable``; any when ``servable`` is None."""
    if servable is None:
        return recent[0] if recent else None
    return next((v for v in recent if servable(v)), None)


def measured_throughput(
    lease: LeaseRecord, node: NodeRecord | None, now: float, ewma: float
) -> tuple[float, float] | None:
    """The node's running means ``(tokens_per_s, rollouts_per_s)`` with a completed ``lease``
    (its progress counted) folded in; None when there is nothing to fold (no node row, no
    elapsed time, no tokens)."""
    elapsed = now - lease.issued_at
    if node is None or elapsed <= 0 or lease.tokens <= 0:
        return None
    tps, rps = lease.tokens / elapsed, lease.samples / elapsed
    return (
        tps if node.tokens_per_s is None else (1 - ewma) * node.tokens_per_s + ewma * tps,
        rps if node.rollouts_per_s is None else (1 - ewma) * node.rollouts_per_s + ewma * rps,
    )


@dataclass(frozen=True)
class RequestBook:
    """What a lease request reads, in one read inside its transaction
    (:meth:`LeaseManager.request`)."""

    #: active leases past their deadline that expire now, by epoch
    due: tuple[LeaseRecord, ...]
    #: ``{lease_id: prompts it still holds}`` of the due leases (re-queued as they expire)
    held: Mapping[str, tuple[int, ...]]
    #: the re-queued prompts that are audit copies of the requesting node's own work
    own_audits: frozenset[int]
    #: the requesting node's active leases (the due ones included)
    active: int
    #: the lowest pending prompts it may take (at most the lease size), ascending
    pending: tuple[int, ...]
    #: the prompt cursor and the last fencing epoch issued
    cursor: int
    epoch: int
    #: ``{audit copy: original prompt index}`` of the audit copies among the candidates
    #: (pending and re-queued): a lease holds each problem once
    originals: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestDecision:
    """What a lease request records (:func:`decide_request`): the expiry, and the lease's
    prompts and epoch unless the node is at its cap."""

    expire: tuple[LeaseRecord, ...]
    #: the node's active leases after the expiry
    holding: int
    #: the new lease's prompts (re-queued first, then fresh) and epoch; None: at the cap
    prompts: tuple[int, ...] | None
    epoch: int
    #: the prompt cursor after the fresh prompts taken (unchanged: none taken)
    cursor: int


@dataclass(frozen=True)
class Backlog:
    """Rollouts ahead of a new lease's in the learner's queue that the learner will still train
    (accepted and waiting, then in flight), against the most that leaves room for the new
    lease's to be trained too (:func:`backlog_bound`; ``leases.max_backlog_steps``).

    The learner consumes in arrival order, B rollouts a step; a rollout with ``n`` trainable
    ones ahead of it is reached ``n // B`` steps on and trained if its version is within S of
    the learner's then (:func:`trainable`). A rollout of the newest version v, while the learner
    is at version L >= v, is trained only if fewer than (v − L + S + 1) · B trainable ones are
    ahead of it: beyond that it is generated, verified and stored to be dropped (a single node
    outrunning its learner on the SmolLM2 demo had ~88 % of its accepted rollouts dropped)."""

    #: trainable rollouts ahead of a new lease's (counted up to the bound)
    ahead: int
    #: the most ahead that leaves a new lease's rollouts trainable
    bound: float
    #: the learner said it is blocked for rollouts: ``bound`` is what it waits for plus its
    #: next batch, ``ahead`` what is on its way to it sooner than a new lease's (not yet
    #: fetched, or in flight)
    starving: bool = False

    @property
    def full(self) -> bool:
        return self.ahead >= self.bound

    def reason(self) -> str:
        if self.starving:
            return (
                f"standby: the learner is blocked, and {self.ahead} rollouts it will train are "
                f"on their way sooner than a new lease's (it needs {self.bound:g} for its batch "
                "and the next)"
            )
        return (
            f"standby: {self.ahead} rollouts the learner will train are ahead of a new lease's "
            f"(bound {self.bound:g}); more would go stale before it trains them"
        )


def trainable(
    runs: Iterable[tuple[int, int]], learner_version: int, staleness: int, batch: int, limit: float
) -> int:
    """How many rollouts of the learner's queue it will still train, counting up to ``limit``;
    ``runs`` is the queue in order as ``(version, count)`` runs. It takes them in order, B a
    step: a rollout with ``n`` trainable ones ahead is reached ``n // B`` steps on, at version
    ``learner_version + n // B``, and trained if its version is within S of that; the ones it
    drops take no step (pure)."""
    n = 0
    for version, count in runs:
        if n >= limit:
            break
        # the run's rollouts are trained while n < (version − learner_version + S + 1) · B
        room = (version - learner_version + staleness + 1) * max(1, batch) - n
        n += max(0, min(count, room))
    return n


def runs_of(versions: Iterable[int]) -> list[tuple[int, int]]:
    """``versions`` in order as ``(version, count)`` runs of equal versions."""
    out: list[tuple[int, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def backlog_bound(steps: float | None, staleness: int, batch: int, lag: int = 0) -> float:
    """The most trainable rollouts ahead of a new lease's: ``(S + 1 − lag) · B``, ``lag`` the
    versions the learner is ahead of the version new leases name, and at most ``steps · B``
    when ``leases.max_backlog_steps`` is set (:class:`Backlog`)."""
    room = staleness + 1 - max(0, lag)
    return max(0, room if steps is None else min(steps, room)) * max(1, batch)


def decide_request(
    book: RequestBook, node_key: bytes, *, size: int, cap: int | None
) -> RequestDecision:
    """Which leases expire, whether the node's cap allows another lease and which prompts it
    gets: the lowest pending ones (those the expiry re-queues included, never an audit copy of
    its own work), then ``size − that`` fresh ones from the cursor (pure).

    A lease holds each problem at most once: an audit copy and its original (re-queued when the
    node that did it was banned and its rows withdrawn), or two copies of one original, would
    give one lease two prompts with the same ``prompt_id``, which the node's answer (one group
    per prompt id) cannot tell apart. The lowest of them is taken (an audit copy, whose index
    is negative); the others stay pending for a later lease."""
    holding = book.active - sum(1 for lease in book.due if lease.node_key == node_key)
    if cap is not None and holding >= cap:
        return RequestDecision(book.due, holding, None, book.epoch, book.cursor)
    requeued = {p for ps in book.held.values() for p in ps} - book.own_audits
    prompts: list[int] = []
    problems: set[int] = set()
    for p in sorted(set(book.pending) | requeued):
        problem = book.originals.get(p, p)
        if problem in problems:
            continue
        problems.add(problem)
        prompts.append(p)
        if len(prompts) == size:
            break
    fresh = size - len(prompts)
    cursor = book.cursor + max(0, fresh)
    prompts += range(book.cursor, cursor)
    return RequestDecision(book.due, holding, tuple(prompts), book.epoch + 1, cursor)


def _never(lease: LeaseRecord) -> bool:
    return False


class LeaseManager:
    """Issues, expires, releases and closes leases; all state in ``store``."""

    def __init__(
        self,
        store: Store,
        config: LeaseSection,
        *,
        clock: Clock,
        group_size: int,
        max_new_tokens: int,
        verifying: Callable[[LeaseRecord], bool] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        #: Random hex suffix of lease ids (``secrets.token_hex``); injectable like the clock, so a
        #: simulation is reproducible from its seed.
        self.nonce: Callable[[int], str] = secrets.token_hex
        #: the coordinator's secret (kept in its state database): lease seeds are keyed with it
        self._secret = store.secret()
        #: whether a due lease's expiry waits: a submission of it that arrived by the deadline is
        #: queued for verification (the core passes :meth:`coordinator.verifying.VerifyingLeases.
        #: holds`; issue 35); None: never
        self.verifying: Callable[[LeaseRecord], bool] = verifying or _never
        #: no active lease has its deadline before this (clock seconds): the due leases need no
        #: read until then. Set from the earliest deadline when a read finds none due, lowered
        #: by every lease issued (deadlines never move; leases only leave the active state).
        self._quiet_until = -math.inf

    def seed_of(self, lease_id: str) -> int:
        """The lease's sampling seed, ``u64be(HMAC-SHA256(secret, SEED_LABEL + id)[:8]) >> 1``.

        Keyed with a secret no node knows, so a node cannot predict the seeds of its next
        leases (the fencing epoch, which it can, used to be the seed); it receives the seed in
        the lease and derives the prompt and sample seeds from it (docs/protocol.md §11.1)."""
        mac = hmac.new(self._secret, SEED_LABEL + lease_id.encode(), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") >> 1

    # --- sizing ----------------------------------------------------------------------------------
    def _tps(self, tokens_per_s: float | None) -> float:
        """A usable throughput: the node's (advertised or measured) within sane bounds, else the
        default. Adverts are untrusted: 5e-324 or 1.8e308 tokens/s must not overflow the sizing
        or yield an infinite deadline."""
        if tokens_per_s is None or not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
            return self.config.default_tokens_per_s
        return min(max(tokens_per_s, MIN_TOKENS_PER_S), MAX_TOKENS_PER_S)

    def lease_size(self, tokens_per_s: float | None, max_prompts: int | None = None) -> int:
        tps = self._tps(tokens_per_s)
        per_prompt = self.group_size * self.max_new_tokens
        n = math.floor(self.config.target_lease_s * tps / per_prompt)
        cap = self.config.max_prompts_per_lease
        if max_prompts is not None:
            cap = min(cap, max_prompts)
        # never more than one submission frame can carry in the worst case (nodes refuse that)
        per_prompt_bytes = (
            worst_case_submission_bytes(1, self.group_size, self.max_new_tokens)
            - SUBMISSION_OVERHEAD
        )
        cap = min(cap, (DEFAULT_LIMITS.bulk_frame - SUBMISSION_OVERHEAD) // per_prompt_bytes)
        return max(1, min(n, cap))

    def expected_s(self, n_prompts: int, tokens_per_s: float | None) -> float:
        """Generation time of a lease of ``n_prompts`` on a node at ``tokens_per_s`` (every
        sample at ``max_new_tokens``; the deadline is this times ``deadline_slack``, clamped)."""
        return n_prompts * self.group_size * self.max_new_tokens / self._tps(tokens_per_s)

    def deadline_s(self, n_prompts: int, tokens_per_s: float | None) -> float:
        tps = self._tps(tokens_per_s)
        expected = n_prompts * self.group_size * self.max_new_tokens
        wanted = min(self.config.max_deadline_s, self.config.deadline_slack * expected / tps)
        return max(self.config.min_deadline_s, wanted)

    # --- transitions -----------------------------------------------------------------------------
    def issue(
        self,
        node_key: bytes,
        *,
        version: int,
        tokens_per_s: float | None,
        max_prompts: int | None = None,
        held_to: tuple[str, str] = ("", ""),
    ) -> LeaseRecord:
        """A new lease for ``node_key`` whatever it holds (:meth:`request` without a cap)."""
        out = self.request(
            node_key, version=version, tokens_per_s=tokens_per_s, max_prompts=max_prompts,
            held_to=held_to, cap=None,
        )  # fmt: skip
        assert isinstance(out, LeaseRecord)
        return out

    def request(
        self,
        node_key: bytes,
        *,
        version: int,
        tokens_per_s: float | None,
        max_prompts: int | None = None,
        held_to: tuple[str, str] = ("", ""),
        cap: int | None,
    ) -> LeaseRecord | int:
        """A lease request in one transaction: one read (:class:`RequestBook`: the due leases,
        the node's active ones, the pending prompts, cursor and epoch), the pure decision
        (:func:`decide_request`) and its record. Returns the new lease (re-queued prompts and
        audit copies of other nodes' prompts first, then fresh ones; ``held_to`` is the node's
        registered (backend, dtype), which its submission is verified against), or the number
        of active leases the node holds when that is ``cap`` or more (no lease issued; the
        expiry is recorded all the same)."""
        now = self.clock()
        size = self.lease_size(tokens_per_s, max_prompts)
        with self.store.transaction():
            book = self._read_request(node_key, size, now)
            decision = decide_request(book, node_key, size=size, cap=cap)
            lease = None
            if decision.prompts is not None:
                prompts = decision.prompts
                lease = LeaseRecord(
                    lease_id=f"L{decision.epoch:08d}-{self.nonce(6)}",
                    node_key=node_key,
                    epoch=decision.epoch,
                    version=version,
                    prompts=prompts,
                    group_size=self.group_size,
                    max_new_tokens=self.max_new_tokens,
                    issued_at=now,
                    deadline=now + self.deadline_s(len(prompts), tokens_per_s),
                    state="active",
                    backend=held_to[0],
                    dtype=held_to[1],
                )
            self._record_request(book, decision, lease, now)
        if lease is None:
            return decision.holding
        log.debug(
            "lease %s (epoch %d) to %s: %d prompts × %d, version %d, deadline in %.1fs",
            lease.lease_id, lease.epoch, node_key.hex()[:16], len(lease.prompts),
            self.group_size, version, lease.deadline - now,
        )  # fmt: skip
        return lease

    def _due(self, now: float) -> list[LeaseRecord]:
        """The active leases past their deadline at ``now`` (in verification or not); one read
        at most, none while :attr:`_quiet_until` says none can be due (every submission and
        lease request asks)."""
        if now < self._quiet_until:
            return []
        with self.store.locked():  # no lease issued between the two reads and the assignment
            due = self.store.due_leases(now)
            if not due:
                nxt = self.store.next_deadline()
                self._quiet_until = math.inf if nxt is None else nxt
        return due

    def _read_request(self, node_key: bytes, size: int, now: float) -> RequestBook:
        store = self.store
        due = tuple(lease for lease in self._due(now) if not self.verifying(lease))
        held = {lease.lease_id: tuple(self._held(lease)) for lease in due}
        copies = sorted({p for ps in held.values() for p in ps if p < 0})
        pending = tuple(store.pending_prompts(size, node_key))
        return RequestBook(
            due=due,
            held=held,
            own_audits=frozenset(store.own_audit_copies(node_key, copies)),
            active=store.active_lease_count(node_key),
            pending=pending,
            originals=store.audit_originals(sorted({*copies, *(p for p in pending if p < 0)})),
            cursor=int(store.get_meta(CURSOR) or 0),
            epoch=int(store.get_meta(EPOCH) or 0),
        )

    def _record_request(
        self, book: RequestBook, decision: RequestDecision, lease: LeaseRecord | None, now: float
    ) -> None:
        store = self.store
        for due in decision.expire:
            store.close_lease(due.lease_id, "expired", now)
            store.requeue_prompts(book.held[due.lease_id])
            store.bump_node(due.node_key, "leases_expired")
            log.info("lease %s expired; prompts re-queued", due.lease_id)
        if lease is None:
            return
        if decision.cursor != book.cursor:
            store.set_meta(CURSOR, str(decision.cursor))
        store.set_meta(EPOCH, str(decision.epoch))
        store.insert_lease(lease)
        self._quiet_until = min(self._quiet_until, lease.deadline)

    def expire_due(self) -> list[LeaseRecord]:
        """Expire active leases past their deadline; their unfinished prompts are re-queued.

        Runs on every lease request and submission: when nothing is due (the common case) it is
        one indexed read, without opening a write transaction."""
        now = self.clock()
        held = self.verifying
        if not [lease for lease in self._due(now) if not held(lease)]:
            return []
        with self.store.transaction():
            due = [lease for lease in self._due(now) if not held(lease)]
            for lease in due:
                self.store.close_lease(lease.lease_id, "expired", now)
                self.store.requeue_prompts(self._held(lease))
                self.store.bump_node(lease.node_key, "leases_expired")
        for lease in due:
            log.info("lease %s expired; prompts re-queued", lease.lease_id)
        return due

    def release(self, node_key: bytes, lease_id: str, epoch: int) -> list[int]:
        """A draining node gives a lease back; returns the prompts made reassignable."""
        with self.store.transaction():
            lease = self.check_holder(node_key, lease_id, epoch)
            if lease.state != "active":
                return []
            self.store.close_lease(lease_id, "released", self.clock())
            held = self._held(lease)
            self.store.requeue_prompts(held)
        log.info("lease %s released by its node; %d prompts re-queued", lease_id, len(held))
        return held

    def close_unfulfillable(self, lease: LeaseRecord) -> list[int]:
        """Close an active lease whose result can never be accepted (refused ``too_stale``: its
        version only ages) at once, instead of at its deadline: its prompts are reassignable and
        the node holds one lease fewer. Closed as expired without counting against the node's
        reliability (an honest, late node); a re-send of the refused submission still gets its
        stored verdict. Returns the re-queued prompts."""
        with self.store.transaction():
            current = self.store.get_lease(lease.lease_id)
            if current is None or current.state != "active":
                return []
            self.store.close_lease(lease.lease_id, "expired", self.clock())
            held = self._held(current)
            self.store.requeue_prompts(held)
        log.info("lease %s can no longer be fulfilled; %d prompts re-queued", lease.lease_id,
                 len(held))  # fmt: skip
        return held

    def check_holder(self, node_key: bytes, lease_id: str, epoch: int) -> LeaseRecord:
        """The lease, if ``node_key`` holds it at ``epoch``; else a :class:`Rejection`."""
        lease = self.store.get_lease(lease_id)
        refusal = holder_refusal(lease, node_key, lease_id, epoch)
        if refusal is not None:
            raise refusal
        assert lease is not None
        return lease

    def open_prompts(self, lease: LeaseRecord) -> set[int]:
        """Prompts of ``lease`` for which a result is still accepted: nobody completed them yet
        and (for an expired lease) they were not re-issued to a newer lease (the fence)."""
        return open_prompts_of(lease, self.store.prompt_states(lease.prompts))

    def fenced_prompts(self, lease: LeaseRecord) -> set[int]:
        """Prompts of an expired ``lease`` not done yet but re-issued to a newer lease."""
        return self._undone(lease)[1]

    def _undone(self, lease: LeaseRecord) -> tuple[set[int], set[int]]:
        """Prompts of ``lease`` not done yet: (still held by it, held by a newer lease)."""
        return undone_prompts(lease, self.store.prompt_states(lease.prompts))

    def outstanding(self) -> list[LeaseRecord]:
        """Active leases (after a restart: the ones still honoured until their deadline)."""
        return self.store.leases("active")

    # --- helpers ---------------------------------------------------------------------------------
    def _held(self, lease: LeaseRecord) -> list[int]:
        """Prompts whose current holder is ``lease`` and that are not done."""
        states = self.store.prompt_states(lease.prompts)
        return [
            p
            for p, (st, holder) in sorted(states.items())
            if holder == lease.lease_id and st != "done"
        ]
