"""Typed contributor-node configuration: TOML file, then CLI overrides, then validation.

``NodeConfig`` imports neither torch nor hivemind, so ``swarm node run --help`` and config errors
answer instantly. Unknown keys are rejected (``extra="forbid"``); every field has a description
(the checked-in ``node/node.example.toml`` documents each one and is loaded by a test);
cross-field rules fail at load with the field named. :func:`load_node_config` raises
:class:`ConfigError` with one line: ``<source>: <field>: <what is wrong>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.identity import parse_fingerprint
from swarm.configfile import ConfigFileError, read_toml

#: the default and largest ``drain_s``: a coordinator that is frozen rather than gone would hold a
#: submission for its 60 s timeout, and the node's stop bound (15 s, docs/operations.md) counts on
#: at most this much
DRAIN_S = 8.0

__all__ = ["MISBEHAVIOURS", "ConfigError", "NodeConfig", "load_node_config", "parse_node_config"]

Misbehaviour = Literal["forge_logprobs", "inflate_reward", "wrong_version", "oov_tokens", "greedy"]
MISBEHAVIOURS: tuple[str, ...] = (
    "forge_logprobs",
    "inflate_reward",
    "wrong_version",
    "oov_tokens",
    "greedy",
)


class ConfigError(ValueError):
    """The node configuration is invalid; the one-line message names the field and the fix."""


class NodeConfig(BaseModel):
    """Everything ``swarm node run`` needs (see node/node.example.toml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- where the swarm is ----------------------------------------------------------------------
    coordinator: str | None = Field(
        default=None,
        description="Coordinator multiaddr, ending in /p2p/<peer id> (printed by `swarm "
        "coordinator launch`)",
    )
    coordinator_key: str | None = Field(
        default=None,
        description="Pinned coordinator key fingerprint (ed25519:...); manifests signed by any "
        "other key are refused",
    )
    initial_peers: list[str] = Field(
        default_factory=list,
        description="Extra DHT bootstrap multiaddrs besides the coordinator",
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="libp2p listen multiaddrs (tcp/0 = any free port)",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Public multiaddrs to announce (port forwarding)"
    )
    client_mode: bool = Field(
        default=False, description="Dial out only (behind NAT): serve no DHT requests"
    )
    use_relay: bool = Field(
        default=True, description="Reach peers behind NAT through libp2p circuit relays"
    )
    use_auto_relay: bool = Field(
        default=False, description="Behind NAT: find relays and become reachable through them"
    )
    direct_port: int = Field(
        default=0,
        ge=-1,
        le=65535,
        description="TCP port for direct chunk connections, which carry checkpoint chunks off "
        "the libp2p daemon, for less CPU (docs/swarm.md, Direct connections); 0 = any "
        "free port, -1 = off (chunks only over libp2p)",
    )
    # --- inference -------------------------------------------------------------------------------
    backend: Literal["auto", "hf", "vllm", "fake"] = Field(
        default="auto", description="Inference backend: auto, hf, vllm (fake: tests only)"
    )
    model_path: str | None = Field(
        default=None,
        description="Local HF model directory; unset = the embedded tiny default",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Compute dtype of the policy weights"
    )
    device: str = Field(default="auto", description='"auto", "cpu", "cuda" or "cuda:N"')
    vllm_max_lora_rank: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="vllm backend: start the engine for LoRA versions up to this adapter rank "
        "(vLLM reserves their memory at start); unset = LoRA versions are refused on vllm",
    )
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op CPU threads")
    probe_budget_s: float = Field(
        default=1.5, gt=0, description="Seconds of the start-up throughput benchmark"
    )
    probe_refresh: bool = Field(
        default=False, description="Re-run the benchmark even when a cached result exists"
    )
    # --- market ----------------------------------------------------------------------------------
    price_per_hour: float | None = Field(
        default=None, ge=0, description="Asking price in USD per hour; unset = free"
    )
    # --- storage ---------------------------------------------------------------------------------
    state_dir: Path = Field(
        default=Path("node-data"),
        description="Node key, probe cache, checkpoint chunks and the accepted-version record",
    )
    keep_versions: int = Field(
        default=5, ge=1, description="Checkpoint versions kept on disk (S + 1)"
    )
    min_free_disk_mb: int = Field(
        default=256,
        ge=0,
        description="Free space kept in state_dir (MiB): refuse to start, or to download a "
        "checkpoint version, that would leave less",
    )
    # --- work loop -------------------------------------------------------------------------------
    max_prompts: int = Field(default=64, ge=1, le=1024, description="Most prompts per lease asked")
    heartbeat_interval_s: float | None = Field(
        default=None, gt=0, description="Heartbeat period; unset = the coordinator's"
    )
    advert_period_s: float = Field(
        default=30.0, gt=0, description="Capability advert re-announced this often (seconds)"
    )
    reachability_interval_s: float = Field(
        default=600.0,
        gt=0,
        description="Re-measure whether other peers can dial this node (a dial-back by the "
        "coordinator) this often (seconds)",
    )
    status_interval_s: float = Field(
        default=10.0, gt=0, description="One-line status log this often (seconds)"
    )
    register_timeout_s: float = Field(
        default=15.0, gt=0, description="Start-up: the coordinator must answer within this"
    )
    backoff_initial_s: float = Field(
        default=0.5, gt=0, description="First retry delay after a coordinator/network error"
    )
    backoff_max_s: float = Field(
        default=30.0, gt=0, description="Longest retry delay (exponential back-off with jitter)"
    )
    max_identical_failures: int = Field(
        default=3,
        ge=1,
        description="Stop taking leases after this many identical generation failures in a row "
        "(a deterministic failure: the node says why in its status and to the coordinator)",
    )
    download_timeout_s: float = Field(
        default=600.0, gt=0, description="A checkpoint download is abandoned after this"
    )
    startup_timeout_s: float = Field(
        default=30.0, gt=0, description="Seconds for the libp2p daemon and DHT to come up"
    )
    drain_s: float = Field(
        default=DRAIN_S,
        gt=0,
        le=DRAIN_S,
        description="After SIGINT/SIGTERM, seconds the lease in hand gets to be handed back "
        "(submitted or released); then it is left to its deadline. At most 8: the node's stop "
        "bound (15 s) counts on it",
    )
    status_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve this node's status page (read-only) on status_host:PORT; 0 = any "
        "free port (the URL is logged and written to <state_dir>/node.json); unset = no page",
    )
    status_host: str = Field(
        default="127.0.0.1",
        description="Address of the status page; keep 127.0.0.1 unless others should see it",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Logging level"
    )
    # --- testing only ----------------------------------------------------------------------------
    misbehave: list[Misbehaviour] = Field(
        default_factory=list,
        description="Byzantine modes for `swarm demo --byzantine` (never set on a real node)",
    )

    @field_validator("coordinator")
    @classmethod
    def _check_coordinator(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value.startswith("/") or "/p2p/" not in value:
            raise ValueError(
                f"{value!r} is not a coordinator multiaddr: expected /ip4/HOST/tcp/PORT/p2p/"
                "PEER_ID, as printed by `swarm coordinator launch`"
            )
        return value

    @field_validator("coordinator_key")
    @classmethod
    def _check_key(cls, value: str | None) -> str | None:
        return None if value is None else parse_fingerprint(value)

    @field_validator("misbehave")
    @classmethod
    def _no_duplicates(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("lists a mode twice")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> NodeConfig:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s={self.backoff_max_s} must be >= backoff_initial_s="
                f"{self.backoff_initial_s}"
            )
        if self.backend == "fake" and self.model_path is not None:
            raise ValueError("backend='fake' ignores model_path; unset model_path or pick hf/vllm")
        if self.vllm_max_lora_rank is not None and self.backend in ("hf", "fake"):
            raise ValueError(
                f"vllm_max_lora_rank: set for backend={self.backend!r}, where it does nothing; "
                "unset it or use backend 'vllm' (or 'auto')"
            )
        if self.device.startswith("cuda") and self.backend == "fake":
            raise ValueError("device: the fake backend runs no model; use device='auto' or 'cpu'")
        if self.dtype != "float32" and self.device == "cpu":
            raise ValueError(
                f"dtype={self.dtype!r} on device='cpu' is slow and inexact; use float32 on CPU"
            )
        return self

    @property
    def coordinator_peer_id(self) -> str | None:
        """The /p2p/ part of :attr:`coordinator`."""
        if self.coordinator is None:
            return None
        return self.coordinator.rsplit("/p2p/", 1)[1].split("/", 1)[0]


def parse_node_config(data: Mapping[str, Any], *, source: str = "<config>") -> NodeConfig:
    """Validate a mapping; raise :class:`ConfigError` naming the first bad field."""
    try:
        return NodeConfig.model_validate(dict(data))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown option; see node/node.example.toml for the valid ones"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{source}: {where}: {msg}{more}") from exc


def load_node_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> NodeConfig:
    """TOML file (optional) merged with CLI ``overrides`` (``None`` values are ignored)."""
    data: dict[str, Any] = {}
    source = "<command line>"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            data = read_toml(p, example="node/node.example.toml")
        except ConfigFileError as exc:
            raise ConfigError(str(exc)) from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return parse_node_config(data, source=source)
