"""Top-k / top-p boundary tokens: what another machine's rounding may legitimately change.

Two honest machines compute logits that differ by rounding. Away from the top-k / top-p
boundaries that only moves a log-prob a little (the tolerance of the spot check absorbs it). At a
boundary it can flip whether a token is kept at all: a tie at the k-th logit, or a token whose
higher-ranked mass sits within rounding of ``top_p``. The node then renormalises over another set
and every log-prob of that position shifts by the flipped token's mass (0.17 in a test run on a
different CPU), and its inverse-CDF draws move with it.

So the verifier does not compute one kept set but two, for a *logit margin* ``m`` (raw logits of
two honest machines differ by at most ``m``, calibrated per dtype: bench/calibrate_verifier.py):

* ``inner``: tokens kept whatever the rounding within ``m`` (surely kept);
* ``outer``: tokens kept for some rounding within ``m`` (possibly kept), ``inner ⊆ outer``.

Any honest node's kept set ``S`` lies between them. Then for a token ``t`` the admissible
log-prob is the interval :func:`logprob_interval` over those sets, and ``t`` is an admissible
inverse-CDF draw at ``u`` if it is for some such ``S`` (:func:`replay_admissible`). Not every
set between them is possible: a kept set is a prefix of its machine's ranking, and two tokens
whose ``x`` differ by more than ``d`` are ranked alike on every honest machine, so the replay tests
the sets ``inner ∪ O`` with ``O`` closed upwards under ``d`` (up to :data:`EXACT_OPTIONAL_MAX`
optional tokens; above, the hull of all subsets). Where
``inner == outer`` (nearly everywhere) both reduce to the exact single-set answers. With
``x = logits / T`` and ``d = 2m / T`` (both machines may move by ``m``):

* top-k: ``i ∈ outer_k`` iff ``#{j : x_j > x_i + d} < k``; ``i ∈ inner_k`` iff
  ``#{j ≠ i : x_j ≥ x_i − d} < k`` (ties at the k-th logit are kept, so they count as above);
* top-p, with ``e_j = exp(x_j − max x)``: ``i ∈ outer`` iff ``i ∈ outer_k`` and
  ``e^{−d} · Σ_{j ∈ inner_k, x_j > x_i + d} e_j / Σ_{j ∈ outer_k} e_j < top_p``
  (a lower bound of the mass ranked above ``i`` on any honest machine); ``i ∈ inner`` iff
  ``i ∈ inner_k`` and ``N / (N + R) < top_p`` with ``N = e^{d} · Σ_{j ∈ outer_k, j ≠ i,
  x_j ≥ x_i − d} e_j`` and ``R = e_i + Σ_{j ∈ inner_k, x_j < x_i − d} e_j`` (an upper bound).

A node computes the mass ranked above a token in fp32 (a softmax, then a cumulative sum) and
compares it with ``top_p`` rounded to fp32, so a token whose exact mass above lies within that
rounding of ``top_p`` may go either way even on one machine: the nucleus comparisons carry a mass
tolerance :data:`TOP_P_ROUNDING` on both sides (``< top_p + r`` for ``outer``, ``< top_p − r``
for ``inner``). It matters where ``top_p`` sits within rounding of 1 (a tail token of mass 2e-9
was dropped by the node and counted surely kept; issue 34); elsewhere the logit margin's factor
``e^{±d}`` is far wider.

Everything is vectorised over leading dimensions (one sort and a few prefix sums per position).

The replay's CDF bounds may also be widened per position and bound (:func:`local_cdf_spread`):
by how far the verifier's own forward in a coarser precision (bf16) moves each bound from its
fp32 forward. Rounding moves a bound where the distribution is sensitive to it, so a slack
proportional to that local spread admits far fewer tokens than one global slack sized for the
worst position (issue 34: 1.12 → about 1.04 tokens per position on the embedded model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policy.draw import processed_logprobs

__all__ = [
    "DEFAULT_LOGIT_MARGIN",
    "EXACT_OPTIONAL_MAX",
    "LOCAL_WINDOW",
    "TOP_P_ROUNDING",
    "KeptBounds",
    "kept_bounds",
    "local_cdf_spread",
    "logprob_interval",
    "replay_admissible",
]

#: Bounds on either side (token-id order) over which :func:`local_cdf_spread` takes its maximum:
#: two forwards can agree at one bound by chance while a third machine's rounding moves it.
LOCAL_WINDOW = 2

#: Default logit margin per dtype (raw-logit difference two honest machines may show), from
#: honest runs (bench/calibrate_verifier.py; docs/reliability.md "Calibration"). The coordinator's
#: ``intake.tolerances`` default to these; tests compare across code paths with them.
DEFAULT_LOGIT_MARGIN: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}

#: Absolute tolerance on the mass compared with ``top_p``: 2^-16, 256 fp32 units in the last place
#: at 1.0. It covers the node's fp32 rounding of ``top_p`` itself (half a unit), of the softmax (a
#: few units) and of the cumulative sum of the higher-ranked mass (at most one unit per term summed
#: for a sum that stays below 1, and a rounding walk of about the square root of that in practice:
#: a cumulative sum over 65,536 terms stays inside it). Widening the nucleus test by it makes a
#: token "possibly kept" only where its higher-ranked mass lies within 1.5e-5 of ``top_p``.
TOP_P_ROUNDING = 2.0**-16

#: Optional tokens (possibly but not surely kept) a position may have for the replay to test each
#: kept set an honest machine can hold (``2^n`` subsets); above it, the hull over all of them.
EXACT_OPTIONAL_MAX = 8

#: Elements per position chunk of the exact test (positions x subsets x slots): ~32 MB of int64
_EXACT_CHUNK = 2**22


@dataclass(frozen=True)
class KeptBounds:
    """The two kept sets of every position (``[..., V]``) and the values they are built on."""

    #: ``logits / temperature`` in fp32 (or the logits' dtype if wider)
    x: torch.Tensor
    #: ``exp(x − max x)`` per position
    e: torch.Tensor
    #: surely kept (whatever the rounding within the margin)
    inner: torch.Tensor
    #: possibly kept (for some rounding within the margin); ``inner ⊆ outer``
    outer: torch.Tensor
    #: ``2 · margin / temperature``: two tokens whose ``x`` differ by more are ranked alike on
    #: every honest machine
    d: float = 0.0


def _masked_sums_above(
    asc: torch.Tensor, e_asc: torch.Tensor, mask_asc: torch.Tensor, c: torch.Tensor, strict: bool
) -> torch.Tensor:
    """``Σ_{j ∈ mask, x_j > c}`` (``strict``) or ``x_j ≥ c`` of ``e_j``, for every entry of
    ``c [..., V]``; ``asc`` are the values sorted ascending with ``e_asc``/``mask_asc`` aligned."""
    w = torch.where(mask_asc, e_asc, torch.zeros_like(e_asc))
    suffix = torch.flip(torch.cumsum(torch.flip(w, [-1]), -1), [-1])  # suffix[i] = Σ_{j ≥ i}
    suffix = torch.cat([suffix, torch.zeros_like(suffix[..., :1])], -1)
    idx = torch.searchsorted(asc, c.contiguous(), right=strict)
    return suffix.gather(-1, idx)


def kept_bounds(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    margin: float = 0.0,
) -> KeptBounds:
    """The surely-kept and possibly-kept sets of every position of raw ``logits [..., V]`` for
    the processing ``temperature → top-k → top-p`` when logits may differ by ``margin``."""
    x = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    if temperature != 1.0:
        x = x / temperature
    d = 2.0 * margin / temperature
    vocab = x.shape[-1]
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    asc, order = torch.sort(x, -1)
    asc = asc.contiguous()
    everything = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < vocab:
        above_out = vocab - torch.searchsorted(asc, (x + d).contiguous(), right=True)
        above_in = vocab - torch.searchsorted(asc, (x - d).contiguous(), right=False) - 1
        outer_k, inner_k = above_out < top_k, above_in < top_k
    else:
        outer_k, inner_k = everything, everything
    if top_p >= 1.0:
        return KeptBounds(x, e, inner_k, outer_k, d)
    e_asc = e.gather(-1, order)
    in_asc, out_asc = inner_k.gather(-1, order), outer_k.gather(-1, order)
    z_out = torch.where(outer_k, e, torch.zeros_like(e)).sum(-1, keepdim=True)
    z_in = torch.where(inner_k, e, torch.zeros_like(e)).sum(-1, keepdim=True)
    grow, shrink = (
        torch.exp(torch.tensor(d, dtype=x.dtype)),
        torch.exp(torch.tensor(-d, dtype=x.dtype)),
    )
    # lower bound of the mass above i on any honest machine -> possibly kept
    surely_above = _masked_sums_above(asc, e_asc, in_asc, x + d, strict=True)
    outer = outer_k & (shrink * surely_above / z_out < top_p + TOP_P_ROUNDING)
    # upper bound of the mass above i -> surely kept
    maybe_above = _masked_sums_above(asc, e_asc, out_asc, x - d, strict=False) - e
    n_hi = grow * maybe_above.clamp_min(0.0)
    below_in = z_in - _masked_sums_above(asc, e_asc, in_asc, x - d, strict=False)
    r_lo = e + below_in.clamp_min(0.0)
    # a token nothing may outrank is first on every machine, and the first token is always kept
    inner = inner_k & ((n_hi <= 0.0) | (n_hi / (n_hi + r_lo) < top_p - TOP_P_ROUNDING))
    return KeptBounds(x, e, inner & outer, outer, d)


def logprob_interval(
    bounds: KeptBounds, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` of the log-prob of ``targets [...]`` over every kept set between ``inner``
    and ``outer``: ``lo = x_t − log Σ_outer e^x`` (largest set), ``hi = x_t − log Σ_{inner ∪ {t}}
    e^x`` (smallest set holding ``t``). Both are ``-inf`` when ``t`` is not even possibly kept."""
    t = targets.unsqueeze(-1)
    e_t = bounds.e.gather(-1, t).squeeze(-1)
    x_t = bounds.x.gather(-1, t).squeeze(-1)
    zero = torch.zeros_like(bounds.e)
    z_out = torch.where(bounds.outer, bounds.e, zero).sum(-1)
    in_t = bounds.inner.gather(-1, t).squeeze(-1)
    z_in = torch.where(bounds.inner, bounds.e, zero).sum(-1) + torch.where(in_t, 0.0, e_t)
    shift = bounds.x.max(-1).values
    lo = x_t - shift - torch.log(z_out)
    hi = x_t - shift - torch.log(z_in)
    possible = bounds.outer.gather(-1, t).squeeze(-1)
    ninf = torch.full_like(lo, float("-inf"))
    return torch.where(possible, lo, ninf), torch.where(possible, hi, ninf)


