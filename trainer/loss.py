"""Pure GRPO math: group advantages, staleness admission, behaviour weights, the clipped objective.

Every function here is pure (no model, no optimizer, no globals) and documents tensor shapes
with ``N`` = number of sequences, ``T`` = padded completion length. Masks are float tensors of 0/1
so that they multiply directly. The objective (DESIGN.md §8) for one minibatch is::

    L = −(1/Σ_i|o_i|) Σ_i Σ_t w_{i,t} · min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1−ε, 1+ε_high) A_i)
        − β_H · (1/Σ_i|o_i|) Σ_i Σ_t H_{i,t}

with ρ = π_θ/π_prox (π_prox: the trainer's weights before this batch's first update), the behaviour
weight w = π_prox/μ truncated at C or masked outside [1/C, C] (μ: the node's sampling policy,
known from its logged log-probs), optionally times λ^Δ, and H the entropy of π_θ at each completion
position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

WeightMode = Literal["truncate", "mask", "off"]
WeightLevel = Literal["token", "sequence"]

#: Largest |log ratio| fed to exp(); keeps sequence-level products finite (e^60 ≈ 1e26).
_MAX_LOG_RATIO = 60.0


def group_advantages(
    rewards: Tensor, group_index: Tensor, *, std_normalize: bool = True, eps: float = 1e-4
) -> Tensor:
    """GRPO advantages ``A_i = (r_i − mean_g r) / (std_g r + eps)`` within each group.

    Args:
        rewards: ``[N]`` float, one reward per sequence.
        group_index: ``[N]`` int64 in ``0..G−1``, the group each sequence belongs to.
        std_normalize: divide by the group's standard deviation (unbiased, as TRL's GRPO); when
            False the advantage is the centred reward only (Dr. GRPO).
        eps: added to the std so that a group with equal rewards gives exactly 0, not NaN.

    Returns:
        ``[N]`` advantages in the dtype of ``rewards``. A group of one sequence has advantage 0.
    """
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index must both be [N]")
    n_groups = int(group_index.max().item()) + 1 if rewards.numel() else 0
    counts = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(
        0, group_index, torch.ones_like(rewards)
    )
    sums = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    mean = sums / counts.clamp(min=1)
    centred = rewards - mean[group_index]
    if not std_normalize:
        return torch.where(counts[group_index] > 1, centred, torch.zeros_like(centred))
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, centred**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    adv = centred / (std[group_index] + eps)
    return torch.where(counts[group_index] > 1, adv, torch.zeros_like(adv))


def admission_mask(staleness: Tensor, max_staleness: int) -> Tensor:
    """``[N]`` bool: True where ``0 ≤ Δ ≤ S`` (trained on); Δ > S is dropped (DESIGN.md §8).

    A negative Δ (a rollout claiming a version the trainer has not reached) is also refused.
    """
    return (staleness >= 0) & (staleness <= max_staleness)


@dataclass(frozen=True)
class BehaviourWeights:
    """Result of :func:`behaviour_weights`; all tensors are detached."""

    #: ``[N, T]`` weight per completion token (0 on padding), sequence weights broadcast over T.
    weights: Tensor
    #: ``[N, T]`` 1.0 where the raw weight was truncated (mode "truncate") or masked (mode "mask").
    modified: Tensor
    #: ``[N, T]`` the raw ratio π_prox/μ before truncation/masking/decay (token or sequence level).
    raw: Tensor


def behaviour_weights(
    prox_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    staleness: Tensor,
    *,
    cap: float,
    mode: WeightMode,
    level: WeightLevel,
    decay: float = 1.0,
) -> BehaviourWeights:
    """Importance weights ``w = π_prox/μ`` that correct for sampling from a stale policy μ.

    Args:
        prox_logp: ``[N, T]`` log π_prox(o_t) recomputed by the trainer.
        behaviour_logp: ``[N, T]`` log μ(o_t) logged by the node at sampling time.
        mask: ``[N, T]`` completion mask (1 on completion tokens including EOS).
        staleness: ``[N]`` Δ = trainer version − rollout version (for the decay λ^Δ).
        cap: C > 1. "truncate": w ← min(w, C); "mask": w ← 0 outside [1/C, C].
        mode: "truncate" | "mask" | "off" (w = 1: no correction).
        level: "token" — one ratio per token; "sequence" — the product of the token ratios of the
            sequence (exp of the summed log ratio), shared by all its tokens.
        decay: λ in (0, 1]; the weight is multiplied by λ^Δ (1.0 disables).
    """
    log_ratio = (prox_logp - behaviour_logp) * mask
    if level == "sequence":
        seq = log_ratio.sum(dim=-1, keepdim=True).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        raw = seq.exp().expand_as(mask) * mask
    else:
        raw = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp() * mask
    if mode == "off":
        weights = mask.clone()
        modified = torch.zeros_like(mask)
    elif mode == "truncate":
        modified = (raw > cap).to(mask.dtype) * mask
        weights = raw.clamp(max=cap)
    elif mode == "mask":
        inside = (raw >= 1.0 / cap) & (raw <= cap)
        modified = (~inside).to(mask.dtype) * mask
        weights = raw * inside.to(mask.dtype)
    else:  # pragma: no cover - guarded by the config's Literal
        raise ValueError(f"unknown weight mode {mode!r}: use truncate, mask or off")
    if decay != 1.0:
        weights = weights * (decay ** staleness.to(mask.dtype)).unsqueeze(-1)
    return BehaviourWeights(
        weights=(weights * mask).detach(), modified=modified.detach(), raw=raw.detach()
    )


@dataclass(frozen=True)
class PolicyLoss:
    """Result of :func:`policy_loss`."""

    #: scalar, the term to minimise (already divided by ``normalizer``).
    loss: Tensor
    #: scalar (detached), Σ over tokens of mask where the PPO clip was binding (not normalised).
    clipped_tokens: Tensor


def policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    mask: Tensor,
    *,
    eps: float,
    eps_high: float,
    normalizer: float,
) -> PolicyLoss:
    """Clipped surrogate ``−(1/normalizer) Σ w · min(ρA, clip(ρ, 1−ε, 1+ε_high) A)``.

    Args:
        logp: ``[N, T]`` log π_θ(o_t) with gradient.
        prox_logp: ``[N, T]`` log π_prox(o_t), detached.
        advantages: ``[N]``.
        weights: ``[N, T]`` behaviour weights (detached; 0 on padding).
        mask: ``[N, T]`` completion mask.
        eps, eps_high: clip range [1−eps, 1+eps_high] (DAPO's "clip-higher" when eps_high > eps).
        normalizer: Σ|o_i| of the (global) minibatch, so that the loss is a per-token mean that does
            not depend on how the minibatch is sharded over ranks.
    """
    ratio = (logp - prox_logp.detach()).exp()
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    loss = -(weights * surrogate * mask).sum() / normalizer
    binding = ((clipped < unclipped).to(mask.dtype) * mask).sum().detach()
    return PolicyLoss(loss=loss, clipped_tokens=binding)


#: log-prob given to a token outside the processed distribution's support (removed by top-k or
#: top-p): finite, so that ratios of two such log-probs stay finite, and constant (no gradient).
LOGP_FLOOR = -1e4


def processed_log_softmax(
    logits: Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> Tensor:
    """``[N, T, V]`` raw logits → ``[N, T, V]`` log-probs of the *sampling* distribution (fp32).

    The same processing the nodes sample from and the coordinator re-scores with
    (:func:`policy.draw.processed_logprobs`: temperature, then top-k, then top-p), so that π_θ and
    π_prox are comparable with μ. Gradients: the top-k/top-p selection is a piecewise-constant
    function of the logits and passes none; the gradient of a kept token's log-prob is that of
    ``z/T − logsumexp over the kept set`` (the renormalised softmax), which is the policy gradient
    of the processed policy. Plain settings (T = 1, no top-k/top-p) are exactly ``log_softmax``.
    """
    from policy.draw import processed_logprobs

    return processed_logprobs(logits, temperature, top_p, top_k)


def token_entropy(logits: Tensor, **processing: float | int) -> Tensor:
    """``[N, T, V]`` logits → ``[N, T]`` entropy (nats, fp32) of the sampling distribution
    (``processing``: ``temperature``/``top_p``/``top_k`` as :func:`processed_log_softmax`)."""
    logp = processed_log_softmax(logits, **processing)  # type: ignore[arg-type]
    finite = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return -(logp.exp() * finite).sum(dim=-1)


def token_logprobs(logits: Tensor, targets: Tensor, **processing: float | int) -> Tensor:
    """``[N, T, V]`` logits and ``[N, T]`` int64 targets → ``[N, T]`` log p(target) (fp32) under
    the sampling distribution (``processing`` as :func:`processed_log_softmax`); a target outside
    its support gets :data:`LOGP_FLOOR` (no gradient) instead of −inf."""
    logp = processed_log_softmax(logits, **processing)  # type: ignore[arg-type]
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked.clamp(min=LOGP_FLOOR)


def token_logprobs_and_entropy(
    logits: Tensor, targets: Tensor, **processing: float | int
) -> tuple[Tensor, Tensor]:
    """:func:`token_logprobs` and :func:`token_entropy` from one processed log-softmax."""
    logp = processed_log_softmax(logits, **processing)  # type: ignore[arg-type]
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).clamp(min=LOGP_FLOOR)
    finite = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return picked, -(logp.exp() * finite).sum(dim=-1)


@dataclass(frozen=True)
class WeightStats:
    """Sums (not means) so that ranks can all-reduce them before dividing."""

    #: Σ mask·(r − 1 − log r), r = π_prox/μ per token: k3 estimator of KL(μ‖π_prox) (×tokens).
    kl_sum: float
    #: Σ mask·(log μ − log π_prox): k1 estimator of the same KL (×tokens).
    kl_k1_sum: float
    #: number of weight units (tokens, or sequences at sequence level) that were truncated/masked.
    modified: float
    #: Σ w and Σ w² over the weight units (tokens or sequences), for ESS = (Σw)²/Σw².
    w_sum: float
    w_sq_sum: float
    #: number of weight units.
    units: float
    #: number of completion tokens.
    tokens: float


def weight_stats(
    prox_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    bw: BehaviourWeights,
    level: WeightLevel,
) -> WeightStats:
    """Mismatch and weight-health sums for one (local) batch; see :class:`WeightStats`."""
    log_r = (prox_logp - behaviour_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO) * mask
    kl = ((log_r.exp() - 1.0 - log_r) * mask).sum()
    if level == "sequence":
        has_tokens = mask.sum(dim=-1) > 0
        w = bw.weights[:, 0][has_tokens] if bw.weights.shape[-1] else bw.weights.new_zeros(0)
        modified = bw.modified[:, 0][has_tokens].sum() if bw.weights.shape[-1] else 0.0
        units = float(has_tokens.sum())
    else:
        sel = mask > 0
        w = bw.weights[sel]
        modified = bw.modified.sum()
        units = float(sel.sum())
    return WeightStats(
        kl_sum=float(kl),
        kl_k1_sum=float((-log_r).sum()),
        modified=float(modified),
        w_sum=float(w.sum()),
        w_sq_sum=float((w**2).sum()),
        units=units,
        tokens=float(mask.sum()),
    )


def effective_sample_size(w_sum: float, w_sq_sum: float) -> float:
    """ESS = (Σw)² / Σw² (0 when every weight is 0)."""
    return w_sum * w_sum / w_sq_sum if w_sq_sum > 0 else 0.0


def entropy_bonus(entropy: Tensor, mask: Tensor, *, coef: float, normalizer: float) -> Tensor:
    """Scalar ``−coef · Σ mask·H / normalizer``: added to the loss, it rewards keeping entropy.

    ``entropy``/``mask``: ``[N, T]``. Without it the tiny default model collapses to one answer
    per prompt before it finds the right one (DESIGN.md §10).
    """
    return -coef * (entropy * mask).sum() / normalizer
