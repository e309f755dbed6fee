"""A LoRA version round trip through real processes on 127.0.0.1: the real trainer (LoRA, in the
test process) publishes adapters with its SwarmPublisher; the coordinator (``swarm coordinator
launch``, every submission spot-checked) signs and holds them; a node (``swarm node run --backend
hf`` on the embedded model) verifies, applies each adapter over the base it loaded once and
samples; the coordinator re-scores at the same adapter and accepts; the trainer's own log-probs
agree with the node's, and a second version trained on those rollouts reaches the node too.

Every process started here is stopped by its PID at the end of the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_harness import (
    FAST_CALIBRATION,
    Proc,
    Trainer,
    coordinator_toml,
    launch_coordinator,
    start_node,
    until,
)

from policy.scoring import score_logprobs
from protocol.identity import Identity
from protocol.messages import AcceptedRollout, logprobs_array, tokens_array
from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.recipe import Trainer as Learner
from trainer.swarm_client import SwarmPublisher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _as_rollouts(accepted: list[AcceptedRollout]) -> list[Rollout]:
    return [
        Rollout(
            group_id=f"{r.lease_id}/{r.prompt_id}",
            prompt_ids=tokens_array(r.prompt_token_ids).tolist(),
            completion_ids=tokens_array(r.completion_token_ids).tolist(),
            behaviour_logprobs=logprobs_array(r.behaviour_logprobs).tolist(),
            policy_version=r.policy_version,
            reward=r.reward,
            seq=r.seq,
        )
        for r in accepted
    ]


def _made_up_rollouts() -> list[Rollout]:
    """Two groups of 4 over the embedded vocabulary with spread rewards (a first step)."""
    out = []
    for g, prompt in enumerate(([1, 4, 5, 6, 3], [1, 7, 6, 3])):
        for j in range(4):
            comp = [4 + (g + j) % 4, 4 + j, 2]
            out.append(
                Rollout(
                    group_id=f"g{g}",
                    prompt_ids=prompt,
                    completion_ids=comp,
                    behaviour_logprobs=[-3.0] * len(comp),
                    policy_version=0,
                    reward=j / 3,
                )
            )
    return out


@pytest.mark.parametrize("verifier_process", [False, True], ids=["in-process", "verifier-process"])
async def test_lora_versions_round_trip_trainer_node_coordinator(
    tmp_path: Path, procs: list[Proc], verifier_process: bool
) -> None:
    """With ``verifier_process`` the coordinator re-scores nothing itself: a ``swarm coordinator
    verifier`` process downloads each adapter and re-scores on it merged into its own base."""
    torch.set_num_threads(1)
    trainer_id = Identity.generate()
    verification: dict[str, object] = {}
    if verifier_process:
        (tmp_path / "verifier").mkdir()
        key = Identity.load_or_create(tmp_path / "verifier" / "verifier.key")
        verification = {"verifier_keys": [key.fingerprint], "local_verifier": False}
    # every submission spot-checked; the tolerance's calibration at its minimum (FAST_CALIBRATION)
    config = coordinator_toml(
        tmp_path, trainer_id, intake=FAST_CALIBRATION, verification=verification
    )
    coord = await launch_coordinator(tmp_path, config)
    procs.append(coord.proc)
    verifier = None
    if verifier_process:
        verifier = Proc(
            ["coordinator", "verifier", "--coordinator", coord.maddr, "--coordinator-key",
             coord.fingerprint, "--config", str(config), "--state-dir", str(tmp_path / "verifier")],
            tmp_path / "verifier.log",
        )  # fmt: skip
        procs.append(verifier)
    harness = Trainer(coord, trainer_id, tmp_path)
    await harness.start()
    # the node starts now (imports, its libp2p daemon) while the learner is built and v1 published:
    # it waits for a version as a node of a new swarm does, and then gets v1 like one that was there
    node = start_node(tmp_path, coord, "n1", 'log_level = "DEBUG"\n')
    procs.append(node)
    try:
        learner = Learner.setup(
            TrainerConfig(
                out_dir=str(tmp_path / "learner"),
                batch_prompts=2,
                group_size=4,
                minibatches=1,
                max_staleness=2,
                lora_rank=4,
                lora_alpha=8.0,
                lr=5e-2,
            )
        )
        publisher = SwarmPublisher(
            harness.transport, harness.broadcast, coord.peer_id, trainer_id,
            model_config_hash="00", tokenizer_hash="00", chunk_size=64 * 1024,
            publish_dtype="float32",  # the node runs exactly the trainer's adapter
        )  # fmt: skip
        # v1: the adapter after one step on made-up rollouts (not the base policy any more)
        learner.train_step(_made_up_rollouts())
        await publisher.publish(1, learner.state_dict_for_publish())
        assert harness.broadcast.store.manifest(1)[1].lora is not None

        async def holds(version: int) -> bool:
            return version in (await harness.status())["versions_held"]  # type: ignore[operator]

        await until(lambda: holds(1), "the coordinator to hold v1", 30, coord.proc)
        seen: list[AcceptedRollout] = []

        async def accepted_at(version: int) -> bool:
            seen.extend(await harness.fetch(seen[-1].seq if seen else 0))
            return sum(r.policy_version == version for r in seen) >= 8

        await until(lambda: accepted_at(1), "accepted rollouts at v1", 90, node)
        at_v1 = [r for r in seen if r.policy_version == 1]
        # the trainer's weights agree with what the node sampled from (fp32 adapter; the node
        # merges W0 + s·BA, the trainer runs peft unmerged: rounding only)
        rollouts = _as_rollouts(at_v1)
        ours = score_logprobs(
            learner.model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts]
        )
        worst = max(
            abs(a - b)
            for r, lp in zip(rollouts, ours, strict=True)
            for a, b in zip(r.behaviour_logprobs, lp, strict=True)
        )
        assert worst < 1e-4, worst
        # v2: trained on the swarm's rollouts; the node switches to it without reloading the base
        groups: dict[str, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(r.group_id, []).append(r)
        batch = [r for g in list(groups.values())[:2] for r in g]
        learner.train_step(batch)
        await publisher.publish(2, learner.state_dict_for_publish())
        await until(lambda: holds(2), "the coordinator to hold v2", 30, coord.proc)
        await until(lambda: accepted_at(2), "accepted rollouts at v2", 90, node)
        status = await harness.status()
        assert status["rejected_by_reason"] == {}  # every submission passed, spot checks included
        assert "spot check of" not in coord.proc.text()  # none skipped (nor failed)
        if verifier is None:
            assert {1, 2} <= set(status["versions_loaded"])  # type: ignore[arg-type]
        else:  # the process re-scored both adapters; the coordinator loaded no model for it
            assert status["versions_loaded"] == []
            checked = verifier.text()
            assert ": v1, " in checked and ": v2, " in checked, checked[-2000:]
            assert ": pass (" in checked and ": fail (" not in checked, checked[-2000:]
        log = node.text()
        assert "loaded policy v1" in log and "loaded policy v2" in log
        assert "building the base model again" not in log
    finally:
        await harness.stop()
