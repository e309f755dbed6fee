"""Registration is restricted to ``intake.accepted_dtypes`` (issue 34): the calibration measures
only the precisions the coordinator accepts, so a node registering another one is refused at
registration with a one-line reason, never registered, and costs no strike."""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_harness import Harness, advert

from coordinator.errors import Rejection
from protocol.errors import ReasonCode
from protocol.identity import Identity


def test_a_dtype_the_coordinator_does_not_accept_is_refused_at_registration(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, intake={"accepted_dtypes": ["float32", "bfloat16"]})
    ident = Identity.generate()
    with pytest.raises(Rejection) as refused:
        h.core.register(ident.public_key, advert(ident, h.clock(), dtype="float16"))
    assert refused.value.code is ReasonCode.REGISTRATION_MISMATCH
    detail = refused.value.detail
    assert "float16" in detail and "float32, bfloat16" in detail and "\n" not in detail
    assert not refused.value.strike
    assert h.store.get_node(ident.public_key) is None  # not registered
    assert h.core.reputation.strikes(ident.public_key) == {}
    # an accepted precision registers; the same node cannot relabel itself to a refused one
    node = h.node(dtype="bfloat16")
    h.clock.advance(10 * h.cfg.intake.registration_change_interval_s)
    with pytest.raises(Rejection) as relabel:
        h.core.register(node.public_key, advert(node, h.clock(), dtype="float16"))
    assert relabel.value.code is ReasonCode.REGISTRATION_MISMATCH
    stored = h.store.get_node(node.public_key)
    assert stored is not None and stored.dtype == "bfloat16"


def test_every_accepted_dtype_registers(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    for dtype in h.cfg.intake.accepted_dtypes:
        node = h.node(dtype=dtype)
        stored = h.store.get_node(node.public_key)
        assert stored is not None and stored.dtype == dtype
