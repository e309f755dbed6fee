"""The scenario of a simulation run: typed, loaded from TOML, overridable from the command line.

Every field is documented (the text becomes the reference in docs/simulation.md); unknown keys are
an error (``extra="forbid"``), and a bad value fails at load with the field named, in one line
(:class:`ScenarioError`). Shipped scenarios live in ``coordinator/sim/scenarios/``.

Sweeps: ``[sweep]`` maps a dotted field name (``"learner.staleness_bound"``) to a list of values.
Each value is run alone against the base scenario (one axis at a time, policy ``cost_aware``), so
a sweep over S and one over churn cost ``len(S) + len(churn)`` runs, not their product.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

#: Provisioning policies compared by the simulation (docs/simulation.md explains each one).
Policy = Literal["cost_aware", "all_nodes", "fastest_first", "premium_only", "premium_colocated"]
POLICIES: tuple[Policy, ...] = (
    "cost_aware", "all_nodes", "fastest_first", "premium_only", "premium_colocated",
)  # fmt: skip
#: Policies whose workers are the learner's operator's own (a co-located cluster): trusted, so
#: nothing is re-scored, no identity is on probation and no verifier is billed.
TRUSTED: frozenset[str] = frozenset({"premium_colocated"})


class ScenarioError(ValueError):
    """A scenario file or override is unusable; the message names the file and the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """The policy model the swarm samples from (sizes its checkpoints and generation time)."""

    params_b: float = Field(default=4.0, gt=0, description="Parameters, billions")
    bytes_per_param: float = Field(default=2.0, gt=0, description="Bytes per weight (bf16: 2)")
    version_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Share of the full checkpoint's bytes one new version ships (1 = full "
        "checkpoints; e.g. 0.02 = sparse deltas). A node without any version first fetches "
        "the full checkpoint",
    )
    preloaded: bool = Field(
        default=True,
        description="Nodes of the initial pool hold version 0 (the public base model, fetched "
        "from a model hub beforehand); nodes joining later fetch a full checkpoint first",
    )
    load_s: float = Field(
        default=8.0, ge=0, description="Seconds to swap a downloaded version into the engine"
    )
    prompt_tokens: int = Field(default=256, ge=1, description="Prompt length (tokens)")
    completion_tokens_mean: float = Field(
        default=2048.0, gt=0, description="Mean completion length (tokens, lognormal)"
    )
    completion_tokens_sigma: float = Field(
        default=0.5, ge=0, description="σ of log completion length (lognormal spread)"
    )
    completion_tokens_max: int = Field(
        default=8192, ge=1, description="Completion length cap (the lease's max_new_tokens)"
    )

    @property
    def checkpoint_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param


class LearnerSection(_Section):
    """The learner (trainer) the swarm feeds."""

    batch_rollouts: int = Field(default=512, ge=1, description="B: rollouts per learner step")
    group_size: int = Field(default=8, ge=1, description="G: samples per prompt")
    step_s: float = Field(default=16.0, gt=0, description="T_train: seconds per learner step")
    step_noise: float = Field(
        default=0.05, ge=0, description="σ of log step time (lognormal jitter per step)"
    )
    staleness_bound: int = Field(default=4, ge=1, description="S: admissible staleness")
    publish_every: int | None = Field(
        default=None, ge=1, description="κ: steps per published version (default S − 1, ≥ 1)"
    )
    publish_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds from a learner step to the version being seedable (serialise, "
        "hash, sign); the learner does not wait for it",
    )
    price_per_hour: float = Field(
        default=20.0, ge=0, description="Price of the learner's GPUs per hour (USD)"
    )

    @property
    def kappa(self) -> int:
        if self.publish_every is not None:
            return self.publish_every
        return max(1, self.staleness_bound - 1)


class LinkSection(_Section):
    """WAN figures of one class of machine: lognormal draws given by median and σ of the log."""

    rtt_ms_median: float = Field(gt=0, description="Round-trip time to the coordinator, median")
    rtt_sigma: float = Field(ge=0, description="σ of log RTT")
    down_mbit_median: float = Field(gt=0, description="Downlink, Mbit/s, median")
    up_mbit_median: float = Field(gt=0, description="Uplink, Mbit/s, median")
    bw_sigma: float = Field(ge=0, description="σ of log bandwidth (down and up)")


