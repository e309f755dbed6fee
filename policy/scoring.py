"""Re-scoring: log-probabilities of given completions under a model, and sampling audits.

:func:`score_logprobs` re-scores with :func:`policy.draw.processed_logprobs` (the processed
distribution the node sampled from), so the coordinator's spot check and the trainer compare like
with like. :func:`audit_samples` re-scores and also measures how completions were sampled (the
expected log-likelihood under honest sampling, and the seeded inverse-CDF replay of
:mod:`policy.draw`), treating top-k / top-p boundary tokens within a logit margin as admissible
(:mod:`policy.boundary`): each token gets an admissible log-prob *interval*, a single value away
from the boundaries.

Batching: sequences ``prompt + completion`` are left-padded, ``position_ids = cumsum(mask) - 1``
(pads at 0), one forward per micro-batch, fp32 log-softmax of the raw logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from policy.boundary import kept_bounds, local_cdf_spread, logprob_interval, replay_admissible
from policy.draw import processed_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SampleAudit", "audit_samples", "cache_kwarg", "left_pad", "score_logprobs"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache keyword of ``model.forward`` ("cache" from transformers 5.x,
    "past_key_values" before)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def left_pad(
    seqs: list[list[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` for left-padded ``seqs`` (all non-empty)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), position_ids.to(device)


@dataclass(frozen=True)
class SampleAudit:
    """What re-scoring one completion tells about it (see :func:`audit_samples`)."""

    #: log p of each completion token under the sampling distribution (this machine's value; for
    #: a boundary token this machine drops but another machine may keep, its log-prob had this
    #: machine kept it as well; -inf only for a token no honest machine keeps)
    logprobs: list[float]
    #: Σ_t H_t: the expected Σ_t log p(token) under honest sampling is ``-entropy``
    entropy: float
    #: Σ_t Var_t[log p(token)] under honest sampling
    variance: float
    #: tokens that are not the inverse-CDF draw at the sample's uniform (None: not replayed)
    replay_misses: int | None
    #: admissible log-prob interval of each token over the kept sets another machine's rounding
    #: (within the logit margin) may give; ``lo == hi == logprobs`` away from top-k/top-p
    #: boundaries, ``-inf`` for a token no honest machine keeps. Empty: same as ``logprobs``.
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)
    #: tokens whose admissible interval has width (boundary positions)
    boundary: int = 0


def _windows(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    temperature: float,
    top_p: float,
    top_k: int,
    batch_size: int,
    pad_id: int,
    *,
    raw: bool = False,
    alt_model: PreTrainedModel | None = None,
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, int, torch.Tensor | None]]:
    """Per micro-batch: ``(rows, logp [B, T, V], targets [B, T], T, alt)`` where row ``k``'s
    completion is right-aligned in the ``T = longest`` window (one forward per micro-batch);
    ``raw``: the raw logits instead of the processed log-probs; ``alt``: the raw logits
    ``[B, T, V]`` (fp32) of ``alt_model``'s forward of the same batch (None without one)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(not p for p in prompt_ids):
        raise ValueError("every prompt must have at least one token")
    device = next(model.parameters()).device
    todo = [i for i, c in enumerate(completion_ids) if c]
    for start in range(0, len(todo), max(1, batch_size)):
        rows = todo[start : start + batch_size]
        seqs = [list(prompt_ids[i]) + list(completion_ids[i]) for i in rows]
        ids, mask, pos = left_pad(seqs, pad_id, device)
        width = ids.shape[1]
        longest = max(len(completion_ids[i]) for i in rows)
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            # logits at t predict token t+1: the last `longest` tokens are predicted by the
            # window [width-longest-1, width-1); each completion is right-aligned in it.
            window = logits[:, width - longest - 1 : width - 1, :]
            alt = None
            if alt_model is not None:
                alt_out = alt_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                alt = alt_out[:, width - longest - 1 : width - 1, :].float()
            if raw:
                yield rows, window.float(), ids[:, width - longest :], longest, alt
                continue
            logp = processed_logprobs(window, temperature, top_p, top_k)
            yield rows, logp, ids[:, width - longest :], longest, alt


def score_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    temperature: float = 1.0,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 32,
    pad_id: int = 0,
) -> list[list[float]]:
    """``out[i][j]`` = log p(completion_ids[i][j] | prompt_ids[i] + completion_ids[i][:j]) under
    the sampling distribution (``temperature``/``top_p``/``top_k``) of ``model``'s raw logits.

    Batched and left-padded; every prompt must be non-empty; an empty completion gives ``[]``.
    The model is used as is (device, dtype, train/eval mode); log-softmax is computed in fp32.
    """
    out: list[list[float]] = [[] for _ in prompt_ids]
    for rows, logp, targets, longest, _ in _windows(
        model, prompt_ids, completion_ids, temperature, top_p, top_k, batch_size, pad_id
    ):
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().tolist()
        for k, i in enumerate(rows):
            out[i] = picked[k][longest - len(completion_ids[i]) :]
    return out


