"""Heartbeats and lease requests: one read, pure rules, one write.

:class:`LeaseDesk` answers the two messages a node sends most, in one direction::

    heartbeat      ─► load_sender ─► admission_refusal ─► liveness (soft) ─► HeartbeatAck
    lease request  ─► load_sender ─► admission_refusal ─► newest_servable, active set, backlog
                                                      ─► LeaseManager.request ─► Lease | Standby
                                                         (one read, decide_request, one write)

:meth:`LeaseDesk.load_sender` is the one read both start with (the sender's row, its ban and
the newest versions: :class:`SenderContext`); :func:`coordinator.admission.admission_refusal`,
:func:`coordinator.leases.newest_servable` and :func:`coordinator.leases.decide_request` are
pure. ``last_seen`` is soft state (:class:`coordinator.liveness.Liveness`), written for all
nodes on the tick.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.activation import ActiveSet, LearnerFigures
from coordinator.admission import admission_refusal
from coordinator.config import CoordinatorConfig
from coordinator.leases import (
    Backlog,
    LeaseManager,
    backlog_bound,
    newest_servable,
    runs_of,
    trainable,
)
from coordinator.ledger import LEARNER_CURSOR, LEARNER_STEP
from coordinator.liveness import Liveness
from coordinator.records import NodeRecord
from coordinator.reputation import ban_in_force
from coordinator.slots import PromptSlots
from coordinator.store import Store
from coordinator.throughput import LeaseLag
from protocol.messages import (
    Heartbeat,
    HeartbeatAck,
    Lease,
    LeaseRequest,
    PromptItem,
    SamplingParams,
    Standby,
    pack_tokens,
)

__all__ = ["LeaseDesk", "SenderContext"]

#: Seconds a read of the backlog waiting for the learner is reused by lease requests.
BACKLOG_READ_S = 0.5


@dataclass(frozen=True)
class _Queue:
    """The learner's queue as :meth:`LeaseDesk.backlog` reads it."""

    read_at: float
    #: the learner's version (None: no learner has reported)
    learner_version: int | None
    batch: int
    bound: float
    #: the accepted rollouts past its cursor within S, as (version, count) runs in order
    waiting: list[tuple[int, int]]
    #: the active leases within S (:meth:`coordinator.store.Store.in_flight`) as (when it is
    #: expected to land: issue time plus :meth:`LeaseDesk.generation_s`, version, samples held)
    in_flight: list[tuple[float, int, int]]
    #: the accepted rollouts within S past what the learner has fetched, as runs in order
    unfetched: list[tuple[int, int]]
    #: the S counted with (:meth:`LeaseDesk.staleness`)
    staleness: int


@dataclass(frozen=True)
class SenderContext:
    """What a heartbeat or a lease request reads before it answers, loaded in one read
    (:meth:`LeaseDesk.load_sender`)."""

    #: the sender's registration; None: not registered
    node: NodeRecord | None
    #: the sender's ban on record ``(bans so far, banned_until, reason)``; None: never banned
    ban: tuple[int, float, str] | None
    #: the newest published versions, newest first (at most S + 1)
    recent_versions: tuple[int, ...]


