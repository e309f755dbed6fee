"""Typed coordinator configuration, loaded from TOML (``load_config``).

Every field has a description (it becomes ``--help`` text); unknown keys are rejected
(``extra="forbid"``) and cross-field rules fail at load with the field named. The checked-in
``coordinator/coordinator.example.toml`` documents every option and is loaded by a test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from coordinator.errors import ConfigError
from coordinator.retention import RETENTION_S
from protocol.identity import parse_fingerprint
from protocol.limits import DEFAULT_LIMITS, worst_case_submission_bytes


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Tolerance(_Section):
    """How closely a node's behaviour log-probs must match the coordinator's re-score (made in
    the dtype the node registered), and how a boundary token or a replayed draw is judged.

    Each token's deviation ``Δ`` is the distance of the claimed log-prob from the admissible
    interval of :func:`policy.boundary.logprob_interval` (0 inside it). Defaults come from
    honest runs (bench/calibrate_verifier.py, docs/reliability.md "Calibration")."""

    metric: Literal["max_abs", "median_rel"] = Field(
        description="max_abs: largest |Δ logprob|; median_rel: median exp(|Δ|)−1 (GRAIL)"
    )
    threshold: float = Field(gt=0, description="Reject when the metric exceeds this value")
    tail_delta: float | None = Field(
        default=None,
        gt=0,
        description="A token whose |Δ| exceeds this is a tail token (None: no tail bound; "
        "max_abs is its own worst-token bound)",
    )
    tail_fraction: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Reject when more than this share of the checked tokens are tail tokens "
        "(the median ignores up to half of them)",
    )
    logit_margin: float = Field(
        default=1e-3,
        ge=0,
        description="Raw-logit difference two honest machines may show: top-k/top-p boundary "
        "tokens within it are admissible either way (policy/boundary.py)",
    )
    replay_slack: float = Field(
        default=1e-3,
        ge=0,
        description="Probability mass by which a replayed draw's CDF interval is widened",
    )
    replay_rel_slack: float = Field(
        default=0.0,
        ge=0,
        description="Calibrated widening of a replayed CDF bound at CDF value c, times c(1−c) "
        "(added to replay_slack; coordinator/calibration.py)",
    )
    replay_miss_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Share of replayed tokens allowed to miss their seeded draw",
    )


def _default_tolerances() -> dict[str, Tolerance]:
    # Calibrated on honest runs: docs/reliability.md "Calibration" (bench/calibrate_verifier.py).
    # The logit margins are policy.boundary.DEFAULT_LOGIT_MARGIN (kept equal by a test).
    return {
        "*/float32": Tolerance(
            metric="max_abs", threshold=1e-3, logit_margin=1e-3, replay_slack=1e-3
        ),
        "*/bfloat16": Tolerance(
            metric="median_rel",
            threshold=0.10,
            tail_delta=1.0,
            tail_fraction=0.02,
            logit_margin=0.25,
            replay_slack=2e-2,
            replay_miss_share=0.02,
        ),
        "*/float16": Tolerance(
            metric="median_rel",
            threshold=0.10,
            tail_delta=1.0,
            tail_fraction=0.02,
            logit_margin=0.05,
            replay_slack=1e-2,
            replay_miss_share=0.02,
        ),
    }


class SamplingSection(_Section):
    """Sampling parameters every lease carries (the whole swarm samples alike)."""

    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off)")
    top_k: int = Field(default=0, ge=0, description="Top-k cut-off (0 = off)")
    max_new_tokens: int = Field(default=8, ge=1, description="Completion length cap in tokens")
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids that end a sample besides the model's EOS ids (the tokenizer's, "
        "config.json's and generation_config.json's); every lease carries the whole stop set",
    )


class PromptSection(_Section):
    """How a task's question becomes prompt tokens (policy/prompts.py)."""

    template: Literal["auto", "chat", "plain"] = Field(
        default="auto",
        description='"chat": the tokenizer\'s chat template; "plain": the text as is (base '
        'models, the embedded model); "auto": chat when the tokenizer has a chat template',
    )
    system_prompt: str | None = Field(
        default=None,
        description="System message of the chat template (unset: the template's own default)",
    )


