"""What a node says about itself, and how it paces retries.

* :func:`make_advert`      -- the :class:`~protocol.messages.CapabilityAdvert` a node registers
                              with and announces (probe results, backend, price, loaded version,
                              expiry)
* :func:`software_version` -- the installed rollout-swarm version string of the advert
* :class:`NodeStats`       -- the counters of this node process (``NodeWorker.statistics()``)
* :class:`Backoff`         -- exponential back-off with jitter for coordinator and network errors
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.messages import CapabilityAdvert, CpuInfo
from protocol.schema import Reachability

if TYPE_CHECKING:
    from node.backends.base import InferenceBackend
    from node.config import NodeConfig
    from node.probe import Capability
    from protocol.identity import Identity

__all__ = ["Backoff", "NodeStats", "make_advert", "software_version"]


def software_version() -> str:
    """The installed rollout-swarm version ("0+unknown" from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"rollout-swarm/{version('rollout-swarm')}"
    except PackageNotFoundError:
        return "rollout-swarm/0+unknown"


def make_advert(
    config: NodeConfig,
    identity: Identity,
    backend: InferenceBackend,
    capability: Capability | None,
    *,
    peer_id: str,
    tokens_per_s: float | None,
    now: float,
    reachability: Reachability = "unknown",
) -> CapabilityAdvert:
    """The advert a node publishes: probe results, backend, price, loaded version, expiry."""
    fields: dict[str, Any]
    if capability is not None:
        fields = capability.to_advert_fields()
    else:
        fields = {
            "gpus": [],
            "cpu": CpuInfo(cores=1, memory_bytes=0),
            "tokens_per_s": 0.0,
            "rollouts_per_s": 0.0,
        }
    if tokens_per_s is not None:
        fields["tokens_per_s"] = float(tokens_per_s)
    fields["backend"] = backend.name
    fields["dtype"] = backend.dtype
    return CapabilityAdvert(
        peer_id=peer_id,
        node_key=identity.public_key,
        price_per_hour=config.price_per_hour,
        policy_version=backend.loaded_version,
        reachability=reachability,  # measured by a dial-back (swarm.reachability), not guessed
        software_version=software_version(),
        expires_at=now + 2 * config.advert_period_s,
        **fields,
    )


class Backoff:
    """Exponential back-off with "equal jitter": delay n is uniform in [d/2, d], d = min(max,
    initial * 2**n)."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial = initial
        self.maximum = maximum
        self.rng = rng or random.Random()
        self.failures = 0

    def next_delay(self) -> float:
        d = min(self.maximum, self.initial * 2 ** min(self.failures, 30))
        self.failures += 1
        return self.rng.uniform(d / 2, d)

    def reset(self) -> None:
        self.failures = 0


@dataclass
class NodeStats:
    """Counters of this node process (``statistics()`` snapshot)."""

    leases_done: int = 0  # leases whose results were submitted and got a verdict
    leases_accepted: int = 0  # ... of which acknowledged
    leases_rejected: int = 0  # ... of which answered with Reject
    leases_released: int = 0  # leases given back unfinished
    samples_accepted: int = 0  # samples in acknowledged submissions
    tokens_generated: int = 0  # completion tokens generated (EOS included)
    generate_s: float = 0.0  # seconds spent inside backend.generate
    coordinator_errors: int = 0  # RPCs that found the coordinator unreachable or failing
    tokens_per_s: float | None = None  # EWMA of generation throughput
    last_reject: str | None = None  # "code: detail" of the latest Reject
    last_reject_at: float | None = None  # when it came, Unix seconds

    def record_generation(self, tokens: int, seconds: float) -> None:
        """Count one lease's generation: ``tokens`` completion tokens in ``seconds``."""
        self.tokens_generated += tokens
        self.generate_s += seconds
        if seconds > 0:
            rate = tokens / seconds
            self.tokens_per_s = (
                rate if self.tokens_per_s is None else 0.7 * self.tokens_per_s + 0.3 * rate
            )
