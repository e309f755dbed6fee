"""Pure GRPO math: group advantages, staleness admission, behaviour weights, the clipped objective.

Every function here is pure (no model, no optimizer, no globals) and documents tensor shapes
with ``N`` = number of sequences, ``T`` = padded completion length. Masks are float tensors of 0/1
so that they multiply directly. The objective (DESIGN.md §8) for one minibatch is::

    L = −(1/Σ_i|o_i|) Σ_i Σ_t w_{i,t} · min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1−ε, 1+ε_high) A_i)
        − β_H · (1/Σ_i|o_i|) Σ_i Σ_t H_{i,t}

with ρ = π_θ/π_prox (π_prox: the trainer's weights before this batch's first update), the behaviour
weight w = π_prox/μ (μ: the node's sampling policy, known from its logged log-probs) per token,
per sequence or as the sequence's geometric mean, truncated at C (TIS), masked or rejected outside
a band (MIS, IcePop, Geo-RS), optionally thinned by the second-moment mask (M2PO) and times λ^Δ,
and H the entropy of π_θ at each completion position. docs/trainer.md names the source of each
option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

WeightMode = Literal["truncate", "mask", "reject", "raw", "off"]
WeightLevel = Literal["token", "sequence", "geometric"]

#: Largest |log ratio| fed to exp(); keeps sequence-level products finite (e^60 ≈ 1e26).
_MAX_LOG_RATIO = 60.0

#: log-prob given to a token outside the processed distribution's support (removed by top-k or
#: top-p): finite, so that ratios of two such log-probs stay finite, and constant (no gradient).
LOGP_FLOOR = -1e4


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


def support_mask(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """``[N, T]`` 1.0 on the completion tokens both policies support: π_prox and μ both give the
    token a log-prob above :data:`LOGP_FLOOR` (inside their top-k/top-p support).

    A token outside π_prox's support (a node's sampled token that the trainer's processing
    removed: the node holds the bf16 rounding of the trainer's weights, or a stale version whose
    top-p set differed) has π_prox = 0: its ratio π_prox/μ is 0 and its KL term infinite (the ±60
    clamp made it 59 nats). Such tokens are counted apart (``out_of_support_frac``), get weight 0
    and no gradient, and the mismatch figures and the weights' ratios are over the shared
    support (docs/trainer.md, "Tokens outside the trainer's support").
    """
    inside = (prox_logp > LOGP_FLOOR) & (behaviour_logp > LOGP_FLOOR)
    return mask * inside.to(mask.dtype)


def k3_terms(log_r: Tensor) -> Tensor:
    """``r − 1 − log r`` per element for ``log_r = log r`` (the k3 estimate of a KL), in float64
    via ``expm1``. The fp32 form ``exp(x) − 1 − x`` keeps nothing of the true ``x²/2`` below
    |x| ≈ 3e-4: ``exp`` rounds to a multiple of 1.2e-7 near 1, so each term is off by up to 6e-8
    with either sign, and a sum over many tokens of a policy that barely moved came out as
    rounding noise, negative as often as not (measured: 512 tokens moved by 1e-5 nats, true sum
    2.7e-8, fp32 sum 3.2e-6). Here the sum is exact to float64 rounding and never negative."""
    x = log_r.double()
    return torch.expm1(x) - x


def shared_log_ratio(prox_logp: Tensor, behaviour_logp: Tensor, shared: Tensor) -> Tensor:
    """``[N, T]`` log π_prox/μ on the tokens of ``shared`` (:func:`support_mask`), 0 elsewhere
    (``torch.where``, not a product: a token at −inf times 0 would be NaN)."""
    return torch.where(shared > 0, prox_logp - behaviour_logp, torch.zeros_like(prox_logp))


@dataclass(frozen=True)
class BehaviourWeights:
    """Result of :func:`behaviour_weights`; all tensors are detached."""

    #: ``[N, T]`` weight per completion token (0 on padding), sequence weights broadcast over T.
    weights: Tensor
    #: ``[N, T]`` 1.0 where the raw weight was truncated ("truncate") or masked ("mask",
    #: "reject"); at sequence/geometric level every token of a modified sequence is 1.0. 0 on a
    #: token outside the shared support (:func:`support_mask`: weight 0, counted apart).
    modified: Tensor
    #: ``[N, T]`` the raw ratio π_prox/μ before truncation/masking/decay, at the chosen level
    #: (token ratio, sequence product, or geometric mean of the sequence's token ratios, over
    #: the shared support); 0 outside it.
    raw: Tensor
    #: ``[N, T]`` 1.0 on completion tokens dropped by the second-moment (M2PO) mask.
    m2_masked: Tensor


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
    cap_low: float | None = None,
    m2_threshold: float | None = None,
    m2_keep: Tensor | None = None,
) -> BehaviourWeights:
    """Importance weights ``w = π_prox/μ`` that correct for sampling from a stale policy μ.

    A token outside the support both policies share (:func:`support_mask`; π_prox = 0 under the
    trainer's top-k/top-p) gets weight 0 in every mode, and the sequence's product, its
    geometric mean and the M2PO mask are taken over the shared tokens only, so one such token
    (a rounding artefact of bf16 publication, measured 1.3e-4 of tokens) neither zeroes its
    whole sequence nor enters the second moment.

    Args:
        prox_logp: ``[N, T]`` log π_prox(o_t) recomputed by the trainer.
        behaviour_logp: ``[N, T]`` log μ(o_t) logged by the node at sampling time.
        mask: ``[N, T]`` completion mask (1 on completion tokens including EOS).
        staleness: ``[N]`` Δ = trainer version − rollout version (for the decay λ^Δ).
        cap: C > 1, the upper bound. "truncate": w ← min(w, C) (TIS); "mask": w ← 0 outside
            [C_low, C], w inside (MIS, IcePop); "reject": w ← 1 inside [C_low, C], 0 outside
            (rejection sampling without IS weights, verl's ``rollout_rs``).
        mode: "truncate" | "mask" | "reject" | "raw" (w untruncated) | "off" (w = 1).
        level: the unit a ratio belongs to. "token": one ratio per token; "sequence": the product
            of the sequence's token ratios, shared by all its tokens; "geometric": their geometric
            mean exp(mean_t log r_t) (Geo-RS: independent of the sequence's length).
        decay: λ in (0, 1]; the weight is multiplied by λ^Δ (1.0 disables).
        cap_low: C_low, the lower bound of the mask/reject band; None means 1/C.
        m2_threshold: τ_M2 (M2PO): drop the tokens with the largest (log π_prox/μ)² until the
            mean over the tokens left is ≤ τ_M2 (:func:`second_moment_mask`); None disables.
        m2_keep: ``[N, T]`` M2PO's mask chosen elsewhere, over more tokens than these (a
            minibatch spread over ranks: :meth:`trainer.step.LearnerStep._m2_keep`); 1.0 on the
            tokens kept. Excludes ``m2_threshold``.
    """
    if m2_threshold is not None and m2_keep is not None:
        raise ValueError("pass m2_threshold or a precomputed m2_keep, not both")
    # the tokens both policies support (support_mask): the others get weight 0 in every mode and
    # stay out of the sequence's product, its geometric mean and the M2PO mask
    shared = support_mask(prox_logp, behaviour_logp, mask)
    log_ratio = shared_log_ratio(prox_logp, behaviour_logp, shared)
    if level == "token":
        unit_log = log_ratio
    else:
        unit_log = log_ratio.sum(dim=-1, keepdim=True)
        if level == "geometric":
            unit_log = unit_log / shared.sum(dim=-1, keepdim=True).clamp(min=1)
        unit_log = unit_log.expand_as(mask)
    raw = unit_log.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp() * shared
    low = 1.0 / cap if cap_low is None else cap_low
    inside = ((raw >= low) & (raw <= cap)).to(mask.dtype)
    if mode == "off":
        weights = shared.clone()
        modified = torch.zeros_like(mask)
    elif mode == "raw":
        weights = raw
        modified = torch.zeros_like(mask)
    elif mode == "truncate":
        modified = (raw > cap).to(mask.dtype) * shared
        weights = raw.clamp(max=cap)
    elif mode == "mask":
        modified = (1.0 - inside) * shared
        weights = raw * inside
    elif mode == "reject":
        modified = (1.0 - inside) * shared
        weights = inside
    else:  # pragma: no cover - guarded by the config's Literal
        raise ValueError(f"unknown weight mode {mode!r}: use truncate, mask, reject, raw or off")
    m2_masked = torch.zeros_like(mask)
    if m2_threshold is not None:
        m2_keep = second_moment_mask(log_ratio, shared, m2_threshold)
    if m2_keep is not None:
        keep = m2_keep.to(mask.dtype)
        m2_masked = (1.0 - keep) * shared
        weights = weights * keep
    if decay != 1.0:
        weights = weights * (decay ** staleness.to(mask.dtype)).unsqueeze(-1)
    return BehaviourWeights(
        weights=(weights * shared).detach(),
        modified=modified.detach(),
        raw=raw.detach(),
        m2_masked=m2_masked.detach(),
    )


def second_moment_mask(log_ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's second-moment trust region: ``[N, T]`` 1.0 on the completion tokens kept.

    With M̂2 = mean over completion tokens of (log r)², the tokens with the largest (log r)² are
    dropped one by one until M̂2 of the tokens left is ≤ ``threshold`` (Zheng et al. 2025,
    "Prosperity before Collapse", arXiv 2510.01161; AReaL's ``m2_threshold``). At least one token
    is kept. Ties are broken by position (row, then token), so the result is deterministic.
    """
    sel = mask > 0
    keep = torch.zeros_like(mask)
    keep[sel] = second_moment_keep((log_ratio * log_ratio)[sel], threshold).to(mask.dtype)
    return keep


def second_moment_keep(m2: Tensor, threshold: float) -> Tensor:
    """:func:`second_moment_mask` on a flat ``[n]`` tensor of (log r)², the tokens in position
    order (ties go to the earlier one: it is dropped first); ``[n]`` bool, True where kept."""
    n = m2.numel()
    kept = torch.zeros(n, dtype=torch.bool, device=m2.device)
    if n == 0:
        return kept
    order = torch.sort(m2, descending=True, stable=True).indices
    ordered = m2[order].double()
    # mean of the suffix starting at i = mean of what is left after dropping the i largest
    suffix_sum = ordered.flip(0).cumsum(0).flip(0)
    suffix_mean = suffix_sum / torch.arange(n, 0, -1, dtype=ordered.dtype, device=m2.device)
    ok = torch.nonzero(suffix_mean <= threshold)
    drop = int(ok[0]) if ok.numel() else n - 1
    kept[:] = True
    kept[order[:drop]] = False
    return kept


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

    A token outside π_prox's support (``prox_logp`` at :data:`LOGP_FLOOR`) has ρ = 1 and passes no
    gradient (its weight is 0, :func:`behaviour_weights`): π_θ may take it into its support
    during the step, and exp(log π_θ − LOGP_FLOOR) would be inf, its product with the weight
    NaN.
    """
    prox_logp = prox_logp.detach()
    log_ratio = torch.where(prox_logp > LOGP_FLOOR, logp - prox_logp, torch.zeros_like(logp))
    ratio = log_ratio.exp()
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    loss = -(weights * surrogate * mask).sum() / normalizer
    binding = ((clipped < unclipped).to(mask.dtype) * mask).sum().detach()
    return PolicyLoss(loss=loss, clipped_tokens=binding)


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

    #: Σ (r − 1 − log r), r = π_prox/μ, over the shared support (:func:`support_mask`): k3
    #: estimator of KL(μ‖π_prox) there (×support_tokens).
    kl_sum: float
    #: Σ (log μ − log π_prox) over the shared support: k1 estimator of the same KL.
    kl_k1_sum: float
    #: Σ (log r)² over the shared support: the second moment M2PO bounds, before any masking.
    m2_sum: float
    #: number of weight units (tokens, or sequences at sequence/geometric level) that were
    #: truncated/masked/rejected.
    modified: float
    #: shared-support tokens whose weight is 0 (masked, rejected or dropped by the M2PO mask):
    #: they contribute nothing to the gradient (nor do the ``out_of_support`` ones).
    zeroed_tokens: float
    #: Σ w and Σ w² over the weight units (tokens or sequences), for ESS = (Σw)²/Σw².
    w_sum: float
    w_sq_sum: float
    #: number of weight units (over the shared support).
    units: float
    #: number of completion tokens.
    tokens: float
    #: completion tokens both policies support (the denominator of the mismatch figures).
    support_tokens: float
    #: completion tokens outside π_prox's or μ's top-k/top-p support (weight 0, no gradient).
    out_of_support: float


def weight_stats(
    prox_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    bw: BehaviourWeights,
    level: WeightLevel,
) -> WeightStats:
    """Mismatch and weight-health sums for one (local) batch; see :class:`WeightStats`.

    Everything but ``tokens`` and ``out_of_support`` is over the tokens both policies support
    (:func:`support_mask`): the mismatch KL is finite there, and a token outside π_prox's support
    (π_prox = 0: KL term infinite, 59 nats at the ±60 clamp) is counted apart instead.
    At sequence/geometric level the units are sequences, each counted with the mean weight over
    its shared tokens (all equal, unless the M2PO mask dropped some of them).
    """
    shared = support_mask(prox_logp, behaviour_logp, mask)
    log_r = shared_log_ratio(prox_logp, behaviour_logp, shared).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    kl = (k3_terms(log_r) * shared).sum()
    zeroed = ((bw.weights == 0).to(mask.dtype) * shared).sum()
    if level == "token":
        sel = shared > 0
        w = bw.weights[sel]
        modified = bw.modified.sum()
        units = float(sel.sum())
    else:
        n_tok = shared.sum(dim=-1)
        has_tokens = n_tok > 0
        # one weight per sequence: the mean over its tokens (all equal unless M2PO dropped some)
        w = (bw.weights.sum(dim=-1) / n_tok.clamp(min=1))[has_tokens]
        modified = (bw.modified.amax(dim=-1) if bw.modified.shape[-1] else n_tok * 0)[has_tokens]
        modified = modified.sum()
        units = float(has_tokens.sum())
    return WeightStats(
        kl_sum=float(kl),
        kl_k1_sum=float((-log_r).sum()),
        m2_sum=float((log_r * log_r).sum()),
        modified=float(modified),
        zeroed_tokens=float(zeroed),
        w_sum=float(w.sum()),
        w_sq_sum=float((w**2).sum()),
        units=units,
        tokens=float(mask.sum()),
        support_tokens=float(shared.sum()),
        out_of_support=float(mask.sum() - shared.sum()),
    )


def sequence_ratio_sums(
    prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor
) -> tuple[float, float, float]:
    """(Σ w, Σ w², n) over the sequences with completion tokens, w = Π_t π_prox/μ (unclipped):
    the sums behind the sequence-level ESS that VCPO scales the learning rate with; the product
    is over the tokens both policies support (:func:`support_mask`), as the behaviour weights'."""
    shared = support_mask(prox_logp, behaviour_logp, mask)
    log_w = shared_log_ratio(prox_logp, behaviour_logp, shared).sum(dim=-1)
    has = shared.sum(dim=-1) > 0
    w = log_w[has].clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).double().exp()
    return float(w.sum()), float((w * w).sum()), float(has.sum())


def ess_lr_scale(w_sum: float, w_sq_sum: float, n: float) -> float:
    """VCPO's learning-rate factor sqrt(min(1, ESS/n)), ESS = (Σw)²/Σw² of the sequence ratios
    (Huang et al. 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv
    2602.17616, rule "sqrt", base ESS ratio 1). 1.0 for an empty minibatch."""
    if n <= 0 or w_sq_sum <= 0:
        return 1.0
    return float(min(1.0, effective_sample_size(w_sum, w_sq_sum) / n) ** 0.5)


def effective_sample_size(w_sum: float, w_sq_sum: float) -> float:
    """ESS = (Σw)² / Σw² (0 when every weight is 0)."""
    return w_sum * w_sum / w_sq_sum if w_sq_sum > 0 else 0.0


def entropy_bonus(entropy: Tensor, mask: Tensor, *, coef: float, normalizer: float) -> Tensor:
    """Scalar ``−coef · Σ mask·H / normalizer``: added to the loss, it rewards keeping entropy.

    ``entropy``/``mask``: ``[N, T]``. Without it the tiny default model collapses to one answer
    per prompt before it finds the right one (DESIGN.md §10). ``mask`` selects the tokens it acts
    on (``entropy_groups``: all completion tokens, or those of informative samples only).
    """
    return -coef * (entropy * mask).sum() / normalizer