class LeaseSection(_Section):
    """Lease sizing and deadlines (DESIGN.md §6)."""

    min_deadline_s: float = Field(
        default=30.0, gt=0, description="Shortest lease deadline in seconds"
    )
    max_deadline_s: float = Field(
        default=1800.0,
        gt=0,
        description="Longest lease deadline: a node advertising a tiny throughput cannot hold "
        "its prompts for longer (min_deadline_s wins if larger)",
    )
    deadline_slack: float = Field(
        default=3.0,
        ge=1,
        description="k in deadline = now + max(min_s, k · expected tokens / tokens_per_s)",
    )
    target_lease_s: float = Field(
        default=10.0,
        gt=0,
        description="Lease size aims at this much generation time on the node (seconds)",
    )
    max_prompts_per_lease: int = Field(
        default=64, ge=1, description="Upper bound on prompts in one lease"
    )
    max_active_per_node: int = Field(
        default=4,
        ge=1,
        description="Active leases one node may hold; beyond it the node is told to stand by",
    )
    max_backlog_steps: float | None = Field(
        default=None,
        gt=0,
        description="Once a learner has reported, a node is stood by while the rollouts the "
        "learner will train ahead of a new lease's (accepted, then in flight) leave no room for "
        "its rollouts to be trained: (S + 1 − lag) · B of them, lag the versions the learner is "
        "ahead of the newest published; this many steps (× B) caps it further. Unset: no cap",
    )
    default_tokens_per_s: float = Field(
        default=50.0, gt=0, description="Assumed throughput (tokens/s) of a node not yet measured"
    )
    throughput_ewma: float = Field(
        default=0.3,
        gt=0,
        le=1,
        description="Weight of a new throughput measurement in the running mean",
    )


