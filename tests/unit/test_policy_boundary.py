"""policy.boundary: the kept sets another machine's rounding may give, and what they admit.

For random logits (with exact ties, the case that broke a test on another CPU) and random
settings, a second machine is simulated by moving every logit by less than the margin: its kept
set must lie between ``inner`` and ``outer``, its log-prob inside the admissible interval (up to
the value change the tolerance absorbs) and its inverse-CDF draw admissible. With no margin and
no ties, both sets are exactly the processed distribution's."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from policy.boundary import (
    EXACT_OPTIONAL_MAX,
    TOP_P_ROUNDING,
    KeptBounds,
    kept_bounds,
    logprob_interval,
    replay_admissible,
)
from policy.draw import draw_tokens, processed_logprobs


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, float, float, int, int]:
    vocab = draw(st.integers(2, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * 2
    ties = draw(st.integers(0, min(4, vocab - 1)))
    for i in range(ties):  # exact ties, as tied embeddings or rounding produce
        logits[i + 1] = logits[0]
    temperature = draw(st.floats(0.3, 2.0))
    top_p = draw(st.floats(0.01, 1.0))
    top_k = draw(st.integers(0, vocab))
    return logits, temperature, top_p, top_k, seed


def _seeded_case(
    seed: int, vocab: int, t: float, p: float, k: int
) -> tuple[torch.Tensor, float, float, int, int]:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return logits * 2, t, p, k, seed


@settings(max_examples=300, deadline=None)
@given(cases(), st.floats(1e-6, 0.2))
# top_p one unit below 1: the node's fp32 nucleus drops a tail token of mass 2e-9 (its mass above
# rounds to 1.0), which the float64 bounds once counted surely kept (a CI failure, stop 46)
@example(_seeded_case(0, 3, 0.375, 0.9999999999999999, 0), 0.125)
def test_another_machines_kept_set_lies_between_the_bounds(
    case: tuple[torch.Tensor, float, float, int, int], margin: float
) -> None:
    logits, t, p, k, seed = case
    gen = torch.Generator().manual_seed(seed + 1)
    moved = logits + (torch.rand(logits.shape, generator=gen, dtype=torch.float64) * 2 - 1) * (
        margin * 0.999
    )
    bounds = kept_bounds(logits[None], t, p, k, margin)
    kept = torch.isfinite(processed_logprobs(moved[None], t, p, k))
    assert bool((kept <= bounds.outer).all()), "a token the other machine keeps is not admissible"
    assert bool((bounds.inner <= kept).all()), "a surely-kept token was dropped elsewhere"
    u = torch.rand(1, generator=gen)
    tok, lp = draw_tokens(moved[None], u, temperature=t, top_p=p, top_k=k)
    # moving every logit by < m moves each CDF value by < expm1(2m/T) of the mass: the slack
    # a replay needs to admit such a machine's draws (the per-dtype replay_slack is calibrated)
    slack = math.expm1(2 * margin / t) + 1e-6
    assert bool(replay_admissible(bounds, tok, u, slack=slack).all())
    lo, hi = logprob_interval(bounds, tok)
    value_change = 2 * margin / t + 1e-4  # what the tolerance, not the interval, absorbs
    assert lo.item() - value_change <= lp.item() <= hi.item() + value_change


#: a CI failure (stop 51): token 29's higher-ranked mass is top_p - 1.4e-5, within the nucleus
#: test's rounding tolerance, so it is possibly kept by design; the test once measured that
#: margin on the processed (renormalized) distribution and missed it
_NEAR_TOP_P = torch.tensor([
    -1.7853, -1.7853, -1.7853, -0.4108, 3.0249, 0.7530, 1.7051, 1.5678, 0.4053, 0.7985, -0.6059,
    2.8860, -0.1034, 1.3033, 2.0589, -2.5771, 1.4596, -1.6582, 1.0414, -1.1785, 1.3120, 1.8276,
    2.0080, 1.8701, -0.1977, 2.7021, -0.0908, -1.8847, 3.5488, -2.2111,
], dtype=torch.float64)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(cases())
@example((_NEAR_TOP_P, 1.875, 0.99, 0, 1296145))
def test_without_margin_and_ties_the_bounds_are_the_processed_set(
    case: tuple[torch.Tensor, float, float, int, int],
) -> None:
    logits, t, p, k, _ = case
    if len(set(logits.tolist())) < logits.numel():
        logits = logits + torch.arange(logits.numel(), dtype=logits.dtype) * 1e-3  # untie
    bounds = kept_bounds(logits[None], t, p, k, 0.0)
    logp = processed_logprobs(logits[None], t, p, k)
    kept = torch.isfinite(logp)
    # a token whose higher-ranked mass lies within the nucleus test's rounding tolerance of top_p
    # is possibly kept by design, not surely: that mass is the one the nucleus tests, after
    # temperature and top-k and before the nucleus (not the renormalized processed distribution)
    pre = processed_logprobs(logits[None], t, 1.0, k)
    probs = torch.sort(torch.softmax(pre.double(), -1)[0], descending=True).values
    assume(bool(((torch.cumsum(probs, 0) - probs - p).abs() > TOP_P_ROUNDING).all()) or p >= 1.0)
    assert torch.equal(bounds.inner, kept) and torch.equal(bounds.outer, kept)
    targets = torch.tensor([int(torch.argmax(logits))])
    lo, hi = logprob_interval(bounds, targets)
    assert lo.item() == hi.item()
    assert math.isclose(lo.item(), logp[0, targets[0]].item(), abs_tol=1e-5)


def test_a_tie_at_the_kth_logit_admits_either_set() -> None:
    """Logits (3, 2, 1, 1) with top-3 keep both 1s (ties at the k-th logit are kept); a machine
    that rounds one of them down keeps one. Both renormalisations are admissible: the interval
    runs from the largest set to the surely-kept one (a conservative bound: it also admits the
    set without either 1)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0]])
    bounds = kept_bounds(logits, top_k=3, margin=1e-6)
    assert bounds.inner.tolist() == [[True, True, False, False]]
    assert bounds.outer.tolist() == [[True, True, True, True]]
    lo, hi = logprob_interval(bounds, torch.tensor([0]))
    both = math.log(math.exp(3) / (math.exp(3) + math.exp(2) + 2 * math.e))
    one = math.log(math.exp(3) / (math.exp(3) + math.exp(2) + math.e))
    surely = math.log(math.exp(3) / (math.exp(3) + math.exp(2)))
    assert math.isclose(lo.item(), both, rel_tol=1e-6)
    assert math.isclose(hi.item(), surely, rel_tol=1e-6)
    assert lo.item() < one < hi.item()
    out_lo, _ = logprob_interval(bounds, torch.tensor([1]))
    assert math.isfinite(out_lo.item())
    # a token no machine keeps stays inadmissible
    far = kept_bounds(torch.tensor([[3.0, 2.0, 1.0, -5.0]]), top_k=3, margin=1e-3)
    lo, hi = logprob_interval(far, torch.tensor([3]))
    assert lo.item() == hi.item() == -math.inf


