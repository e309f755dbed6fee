"""Adaptive verification (coordinator/trust.py): new nodes are re-scored at a high rate that decays
with clean history to a floor; struck and flagged nodes are checked in full until released; the
rate per node is in the status document."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from coord_harness import Harness, advert, sampled, submission

from coordinator.logprobs import InProcessLogprobVerifier
from coordinator.status import build_status
from coordinator.trust import TrustState
from policy.model import ModelSpec, build_model
from protocol.errors import ReasonCode
from protocol.messages import Ack, Reject


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0)


def adaptive(tmp_path: Path, model: Any, **intake: Any) -> Harness:
    h = Harness(
        tmp_path,
        intake={
            "spot_check_fraction": 0.05,
            "new_node_check_rate": 1.0,
            "target_forged_share": 1 / 3,  # P = 3: the rate halves after 3 clean leases
            "suspect_release_checks": 3,
            **intake,
        },
        sampling={"max_new_tokens": 8},
    )
    h.verifier = InProcessLogprobVerifier(lambda v: model, h.cfg.intake.tolerances, cache_size=2)
    h.reopen()
    h.publish(1)
    return h


def test_the_rate_formula(tmp_path: Path) -> None:
    """rate(h) = 1 / (1 + h/100) down to the floor 0.05 (defaults: ε = 0.01, P = 100), which a
    new identity reaches after 1,900 clean leases at a cost of ~P·ln(20) = 300 checks."""
    from coordinator.config import IntakeSection
    from coordinator.store import Store
    from coordinator.trust import Trust

    trust = Trust(Store(tmp_path / "s.sqlite"), IntakeSection())
    rates = [trust.rate_of(TrustState(0, False, None, None, h)) for h in (0, 100, 300, 1900, 5000)]
    assert rates == pytest.approx([1.0, 0.5, 0.25, 0.05, 0.05])
    assert trust.rate_after(1899) > 0.05
    assert trust.leases_to_floor() == 1900 and trust.leases_to_floor(1900) == 0
    assert trust.rate_of(TrustState(0, True, None, None, 5000)) == 1.0  # a suspect: full checks
    assert trust.level_of(TrustState(0, False, None, None)) == "new"
    assert trust.level_of(TrustState(0, False, None, None, 1900)) == "trusted"
    node = b"n" * 32
    ob = trust.obligation(node)  # the typed view for a verification budget
    assert ob.rate == 1.0 and not ob.suspect and ob.leases_to_floor == 1900
    assert ob.checks_to_floor == pytest.approx(100 * math.log(20), rel=0.01)


async def test_a_new_node_is_checked_often_then_less(tmp_path: Path, model: Any) -> None:
    """Its first lease is always re-scored; the rate falls with each accepted lease, checked or
    not (P = 3: 1, 0.75, 0.6, 0.5, 0.43), so a cheater cannot slow it by hiding which leases
    were checked; the checks themselves are drawn by the secret."""
    h = adaptive(tmp_path, model)
    node = h.node()
    rates, checked = [], 0
    for _ in range(40):
        rates.append(h.core.trust.rate(node.public_key))
        if rates[-1] < 0.5:
            break
        before = h.core.metrics.spot_checks.labels(result="pass")._value.get()
        got = await h.core.submit(node.public_key, sampled(h.lease(node, max_prompts=1), model))
        assert isinstance(got, Ack), got
        checked += h.core.metrics.spot_checks.labels(result="pass")._value.get() > before
    assert rates == pytest.approx([1.0, 0.75, 0.6, 0.5, 3 / 7]) and checked >= 1
    assert h.core.trust.state(node.public_key).clean_checks == checked
    assert h.core.trust.state(node.public_key).clean_leases == 4
    status = build_status(
        h.core, fingerprint="c", peer_id="p", started_at=0.0, trainer_stats={}, broadcast=None
    )
    assert status["node_check_rate"][node.fingerprint] == pytest.approx(rates[-1], abs=1e-4)
    assert status["node_trust"][node.fingerprint] == "new"
    assert status["node_clean_checks"][node.fingerprint] == checked
    assert status["node_suspect"][node.fingerprint] is False


async def test_a_struck_node_is_checked_in_full_until_released(tmp_path: Path, model: Any) -> None:
    h = adaptive(tmp_path, model, spot_check_fraction=0.0, new_node_check_rate=0.0)
    node = h.node()
    assert h.core.trust.rate(node.public_key) == 0.0
    bad = await h.core.submit(node.public_key, submission(h.lease(node), finish="length"))
    assert isinstance(bad, Reject) and bad.code is ReasonCode.BAD_TERMINATION
    assert h.core.trust.is_suspect(node.public_key)
    for i in range(3):  # suspect_release_checks = 3 full checks in a row
        assert h.core.trust.rate(node.public_key) == 1.0
        got = await h.core.submit(node.public_key, sampled(h.lease(node), model))
        assert isinstance(got, Ack), got
        verdicts = [e.data() for e in h.core.receipts.entries() if e.kind == "verdict"]
        assert verdicts[-1]["checks"]["full"] is True, i
    assert not h.core.trust.is_suspect(node.public_key)  # released: a new node again
    assert h.core.trust.state(node.public_key).clean_checks == 0


async def test_a_relabelled_node_loses_its_clean_history(tmp_path: Path, model: Any) -> None:
    h = adaptive(tmp_path, model, registration_change_interval_s=0.0)
    node = h.node()
    for _ in range(3):
        got = await h.core.submit(node.public_key, sampled(h.lease(node, max_prompts=1), model))
        assert isinstance(got, Ack)
    assert h.core.trust.state(node.public_key).clean_checks > 0
    h.core.register(node.public_key, advert(node, h.clock(), dtype="bfloat16"))
    assert h.core.trust.state(node.public_key).clean_checks == 0
    assert h.core.trust.rate(node.public_key) == 1.0