class IntakeSection(_Section):
    """Verification of submitted rollouts (DESIGN.md §7)."""

    spot_check_fraction: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Floor of the adaptive check rate: share of leases re-scored for a node with "
        "a long clean history (0 with new_node_check_rate 0 = spot checks off)",
    )
    new_node_check_rate: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of leases re-scored for a node without clean history (new, "
        "re-registered, struck, or released from suspicion); falls as rate / (1 + h / P) with its "
        "clean leases h, P = 1 / target_forged_share, down to "
        "spot_check_fraction (coordinator/trust.py)",
    )
    target_forged_share: float = Field(
        default=0.01,
        gt=0,
        lt=1,
        description="Bound on the expected share of forged leases among a cheater's accepted "
        "ones, whenever it starts forging; sets how slowly the check rate falls",
    )
    vouched_nodes: list[str] = Field(
        default_factory=list,
        description="Fingerprints (ed25519:...) of nodes the operator vouches for (its own or a "
        "partner's machines): they skip probation, starting at the spot_check_fraction floor "
        "and outside the verification budget's admission, until a strike or flag (coordinator/"
        "trust.py vouched_state)",
    )
    ban_multiple: float = Field(
        default=10.0,
        gt=1,
        description="A failed check whose figure is at least this multiple of its limit (far "
        "beyond any honest error) bans the node at once, for reputation.ban_max_s",
    )
    tolerances: dict[str, Tolerance] = Field(
        default_factory=_default_tolerances,
        description='Per "backend/dtype" tolerance ("*" matches any backend); backend and dtype '
        "are the node's registration's, never a submission's",
    )
    calibrate: bool = Field(
        default=True,
        description="Derive each version's tolerance from the coordinator's own measurement of "
        "honest error across accepted_dtypes (coordinator/calibration.py), for every node alike; "
        "false: the fixed per-dtype tolerances table, chosen by the node's registration",
    )
    accepted_dtypes: list[Literal["float32", "bfloat16", "float16"]] = Field(
        default_factory=lambda: ["float32", "bfloat16", "float16"],  # type: ignore[arg-type]
        description="Precisions an honest node may compute in: the calibration measures every "
        "one of them against the verifier's fp32 forward",
    )
    calibration_samples: int = Field(
        default=256,
        ge=8,
        description="Honest samples the coordinator draws per precision and path to calibrate a "
        "version (on its first check)",
    )
    calibration_every: int = Field(
        default=16,
        ge=1,
        description="Re-measure the honest error every this many versions; a version in between "
        "is held to the newest measurement at or below it (a measurement costs about as much as "
        "generating calibration_samples rollouts per precision; 1: every version)",
    )
    calibration_margin: float = Field(
        default=2.0,
        ge=1.0,
        description="The calibrated tolerance is this multiple of the largest honest error "
        "measured (log-prob, logit and CDF)",
    )
    calibration_local: bool = Field(
        default=True,
        description="Widen each replayed CDF bound by the local spread of the verifier's own fp32 "
        "and bf16 forwards (a second forward per check; coordinator/calibration.py); false: one "
        "global slack, which admits more tokens per position but is cheaper on a verifier "
        "without fast bf16 (a CPU)",
    )
    sampling_z_max: float = Field(
        default=6.0,
        gt=0,
        description="Refuse spot-checked samples whose summed log-prob lies more than this many "
        "standard deviations from what sampling at the lease's temperature gives (greedy or "
        "low-temperature decoding, another sampler)",
    )
    suspect_full_check: bool = Field(
        default=True,
        description="Check every lease (every sample) of a suspect: a node struck or flagged "
        "that has not since passed suspect_release_checks full checks in a row",
    )
    suspect_release_checks: int = Field(
        default=16,
        ge=1,
        description="Consecutive passed full checks after which a struck or flagged node is no "
        "longer a suspect (its rate then decays from new_node_check_rate)",
    )
    registration_change_interval_s: float = Field(
        default=600.0,
        ge=0,
        description="A node may change its registered backend or dtype at most this often "
        "(seconds); a sooner change is refused (registration_mismatch, no strike)",
    )


class RewardAuditSection(_Section):
    """Reward audits: a keyed-random share of prompts is re-issued to another node and each
    node's rewards are compared with others' on the same prompts (coordinator/audits.py)."""

    fraction: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Share of accepted prompts re-issued to another node (0 = audits off); the "
        "copies train like any group, so the cost is duplicated prompts, not wasted work",
    )
    min_pairs: int = Field(
        default=16,
        ge=2,
        description="Audited prompt pairs (with different mean rewards) of a node before its "
        "first test; later tests at 2x, 4x, ... as many",
    )
    alpha: float = Field(
        default=1e-3,
        gt=0,
        lt=1,
        description="False-positive rate of the flag over a node's whole life (sign test, "
        "alpha spent as alpha/2, alpha/4, ... over the tests)",
    )
    max_version_gap: int = Field(
        default=1,
        ge=0,
        description="Only pairs sampled at policy versions at most this far apart are compared "
        "(learning between versions raises the later group's rewards)",
    )


class ReceiptsSection(_Section):
    """The hash-chained verdict log (coordinator/receipts.py, ``swarm audit``)."""

    seal_every: int = Field(
        default=64, ge=1, description="Sign the chain after at most this many new entries"
    )
    seal_interval_s: float = Field(
        default=30.0, gt=0, description="Sign new entries at least this often (seconds)"
    )


class ReputationSection(_Section):
    """Strikes and bans (DESIGN.md §7)."""

    strikes_to_ban: int = Field(default=3, ge=1, description="Strikes that trigger a ban")
    ban_base_s: float = Field(default=60.0, gt=0, description="First ban length in seconds")
    ban_max_s: float = Field(
        default=86400.0, gt=0, description="Longest ban in seconds (back-off cap)"
    )


