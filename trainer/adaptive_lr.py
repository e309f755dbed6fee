"""KL-adaptive learning rate (``target_step_kl``): keep each learner step's move near a target.

How far one learner step moves the policy, ``step_kl`` (the k3 estimate of KL(π_prox‖π_new) on
the step's own tokens that both policies support, :func:`trainer.rollback.kl_k3_sums`; a token
the step took into or out of a top-k/top-p support is left out), is what staleness multiplies: a
rollout S versions old was drawn from a policy about S such moves away from π_prox, and the
mismatch KL(μ‖π_prox), the behaviour weights' spread and the bias of their truncation grow
with it. Measured on the embedded task (docs/trainer.md, "KL-adaptive learning rate") the move
is 0.003–0.01 nat/token early in training and 0.1–0.5 near the target under staleness, at the
same learning rate: early steps could be larger, late ones are the drift that precedes most
collapses.

The rule is the ``adaptive`` schedule of rsl_rl's PPO (ETH Zürich's legged-robot RL library;
``desired_kl``), itself after the adaptive KL penalty of Schulman et al. 2017, "Proximal Policy
Optimization Algorithms", §4: after a step whose KL was above twice the target the learning rate
is divided by ``change`` (1.5), above 0 and below half the target multiplied by it, and left
alone otherwise; it stays within ``[low, high]`` × the configured rate. A step that did not move
the policy (``step_kl`` = 0: every update skipped, a deterministic policy with nothing to learn,
every reward equal) is no evidence that the rate is too small, and rsl_rl raises the rate only
for ``0 < KL < target/2``: raising it there let the rate climb to its ceiling on a run that then
took one enormous step (docs/trainer.md, "KL-adaptive learning rate", ``vcpo-filter-kl4``).
"""

from __future__ import annotations


def next_lr_factor(
    factor: float,
    step_kl: float,
    target: float,
    *,
    change: float = 1.5,
    low: float = 0.05,
    high: float = 1.0,
) -> float:
    """The learning-rate factor (× ``lr``) for the next step, after a step that moved the policy
    by ``step_kl`` nats per token at ``factor``."""
    if not target > 0.0 or not change > 1.0 or not 0.0 < low <= high:
        raise ValueError(
            f"need target > 0, change > 1, 0 < low <= high; got {target}, {change}, {low}, {high}"
        )
    if step_kl != step_kl:  # NaN: no evidence either way (e.g. a step with no tokens)
        return factor
    if step_kl > 2.0 * target:
        factor /= change
    elif 0.0 < step_kl < 0.5 * target:  # k3 ≥ 0; 0 (or rounding below it): the policy stood still
        factor *= change
    return min(high, max(low, factor))
