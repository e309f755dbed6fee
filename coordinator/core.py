"""The transport-independent coordinator: one object the network service calls into.

:class:`Coordinator` ties together the store, lease state machine, intake pipeline, reputation and
capacity planner. Its methods take decoded protocol messages plus the signer's public key (from the
envelope) and return protocol messages. Refusals raise :class:`~coordinator.errors.Rejection`
(the service answers ``Reject(code, detail)``), except :meth:`submit`, which returns the verdict
(``Ack`` or ``Reject``) because verdicts are stored and replayed to an identical re-send.

Every state change is committed to SQLite before the method returns, except liveness: the
``last_seen`` of a heartbeat or lease request is soft state, kept in memory and written for all
nodes in one transaction by :meth:`flush_liveness` (every :meth:`tick`, before any query that reads
it). A durable commit per heartbeat would cost an fsync each (~4 ms on ext4 with
``synchronous=FULL``): 10,000 nodes send ~2,000 such messages per second. A crash loses at most
one tick of ``last_seen``, far inside the liveness horizon. Time comes from the injected ``clock``
(Unix seconds), so tests drive leases and bans without sleeping. Call :meth:`tick` periodically
(flush, expiry, and a re-plan every ``capacity.replan_interval_s``).

Verification is held to the node's registration (its backend and dtype, recorded in each lease),
at the node's adaptive check rate (:mod:`coordinator.trust`); reward audits re-issue a keyed-random
share of prompts (:mod:`coordinator.audits`); every lease-bound verdict, registration, flag and
learner step goes into the hash-chained receipt log (:mod:`coordinator.receipts`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge

from coordinator.activation import ActiveSet
from coordinator.audits import RewardAudits
from coordinator.capacity import Plan
from coordinator.config import CoordinatorConfig
from coordinator.errors import Rejection
from coordinator.intake import Intake, IntakeMetrics, PromptSlot
from coordinator.leases import LeaseManager
from coordinator.ledger import Ledger
from coordinator.logprobs import LogprobVerifier
from coordinator.problems import Task
from coordinator.receipts import ReceiptLog
from coordinator.reputation import Reputation
from coordinator.retention import Retention
from coordinator.store import LeaseRecord, NodeRecord, Store
from coordinator.submissions import SubmissionDesk
from coordinator.throughput import LeaseLag, ThroughputBook
from coordinator.trust import Trust
from policy.model import Tokenizer
from policy.prompts import PromptRenderer
from protocol.codec import decode, encode
from protocol.envelope import ReplayGuard, open_envelope
from protocol.errors import ReasonCode
from protocol.identity import Identity, fingerprint_of
from protocol.manifest import verify_manifest
from protocol.messages import (
    CapabilityAdvert,
    Heartbeat,
    HeartbeatAck,
    Lease,
    LeaseRequest,
    Manifest,
    PromptItem,
    Register,
    RegisterAck,
    SamplingParams,
    SignedEnvelope,
    Standby,
    pack_tokens,
)
from swarm.faults import fault_point

log = logging.getLogger(__name__)
T = TypeVar("T")


class Coordinator(SubmissionDesk, ActiveSet):
    """Core state machine of the control plane (no sockets)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        store: Store,
        task: Task,
        tokenizer: Tokenizer,
        clock: Callable[[], float] = time.time,
        verifier: LogprobVerifier | None = None,
        publisher_key: bytes | None = None,
        registry: CollectorRegistry | None = None,
        replay: ReplayGuard | None = None,
        servable: Callable[[int], bool] | None = None,
        signer: Identity | None = None,
        prompts: PromptRenderer | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.task = task
        self.tokenizer = tokenizer
        #: renders a task's question into the prompt tokens a lease carries
        self.prompts = prompts or PromptRenderer(
            tokenizer, template=config.prompt.template, system_prompt=config.prompt.system_prompt
        )
        #: the stop set every lease carries and the intake checks (the model's EOS ids plus the
        #: configured extras; :func:`policy.model.model_stop_ids`); default: the tokenizer's EOS
        self.stop_token_ids: tuple[int, ...] = tuple(
            sorted(
                set(stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id])
                | set(config.sampling.stop_token_ids)
            )
        )
        #: what each node last said when it gave a lease back (shown on /status, swarm inspect)
        self.node_problems: dict[bytes, str] = {}
        self.clock = clock
        self.publisher_key = publisher_key
        #: Whether a version's weights can be fetched from here now (the network service: held in
        #: full). Leases name the newest servable version; None: every published one is.
        self.servable = servable
        self.replay = replay if replay is not None else ReplayGuard()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.leases = LeaseManager(
            store,
            config.leases,
            clock=clock,
            group_size=config.group_size,
            max_new_tokens=config.sampling.max_new_tokens,
        )
        self.reputation = Reputation(store, config.reputation)
        self.trust = Trust(store, config.intake)
        self.audits = RewardAudits(store, config.reward_audit, store.secret())
        #: the hash-chained verdict log, sealed with ``signer`` (the coordinator key)
        self.receipts = ReceiptLog(
            store,
            signer,
            seal_every=config.receipts.seal_every,
            seal_interval_s=config.receipts.seal_interval_s,
        )
        self.ledger = Ledger(store, self.receipts, verifier)
        self.metrics = IntakeMetrics(self.registry)
        self.intake = Intake(
            task,
            tokenizer,
            verifier=verifier,
            secret=store.secret(),
            metrics=self.metrics,
        )
        self._g_active = Gauge(
            "swarm_nodes_active", "Nodes in the active set", registry=self.registry
        )
        self._g_version = Gauge(
            "swarm_policy_version", "Latest published version", registry=self.registry
        )
        #: T_bcast: weights ready at the trainer -> leases name them (seconds); measured by the
        #: service from the configured starting value
        self.t_bcast_s = config.capacity.t_bcast_s
        #: T_train estimate: the configured value until the trainer reports its step time.
        self.t_train_s = config.capacity.t_train_s
        #: the variability of the learner's step time (coefficient of variation), as reported
        self.t_train_cv = 0.0
        #: B and κ: configured until the trainer reports its own (the learner's figures win)
        self.batch_rollouts = config.capacity.batch_rollouts
        self.kappa = config.kappa
        #: versions per publication as observed (a trainer whose publication outlasts κ steps
        #: publishes less often: the window a version is the newest grows); running mean
        self.published_kappa: float | None = None
        self._last_published: int | None = None
        #: per-node μ_i, g_i, o_i, d_i measured from accepted leases (coordinator.throughput)
        self.throughput = ThroughputBook(config.leases.throughput_ewma)
        #: publish call -> first lease naming the version (a diagnostic beside T_bcast: much
        #: longer than the coordinator's download means nodes stall before asking for work)
        self.lease_lag = LeaseLag(config.leases.throughput_ewma)
        self.plan: Plan | None = None
        self._standby: frozenset[str] = frozenset()
        self._planned_at = -math.inf
        #: node_key -> last_seen not yet written to the store (see the module docstring)
        self._seen: dict[bytes, float] = {}
        #: bounded storage: consumed rollouts past the audit window are pruned on the tick
        self.retention = Retention(store, self.clock)
        self.leases.expire_due()
        outstanding = self.leases.outstanding()
        if outstanding:
            log.info(
                "resuming with %d outstanding leases (honoured until their deadline)",
                len(outstanding),
            )
        self.replan()

    # --- identity and admission ------------------------------------------------------------------
    def open(self, env: SignedEnvelope, type_: type[T]) -> tuple[bytes, T]:
        """Check 2: signature, replay window, and (except for Register) a known, unbanned node."""
        # A decode error (unknown field, NaN, too long, ...) costs no strike, even with a valid
        # signature (docs/operations.md §6.2): a node one protocol revision ahead, or with a
        # numerical glitch, must not be banned for it; the refusal is all it gets.
        msg = open_envelope(env, type_, now=self.clock(), replay=self.replay)
        if not isinstance(msg, Register):
            self._admit(env.signer)
        return env.signer, msg

    def _admit(self, node_key: bytes) -> NodeRecord:
        node = self.store.get_node(node_key)
        if node is None:
            raise Rejection(
                ReasonCode.UNKNOWN_NODE, f"{fingerprint_of(node_key)} must register first"
            )
        ban = self.reputation.banned(node_key, self.clock())
        if ban is not None:
            left = max(0.0, ban.until - self.clock())
            raise Rejection(
                ReasonCode.BANNED,
                f"banned for {left:.0f}s more (ban #{ban.count}: {ban.reason})",
                retry_after_s=left,
            )
        return node

    def register(self, node_key: bytes, advert: CapabilityAdvert) -> RegisterAck:
        now = self.clock()
        if advert.node_key != node_key:
            raise Rejection(ReasonCode.SCHEMA, "advert.node_key differs from the envelope signer")
        if self.reputation.banned(node_key, now) is not None:
            self._admit(node_key)  # raises banned
        old = self.store.get_node(node_key)
        if old is None:
            self._make_room(now)
        relabel = old is not None and (old.backend, old.dtype) != (advert.backend, advert.dtype)
        if relabel:
            assert old is not None
            self._check_relabel(node_key, old, advert, now)
        record = NodeRecord(
            node_key=node_key,
            fingerprint=fingerprint_of(node_key),
            advert=encode(advert),
            registered_at=old.registered_at if old else now,
            last_seen=now,
            tokens_per_s=old.tokens_per_s
            if old and old.tokens_per_s
            else advert.tokens_per_s or None,
            rollouts_per_s=old.rollouts_per_s if old and old.rollouts_per_s else None,
            price_per_hour=advert.price_per_hour,
            backend=advert.backend,
            dtype=advert.dtype,
            leases_completed=old.leases_completed if old else 0,
            leases_expired=old.leases_expired if old else 0,
        )
        with self.store.transaction():
            self.store.upsert_node(record)
            if old is None or relabel:
                if relabel:
                    self.trust.relabelled(node_key, now)
                self.receipts.append(
                    "register",
                    {
                        "node": record.fingerprint,
                        "held_to": f"{advert.backend}/{advert.dtype}",
                        "previous": f"{old.backend}/{old.dtype}" if old is not None else None,
                    },
                    now,
                )
        # Re-planning scans the whole swarm: only when the plan's inputs changed (a new or
        # returning node, another price or throughput), so repeated re-registrations stay cheap.
        horizon = now - self.config.heartbeat_interval_s * self.config.heartbeat_misses
        # A node never seen before has no measured rate, so it cannot change the plan (unmeasured
        # nodes are always active); re-planning for each of 10,000 joining nodes would scan the
        # swarm 10,000 times. Its gauge count follows at the next tick.
        if old is not None and (
            max(old.last_seen, self._seen.get(node_key, -math.inf)) < horizon
            or old.price_per_hour != record.price_per_hour
            or old.tokens_per_s != record.tokens_per_s
        ):
            self.replan()
        return RegisterAck(
            node_fingerprint=fingerprint_of(node_key),
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            current_policy_version=self.lease_version(),
            server_time=now,
        )

    def _check_relabel(
        self, node_key: bytes, old: NodeRecord, advert: CapabilityAdvert, now: float
    ) -> None:
        """A registered node asks to be held to another backend/dtype: allowed at most every
        ``intake.registration_change_interval_s`` (logged; its clean history restarts)."""
        last = self.trust.state(node_key).label_changed_at or old.registered_at
        wait = last + self.config.intake.registration_change_interval_s - now
        if wait > 0:
            raise Rejection(
                ReasonCode.REGISTRATION_MISMATCH,
                f"registered as {old.backend}/{old.dtype}; a change to {advert.backend}/"
                f"{advert.dtype} is allowed in {wait:.0f}s (one change per "
                f"{self.config.intake.registration_change_interval_s:.0f}s)",
                strike=False,
                retry_after_s=wait,
            )
        log.warning(
            "node %s re-registered as %s/%s (was %s/%s); its checks restart as for a new node",
            fingerprint_of(node_key), advert.backend, advert.dtype, old.backend, old.dtype,
        )  # fmt: skip

    def _make_room(self, now: float) -> None:
        """Keep the node table within ``max_nodes``: forget the longest-gone node that holds
        nothing (no active lease, no ban in force), or refuse the newcomer if there is none."""
        cap = self.config.max_nodes
        if self.store.node_count() < cap:
            return
        self.flush_liveness()
        horizon = self.config.heartbeat_interval_s * self.config.heartbeat_misses
        victim = self.store.evictable_node(now - horizon, now)
        if victim is None:
            raise Rejection(
                ReasonCode.SWARM_FULL,
                f"the swarm is full ({cap} registered nodes, all alive, holding leases or banned);"
                " try again later",
                retry_after_s=horizon,
            )
        self.store.delete_node(victim)
        self._seen.pop(victim, None)
        log.info("node table full (%d): forgot %s, gone the longest", cap, fingerprint_of(victim))

    def heartbeat(self, node_key: bytes, hb: Heartbeat) -> HeartbeatAck:
        self._admit(node_key)
        now = self.clock()
        self._seen[node_key] = now
        return HeartbeatAck(
            server_time=now,
            current_policy_version=self.lease_version(),
            active=self.is_active(node_key),
        )

    # --- leases ----------------------------------------------------------------------------------
    def request_lease(self, node_key: bytes, req: LeaseRequest) -> Lease | Standby:
        node = self._admit(node_key)
        self._seen[node_key] = self.clock()
        version = self.lease_version()
        if version is None:
            return Standby(retry_after_s=1.0, reason="no policy version available yet")
        if not self.is_active(node_key):
            return Standby(
                retry_after_s=self.config.heartbeat_interval_s,
                reason="standby: the active set covers the learner's demand",
            )
        # Standby answers (most lease requests of a large swarm) need no expiry pass; a lease does.
        self.leases.expire_due()
        held, cap = self.store.active_lease_count(node_key), self.config.leases.max_active_per_node
        if held >= cap:  # no hoarding of prompts (and no unbounded lease rows) by one node
            return Standby(
                retry_after_s=min(self.config.heartbeat_interval_s, 86400.0),
                reason=f"you hold {held} active leases (limit {cap}); submit or release them",
            )
        lease = self.leases.issue(
            node_key,
            version=version,
            tokens_per_s=node.tokens_per_s,
            max_prompts=req.max_prompts,
            held_to=(node.backend, node.dtype),
        )
        self.lease_lag.leased(version, self.clock())
        s = self.config.sampling
        return Lease(
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            policy_version=version,
            prompts=[
                PromptItem(prompt_id=slot.problem.prompt_id, token_ids=pack_tokens(slot.token_ids))
                for slot in self._slots(lease).values()
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

    def lease_version(self) -> int | None:
        """The version new leases name: the newest published one that is servable (its chunks
        can be fetched from the coordinator), within S of the newest; None if there is none.

        A version published but not yet (or never) held — the trainer died while seeding it —
        is skipped: a node leased on it could not load it and would release lease after lease."""
        latest = self.store.latest_version()
        if latest is None or self.servable is None or self.servable(latest):
            return latest
        usable = self.store.versions()[-(self.config.staleness_bound + 1) :]
        return next((v for v in reversed(usable) if self.servable(v)), None)

    def release(self, node_key: bytes, lease_id: str, epoch: int, reason: str = "") -> list[int]:
        """A node gives a lease back; its prompts are reassignable at once. A reason other than
        a shutdown is kept as the node's last problem (``/status`` ``node_problems``)."""
        self._admit(node_key)
        prompts = self.leases.release(node_key, lease_id, epoch)
        if reason and reason != "node shutting down":
            if len(self.node_problems) >= self.config.max_nodes:
                self.node_problems.pop(next(iter(self.node_problems)))
            self.node_problems[node_key] = reason
        return prompts

    def _slots(self, lease: LeaseRecord) -> dict[str, PromptSlot]:
        slots = {}
        originals = self.audits.originals(lease.prompts)  # audit copies ask the original prompt
        for position, index in enumerate(lease.prompts):
            problem = self.task.problem(originals.get(index, index))
            ids = tuple(self.prompts.render(problem.prompt))
            slots[problem.prompt_id] = PromptSlot(index, problem, ids, position)
        return slots

    # --- versions --------------------------------------------------------------------------------
    def publish_version(self, manifest_env: SignedEnvelope) -> Manifest:
        """Record a signed manifest (verified against ``publisher_key``) as the newest version."""
        if self.publisher_key is None:
            raise Rejection(ReasonCode.INTERNAL, "coordinator has no publisher key configured")
        manifest = verify_manifest(manifest_env, self.publisher_key, self.clock())
        with self.store.transaction():
            latest = self.store.latest_version()
            if latest is not None and manifest.version <= latest:
                raise Rejection(
                    ReasonCode.VERSION_NOT_NEWER,
                    f"version {manifest.version} is not newer than {latest}",
                )
            self._check_delta_base(manifest)
            self.store.put_version(manifest.version, encode(manifest_env), self.clock())
        fault_point("publish.after_commit")
        self.lease_lag.published(manifest.version, self.clock())
        step = manifest.version - (self._last_published or 0)
        # a jump far beyond κ is a restarted trainer renumbering, not its publication pace
        if self._last_published is not None and 0 < step <= 8 * self.kappa:
            old = self.published_kappa
            self.published_kappa = step if old is None else 0.7 * old + 0.3 * step
        self._last_published = manifest.version
        self._g_version.set(manifest.version)
        log.info("published policy version %d", manifest.version)
        return manifest

    def _check_delta_base(self, manifest: Manifest) -> None:
        """A delta version must name, by its exact root hash, a version published here: the
        swarm could not apply it otherwise (the trainer then publishes a keyframe)."""
        if manifest.delta is None:
            return
        base, raw = manifest.delta.base_version, self.store.get_version(manifest.delta.base_version)
        held = None if raw is None else decode(decode(raw, SignedEnvelope).payload, Manifest)
        if held is None or held.root_hash != manifest.delta.base_root_hash:
            why = "was never published here" if held is None else "was published with other bytes"
            raise Rejection(
                ReasonCode.DELTA_BASE_MISSING,
                f"v{manifest.version} is a delta against v{base}, which {why}; publish a keyframe",
            )

    def tick(self) -> None:
        """Periodic upkeep: write liveness, expire overdue leases, seal new receipts, and re-plan
        the active set when ``capacity.replan_interval_s`` has passed since the last plan (a
        re-plan reads every live node: ~0.1 s of CPU at 10,000 nodes, too much for every tick)."""
        self.flush_liveness()
        self.leases.expire_due()
        if self.clock() - self._planned_at >= self.config.capacity.replan_interval_s:
            self.replan()
        self.receipts.seal(self.clock())
        self.retention.tick()  # consumed rollouts past the audit window leave the database

    def close(self) -> None:
        """Release the database and any task worker process."""
        closer = getattr(self.task, "close", None)
        if callable(closer):
            closer()
        self.flush_liveness()
        self.receipts.seal(self.clock(), force=True)
        self.store.close()

    def status(self) -> dict[str, Any]:
        """Snapshot for ``/status`` (scalars, lists and flat maps only)."""
        by_state = self.store.lease_counts()  # every tick: never load the whole lease history
        self.flush_liveness()
        now = self.clock()
        # counts, not rows: at 10,000 nodes loading them twice cost ~0.4 s a tick (issue 35)
        banned = [fingerprint_of(k) for k in self.store.banned_registered(now)]
        horizon = now - self.config.heartbeat_interval_s * self.config.heartbeat_misses
        return {
            "policy_version": self.store.latest_version(),
            "versions": self.store.versions()[-(self.config.staleness_bound + 1) :],
            "nodes_registered": self.store.node_count(),
            "nodes_alive": self.store.live_node_count(horizon, now),
            "nodes_banned": banned,
            "leases": by_state,
            "rollouts_accepted": self.store.rollout_count(),
            # the sampling contract every lease carries (the trainer matches it)
            "sampling": {
                "temperature": self.config.sampling.temperature,
                "top_p": self.config.sampling.top_p,
                "top_k": self.config.sampling.top_k,
                "max_new_tokens": self.config.sampling.max_new_tokens,
                "prompt_template": self.prompts.template,
            },
            "stop_token_ids": list(self.stop_token_ids),
            "plan": self.plan.explanation if self.plan else None,
            "plan_required_rollouts_per_s": self.plan.required if self.plan else None,
            "plan_predicted_idle_frac": self.plan.predicted_idle if self.plan else None,
            "plan_pool_idle_frac": self.plan.pool_idle if self.plan else None,
            "plan_step_period_s": self.plan.step_period if self.plan else None,
            "plan_t_train_s": self.t_train_s,
            "plan_t_train_cv": self.t_train_cv,
            "plan_t_bcast_s": self.t_bcast_s,
            "plan_lease_lag_s": self.lease_lag.mean_s,
            "plan_batch_rollouts": self.batch_rollouts,
            "plan_kappa": self.effective_kappa,
            "plan_standby": [
                fingerprint_of(bytes.fromhex(k)) for k in (self.plan.standby if self.plan else ())
            ],
            **self.verification_status(),
        }

    def verification_status(self) -> dict[str, Any]:
        """Verification compute against the learner's, and the receipt log's head."""
        return self.ledger.status()