class NetworkSection(_Section):
    """Wide-area network model (docs/simulation.md states the distributions)."""

    consumer: LinkSection = Field(
        default_factory=lambda: LinkSection(
            rtt_ms_median=60, rtt_sigma=0.5, down_mbit_median=200, up_mbit_median=40, bw_sigma=0.7
        ),
        description="Home and community-cloud machines",
    )
    datacenter: LinkSection = Field(
        default_factory=lambda: LinkSection(
            rtt_ms_median=25,
            rtt_sigma=0.4,
            down_mbit_median=2000,
            up_mbit_median=2000,
            bw_sigma=0.3,
        ),
        description="Cloud machines",
    )
    coordinator_mbit: float = Field(
        default=2000.0, gt=0, description="Coordinator and learner links, Mbit/s, both ways"
    )
    sources: int = Field(
        default=4,
        ge=1,
        description="Peers a node downloads a version from in parallel (rarest-first relay)",
    )


class ChurnSection(_Section):
    """Nodes joining and leaving besides the catalogue's hardware failures."""

    per_hour: float = Field(
        default=0.1,
        ge=0,
        le=5,
        description="Disruptions (leave, crash or stall) per node per hour, besides hardware "
        "failures; a node that leaves or crashes is replaced by a new one of the same kind",
    )
    rejoin_s_mean: float = Field(
        default=120.0, ge=0, description="Mean delay before a replacement node joins (s)"
    )
    leave: float = Field(default=0.5, ge=0, description="Share of departures that are graceful")
    crash: float = Field(default=0.3, ge=0, description="Share that crash (lease left to expire)")
    stall: float = Field(
        default=0.2, ge=0, description="Share that stall and come back (late results)"
    )
    stall_s_median: float = Field(default=240.0, gt=0, description="Stall length, median (s)")
    stall_sigma: float = Field(default=1.0, ge=0, description="σ of log stall length")
    ramp_s: float = Field(
        default=60.0, ge=0, description="The initial pool joins uniformly over this many seconds"
    )


class ByzantineSection(_Section):
    """Nodes that cheat; their submissions fail verification when it looks."""

    fraction: float = Field(default=0.0, ge=0, le=1, description="Share of nodes that cheat")
    garbage: float = Field(
        default=0.5,
        ge=0,
        description="Share of cheaters sending tokens outside the vocabulary (every check sees it)",
    )
    forger: float = Field(
        default=0.5,
        ge=0,
        description="Share of cheaters forging behaviour log-probs (only a log-prob spot check "
        "sees it)",
    )


class VerificationSection(_Section):
    """Cost of the coordinator's intake, charged as simulated time."""

    workers: int = Field(
        default=1, ge=1, description="Intake verifiers working in parallel (queue in front)"
    )
    verifier_tflops: float = Field(
        default=50.0,
        gt=0,
        description="Effective TFLOP/s of the GPU that re-scores spot-checked samples "
        "(e.g. an L4 at ~40% of its bf16 peak)",
    )
    price_per_hour: float = Field(
        default=0.5,
        ge=0,
        description="USD per hour of each verifier (the catalogue's L4), billed for the whole "
        "window like the learner (not for a trusted co-located cluster)",
    )