class CapacitySection(_Section):
    """Capacity model and cost-aware activation (DESIGN.md §9)."""

    batch_rollouts: int = Field(
        default=256, ge=1, description="B: rollouts consumed per learner step"
    )
    t_train_s: float = Field(default=1.0, gt=0, description="T_train: seconds per learner step")
    t_bcast_s: float = Field(
        default=0.0, ge=0, description="T_bcast: checkpoint dissemination time estimate (seconds)"
    )
    headroom: float = Field(
        default=0.2, ge=0, description="Extra capacity above the rule (0.2 = +20%)"
    )
    activation: bool = Field(
        default=True, description="Put nodes beyond the cheapest sufficient set on standby"
    )
    replan_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="Re-plan the active set at most this often on the upkeep tick (seconds; a "
        "re-plan reads the nodes whose rows changed); a returning or re-priced node re-plans at "
        "once",
    )


class VerificationBudgetSection(_Section):
    """Verification as a budgeted resource (docs/capacity.md, "Verification as a resource of
    the plan"): the verifiers' measured throughput V against the demand D of the nodes' check
    rates, new identities admitted at the rate the spare budget absorbs, and leases whose
    submission waits for its check kept from expiring."""

    admission: bool = Field(
        default=True,
        description="Admit new node identities only while the spare verification budget "
        "(1 − headroom)·V − D absorbs their probation; beyond it a registration is refused "
        "swarm_full with retry_after_s, oldest first (admitted nodes are never evicted for it)",
    )
    headroom: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="h in the rule D <= (1 − h)·V: share of the verifiers' throughput kept free",
    )
    assumed_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="V before any re-score was measured (re-scored tokens/s of all verifiers); "
        "unset: no admission limit until the first re-scores are measured",
    )
    window_s: float = Field(
        default=60.0,
        gt=0,
        description="Verifiers that answered within this many seconds count in V (when none "
        "did, the last one that answered)",
    )
    throughput_ewma: float = Field(
        default=0.3,
        gt=0,
        le=1,
        description="Weight of a new re-score in a verifier's running mean of tokens/s",
    )
    admission_burst: int = Field(
        default=8,
        ge=1,
        description="New identities the probation bucket holds at most (admitted at once when "
        "the budget has been spare for a while)",
    )
    admission_min_nodes: int = Field(
        default=32,
        ge=0,
        description="The budget limits admission only once this many nodes are registered: "
        "a smaller swarm, whose verifier is usually the coordinator itself, admits every "
        "newcomer (its probation still counts in D)",
    )
    admission_retry_s: float = Field(
        default=30.0,
        gt=0,
        description="retry_after_s of a registration refused while the budget has no room "
        "(seconds); a refused identity keeps its place in the queue this long past the time "
        "it was told",
    )
    hold_verifying_leases: bool = Field(
        default=True,
        description="A lease whose submission arrived before its deadline does not expire "
        "while that submission waits for verification (a node that stops answering still "
        "loses its lease at the deadline)",
    )
    verifier_keys: list[str] = Field(
        default_factory=list,
        description="Fingerprints (ed25519:...) of the verifier processes allowed to take "
        "re-score jobs (`swarm coordinator verifier`, run by the operator on its own GPUs); "
        "each is one more verifier in V",
    )
    local_verifier: bool = Field(
        default=True,
        description="The coordinator re-scores in its own process too, one job at a time; "
        "false: only the verifier processes do (at least one key in verifier_keys)",
    )
    job_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A re-score job a verifier process took and has not answered within this "
        "(seconds) is given to the next verifier that asks",
    )
    job_attempts: int = Field(
        default=3,
        ge=1,
        description="Times one re-score job is given out before its check fails (the lease "
        "is re-scored again later, its rows held meanwhile)",
    )