def local_cdf_spread(
    ref_logits: torch.Tensor,
    alt_logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    window: int = LOCAL_WINDOW,
) -> torch.Tensor:
    """``[..., V]``: at every CDF bound ``k`` (``cdf[k] = Σ_{j ≤ k} p_j`` of the processed
    distribution in token-id order), the largest ``|cdf_alt − cdf_ref|`` over the bounds within
    ``window`` of ``k``, for two forwards of the same positions (raw logits ``[..., V]``: the
    verifier's fp32 and its coarser-precision one), both over the reference's top-k/top-p kept
    set. The last bound (``cdf = 1``) is 0."""
    if ref_logits.shape != alt_logits.shape:
        raise ValueError(f"logits of shape {tuple(ref_logits.shape)} and "
                         f"{tuple(alt_logits.shape)}: the two forwards must cover the same "
                         "positions")  # fmt: skip
    lp_ref = processed_logprobs(ref_logits, temperature, top_p, top_k)
    # the alt forward over the reference's kept set: a boundary token the two keep differently
    # is the logit margin's business (kept_bounds), not a rounding of the bounds
    x_alt = alt_logits.float() / temperature
    x_alt = torch.where(torch.isfinite(lp_ref), x_alt, torch.full_like(x_alt, -torch.inf))
    c_ref = lp_ref.exp().cumsum(-1)
    c_alt = torch.softmax(x_alt, -1).cumsum(-1)
    d = (c_alt - c_ref).abs()
    d[..., -1] = 0.0
    if window > 0:
        vocab = d.shape[-1]
        flat = d.reshape(-1, 1, vocab)
        d = torch.nn.functional.max_pool1d(flat, 2 * window + 1, 1, window).reshape(d.shape)
        d[..., -1] = 0.0
    return d


