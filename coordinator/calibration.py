"""The coordinator decides what a node is held to: per-version tolerance from its own measurement.

A node's registration names a dtype, but a label must not buy a tolerance (issue 34, finding 1:
a node registered bf16 got ``median_rel`` 0.10 and a 2% tail, and had log-probs shifted by −0.99
on 45% of its tokens accepted). Instead, for each version the coordinator measures the honest
error itself, on its own copy of the weights, between the verifier's path (one batched fp32
forward) and every path an honest node may take in the precisions it accepts
(``intake.accepted_dtypes``):

* ``kv/<dtype>``      — weights in ``dtype``, one token at a time through the KV cache (how a
                        node generates);
* ``batched/<dtype>`` — weights in ``dtype``, one batched forward;
* ``fp32-compute/<dtype>`` — weights rounded to ``dtype``, computed in fp32 (a GPU that keeps
                        activations and accumulation at higher precision).

Each path samples honest completions with the sampling contract (:func:`policy.draw.draw_tokens`
at the lease's settings, seeded uniforms) from the prompts of the version's first check, and the
measured figures, their maximum over every position of every path, are:

* ``logprob``: ``|Δ log p(token)|`` of each drawn token under the processed distribution (where
  both paths keep the same top-k/top-p set; boundary flips are the logit margin's business);
* ``logit``: the raw-logit difference, centred per position (softmax ignores a common shift);
* ``cdf_rel``: ``|Δ cdf_k| / (c_k (1 − c_k))`` over every CDF bound ``k`` of the processed
  distribution in token-id order (the inverse-CDF replay's bounds): to first order a logit error
  moves ``cdf_k`` by ``c_k (1 − c_k)`` times the difference of the mean errors below and above
  ``k``, so this ratio is bounded by twice the logit error, and measured it is far tighter.

* ``local``: ``|Δ cdf_k| / (D_k + F · c_k (1 − c_k))`` (``ρ``), where ``D_k`` is the local spread
  of the verifier's own two forwards at that bound (:func:`policy.boundary.local_cdf_spread`:
  its fp32 forward against one in the coarsest accepted precision, :func:`local_dtype`, the most
  over the bounds within two of ``k``) and ``F`` = :data:`LOCAL_FLOOR` covers the bounds where
  the two happen to agree.

The version's tolerance is these maxima times ``intake.calibration_margin`` (``M``, default 2):
``max_abs`` per token ``M · logprob`` (every token bounded: no median, no tail share), logit
margin ``M · logit``, and no replay misses. The replay widens each CDF bound by ``M · ρ · (D_k +
F · c (1 − c))`` (:func:`local_slack`: the check makes the second forward; ``M · ρ · F`` is the
tolerance's ``replay_rel_slack``). One global slack ``M · cdf_rel · c (1 − c)`` had to cover the
worst position of all (the largest bf16 ``cdf_rel`` is 10× its median) and admitted 1.12 tokens
per position on the embedded model; the local one admits about 1.04 (issue 34).
:data:`FLOORS` keep each above fp32 rounding. docs/reliability.md "Calibration" gives the
figures and what the margin buys.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coordinator.config import Tolerance
from policy.boundary import local_cdf_spread
from policy.draw import draw_tokens, processed_logprobs, sample_uniforms
from policy.sampling import sample_seed

__all__ = [
    "FLOORS",
    "LOCAL_FLOOR",
    "HonestError",
    "admissible_per_position",
    "calibrated_tolerance",
    "local_dtype",
    "local_slack",
    "measure_honest_error",
]

#: Lower bounds of the calibrated figures (fp32 rounding of a log-softmax and of a CDF sum): a
#: model whose paths agree bit for bit still gets a tolerance that float noise cannot break.
FLOORS = {"logprob": 1e-4, "logit": 1e-4, "cdf_rel": 1e-4, "slack": 1e-6, "local": 0.05}

#: ``F``: the share of ``c (1 − c)`` added to the local spread at every bound. The cheapest of
#: 5e-4, 1e-3, 2e-3 and 4e-3 on the embedded model (admitted tokens per position at M = 2:
#: 1.051, 1.051, 1.049, 1.053; docs/reliability.md): smaller needs a larger ρ where the two
#: forwards agree by chance, larger widens every bound.
LOCAL_FLOOR = 2e-3


@dataclass(frozen=True)
class HonestError:
    """The largest honest error measured between the verifier's path and a node's paths."""

    #: max |Δ log p(token)| of drawn tokens (same kept set)
    logprob: float
    #: max centred raw-logit difference
    logit: float
    #: max |Δ cdf_k| / (c_k (1 − c_k))
    cdf_rel: float
    #: ρ: max |Δ cdf_k| / (D_k + F c_k (1 − c_k)), D the verifier's own local spread
    local: float
    #: the precision of the verifier's second forward (None: fp32 only accepted, D = 0)
    local_dtype: str | None
    #: positions measured (all paths together)
    positions: int
    #: samples drawn (all paths together)
    samples: int
    #: the figures per path: name -> (logprob, logit, cdf_rel, local)
    paths: dict[str, tuple[float, float, float, float]]


def calibrated_tolerance(err: HonestError, margin: float, *, local: bool = True) -> Tolerance:
    """The tolerance of a version whose honest error is ``err`` (see the module docstring);
    ``local`` false (``intake.calibration_local``): no second forward, one global replay slack
    ``M · cdf_rel · c (1 − c)``."""
    if not (math.isfinite(margin) and margin >= 1.0):
        raise ValueError(f"calibration margin must be a finite number >= 1, got {margin}")
    return Tolerance(
        metric="max_abs",
        threshold=margin * max(err.logprob, FLOORS["logprob"]),
        logit_margin=margin * max(err.logit, FLOORS["logit"]),
        replay_slack=FLOORS["slack"],
        replay_rel_slack=max(local_slack(err, margin) * LOCAL_FLOOR, FLOORS["cdf_rel"])
        if local
        else margin * max(err.cdf_rel, FLOORS["cdf_rel"]),
        replay_miss_share=0.0,
    )


def local_slack(err: HonestError, margin: float) -> float:
    """``M · ρ``: the factor of the local spread ``D_k + F c (1 − c)`` by which the replay widens
    each CDF bound (:func:`policy.scoring.audit_samples`' ``local_slack``)."""
    if not (math.isfinite(margin) and margin >= 1.0):
        raise ValueError(f"calibration margin must be a finite number >= 1, got {margin}")
    return margin * max(err.local, FLOORS["local"])


def local_dtype(dtypes: Sequence[str]) -> str | None:
    """The coarsest accepted precision other than fp32 (largest machine epsilon: bf16 before
    fp16), in which the verifier makes its second forward; None when only fp32 is accepted."""
    found: list[tuple[float, str]] = []
    for name in dtypes:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"unknown dtype {name!r} in intake.accepted_dtypes")
        if dt != torch.float32:
            found.append((torch.finfo(dt).eps, name))
    return max(found)[1] if found else None


