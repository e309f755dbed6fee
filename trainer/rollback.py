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

The snapshot holds the parameters the optimizer steps and their optimizer state: in one process
the model's parameters, under FSDP2 this rank's shards (one more copy of the parameters and of
Adam's two moments while a step runs). Under FSDP2 ``model.parameters()`` is not that: after a
no-grad forward the root module (embeddings, final norm and the tied head) stays *unsharded*
(FSDP2 keeps the root's weights gathered after forward, expecting the backward), and its module
attributes are then temporary full tensors that the optimizer never sees. A snapshot of those
missed the update of the root's weights and their Adam moments, and a restore written into them
was lost (issue 36). So :meth:`StepSnapshot.take` and :meth:`StepSnapshot.restore` first
reshard every FSDP2 module (:func:`reshard`) and work on ``optimizer.param_groups``; the
restore's reshard also drops a gathered copy of the undone weights, which the next forward would
otherwise reuse instead of gathering the restored shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.loss import k3_terms


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 module's gathered weights and register its shards again (a no-op for a
    module that is not sharded, or already is); local, no collective."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` steps, in its order (under FSDP2: this rank's shards)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class StepSnapshot:
    """Copies of the optimizer's parameters and of their optimizer state before a step."""

    params: list[Tensor]
    state: list[dict[str, Any]]

    @classmethod
    @torch.no_grad()
    def take(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StepSnapshot:
        reshard(model)
        params = optimizer_params(optimizer)
        return cls(
            params=[p.detach().clone() for p in params],
            state=[
                {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in
                 optimizer.state.get(p, {}).items()}
                for p in params
            ],
        )  # fmt: skip

    @torch.no_grad()
    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Put the weights and the optimizer state back as they were at :meth:`take`."""
        reshard(model)
        params = optimizer_params(optimizer)
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
    k3 = k3_terms(log_r) * mask
    return float(k3.sum()), float(mask.sum())