class LeaseDesk:
    """Answers heartbeats and lease requests (module docstring)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        store: Store,
        clock: Callable[[], float],
        leases: LeaseManager,
        liveness: Liveness,
        active: ActiveSet,
        slots: PromptSlots,
        lease_lag: LeaseLag,
        stop_token_ids: Sequence[int],
        servable: Callable[[int], bool] | None,
        learner: LearnerFigures,
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.leases = leases
        self.liveness = liveness
        self.active = active
        self.slots = slots
        self.lease_lag = lease_lag
        self.stop_token_ids = list(stop_token_ids)
        #: Whether a version's weights can be fetched from here now (the network service: held
        #: in full). Leases name the newest servable version; None: every published one is.
        self.servable = servable
        #: the learner's figures as reported (configured until then): B, T_train, its S and
        #: whether it is blocked for rollouts (the backlog bound)
        self.learner = learner
        #: the learner's queue as last read (:meth:`backlog`)
        self._queue: _Queue | None = None

    def load_sender(self, node_key: bytes) -> SenderContext:
        """The sender's row, its ban and the S + 1 newest versions, read under the connection
        lock (:class:`SenderContext`)."""
        store = self.store
        with store.locked():
            return SenderContext(
                store.get_node(node_key),
                store.get_ban(node_key),
                store.recent_versions(self.config.staleness_bound + 1),
            )

    def _sender(self, node_key: bytes) -> SenderContext:
        """Load what a heartbeat or lease request reads (one read) and admit the sender."""
        sender = self.load_sender(node_key)
        now = self.clock()
        refusal = admission_refusal(node_key, sender.node, ban_in_force(sender.ban, now), now)
        if refusal is not None:
            raise refusal
        return sender

    def heartbeat(self, node_key: bytes, hb: Heartbeat) -> HeartbeatAck:
        sender = self._sender(node_key)
        now = self.clock()
        self.liveness.saw(node_key, now)
        return HeartbeatAck(
            server_time=now,
            current_policy_version=newest_servable(sender.recent_versions, self.servable),
            active=self.active.is_active(node_key),
            heartbeat_interval_s=self.liveness.interval_s,
        )

    def request_lease(self, node_key: bytes, req: LeaseRequest) -> Lease | Standby:
        sender = self._sender(node_key)
        node = sender.node
        assert node is not None  # admitted
        self.liveness.saw(node_key, self.clock())
        version = newest_servable(sender.recent_versions, self.servable)
        if version is None:
            return Standby(retry_after_s=1.0, reason="no policy version available yet")
        if not self.active.is_active(node_key):
            return Standby(
                retry_after_s=min(self.liveness.interval_s, 86400.0),
                reason="standby: the active set covers the learner's demand",
            )
        backlog = self.backlog(
            sender.recent_versions[0],
            prompts=self.leases.lease_size(node.tokens_per_s, req.max_prompts),
            tokens_per_s=node.tokens_per_s,
            node_key=node_key,
        )
        if backlog is not None and backlog.full:
            return Standby(retry_after_s=self._backlog_retry_s(), reason=backlog.reason())
        # Standby answers (most lease requests of a large swarm) need no expiry pass; a lease
        # does: one read, the decision (expiry, the per-node cap: no hoarding of prompts and no
        # unbounded lease rows by one node, the prompts), one transaction.
        cap = self.config.leases.max_active_per_node
        lease = self.leases.request(
            node_key,
            version=version,
            tokens_per_s=node.tokens_per_s,
            max_prompts=req.max_prompts,
            held_to=(node.backend, node.dtype),
            cap=cap,
        )
        if isinstance(lease, int):
            return Standby(
                retry_after_s=min(self.liveness.interval_s, 86400.0),
                reason=f"you hold {lease} active leases (limit {cap}); submit or release them",
            )
        self.lease_lag.leased(version, self.clock())
        s = self.config.sampling
        return Lease(
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            policy_version=version,
            prompts=[
                PromptItem(prompt_id=slot.problem.prompt_id, token_ids=pack_tokens(slot.token_ids))
                for slot in self.slots.of(lease).values()
            ],
            group_size=lease.group_size,
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_new_tokens=lease.max_new_tokens,
                stop_token_ids=list(self.stop_token_ids),
                seed=self.leases.seed_of(lease.lease_id),  # keyed: docs/protocol.md §11.1
            ),
            issued_at=lease.issued_at,
            deadline=lease.deadline,
        )

    def backlog(
        self,
        newest: int,
        *,
        prompts: int = 1,
        tokens_per_s: float | None = None,
        node_key: bytes | None = None,
    ) -> Backlog | None:
        """The trainable rollouts ahead of a new lease's of ``prompts`` prompts for the node
        ``node_key`` at ``tokens_per_s`` (:class:`~coordinator.leases.Backlog`): the accepted
        ones past the learner's cursor, then the leases in flight expected to land before it
        (:meth:`generation_s`), once a learner has reported on this database (None before:
        nothing tells what it consumes). The queue is read at most every
        :data:`BACKLOG_READ_S` (a lease request of a large swarm does not scan it)."""
        now = self.clock()
        if self._queue is None or now - self._queue.read_at >= BACKLOG_READ_S:
            self._queue = self._read_queue(newest, now)
        q = self._queue
        if q.learner_version is None:
            return None
        lands = now + self.generation_s(node_key, prompts, tokens_per_s)
        sooner = [(version, n) for at, version, n in q.in_flight if at <= lands]
        wanting = self.learner.wanting_now(now)
        if wanting > 0:
            # The learner took what it was given and is blocked for ``wanting`` more (rollouts it
            # drops, stale or in groups of equal rewards, are not what the model counts): a new
            # lease waits only while what it has not fetched yet and the leases in flight that
            # land before the new one would bring what it waits for and its next batch (a node
            # stood by asks again half a step later). Without this a learner short of one group
            # waited for ever behind a full backlog of rollouts it would drop (SmolLM2, S = 0).
            # Counting every lease in flight, or only what it waits for, kept fast nodes waiting
            # with the learner for slow nodes' leases (the simulation's learner, reporting as
            # the trainer does, idled 33 % instead of 18 % over 1.5 h at 100 nodes).
            want = wanting + q.batch
            ahead = trainable(q.unfetched + sooner, q.learner_version, q.staleness, q.batch, want)
            return Backlog(ahead, want, starving=True)
        runs = q.waiting + sooner
        return Backlog(trainable(runs, q.learner_version, q.staleness, q.batch, q.bound), q.bound)

    def generation_s(
        self, node_key: bytes | None, prompts: int, tokens_per_s: float | None
    ) -> float:
        """Expected generation seconds of a lease of ``prompts`` prompts on ``node_key``: at the
        node's measured generation rate (samples per second over its accepted leases,
        :class:`~coordinator.throughput.ThroughputBook`) when it has one, else every sample at
        ``max_new_tokens`` at ``tokens_per_s`` (:meth:`LeaseManager.expected_s`, the deadline's
        worst case: completions average a quarter of the cap in the shipped scenarios, and a
        worst-case estimate ranks a fast node's lease behind slow ones that land before it)."""
        fig = self.active.throughput.get(node_key) if node_key is not None else None
        if fig is not None and fig.gen_rate > 0 and math.isfinite(fig.gen_rate):
            return prompts * self.leases.group_size / fig.gen_rate
        return self.leases.expected_s(prompts, tokens_per_s)

    def staleness(self) -> int:
        """The S the backlog counts with: the coordinator's, or the learner's own if it reported
        a smaller one (it drops what is older at its S, whatever the coordinator accepts)."""
        own = self.learner.max_staleness
        s = self.config.staleness_bound
        return s if own is None else min(s, own)

    def _read_queue(self, newest: int, now: float) -> _Queue:
        store = self.store
        s = self.staleness()
        batch = max(1, self.learner.batch_rollouts)
        with store.locked():
            step = store.get_meta(LEARNER_STEP)
            if step is None:
                return _Queue(now, None, batch, 0.0, [], [], [], s)
            cursor = int(store.get_meta(LEARNER_CURSOR) or 0)
            # the learner's version runs ahead of the newest published one (κ, the broadcast)
            version = max(newest, int(step))
            bound = backlog_bound(
                self.config.leases.max_backlog_steps, s, batch, lag=version - newest
            )
            # a few bounds' worth: the ones it will drop as stale are skipped
            limit = 4 * math.ceil(bound) + batch
            waiting = runs_of(store.waiting_versions(cursor, version - s, limit))
            fetched = self.learner.fetched_after
            unfetched = (
                runs_of(store.waiting_versions(fetched, version - s, limit))
                if fetched > cursor
                else waiting
            )
            flying = [
                (issued + self.generation_s(key, held, tps), v, held * group)
                for v, held, group, issued, tps, key in store.in_flight(version - s)
            ]
            return _Queue(now, version, batch, bound, waiting, flying, unfetched, s)

    def _backlog_retry_s(self) -> float:
        """Ask again after half a learner step (it frees B), within [1 s, the heartbeat]."""
        return min(self.liveness.interval_s, max(1.0, self.learner.t_train_s / 2))

    def lease_version(self) -> int | None:
        """The version new leases name: the newest published one that is servable (its chunks
        can be fetched from the coordinator), within S of the newest; None if there is none.

        A version published but not yet (or never) held — the trainer died while seeding it —
        is skipped: a node leased on it could not load it and would release lease after lease."""
        recent = self.store.recent_versions(self.config.staleness_bound + 1)
        return newest_servable(recent, self.servable)
