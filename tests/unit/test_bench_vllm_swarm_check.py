"""bench/vllm_swarm_check.py reads a coordinator's verdict receipts per backend (GPU script)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from coord_harness import Harness, submission
from msgspec.structs import replace

from protocol.messages import Ack, Reject

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from vllm_swarm_check import summarise, verdicts


async def test_both_backends_accepted_then_a_refusal_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    nodes = {"vllm": h.node(backend="vllm"), "hf": h.node(backend="hf")}
    for backend, node in nodes.items():
        sub = replace(submission(h.lease(node)), backend=backend)
        assert isinstance(await h.core.submit(node.public_key, sub), Ack)
    db = tmp_path / "state.sqlite"
    entries = verdicts(db)
    assert [e["held_to"] for e in entries] == ["vllm/float32", "hf/float32"]
    assert summarise(entries, ["vllm", "hf"], min_checked=0) == 0
    assert "PASS" in capsys.readouterr().out
    assert summarise(entries, ["vllm", "hf"], min_checked=1) == 1  # no verifier: none checked
    for e in entries:  # as a coordinator with a verifier records a passed spot check
        e["checks"] |= {"spot_checked": True, "passed": True}
    assert summarise(entries, ["vllm", "hf"], min_checked=1) == 0
    entries[0]["checks"]["passed"] = False
    assert summarise(entries, ["vllm", "hf"], min_checked=1) == 1

    vllm = nodes["vllm"]
    bad = submission(h.lease(vllm, max_prompts=1), completions=[[[99, 2], [99, 2]]])
    bad = replace(bad, backend="vllm")
    assert isinstance(await h.core.submit(vllm.public_key, bad), Reject)
    assert summarise(verdicts(db), ["vllm", "hf"], min_checked=0) == 1
    assert "REFUSED vllm lease" in capsys.readouterr().out