class NetworkSection(_Section):
    """Where the coordinator listens and whom it trusts (used by ``coordinator.service``)."""

    host: str = Field(default="127.0.0.1", description="libp2p listen host (0.0.0.0 = public)")
    port: int = Field(default=0, ge=0, le=65535, description="libp2p listen TCP port (0 = any)")
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Public multiaddrs to announce (port forwarding, NAT)"
    )
    http_host: str = Field(default="127.0.0.1", description="Host of /status and /metrics")
    http_port: int = Field(
        default=0, ge=0, le=65535, description="Port of /status and /metrics (0 = any free port)"
    )
    trainer_key: str | None = Field(
        default=None,
        description="Fingerprint (ed25519:...) of the trainer allowed to publish and fetch",
    )
    upload_rate_mb_s: float | None = Field(
        default=None, gt=0, description="Cap on this peer's checkpoint upload rate (MB/s)"
    )
    direct_port: int = Field(
        default=0,
        ge=-1,
        le=65535,
        description="TCP port for direct chunk connections, which carry checkpoint chunks off "
        "the libp2p daemon, for less CPU (docs/swarm.md, Direct connections); 0 = any "
        "free port, -1 = off (chunks only over libp2p)",
    )
    request_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="An incoming request must arrive within this (seconds); each 64 KiB of the "
        "answer must be taken within it too, and the whole answer at 32 KiB/s on average",
    )


