"""Trust a patient cheater cannot outwait (issue 34, findings 3 and 5), with its power stated.

The formulas of coordinator/detection.py evaluated on the real check-rate schedule
(coordinator/trust.py) for every strategy of the issue, and the mechanics behind them on the real
core: a forgery far beyond any honest error bans at once and withdraws what the trainer has not
consumed; strikes do not lapse with time."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from coord_harness import Harness, sampled

from coordinator.config import IntakeSection
from coordinator.detection import (
    forged_leases_to_ban,
    share_forging_from,
    share_forging_with_probability,
)
from coordinator.logprobs import CalibrationSettings, InProcessLogprobVerifier
from coordinator.store import Store
from coordinator.trust import Trust
from policy.model import ModelSpec, build_model
from protocol.errors import ReasonCode
from protocol.messages import Ack, Reject, pack_logprobs, unpack_logprobs, unpack_tokens

EPS = 0.01


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0).eval()


def test_forged_share_is_bounded_for_every_strategy(tmp_path: Path) -> None:
    trust = Trust(Store(tmp_path / "s.sqlite"), IntakeSection())
    rate = trust.rate_after
    h_f = trust.leases_to_floor()
    # forge after n honest leases (n = 0 ... well past the floor), every lease until caught
    worst_from = max(share_forging_from(rate, n) for n in [*range(0, 400, 7), h_f, 3 * h_f])
    assert worst_from <= EPS
    # forge at the floor: the same at n = h_f (19 forged accepted against 1,900 honest)
    assert share_forging_from(rate, h_f) == pytest.approx(19 / (1900 + 19), rel=0.02)
    # forge each lease with probability p
    worst_p = max(share_forging_with_probability(rate, p) for p in
                  (1e-3, 0.01, 0.02, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0))  # fmt: skip
    assert worst_p <= EPS + 1e-9
    # a fresh identity per lease: its first lease is always checked
    assert 1.0 - rate(0) == 0.0


def test_the_old_schedule_failed_these_bounds(tmp_path: Path) -> None:
    """The rate that halved every 2 passed checks (floor after ~9 checks, ~52 leases): forging
    at the floor gave 19 forged against ~52 honest leases, 27% of the accepted ones."""

    def old(h: int) -> float:  # clean checks ~ leases checked: the halving in leases
        checks, rate = 0.0, 1.0
        for _ in range(h):
            checks += rate
            rate = max(0.05, 0.5 ** (checks / 2.0))
        return rate

    assert share_forging_from(old, 52) > 0.2


def test_a_cheater_is_banned_within_a_bounded_number_of_forged_leases() -> None:
    # every forged lease is caught with probability >= the floor 0.05
    assert forged_leases_to_ban(0.05, 1) == 90  # gross forgery: banned at the first detection
    assert forged_leases_to_ban(0.05, 3) == 165  # subtle: three strikes (they never lapse)
    with pytest.raises(ValueError):
        forged_leases_to_ban(0.0, 1)


def _harness(tmp_path: Path, model: Any, **intake: Any) -> Harness:
    h = Harness(
        tmp_path,
        intake={"spot_check_fraction": 1.0, **intake},
        sampling={"max_new_tokens": 8},
        reputation={"strikes_to_ban": 3},
    )
    h.verifier = InProcessLogprobVerifier(
        lambda v: model, h.cfg.intake.tolerances, cache_size=2,
        # strikes and bans of log-prob forgeries, not the replay's slack: no second (bf16)
        # forward per check (test_calibrated_tolerance covers the local slack)
        calibration=CalibrationSettings(samples=64, local=False),
    )  # fmt: skip
    h.reopen()
    h.publish(1)
    return h


def _forged(sub: Any, shift: float) -> Any:
    def move(s: Any) -> Any:
        lps = [min(0.0, x + shift) for x in unpack_logprobs(s.logprobs)]
        return msgspec.structs.replace(s, logprobs=pack_logprobs(lps))

    return msgspec.structs.replace(
        sub, groups=[msgspec.structs.replace(g, samples=[move(s) for s in g.samples])
                     for g in sub.groups],
    )  # fmt: skip


async def test_a_gross_forgery_bans_at_once_and_withdraws_unconsumed_work(
    tmp_path: Path, model: Any
) -> None:
    h = _harness(tmp_path, model)
    node = h.node()
    first = await h.core.submit(node.public_key, sampled(h.lease(node, 2), model))
    assert isinstance(first, Ack), first
    consumed = h.store.max_rollout_seq()
    h.core.learner_report(1, consumed, 1.0)  # the trainer consumed the first lease
    second = await h.core.submit(node.public_key, sampled(h.lease(node, 2), model))
    assert isinstance(second, Ack), second
    pending = h.store.rollout_count() - consumed
    assert pending > 0
    # every log-prob 2 nats off: hundreds of times the calibrated limit
    bad = await h.core.submit(node.public_key, _forged(sampled(h.lease(node, 1), model), -2.0))
    assert isinstance(bad, Reject) and bad.code is ReasonCode.LOGPROB_MISMATCH, bad
    ban = h.core.reputation.banned(node.public_key, h.clock())
    assert ban is not None and "far beyond" in ban.reason
    # what the trainer had not consumed is gone, its prompts back in the queue
    assert h.store.rollout_count() == consumed
    assert h.core.fetch_rollouts(consumed, 100).rollouts == []
    withdrawn = [e.data() for e in h.core.receipts.entries() if e.kind == "withdrawn"]
    assert withdrawn == [
        {"node": node.fingerprint, "rollouts": pending, "prompts": 2,
         "consumed_before": consumed, "cursor": consumed},
    ]  # fmt: skip
    assert len(h.store.pending_prompts(10)) >= 2


async def test_subtle_forgeries_strike_and_strikes_do_not_lapse(tmp_path: Path, model: Any) -> None:
    """Just over the limit (severity below ban_multiple): a strike, not a ban; the node is then
    checked in full; a day later the old strikes still count and the third bans."""
    h = _harness(tmp_path, model)
    assert h.verifier is not None
    node = h.node(dtype="bfloat16")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    first = h.lease(node, 1)
    prompt = list(unpack_tokens(first.prompts[0].token_ids))
    limit = h.verifier.tolerance_of(1, [prompt], 8).threshold  # the version's calibration
    for i in range(3):
        lease = first if i == 0 else h.lease(node, 1)
        forged = _forged(sampled(lease, bf16, dtype="bfloat16"), -3 * limit)
        got = await h.core.submit(node.public_key, forged)
        assert isinstance(got, Reject) and got.code is ReasonCode.LOGPROB_MISMATCH, got
        banned = h.core.reputation.banned(node.public_key, h.clock())
        assert (banned is not None) == (i == 2), i  # the third strike bans, not the first
        assert h.core.trust.is_suspect(node.public_key)
        h.clock.advance(86_400.0)  # a day: the old 3,600 s window would have cleared it
