"""The transport-independent coordinator: one object the network service calls into.

:class:`Coordinator` composes its collaborators in one ``__init__`` that reads top to bottom: the
durable books over the store (:class:`~coordinator.leases.LeaseManager`,
:class:`~coordinator.reputation.Reputation`, :class:`~coordinator.trust.Trust`,
:class:`~coordinator.audits.RewardAudits`, :class:`~coordinator.receipts.ReceiptLog`,
:class:`~coordinator.ledger.Ledger`, :class:`~coordinator.retention.Retention`,
:class:`~coordinator.admission.Admission`), the soft state
(:class:`~coordinator.liveness.Liveness`, :class:`~coordinator.throughput.ThroughputBook`,
:class:`~coordinator.activation.LearnerFigures`, :class:`~coordinator.activation.ActiveSet`), and
the submission pipeline (:class:`~coordinator.submissions.SubmissionDesk` over
:class:`~coordinator.intake.Intake` and :class:`~coordinator.slots.PromptSlots`) with the
trainer's :class:`~coordinator.feed.RolloutFeed`, heartbeats and lease requests
(:class:`~coordinator.lease_desk.LeaseDesk`), registration
(:class:`~coordinator.registration.RegistrationDesk`) and version publication
(:class:`~coordinator.publication_desk.PublicationDesk`). Each receives what it uses as
constructor arguments; the coordinator keeps admission at the envelope, releases and upkeep,
and delegates the rest. Its methods take decoded protocol messages plus the signer's public key
(from the envelope) and return protocol messages. Refusals raise
:class:`~coordinator.errors.Rejection` (the service answers ``Reject(code, detail)``), except
:meth:`submit`, which returns the verdict (``Ack`` or ``Reject``) because verdicts are stored
and replayed to an identical re-send.

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
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from coordinator.activation import ActiveSet, LearnerFigures
from coordinator.admission import Admission
from coordinator.audits import RewardAudits
from coordinator.capacity import NodeCapacity, Plan
from coordinator.config import CoordinatorConfig
from coordinator.feed import RolloutFeed
from coordinator.intake import Intake, IntakeMetrics
from coordinator.lease_desk import LeaseDesk
from coordinator.leases import LeaseManager
from coordinator.ledger import Ledger
from coordinator.liveness import HeartbeatSchedule, Liveness
from coordinator.logprobs import LogprobVerifier
from coordinator.outcome import AcceptRules
from coordinator.problems import Task
from coordinator.publication_desk import PublicationDesk
from coordinator.receipts import ReceiptLog
from coordinator.registration import RegistrationDesk
from coordinator.reputation import Reputation
from coordinator.retention import Retention
from coordinator.slots import PromptSlots
from coordinator.store import NodeRecord, Store
from coordinator.submission_records import SubmissionRecords
from coordinator.submissions import SubmissionDesk
from coordinator.throughput import LeaseLag, ThroughputBook
from coordinator.trust import Trust
from coordinator.verify_budget import VerificationBudget
from coordinator.verifying import VerifyingLeases
from policy.model import Tokenizer
from policy.prompts import PromptRenderer
from protocol.envelope import ReplayGuard, open_envelope
from protocol.identity import Identity, fingerprint_of
from protocol.messages import (
    Ack,
    CapabilityAdvert,
    Heartbeat,
    HeartbeatAck,
    Lease,
    LeaseRequest,
    Manifest,
    Register,
    RegisterAck,
    Reject,
    RolloutBatch,
    RolloutSubmission,
    SignedEnvelope,
    Standby,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Coordinator:
    """Core state machine of the control plane (no sockets): composes the collaborators below in
    one place and keeps the public methods the service, the simulation and the benches call."""

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
        # --- what it was given ---
        self.config = config
        self.store = store
        self.task = task
        self.tokenizer = tokenizer
        self.clock = clock
        self.replay = replay if replay is not None else ReplayGuard()
        self.registry = registry if registry is not None else CollectorRegistry()
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

        # --- durable books over the store ---
        #: leases whose submission waits for its check do not expire (issue 35): shared by the
        #: lease manager (expiry) and the verification budget (its figures)
        verifying = VerifyingLeases(enabled=config.verification.hold_verifying_leases)
        self.leases = LeaseManager(
            store,
            config.leases,
            clock=clock,
            group_size=config.group_size,
            max_new_tokens=config.sampling.max_new_tokens,
            verifying=verifying.holds,
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
        #: bounded storage: consumed rollouts past the audit window are pruned on the tick
        self.retention = Retention(store, clock, retention_s=config.rollout_retention_s)
        self.admission = Admission(store, self.reputation, clock)
        #: verification as a budget (issue 35): V, D, new identities admitted at the rate it
        #: absorbs, leases whose submission waits for its check kept from expiring
        self.budget = VerificationBudget(
            config, trust=self.trust, clock=clock, lease_size=self.leases.lease_size,
            checks_on=verifier is not None, verifying=verifying,
        )  # fmt: skip

        # --- soft state: liveness, measured figures, the plan ---
        #: last_seen in memory, and the heartbeat interval handed out (it grows with the swarm)
        self.liveness = Liveness(store, HeartbeatSchedule.from_config(config))
        #: per-node μ_i, g_i, o_i, d_i measured from accepted leases (coordinator.throughput)
        self.throughput = ThroughputBook(config.leases.throughput_ewma)
        #: publish call -> first lease naming the version (a diagnostic beside T_bcast: much
        #: longer than the coordinator's download means nodes stall before asking for work)
        self.lease_lag = LeaseLag(config.leases.throughput_ewma)
        #: B, T_train (and its variability), κ, T_bcast: configured until the learner reports
        self.learner = LearnerFigures.from_config(config)
        self.active = ActiveSet(
            config,
            store=store,
            clock=clock,
            liveness=self.liveness,
            throughput=self.throughput,
            learner=self.learner,
            registry=self.registry,
            verification=self.budget,
        )
        #: records the trainer's signed manifests (rswarm/publish): newest, a delta's base held
        self.publication = PublicationDesk(
            store=store, clock=clock, publisher_key=publisher_key, lease_lag=self.lease_lag,
            learner=self.learner, registry=self.registry,
        )  # fmt: skip

        # --- the submission pipeline and the trainer's feed ---
        self.metrics = IntakeMetrics(self.registry)
        self.intake = Intake(
            task, tokenizer, verifier=self.budget.metered(verifier), secret=store.secret(),
            metrics=self.metrics,
        )  # fmt: skip
        self.slots = PromptSlots(task, self.prompts, self.audits)
        self.desk = SubmissionDesk(
            config.intake,
            store=store,
            records=SubmissionRecords(
                store, receipts=self.receipts, ledger=self.ledger, audits=self.audits
            ),
            clock=clock,
            leases=self.leases,
            slots=self.slots,
            intake=self.intake,
            metrics=self.metrics,
            check_rate=self.trust.rate_of,
            rules=AcceptRules(
                intake=config.intake,
                reward_audit=config.reward_audit,
                throughput_ewma=config.leases.throughput_ewma,
                audited=self.audits.audited,
            ),
            reputation=config.reputation,
            throughput=self.throughput,
            staleness_bound=config.staleness_bound,
            vocab_size=tokenizer.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
            stop_token_ids=frozenset(self.stop_token_ids),
            problems=self.node_problems,
        )
        self.lease_desk = LeaseDesk(
            config,
            store=store,
            clock=clock,
            leases=self.leases,
            liveness=self.liveness,
            active=self.active,
            slots=self.slots,
            lease_lag=self.lease_lag,
            stop_token_ids=self.stop_token_ids,
            servable=servable,
            learner=self.learner,
        )
        self.feed = RolloutFeed(store, self.ledger, clock)
        #: rswarm/register: one read, the pure decision, room for a newcomer, one write
        self.registration = RegistrationDesk(
            config,
            store=store,
            clock=clock,
            liveness=self.liveness,
            budget=self.budget,
            receipts=self.receipts,
            replan=lambda: self.replan(),  # late-bound: the one re-plan entry point
            lease_version=self.lease_desk.lease_version,
        )

        # --- resume ---
        # the interval handed out before a restart is soft state: bind the horizon to the
        # longest one the registered nodes may have been told until they have all heard anew
        self.liveness.schedule.resume(store.node_count(), clock())
        self.liveness.recount(clock())
        self.leases.expire_due()
        outstanding = self.leases.outstanding()
        if outstanding:
            log.info(
                "resuming with %d outstanding leases (honoured until their deadline)",
                len(outstanding),
            )
        self.replan()

    # --- delegation: the submission pipeline, the trainer's feed, the active set ------------------
    async def submit(
        self, node_key: bytes, sub: RolloutSubmission, arrived_at: float | None = None
    ) -> Ack | Reject:
        """Verify and store a submission (:meth:`SubmissionDesk.submit`). ``arrived_at``: when
        its envelope was opened (default now); its lease does not expire while it is checked."""
        at = self.clock() if arrived_at is None else arrived_at
        with self.budget.verifying.waiting(sub.lease_id, node_key, at):
            return await self.desk.submit(node_key, sub, at)

    def replayed_submission(self, env: SignedEnvelope) -> Ack | Reject | None:
        """The stored verdict of a re-sent envelope (:meth:`SubmissionDesk.replayed_submission`)."""
        return self.desk.replayed_submission(env)

    def learner_report(self, step: int, cursor: int, step_time_s: float) -> None:
        """The trainer's figures with a fetch (:meth:`RolloutFeed.learner_report`)."""
        self.feed.learner_report(step, cursor, step_time_s)

    def learner_waiting(self, after_seq: int, wanting: int, max_staleness: int | None) -> None:
        """A fetch's word on the learner's queue: it has fetched up to ``after_seq``, is blocked
        for ``wanting`` more rollouts (0: it is not) and trains within ``max_staleness`` (None:
        not said); the lease backlog bound reads them (:meth:`LeaseDesk.backlog`)."""
        learner = self.learner
        learner.fetched_after = max(0, after_seq)
        learner.wanting, learner.wanting_at = max(0, wanting), self.clock()
        if max_staleness is not None:
            learner.max_staleness = max(0, max_staleness)

    def fetch_rollouts(
        self, after_seq: int, max_rollouts: int, min_policy_version: int | None = None
    ) -> RolloutBatch:
        """Accepted rollouts after ``after_seq`` (:meth:`RolloutFeed.fetch`)."""
        return self.feed.fetch(after_seq, max_rollouts, min_policy_version)

    def flush_liveness(self) -> None:
        """Write buffered ``last_seen`` times (:meth:`Liveness.flush`)."""
        self.liveness.flush()

    def alive_nodes(self) -> list[NodeRecord]:
        """Registered, alive, unbanned nodes (:meth:`ActiveSet.alive_nodes`)."""
        return self.active.alive_nodes()

    def node_capacity(self, node: NodeRecord) -> NodeCapacity | None:
        """What the planner knows of ``node`` (:meth:`ActiveSet.node_capacity`)."""
        return self.active.node_capacity(node)

    def replan(self) -> Plan:
        """Recompute the active set (:meth:`ActiveSet.replan`)."""
        return self.active.replan()

    def is_active(self, node_key: bytes) -> bool:
        """Whether a lease request of ``node_key`` gets work (:meth:`ActiveSet.is_active`)."""
        return self.active.is_active(node_key)

    @property
    def plan(self) -> Plan | None:
        """The current activation plan (None before the first)."""
        return self.active.plan

    @property
    def effective_kappa(self) -> float:
        """κ of the rule (:attr:`LearnerFigures.effective_kappa`)."""
        return self.learner.effective_kappa

    # --- the learner's figures (read and written by the service and the simulation) -------------
    @property
    def t_bcast_s(self) -> float:
        """T_bcast (seconds), measured by the service (:class:`LearnerFigures`)."""
        return self.learner.t_bcast_s

    @t_bcast_s.setter
    def t_bcast_s(self, value: float) -> None:
        self.learner.t_bcast_s = value

    @property
    def t_train_s(self) -> float:
        """T_train: seconds per learner step, as reported (:class:`LearnerFigures`)."""
        return self.learner.t_train_s

    @t_train_s.setter
    def t_train_s(self, value: float) -> None:
        self.learner.t_train_s = value

    @property
    def t_train_cv(self) -> float:
        """The learner's step-time coefficient of variation (:class:`LearnerFigures`)."""
        return self.learner.t_train_cv

    @t_train_cv.setter
    def t_train_cv(self, value: float) -> None:
        self.learner.t_train_cv = value

    @property
    def batch_rollouts(self) -> int:
        """B: rollouts per learner step (:class:`LearnerFigures`)."""
        return self.learner.batch_rollouts

    @batch_rollouts.setter
    def batch_rollouts(self, value: int) -> None:
        self.learner.batch_rollouts = value

    @property
    def kappa(self) -> int:
        """Κ: learner steps between published versions (:class:`LearnerFigures`)."""
        return self.learner.kappa

    @kappa.setter
    def kappa(self, value: int) -> None:
        self.learner.kappa = value

    @property
    def published_kappa(self) -> float | None:
        """Versions per publication as observed (:class:`LearnerFigures`)."""
        return self.learner.published_kappa

    @property
    def _planned_at(self) -> float:
        """When the plan was made (the simulation and bench/coord_scale.py read and set it)."""
        return self.active.planned_at

    @_planned_at.setter
    def _planned_at(self, value: float) -> None:
        self.active.planned_at = value

    # --- identity and admission ------------------------------------------------------------------
    def open(self, env: SignedEnvelope, type_: type[T], *, admit: bool = True) -> tuple[bytes, T]:
        """Check 2: signature, replay window, and (except for Register) a known, unbanned node;
        ``admit=False`` leaves the last to the caller (a heartbeat: :meth:`LeaseDesk.heartbeat`
        admits the sender from the one read it makes anyway)."""
        # A decode error (unknown field, NaN, too long, ...) costs no strike, even with a valid
        # signature (docs/operations.md §6.2): a node one protocol revision ahead, or with a
        # numerical glitch, must not be banned for it; the refusal is all it gets.
        msg = open_envelope(env, type_, now=self.clock(), replay=self.replay)
        if admit and not isinstance(msg, Register):
            self.admission.admit(env.signer)
        return env.signer, msg

    def register(self, node_key: bytes, advert: CapabilityAdvert) -> RegisterAck:
        """Register or re-register a node (:meth:`RegistrationDesk.register`)."""
        return self.registration.register(node_key, advert)

    # --- heartbeats and leases (coordinator.lease_desk) ------------------------------------------
    def heartbeat(self, node_key: bytes, hb: Heartbeat) -> HeartbeatAck:
        """Admit the sender, note it alive (:meth:`LeaseDesk.heartbeat`)."""
        return self.lease_desk.heartbeat(node_key, hb)

    def request_lease(self, node_key: bytes, req: LeaseRequest) -> Lease | Standby:
        """A lease, or why not now (:meth:`LeaseDesk.request_lease`)."""
        return self.lease_desk.request_lease(node_key, req)

    def lease_version(self) -> int | None:
        """The version new leases name (:meth:`LeaseDesk.lease_version`)."""
        return self.lease_desk.lease_version()

    @property
    def servable(self) -> Callable[[int], bool] | None:
        """Whether a version's weights can be fetched from here now (the network service: held
        in full); leases name the newest servable version. None: every published one is."""
        return self.lease_desk.servable

    @servable.setter
    def servable(self, value: Callable[[int], bool] | None) -> None:
        self.lease_desk.servable = value

    def release(self, node_key: bytes, lease_id: str, epoch: int, reason: str = "") -> list[int]:
        """A node gives a lease back; its prompts are reassignable at once. A reason other than
        a shutdown is kept as the node's last problem (``/status`` ``node_problems``)."""
        self.admission.admit(node_key)
        prompts = self.leases.release(node_key, lease_id, epoch)
        if reason and reason != "node shutting down":
            if len(self.node_problems) >= self.config.max_nodes:
                self.node_problems.pop(next(iter(self.node_problems)))
            self.node_problems[node_key] = reason
        return prompts

    # --- versions --------------------------------------------------------------------------------
    def publish_version(self, manifest_env: SignedEnvelope) -> Manifest:
        """Record a signed manifest as the newest version (:meth:`PublicationDesk.publish`)."""
        return self.publication.publish(manifest_env)

    def tick(self) -> None:
        """Periodic upkeep: write liveness (and count the nodes alive: the heartbeat interval
        handed out follows it), expire overdue leases, seal new receipts, and re-plan
        the active set when ``capacity.replan_interval_s`` has passed since the last plan (a
        re-plan reads every live node: ~0.1 s of CPU at 10,000 nodes, too much for every tick)."""
        self.liveness.recount(self.clock())  # flushes; sets the heartbeat interval handed out
        self.leases.expire_due()
        if self.active.replan_due():
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
        horizon = self.liveness.horizon(now)
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