def _kv_logits(model: Any, prompt: list[int], n: int, steps: int, draw: Any) -> tuple[Any, Any]:
    """Generate ``n`` samples of ``prompt`` through the KV cache (one token at a time, the
    node's path): ``(tokens [n, steps], logits [n, steps, V] fp32)``; ``draw(logits, t)`` picks
    the tokens of step ``t``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt] * n)
    toks, out = [], []
    with torch.inference_mode():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for t in range(steps):
            out.append(logits.float())
            tok = draw(logits.float(), t)
            toks.append(tok)
            if t + 1 < steps:
                logits = model(
                    input_ids=tok.unsqueeze(1), past_key_values=cache, use_cache=True
                ).logits[:, -1]
    return torch.stack(toks, 1), torch.stack(out, 1)


def _batched_logits(model: Any, prompt: list[int], tokens: Any) -> Any:
    """Logits of each completion position in one forward (same-length rows: no padding)."""
    n = tokens.shape[0]
    ids = torch.cat([torch.tensor([prompt] * n), tokens], 1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    return logits[:, len(prompt) - 1 : -1]


def _compare(
    ref: Any,
    other: Any,
    tokens: Any,
    spread: Any,
    temperature: float,
    top_p: float,
    top_k: int,
) -> tuple[float, float, float, float, int]:
    """(logprob, logit, cdf_rel, local, positions) of ``other`` logits against ``ref``
    [N, T, V]; ``spread`` [N, T, V] is the verifier's local spread (:func:`local_cdf_spread`)."""
    lp_r = processed_logprobs(ref, temperature, top_p, top_k)
    lp_o = processed_logprobs(other, temperature, top_p, top_k)
    same_set = (torch.isfinite(lp_r) == torch.isfinite(lp_o)).all(-1)  # [N, T]
    t = tokens.unsqueeze(-1)
    d_lp = (lp_r.gather(-1, t) - lp_o.gather(-1, t)).squeeze(-1).abs()
    d_lp = torch.where(same_set & torch.isfinite(d_lp), d_lp, torch.zeros_like(d_lp))
    diff = other - ref
    d_logit = (diff - diff.mean(-1, keepdim=True)).abs().amax(-1)
    c_r = lp_r.exp().cumsum(-1)[..., :-1]
    c_o = lp_o.exp().cumsum(-1)[..., :-1]
    inside = (c_r > 1e-6) & (c_r < 1 - 1e-6) & same_set.unsqueeze(-1)
    cc = c_r * (1 - c_r)
    moved = (c_o - c_r).abs()
    ratio = torch.where(inside, moved / cc.clamp_min(1e-12), torch.zeros_like(moved))
    local = moved / (spread[..., :-1] + LOCAL_FLOOR * cc).clamp_min(1e-12)
    local = torch.where(inside, local, torch.zeros_like(local))
    return (
        float(d_lp.max()),
        float(d_logit.max()),
        float(ratio.max()),
        float(local.max()),
        int(d_lp.numel()),
    )


