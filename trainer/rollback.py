"""Undo a learner step that moved the policy too far (``max_step_kl``).

A learner step is ``minibatches`` optimizer updates on one batch. Measured on the embedded task
(docs/trainer.md, "Collapses and the step rollback"), a policy that has nearly solved its task
sometimes takes one step that changes it by several nats per token -- and with rollouts S
versions old the swarm keeps sampling the broken policy for S more steps before the learner
sees what it did. The PPO clip does not prevent it: it bounds the ratio π_θ/π_prox only on the
batch's own tokens and is inactive on the first update of a step (π_θ = π_prox there).

So after a step the trainer measures how far it moved on the step's own tokens,

    step_kl = Σ_t mask·(r_t − 1 − log r_t) / Σ_t mask,   r_t = π_new(o_t) / π_prox(o_t)

(the k3 estimator of KL(π_prox‖π_new), Schulman 2020, "Approximating KL divergence"), and when it
is above ``max_step_kl`` restores the weights *and* the optimizer state from before the step, so
neither the weights nor Adam's moments keep the jump. This is the trust-region test of TRPO
(Schulman et al. 2015, a step whose KL exceeds δ is rejected) applied after the fact, as
OpenAI Spinning Up's PPO does with ``target_kl`` (it stops the step's updates instead; here a
single update can already be the jump, so the step is undone).

The snapshot holds the rank's local parameters and optimizer tensors (with FSDP2, its shards):
one more copy of the parameters and of Adam's two moments while a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class StepSnapshot:
    """Copies of the parameters and the optimizer state before a step."""

    params: list[Tensor]
    state: list[dict[str, Any]]

    @classmethod
    @torch.no_grad()
    def take(
        cls, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> StepSnapshot:
        return cls(
            params=[p.detach().clone() for p in params],
            state=[
                {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in
                 optimizer.state.get(p, {}).items()}
                for p in params
            ],
        )  # fmt: skip

    @torch.no_grad()
    def restore(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        """Put the weights and the optimizer state back as they were at :meth:`take`."""
        for p, saved, st in zip(params, self.params, self.state, strict=True):
            p.copy_(saved)
            if st:
                optimizer.state[p] = {
                    k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()
                }
            else:  # the step was the first: the optimizer had no state for p yet
                optimizer.state.pop(p, None)


def kl_k3_sums(new_logp: Tensor, prox_logp: Tensor, mask: Tensor) -> tuple[float, float]:
    """(Σ mask·(r − 1 − log r), Σ mask) with r = exp(new − prox): the sums behind ``step_kl``
    (summed over minibatches and ranks before dividing)."""
    log_r = (new_logp - prox_logp).clamp(-60.0, 60.0) * mask
    k3 = (log_r.exp() - 1.0 - log_r) * mask
    return float(k3.sum()), float(mask.sum())