def audit_samples(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    temperature: float = 1.0,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
    uniforms: list[torch.Tensor] | None = None,
    slack: float = 1e-3,
    rel_slack: float = 0.0,
    margin: float = 0.0,
    alt_model: PreTrainedModel | None = None,
    local_slack: float = 0.0,
    batch_size: int = 32,
    pad_id: int = 0,
) -> list[SampleAudit]:
    """Re-score completions (as :func:`score_logprobs`) and measure how they were sampled.

    * ``lo``/``hi``: each token's admissible log-prob interval when the node's raw logits may
      differ from these by ``margin`` (:func:`policy.boundary.logprob_interval`): a point away
      from the top-k/top-p boundaries, wider where rounding may flip a boundary token.
    * ``entropy``/``variance``: the mean and variance of Σ_t log p(token) under honest sampling
      from the same distribution; a greedy or low-temperature sampler lands far above the mean.
    * with ``uniforms`` (one tensor per completion, at least as long as it): token ``t`` must be
      the inverse-CDF draw at ``u[t]`` for some admissible kept set, i.e.
      ``cdf[k-1] <= u·total < cdf[k]``, each bound widened by ``slack + rel_slack·c(1−c)``
      probability mass (``c`` the bound's CDF value) for
      float rounding between the node's and this forward pass
      (:func:`policy.boundary.replay_admissible`); with ``alt_model`` (the same weights in a
      coarser precision, on the same device) each bound is widened further by ``local_slack``
      times how far ``alt_model``'s forward moves it (:func:`policy.boundary.local_cdf_spread`),
      a second forward per micro-batch.
    """
    if (alt_model is None) != (local_slack == 0.0):
        raise ValueError(
            "audit_samples: alt_model and a local_slack > 0 go together (the slack scales how "
            "far alt_model's forward moves each CDF bound)"
        )
    out: list[SampleAudit | None] = [None] * len(prompt_ids)
    device = next(model.parameters()).device
    for rows, logits, targets, longest, alt in _windows(
        model, prompt_ids, completion_ids, 1.0, 1.0, 0, batch_size, pad_id, raw=True,
        alt_model=alt_model if uniforms is not None else None,
    ):  # fmt: skip
        logp = processed_logprobs(logits, temperature, top_p, top_k)
        probs = logp.exp()
        finite = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
        ent = -(probs * finite).sum(-1)  # [B, T]
        second = (probs * finite * finite).sum(-1)
        var = (second - ent * ent).clamp_min(0.0)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        bounds = kept_bounds(logits, temperature, top_p, top_k, margin)
        lo, hi = logprob_interval(bounds, targets)
        # a boundary token this machine drops but another may keep: its log-prob had this
        # machine kept it too (this machine's set plus the token), not -inf, which would wreck
        # the sampling statistic of an honest sample
        x_t = bounds.x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        kept = torch.where(torch.isfinite(logp), bounds.x, torch.full_like(bounds.x, -torch.inf))
        with_t = torch.logaddexp(torch.logsumexp(kept, -1), x_t)
        picked = torch.where(
            torch.isfinite(picked), picked, torch.where(torch.isfinite(lo), x_t - with_t, lo)
        )
        ok_all: torch.Tensor | None = None
        if uniforms is not None:
            u = torch.zeros(targets.shape, dtype=torch.float32)
            for k, i in enumerate(rows):
                n = len(completion_ids[i])
                u[k, longest - n :] = uniforms[i][:n]
            local = None
            if alt is not None:
                spread = local_cdf_spread(logits, alt, temperature, top_p, top_k)
                local = local_slack * spread
            ok_all = replay_admissible(bounds, targets, u.to(device), slack, rel_slack, local)
        for k, i in enumerate(rows):
            n = len(completion_ids[i])
            sl = slice(longest - n, longest)
            misses = None if ok_all is None else int((~ok_all[k, sl]).sum())
            lo_k, hi_k = lo[k, sl], hi[k, sl]
            out[i] = SampleAudit(
                logprobs=picked[k, sl].cpu().tolist(),
                entropy=float(ent[k, sl].sum()),
                variance=float(var[k, sl].sum()),
                replay_misses=misses,
                lo=lo_k.cpu().tolist(),
                hi=hi_k.cpu().tolist(),
                boundary=int((hi_k > lo_k).sum()),
            )
    return [a or SampleAudit([], 0.0, 0.0, 0 if uniforms is not None else None) for a in out]
