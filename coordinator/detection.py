"""Detection power of the verification against adaptive cheaters, as formulas (issue 34).

A cheater knows the rule (docs/ is public) and counts its own accepted leases, so it knows its
check rate ``r(h)`` (:meth:`coordinator.trust.Trust.rate_after`) — never whether a given lease is
checked (the draw is keyed with the coordinator's secret). Every checked lease is re-scored in
full, so a forged lease that is checked is refused; a forgery whose figure is at least
``intake.ban_multiple`` times its limit bans at once, a subtler one strikes (and the node is then
checked on every lease until released). The functions below give, for each strategy of the
issue, the expected share of forged leases among the cheater's accepted ones up to its first
detection (the cheater's best case: after a detection it is banned or starts over at ``h = 0``)
and the forged leases it takes to be banned with a given probability:

* forge from lease ``h0`` on, every lease (:func:`share_forging_from`): forged accepted
  ``F = Σ_{k≥1} Π_{j<k} (1 − r(h0 + j))``, share ``F / (h0 + F)``; with ``r(h) ≥ 1/(1 + h/P)``
  this is at most ``1/(1 + P)``;
* forge each lease with probability ``p`` (:func:`share_forging_with_probability`): with
  ``S_h`` the probability of no detection before lease ``h``, ``F = Σ_h S_h p (1 − r(h))``,
  ``H = Σ_h S_h (1 − p)``, ``S_{h+1} = S_h (1 − p r(h))``, share ``F / (F + H)``;
* forge at the floor (after ``h_f`` honest leases): the first case at ``h0 = h_f``;
* a fresh identity per lease: the share is ``1 − r(0)`` (0 at ``new_node_check_rate`` 1);
* leases to ban (:func:`forged_leases_to_ban`): every forged lease is caught with probability
  at least the floor ``f``; a gross forgery bans at its first detection, a subtle one at its
  ``strikes_to_ban``-th (strikes never lapse by time): the smallest ``k`` with
  ``P(Binomial(k, f) ≥ s) ≥ q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["forged_leases_to_ban", "share_forging_from", "share_forging_with_probability"]

Rate = Callable[[int], float]

#: Survival probability below which a sum is cut off (its tail adds less than this per lease).
_TAIL = 1e-12
_MAX_LEASES = 10_000_000


def share_forging_from(rate: Rate, h0: int) -> float:
    """Expected forged share of a cheater that is honest for ``h0`` leases, then forges every
    lease until detected (see the module docstring)."""
    forged, survive = 0.0, 1.0
    for j in range(_MAX_LEASES):
        survive *= 1.0 - rate(h0 + j)
        if survive < _TAIL:
            break
        forged += survive
    return forged / (h0 + forged) if h0 + forged > 0 else 0.0


def share_forging_with_probability(rate: Rate, p: float) -> float:
    """Expected forged share of a cheater that forges each lease with probability ``p``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    forged = honest = 0.0
    survive = 1.0
    for h in range(_MAX_LEASES):
        r = rate(h)
        forged += survive * p * (1.0 - r)
        honest += survive * (1.0 - p)
        survive *= 1.0 - p * r
        if survive < _TAIL or (p == 0.0 and h > 0):
            break
    return forged / (forged + honest) if forged + honest > 0 else 0.0


def forged_leases_to_ban(floor: float, strikes: int, prob: float = 0.99) -> int:
    """Forged leases within which a cheater is banned with probability ``prob`` when each forged
    lease is caught with probability at least ``floor`` and ``strikes`` detections ban."""
    if not (0.0 < floor <= 1.0 and strikes >= 1 and 0.0 < prob < 1.0):
        raise ValueError("need 0 < floor <= 1, strikes >= 1, 0 < prob < 1")
    k = strikes
    while True:
        # P(Binomial(k, floor) >= strikes)
        below = sum(math.comb(k, i) * floor**i * (1 - floor) ** (k - i) for i in range(strikes))
        if 1.0 - below >= prob:
            return k
        k += 1