def replay_admissible(
    bounds: KeptBounds,
    targets: torch.Tensor,
    u: torch.Tensor,
    slack: float,
    rel_slack: float = 0.0,
    local: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whether each of ``targets [...]`` is the inverse-CDF draw at ``u [...]`` for some kept
    set ``S`` between ``inner`` and ``outer`` (each bound widened by ``slack`` probability mass).

    With ``S`` fixed the draw is ``t`` iff ``0 ≤ f(S) < e_t`` where ``f(S) = u·Σ_S e −
    Σ_{j ∈ S, j < t} e_j`` (``cdf(t−1) ≤ u < cdf(t)``). ``f`` grows with the optional tokens above
    ``t`` in id order and shrinks with those below, so over all ``S`` it ranges over
    ``[f_min, f_max]``; the draw is admissible iff ``f_max ≥ −s_lo·Z`` and ``f_min < e_t +
    s_hi·Z`` (``Z = Σ_outer e``), ``s = slack + rel_slack · c (1 − c)`` at the bound's CDF value
    ``c``: a raw-logit error moves ``cdf[k]`` by ``c (1 − c)`` times the difference of the mean
    errors below and above ``k`` (to first order), so the calibrated ``rel_slack`` widens the
    bounds where rounding can move them and not at the ends of the CDF. ``local [..., V]``
    (optional) adds a widening per bound: ``local[k]`` at the bound ``cdf[k]``, so ``local[t −
    1]`` at the lower bound of ``t`` (none for ``t = 0``) and ``local[t]`` at its upper bound
    (the calibrated factor times :func:`local_cdf_spread`)."""
    t = targets.unsqueeze(-1)
    zero = torch.zeros_like(bounds.e)
    e_in = torch.where(bounds.inner, bounds.e, zero)
    e_out = torch.where(bounds.outer, bounds.e, zero)
    cum_in, cum_out = e_in.cumsum(-1), e_out.cumsum(-1)
    e_t = bounds.e.gather(-1, t).squeeze(-1)
    tot_in, tot_out = cum_in[..., -1], cum_out[..., -1]
    upto_in = cum_in.gather(-1, t).squeeze(-1)  # Σ_{j ≤ t}
    upto_out = cum_out.gather(-1, t).squeeze(-1)
    in_t = bounds.inner.gather(-1, t).squeeze(-1)
    out_t = bounds.outer.gather(-1, t).squeeze(-1)
    below_in = upto_in - torch.where(in_t, e_t, torch.zeros_like(e_t))
    below_out = upto_out - torch.where(out_t, e_t, torch.zeros_like(e_t))
    above_in, above_out = tot_in - upto_in, tot_out - upto_out
    uf = u.to(e_t.dtype)
    f_max = uf * e_t + uf * above_out - (1.0 - uf) * below_in
    f_min = uf * e_t + uf * above_in - (1.0 - uf) * below_out
    z = tot_out
    c_lo = (below_out / z).clamp(0.0, 1.0)
    c_hi = ((below_in + e_t) / z).clamp(0.0, 1.0)
    s_lo = slack + rel_slack * c_lo * (1.0 - c_lo)
    s_hi = slack + rel_slack * c_hi * (1.0 - c_hi)
    if local is not None:
        lw = local.to(e_t.dtype)
        s_lo = s_lo + torch.where(
            targets > 0, lw.gather(-1, (t - 1).clamp_min(0)).squeeze(-1), torch.zeros_like(e_t)
        )
        s_hi = s_hi + lw.gather(-1, t).squeeze(-1)
    hull = out_t & (f_max >= -s_lo * z) & (f_min < e_t + s_hi * z)
    return _exact_sets(bounds, targets, hull, uf, below_in, tot_in, in_t, -s_lo * z,
                       e_t + s_hi * z)  # fmt: skip


def _exact_sets(
    bounds: KeptBounds,
    targets: torch.Tensor,
    hull: torch.Tensor,
    u: torch.Tensor,
    below_in: torch.Tensor,
    tot_in: torch.Tensor,
    in_t: torch.Tensor,
    f_lo: torch.Tensor,
    f_hi: torch.Tensor,
) -> torch.Tensor:
    """``hull`` narrowed, where a position has at most :data:`EXACT_OPTIONAL_MAX` optional tokens
    (possibly but not surely kept), to the kept sets an honest machine can hold: every ``S =
    inner ∪ O`` with ``O`` a subset of the optional tokens that is *closed upwards* (a token whose
    ``x`` lies more than ``d`` above one in ``O`` is in ``O`` too: both machines rank them alike,
    and every kept set is a prefix of its machine's ranking). ``t`` is admissible iff ``t ∈ S`` and
    ``f(S) = u · Σ_S e − Σ_{j ∈ S, j < t} e_j`` lies in ``[f_lo, f_hi)`` for one such ``S``."""
    opt = bounds.outer & ~bounds.inner
    n_opt = opt.sum(-1)
    sel = hull & (n_opt > 0) & (n_opt <= EXACT_OPTIONAL_MAX)
    if not bool(sel.any()):
        return hull
    where = sel.nonzero(as_tuple=True)
    args = (bounds.x[where], bounds.e[where], opt[where], n_opt[where], targets[where], u[where],
            below_in[where], tot_in[where], in_t[where], f_lo[where], f_hi[where])  # fmt: skip
    width = int(n_opt[where].max())
    rows = max(1, _EXACT_CHUNK // (2**width * width))  # positions per chunk: bounded memory
    found = torch.cat([_any_set(bounds.d, width, *(a[k : k + rows] for a in args))
                       for k in range(0, len(args[0]), rows)])  # fmt: skip
    narrowed = hull.clone()
    narrowed[where] = found
    return narrowed


def _any_set(
    d: float,
    width: int,
    x: torch.Tensor,
    e: torch.Tensor,
    opt: torch.Tensor,
    n_opt: torch.Tensor,
    t: torch.Tensor,
    u: torch.Tensor,
    below_in: torch.Tensor,
    tot_in: torch.Tensor,
    in_t: torch.Tensor,
    f_lo: torch.Tensor,
    f_hi: torch.Tensor,
) -> torch.Tensor:
    """:func:`_exact_sets` for ``P`` positions (rows ``[P, V]`` / ``[P]``) with at most ``width``
    optional tokens each."""
    # the optional tokens, highest x first; slots past a position's count are padding
    ox, slot = torch.where(opt, x, torch.full_like(x, -torch.inf)).topk(width, -1)  # [P, W]
    real = torch.arange(width, device=x.device) < n_opt.unsqueeze(-1)
    oe = torch.where(real, e.gather(-1, slot), torch.zeros_like(ox))
    pos = 1 << torch.arange(width, device=x.device)  # slot a's bit
    subset = torch.arange(2**width, device=x.device)  # [M]: bit a set = slot a's token in S
    member = (subset.unsqueeze(-1) & pos).bool()  # [M, W]
    # slots ranked surely above slot b (more than d higher): S holding b must hold them all
    above = (ox.unsqueeze(-1) > ox.unsqueeze(-2) + d) & real.unsqueeze(-1)  # [P, a, b]
    need = (above.long() * pos.unsqueeze(-1)).sum(-2)  # [P, b] bitmask of a
    missing = (need.unsqueeze(1) & ~subset.view(1, -1, 1)) != 0  # [P, M, b]
    closed = ~(member.unsqueeze(0) & missing).any(-1)  # [P, M]
    padding = (subset.unsqueeze(0) >> n_opt.unsqueeze(-1)) != 0  # a padding slot's bit set
    w = member.to(e.dtype).unsqueeze(0) * oe.unsqueeze(1)  # [P, M, W] the members' e
    z_s = tot_in.unsqueeze(-1) + w.sum(-1)
    below_s = below_in.unsqueeze(-1) + (w * (slot < t.unsqueeze(-1)).unsqueeze(1)).sum(-1)
    holds_t = in_t.unsqueeze(-1) | (
        member.unsqueeze(0) & (slot == t.unsqueeze(-1)).unsqueeze(1)
    ).any(-1)
    f = u.unsqueeze(-1) * z_s - below_s
    ok = closed & ~padding & holds_t & (f >= f_lo.unsqueeze(-1)) & (f < f_hi.unsqueeze(-1))
    return ok.any(-1)
