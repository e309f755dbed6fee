"""Verification scaled out to a verifier process (issue 35): a real ``swarm coordinator
verifier`` re-scores the spot checks of a real ``swarm coordinator launch`` over libp2p.

The coordinator runs with ``verification.local_verifier = false``: every re-score is a job the
verifier process takes (``rswarm/vtake``), re-scores on the version it downloads from the
coordinator (verified against the pinned coordinator key), and answers (``rswarm/vdone``). An
honest lease reaches the trainer's feed; a forged one is refused ``logprob_mismatch``; a key not
in ``verification.verifier_keys`` is refused and its process exits with one line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from demo_harness import status_of
from swarm_harness import (
    FAST_CALIBRATION,
    CoordinatorProc,
    Proc,
    TestNode,
    Trainer,
    coordinator_toml,
    launch_coordinator,
    lease_keys,
    settled,
    until,
    until_in_feed,
)

from node.byzantine import misbehave
from policy.model import CharTokenizer
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import Ack, Reject

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

TOK = CharTokenizer()


def _verifier(tmp: Path, coord: CoordinatorProc, config: Path, name: str) -> Proc:
    return Proc(
        ["coordinator", "verifier", "--coordinator", coord.maddr, "--coordinator-key",
         coord.fingerprint, "--config", str(config), "--state-dir", str(tmp / name)],
        tmp / f"{name}.log",
    )  # fmt: skip


@pytest.mark.timeout(300)
async def test_a_verifier_process_rescores_the_coordinators_spot_checks(tmp_path: Path) -> None:
    trainer_id = Identity.generate()
    (tmp_path / "verifier").mkdir()
    key = Identity.load_or_create(tmp_path / "verifier" / "verifier.key")
    config = coordinator_toml(
        tmp_path, trainer_id, intake=FAST_CALIBRATION,
        verification={"admission": False, "verifier_keys": [key.fingerprint],
                      "local_verifier": False, "job_timeout_s": 60.0},
    )  # fmt: skip
    coord = await launch_coordinator(tmp_path, config)
    trainer = Trainer(coord, trainer_id, tmp_path)
    procs: list[Proc] = []
    try:
        await trainer.start()
        await trainer.publish(1)
        verifier = _verifier(tmp_path, coord, config, "verifier")
        procs.append(verifier)
        node = TestNode(trainer.transport, coord.peer_id)
        await node.register()

        # an honest lease: acknowledged, re-scored by the process, then in the feed
        lease = await node.lease()
        assert isinstance(await node.submit(node.rollouts(lease)), Ack)
        await until_in_feed(trainer, lease_keys(lease), wait_s=150)
        log = verifier.text()
        assert f"verifier {key.fingerprint} up" in log, log[-2000:]
        assert ": pass (" in log, log[-2000:]

        # a forged lease: refused by the process's verdict
        fresh = await node.lease()
        forged = misbehave(
            ["forge_logprobs"], node.rollouts(fresh), fresh, vocab_size=TOK.vocab_size,
            tokenizer=TOK, rng=random.Random(0),
        )  # fmt: skip
        verdict = await settled(trainer, node, forged, await node.submit(forged))
        assert isinstance(verdict, Reject) and verdict.code is ReasonCode.LOGPROB_MISMATCH
        assert ": fail (" in verifier.text()

        # the operator's /status counts the process and meters its throughput
        # (the document is refreshed every second: wait for the one after the verdicts)
        url = json.loads((coord.state / "coordinator.json").read_text())["http_url"]
        await until(lambda: status_of(url)["verify_verifiers"] == 1, "V metered", 10)
        status = status_of(url)
        assert status["verifier_processes"] == 1, status
        assert status["verify_verifiers"] == 1 and status["verify_tokens_per_s"] > 0, status
        assert status["verify_jobs_queued"] == 0 and status["verify_jobs_timed_out"] == 0

        # a key the coordinator does not list: refused, the process ends with one line
        stranger = _verifier(tmp_path, coord, config, "stranger")
        procs.append(stranger)
        await until(lambda: stranger.popen.poll() is not None, "the stranger to exit", 120)
        assert stranger.popen.returncode == 1
        errors = [line for line in stranger.text().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "refused this verifier's key" in errors[0], errors
    finally:
        for proc in procs:
            proc.stop()
        try:
            await trainer.stop()
        finally:
            coord.proc.stop()
    assert all(p.popen.poll() is not None for p in procs)