class Scenario(_Section):
    """One simulated swarm."""

    name: str = Field(default="scenario", description="Title in the report")
    nodes: int = Field(default=100, ge=1, le=200_000, description="Nodes in the pool at start")
    hours: float = Field(default=1.0, gt=0, description="Simulated duration (hours)")
    warmup_minutes: float = Field(
        default=10.0, ge=0, description="Excluded from rates, idle and cost (minutes)"
    )
    seed: int = Field(default=1, ge=0, description="Seed of every random draw")
    mix: dict[str, float] = Field(
        default_factory=lambda: {
            "rtx3060": 0.25,
            "rtx3090": 0.25,
            "rtx4090": 0.2,
            "l4": 0.1,
            "a10": 0.05,
            "a100": 0.1,
            "h100": 0.05,
        },
        description="Share of the pool per GPU kind (keys of coordinator/sim/gpus.toml)",
    )
    volunteer_fraction: float = Field(
        default=0.0, ge=0, le=1, description="Share of consumer nodes that ask no price"
    )
    throughput_sigma: float = Field(
        default=0.2, ge=0, description="σ of log per-node throughput around the catalogue"
    )
    lease_sigma: float = Field(
        default=0.1, ge=0, description="σ of log per-lease generation time around the node's"
    )
    policies: list[Policy] = Field(
        default_factory=lambda: list(POLICIES), description="Provisioning policies to compare"
    )
    policy_hours: dict[str, float] = Field(
        default_factory=dict,
        description="Shorter simulated duration for some policies (e.g. all_nodes at 10,000 "
        "nodes floods the intake)",
    )
    store: Literal["memory", "file"] = Field(
        default="memory", description="Coordinator SQLite: in memory, or a temp file (WAL, FULL)"
    )
    model: ModelSection = Field(default_factory=lambda: ModelSection(), description="Model")
    learner: LearnerSection = Field(default_factory=lambda: LearnerSection(), description="Learner")
    network: NetworkSection = Field(default_factory=lambda: NetworkSection(), description="Network")
    churn: ChurnSection = Field(default_factory=lambda: ChurnSection(), description="Churn")
    byzantine: ByzantineSection = Field(
        default_factory=lambda: ByzantineSection(), description="Cheaters"
    )
    verification: VerificationSection = Field(
        default_factory=lambda: VerificationSection(), description="Intake cost"
    )
    coordinator: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides of the coordinator config (coordinator.example.toml keys)",
    )
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict,
        description='One-at-a-time sweeps: dotted field → values, e.g. "churn.per_hour" = [0, 0.3]',
    )

    @field_validator("coordinator")
    @classmethod
    def _coordinator_overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_coordinator_overrides(value)
        return value

    @model_validator(mode="after")
    def _cross(self) -> Scenario:
        if self.warmup_minutes >= self.hours * 60:
            raise ValueError(
                f"warmup_minutes={self.warmup_minutes} must be shorter than hours={self.hours}"
            )
        if not self.mix or any(v < 0 for v in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError("mix must give each GPU kind a share >= 0, at least one > 0")
        for key in self.sweep:
            if key.startswith("sweep") or not _has_path(self, key):
                raise ValueError(f"sweep key {key!r} is not a scenario field")
        for key in self.policy_hours:
            if key not in POLICIES:
                raise ValueError(f"policy_hours key {key!r}: use one of {', '.join(POLICIES)}")
        return self

    def with_values(self, values: dict[str, Any]) -> Scenario:
        """A copy with dotted fields replaced (``{"learner.staleness_bound": 6}``)."""
        data = self.model_dump()
        for key, value in values.items():
            _set_path(data, key, value)
        return parse_scenario(data, source="override")


def _check_coordinator_overrides(overrides: dict[str, Any]) -> None:
    """Unknown keys and bad values of ``[coordinator]`` fail at load, not when a run starts."""
    from coordinator.config import parse_config
    from coordinator.errors import ConfigError

    data: dict[str, Any] = {"db_path": ":memory:"}
    for key, value in overrides.items():
        data[key] = copy.deepcopy(value)
    try:
        parse_config(data, source="coordinator")
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("coordinator: ")) from None


def _has_path(obj: BaseModel, dotted: str) -> bool:
    cur: Any = obj
    for part in dotted.split("."):
        if isinstance(cur, BaseModel) and part in type(cur).model_fields:
            cur = getattr(cur, part)
        else:  # free-form tables: any key below them
            return isinstance(cur, dict) and dotted.split(".")[0] in ("coordinator", "mix")
    return True


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for part in parts[:-1]:
        nxt = cur.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ScenarioError(f"{dotted}: {part} is not a section")
        cur = nxt
    cur[parts[-1]] = copy.deepcopy(value)


def parse_scenario(data: dict[str, Any], *, source: str = "<scenario>") -> Scenario:
    """Validate a mapping; raises :class:`ScenarioError` naming the first bad field."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        msg = first["msg"].removeprefix("Value error, ")
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ScenarioError(f"{source}: {where}: {msg}{more}") from exc


def shipped(name: str) -> Path:
    """Path of a shipped scenario (``nodes100``, ``nodes1000``, ``nodes10000``, ...)."""
    return Path(__file__).parent / "scenarios" / f"{name}.toml"


def load_scenario(path_or_name: str | Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read a scenario TOML (a path, or the name of a shipped one) and apply dotted overrides."""
    from swarm.configfile import ConfigFileError, read_toml

    path = Path(path_or_name)
    if not path.suffix and not path.exists():
        path = shipped(str(path_or_name))
    try:
        data = read_toml(path, example="coordinator/sim/scenarios/nodes100.toml")
    except ConfigFileError as exc:
        raise ScenarioError(str(exc)) from exc
    for key, value in (overrides or {}).items():
        _set_path(data, key, value)
    return parse_scenario(data, source=str(path))