class CoordinatorConfig(_Section):
    """Everything the coordinator core needs; the network service adds its own section later."""

    db_path: Path = Field(
        default=Path("coordinator-data/state.sqlite"), description="SQLite state file (WAL mode)"
    )
    task: str = Field(
        default="reverse3",
        description='Task: "reverse3", "reverseN", "arith" (arithmetic word problems) or '
        '"jsonl:PATH"',
    )
    task_seed: int = Field(default=0, ge=0, description="Seed of the prompt order")
    format_reward: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Math tasks: share of the reward paid for a well-formed answer (a \\boxed{} "
        "or #### answer in a finished completion); the rest pays for a correct one",
    )
    model_path: str | None = Field(
        default=None, description="Local HF model directory; unset = embedded tiny default"
    )
    group_size: int = Field(default=8, ge=1, description="G: samples per prompt (one GRPO group)")
    staleness_bound: int = Field(
        default=4, ge=1, description="S: oldest usable version is current − S"
    )
    publish_every: int | None = Field(
        default=None,
        ge=1,
        description="κ: learner steps between published versions (default S − 1)",
    )
    heartbeat_interval_s: float = Field(
        default=10.0,
        gt=0,
        le=86400,
        description="Nodes send a heartbeat this often (seconds): the shortest interval, handed "
        "out while the swarm is under heartbeat_rate_max × this many live nodes",
    )
    heartbeat_misses: int = Field(
        default=3, ge=1, description="A node missing this many heartbeats counts as gone"
    )
    heartbeat_rate_max: float = Field(
        default=250.0,
        ge=0,
        description="Heartbeats per second asked of the whole swarm at most: past "
        "heartbeat_rate_max × heartbeat_interval_s live nodes the interval handed out grows "
        "with the swarm (quarter-octave steps; coordinator/liveness.py); 0: never (every node "
        "beats every heartbeat_interval_s)",
    )
    max_nodes: int = Field(
        default=10_000,
        ge=1,
        description="Node identities remembered at most; when full, the longest-gone node with "
        "no active lease and no ban is forgotten, else a new registration is refused",
    )
    rollout_retention_s: float = Field(
        default=RETENTION_S,
        ge=0,
        description="Audit window: an accepted rollout the learner has consumed is deleted from "
        "the database this many seconds after its acceptance (its receipt stays; "
        "coordinator/retention.py)",
    )
    sampling: SamplingSection = Field(
        default_factory=lambda: SamplingSection(), description="Sampling"
    )
    prompt: PromptSection = Field(
        default_factory=lambda: PromptSection(), description="Prompt rendering"
    )
    leases: LeaseSection = Field(default_factory=lambda: LeaseSection(), description="Leases")
    intake: IntakeSection = Field(
        default_factory=lambda: IntakeSection(), description="Verification"
    )
    reputation: ReputationSection = Field(
        default_factory=lambda: ReputationSection(), description="Strikes and bans"
    )
    reward_audit: RewardAuditSection = Field(
        default_factory=lambda: RewardAuditSection(), description="Reward audits"
    )
    receipts: ReceiptsSection = Field(
        default_factory=lambda: ReceiptsSection(), description="Verdict log"
    )
    capacity: CapacitySection = Field(
        default_factory=lambda: CapacitySection(), description="Capacity model"
    )
    network: NetworkSection = Field(
        default_factory=lambda: NetworkSection(), description="Network and trust"
    )
    verification: VerificationBudgetSection = Field(
        default_factory=lambda: VerificationBudgetSection(), description="Verification budget"
    )

    @property
    def kappa(self) -> int:
        """κ, with its default S − 1 (at least 1)."""
        if self.publish_every is not None:
            return self.publish_every
        return max(1, self.staleness_bound - 1)

    @model_validator(mode="after")
    def _cross_field(self) -> CoordinatorConfig:
        s = self.staleness_bound
        if self.publish_every is not None and self.publish_every > max(1, s - 1):
            raise ValueError(
                f"publish_every={self.publish_every} must be <= staleness_bound − 1 = {s - 1}: "
                "results generated on a version must still be usable when the next one lands"
            )
        if self.reputation.ban_max_s < self.reputation.ban_base_s:
            raise ValueError("reputation.ban_max_s must be >= reputation.ban_base_s")
        if self.leases.min_deadline_s < self.heartbeat_interval_s:
            raise ValueError(
                f"leases.min_deadline_s={self.leases.min_deadline_s} must be >= "
                f"heartbeat_interval_s={self.heartbeat_interval_s}"
            )
        worst = worst_case_submission_bytes(1, self.group_size, self.sampling.max_new_tokens)
        if worst > DEFAULT_LIMITS.bulk_frame:
            raise ValueError(
                f"sampling.max_new_tokens={self.sampling.max_new_tokens} with group_size="
                f"{self.group_size}: the results of one prompt can reach {worst / 2**20:.0f} MiB, "
                f"more than one {DEFAULT_LIMITS.bulk_frame // 2**20} MiB submission; lower either"
            )
        for i, text in enumerate(self.intake.vouched_nodes):
            try:
                parse_fingerprint(text)
            except ValueError as exc:
                raise ValueError(f"intake.vouched_nodes[{i}]: {exc}") from None
        for i, text in enumerate(self.verification.verifier_keys):
            try:
                parse_fingerprint(text)
            except ValueError as exc:
                raise ValueError(f"verification.verifier_keys[{i}]: {exc}") from None
        if not self.verification.local_verifier and not self.verification.verifier_keys:
            raise ValueError(
                "verification.local_verifier = false needs verification.verifier_keys: "
                "otherwise nothing re-scores the spot checks"
            )
        for key in self.intake.tolerances:
            if key.count("/") != 1:
                raise ValueError(f'intake.tolerances key {key!r} must look like "backend/dtype"')
        return self


def load_config(path: str | Path) -> CoordinatorConfig:
    """Read and validate a coordinator TOML file; raises :class:`ConfigError` naming the field."""
    from swarm.configfile import ConfigFileError, read_toml

    try:
        data = read_toml(path, example="coordinator/coordinator.example.toml")
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from exc
    return parse_config(data, source=str(path))


def parse_config(data: dict[str, object], *, source: str = "<config>") -> CoordinatorConfig:
    """Validate a mapping (e.g. parsed TOML merged with CLI overrides)."""
    try:
        return CoordinatorConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        msg = first["msg"].removeprefix("Value error, ")
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{source}: {where}: {msg}{more}") from exc
