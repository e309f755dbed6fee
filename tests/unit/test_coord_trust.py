"""Adaptive verification (coordinator/trust.py): new nodes are re-scored at a high rate that decays
with clean history to a floor; struck and flagged nodes are checked in full until released; the
rate per node is in the status document."""

from __future__ import annotations

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
            "clean_checks_halflife": 2.0,
            "suspect_release_checks": 3,
            **intake,
        },
        sampling={"max_new_tokens": 8},
    )
    h.verifier = InProcessLogprobVerifier(lambda v: model, h.cfg.intake.tolerances, cache_size=2)
    h.reopen()
    h.publish(1)
    return h


def test_the_rate_formula() -> None:
    from coordinator.config import IntakeSection
    from coordinator.trust import Trust

    class NoStore:
        def ensure_schema(self, script: str) -> None: ...

    trust = Trust(NoStore(), IntakeSection())  # type: ignore[arg-type]
    rates = [trust.rate_of(TrustState(c, False, None, None)) for c in range(0, 12, 2)]
    assert rates[:4] == pytest.approx([1.0, 0.5, 0.25, 0.125])
    assert rates[-1] == 0.05  # the floor
    assert trust.rate_of(TrustState(0, True, None, None)) == 1.0  # a suspect: full checks
    assert trust.level_of(TrustState(0, False, None, None)) == "new"
    assert trust.level_of(TrustState(40, False, None, None)) == "trusted"


async def test_a_new_node_is_checked_often_then_less(tmp_path: Path, model: Any) -> None:
    """Its first lease is always re-scored; the rate falls with each passed check. Which leases
    are drawn depends on random lease ids: while the rate is above 1/2 every lease is drawn with
    probability above 1/2, so the 3 checks that bring it below 1/2 take more than 40 leases with
    probability < 1e-9."""
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
    assert rates[0] == 1.0 and checked >= 3
    assert rates == sorted(rates, reverse=True) and rates[-1] < 0.5
    assert h.core.trust.state(node.public_key).clean_checks == checked
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