def _draws_of_closed_sets(bounds: KeptBounds, t: int, u: float, lo: float, hi: float) -> bool:
    """Reference for the exact replay: enumerate every kept set ``inner ∪ O`` (``O`` a subset of
    the optional tokens closed upwards under the margin) in float64, one position."""
    x, e = bounds.x[0].double(), bounds.e[0].double()
    inner = [i for i in range(x.numel()) if bounds.inner[0, i]]
    optional = [i for i in range(x.numel()) if bounds.outer[0, i] and not bounds.inner[0, i]]
    for r in range(len(optional) + 1):
        for chosen in itertools.combinations(optional, r):
            if any(x[a] > x[b] + bounds.d for b in chosen for a in optional if a not in chosen):
                continue  # a token ranked surely above a member is missing: no machine keeps it
            members = set(inner) | set(chosen)
            if t not in members:
                continue
            f = u * sum(e[j] for j in members) - sum(e[j] for j in members if j < t)
            if lo <= f < hi:
                return True
    return False


@settings(max_examples=300, deadline=None)
@given(cases(), st.floats(0.01, 0.5), st.floats(0.0, 1.0))
def test_the_replay_tests_each_kept_set_an_honest_machine_can_hold(
    case: tuple[torch.Tensor, float, float, int, int], margin: float, u_value: float
) -> None:
    """With up to EXACT_OPTIONAL_MAX optional tokens the replay admits ``t`` iff one kept set of
    the closed family draws it (against a brute-force enumeration), not whenever the hull of
    ``f`` over all subsets reaches ``[0, e_t)``: a token lying between two sets' draws."""
    logits, t_, p, k, _ = case
    bounds = kept_bounds(logits[None], t_, p, k, margin)
    vocab = logits.numel()
    assume(int((bounds.outer & ~bounds.inner).sum()) <= EXACT_OPTIONAL_MAX)
    u = torch.tensor([u_value], dtype=logits.dtype)
    for t in range(vocab):
        got = bool(replay_admissible(bounds, torch.tensor([t]), u, slack=0.0)[0])
        z = float(bounds.e[0][bounds.outer[0]].sum())
        # the reference with a hair of slack either way: float rounding at a bound decides nothing
        loose = _draws_of_closed_sets(
            bounds, t, u_value, -1e-9 * z, float(bounds.e[0, t]) + 1e-9 * z
        )
        tight = _draws_of_closed_sets(
            bounds, t, u_value, 1e-9 * z, float(bounds.e[0, t]) - 1e-9 * z
        )
        assert tight <= got <= loose, f"token {t}: replay {got}, reference {tight}/{loose}"


def test_a_draw_only_an_impossible_kept_set_gives_is_refused() -> None:
    """Logits (−0.23, −0.36, −0.72, −0.31, 1.38), top-p 0.72, margin 0.05 (d = 0.1): token 4 is
    surely kept, tokens 0, 1 and 3 possibly. Token 0 lies more than d above token 1, so every
    machine that keeps 1 keeps 0, which comes first in id order with ~14 % of the mass: at u = 0.1
    the draw is 0 (or, without 1, 0 or 4), never 1. The hull over every subset of the optional
    tokens counted the set {4, 1}, where 1 comes first, and admitted it."""
    logits = torch.tensor([[-0.23, -0.36, -0.72, -0.31, 1.38]], dtype=torch.float64)
    bounds = kept_bounds(logits, top_p=0.72, margin=0.05)
    assert bounds.inner.tolist() == [[False, False, False, False, True]]
    assert bounds.outer.tolist() == [[True, True, False, True, True]]
    u = torch.tensor([0.1], dtype=torch.float64)
    admitted = [t for t in range(5) if bool(replay_admissible(bounds, torch.tensor([t]), u, 0.0))]
    assert 1 not in admitted and 0 in admitted
    for t in range(5):
        assert (t in admitted) == _draws_of_closed_sets(bounds, t, 0.1, 0.0, float(bounds.e[0, t]))
