"""The sampling contract without torch: sampling settings and the seed derivations.

What "a sample of version v" means is shared by the node (draws it), the coordinator (re-scores
and replays it) and the trainer (weights it); this module holds the parts that need no tensors:

* :class:`SamplingConfig` -- temperature, top-p, top-k, token budget and the stop set of a lease
* :func:`prompt_seed`     -- seed of prompt ``i`` of a lease from the lease's sampling seed
* :func:`sample_seed`     -- seed of sample ``j`` of a prompt from the prompt's seed

The tensor side (processing, seeded inverse-CDF draw, re-scoring) is :mod:`policy.draw` and
:mod:`policy.scoring`. docs/protocol.md defines each derivation with test vectors.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

__all__ = ["SamplingConfig", "prompt_seed", "sample_seed"]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. ``temperature=1, top_p=1, top_k=0`` is plain ancestral sampling, whose
    log-probs equal the raw model log-probs."""

    #: softmax temperature (> 0; greedy decoding is not offered: its log-probs are degenerate).
    temperature: float = 1.0
    #: nucleus mass in (0, 1]; 1 disables. A token is kept when the mass of the strictly more
    #: likely tokens is < top_p (the most likely token is always kept).
    top_p: float = 1.0
    #: keep the k most likely tokens (ties at the k-th logit kept); 0 disables.
    top_k: int = 0
    #: generated tokens per sample at most (>= 1).
    max_new_tokens: int = 32
    #: the stop set: token ids that end a sample (the token is kept). A lease always names the
    #: whole set (the coordinator's: the model's EOS ids plus configured extras) and the node
    #: uses exactly it; ``None`` (local use: probes, benchmarks) means the backend's own EOS ids.
    stop_token_ids: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def is_plain(self) -> bool:
        """True when the sampling distribution is the raw model distribution."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0


def sample_seed(request_seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request seeded ``request_seed`` (63-bit, stable)."""
    digest = hashlib.blake2b(
        f"rollout-swarm/sample/{request_seed}/{index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") >> 1


def prompt_seed(lease_seed: int, index: int) -> int:
    """Seed of prompt ``index`` of a lease with sampling seed ``lease_seed`` (63-bit, stable)."""
    digest = hashlib.blake2b(
        f"rollout-swarm/prompt/{lease_seed}/{index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") >> 1