def measure_honest_error(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    dtypes: Sequence[str],
    samples: int,
    steps: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> HonestError:
    """Draw about ``samples`` honest completions of ``steps`` tokens per path (groups of 8 over
    ``prompts``, cycled) and measure each path against the verifier's batched fp32 forward of the
    same tokens (see the module docstring). ``model`` is the version's fp32 model, not changed."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("calibration needs at least one non-empty prompt")
    group = 8
    worst: dict[str, list[float]] = {}
    positions = drawn = 0
    ref_model = model
    alt_name = local_dtype(dtypes)
    alt_model = None if alt_name is None else copy.deepcopy(ref_model).to(getattr(torch, alt_name))
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        cast = ref_model if dtype == "float32" else copy.deepcopy(ref_model).to(dt)
        upcast = None if dtype == "float32" else copy.deepcopy(cast).to(torch.float32)
        for k in range(max(1, math.ceil(samples / group))):
            prompt = list(prompts[k % len(prompts)])
            seeds = [sample_seed(seed * 1_000_003 + k, j) for j in range(group)]
            u = torch.stack([sample_uniforms(s, steps) for s in seeds])  # [n, steps]

            def draw(logits: Any, t: int, u: Any = u) -> Any:
                tok, _ = draw_tokens(
                    logits, u[:, t], temperature=temperature, top_p=top_p, top_k=top_k
                )
                return tok

            tokens, kv = _kv_logits(cast, prompt, group, steps, draw)
            ref = _batched_logits(ref_model, prompt, tokens)
            paths = {f"kv/{dtype}": kv}
            if dtype != "float32":
                paths[f"batched/{dtype}"] = _batched_logits(cast, prompt, tokens)
                paths[f"fp32-compute/{dtype}"] = _batched_logits(upcast, prompt, tokens)
            if alt_model is None:
                spread = torch.zeros_like(ref)
            else:
                alt = _batched_logits(alt_model, prompt, tokens)
                spread = local_cdf_spread(ref, alt, temperature, top_p, top_k)
            for name, logits in paths.items():
                lp, lg, cr, lc, n = _compare(ref, logits, tokens, spread, temperature, top_p, top_k)
                w = worst.setdefault(name, [0.0, 0.0, 0.0, 0.0])
                w[0], w[1], w[2] = max(w[0], lp), max(w[1], lg), max(w[2], cr)
                w[3] = max(w[3], lc)
                positions += n
            drawn += group
    return HonestError(
        logprob=max(w[0] for w in worst.values()),
        logit=max(w[1] for w in worst.values()),
        cdf_rel=max(w[2] for w in worst.values()),
        local=max(w[3] for w in worst.values()),
        local_dtype=alt_name,
        positions=positions,
        samples=drawn,
        paths={k: (w[0], w[1], w[2], w[3]) for k, w in worst.items()},
    )


def admissible_per_position(
    logits: Any,
    u: Any,
    tol: Tolerance,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    alt_logits: Any = None,
    local: float = 0.0,
) -> float:
    """Mean number of tokens the seeded replay admits at a position (``logits [N, V]`` raw, the
    verifier's; ``u [N]`` the positions' uniforms): 1.0 is an exact replay; what a cheater picking
    the best admissible token at each position chooses from (issue 34, finding 2). With
    ``alt_logits [N, V]`` (the verifier's coarser-precision forward of the same positions) each
    bound is widened by ``local`` times their spread, as the check does."""
    from policy.boundary import kept_bounds, replay_admissible

    n, vocab = logits.shape
    bounds = kept_bounds(logits.float(), temperature, top_p, top_k, tol.logit_margin)
    widen = None
    if alt_logits is not None:
        spread = local_cdf_spread(logits.float(), alt_logits.float(), temperature, top_p, top_k)
        widen = local * spread
    count = torch.zeros(n)
    for t in range(vocab):
        targets = torch.full((n,), t, dtype=torch.long)
        ok = replay_admissible(bounds, targets, u, tol.replay_slack, tol.replay_rel_slack, widen)
        count += ok.float()
    return float(count.mean())
