"""The whole swarm on a model with a real tokenizer: byte-level BPE, chat template, two EOS ids.

Not the embedded character model: :func:`policy.testing.build_tiny_chat_model` writes a random
Llama with a BPE tokenizer trained here, a ChatML template and ``generation_config.eos_token_id``
= ``[<|im_end|>, <|endoftext|>]`` (what instruct models ship). Real processes on 127.0.0.1: a
coordinator (arithmetic word problems rendered with the chat template, spot checks on every
lease, temperature 0.8 with top-p 0.95), the real trainer (it adopts the coordinator's sampling
settings), and two ``hf`` nodes. The run must: accept rollouts without a single rejection (the
lease's stop set covers both EOS ids), train three learner steps with the behaviour weights at
one (mismatch KL ≈ 0 at staleness 0: π is computed from the processed distribution), and have the
nodes load a published version and produce accepted rollouts with it.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from swarm_harness import Proc, coordinator_toml, launch_coordinator, start_node, until

from policy.testing import build_tiny_chat_model
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(240)


def _status(coord_state: Path) -> dict[str, Any]:
    info = json.loads((coord_state / "coordinator.json").read_text())
    with urllib.request.urlopen(info["http_url"] + "/status", timeout=3.0) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def _metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_swarm_trains_a_chat_model_with_two_eos_ids(
    tmp_path: Path, procs: list[Proc]
) -> None:
    model = build_tiny_chat_model(tmp_path / "model")
    trainer_dir = tmp_path / "trainer"
    trainer_key = Identity.load_or_create(trainer_dir / "trainer.key")
    cfg = coordinator_toml(
        tmp_path,
        trainer_key,
        top={"model_path": str(model), "task": "arith", "group_size": 4},
        sampling={"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95},
        prompt={"system_prompt": "Answer briefly."},
        intake={"spot_check_fraction": 1.0},
    )
    coord = await launch_coordinator(tmp_path, cfg)
    procs.append(coord.proc)
    (tmp_path / "trainer.toml").write_text(
        f'model_path = "{model}"\nbatch_prompts = 2\ngroup_size = 4\nmax_staleness = 2\n'
        f'minibatches = 1\nout_dir = "{trainer_dir}"\nresume = false\nentropy_coef = 0.0\n'
    )
    trainer = Proc(
        ["trainer", "run", "--config", str(tmp_path / "trainer.toml"), "--coordinator",
         coord.maddr, "--coordinator-key", coord.fingerprint, "--state-dir", str(trainer_dir),
         "--max-steps", "3"],
        tmp_path / "trainer.log",
    )  # fmt: skip
    procs.append(trainer)
    model_line = f'model_path = "{model}"\n'
    for name in ("node-a", "node-b"):
        procs.append(start_node(tmp_path, coord, name, model_line, max_prompts=2))

    metrics = trainer_dir / "metrics.jsonl"
    await until(lambda: len(_metrics(metrics)) >= 3, "three learner steps", 180, trainer)
    assert trainer.wait(60) == 0, trainer.text()[-2000:]
    assert "sampling contract: {'temperature': 0.8, 'top_p': 0.95, 'top_k': 0}" in trainer.text()

    status = _status(coord.state)
    assert status["stop_token_ids"] == sorted(set(status["stop_token_ids"]))
    assert len(status["stop_token_ids"]) == 2  # <|im_end|> and <|endoftext|>
    assert status["sampling"]["prompt_template"] == "chat"
    # the learner may outrun a node by more than S versions (3 steps in about a second here):
    # that node's late rollouts are refused too_stale, which is no fault (no strike); nothing else
    rejected = status.get("rejected_by_reason") or {}
    assert set(rejected) <= {"too_stale"}, rejected
    assert not status.get("nodes_banned")
    assert status["rollouts_accepted"] >= 3 * 2 * 4

    rows = _metrics(metrics)
    fresh = [r for r in rows if r["staleness_hist"] == {"0": r["rollouts"]}]
    assert fresh, rows  # the first step trains on v0 rollouts at staleness 0
    for r in fresh:  # π_prox from the processed distribution: nothing to correct
        assert r["mismatch_kl"] < 1e-4 and r["ess_frac"] > 0.999, r

    # The nodes loaded a version the trainer published after v0, sampled with it, and the
    # coordinator accepted those rollouts (spot-checked against that version's weights).
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("node-a", "node-b"))
    assert "loaded policy v1" in logs or "loaded policy v2" in logs, logs[-3000:]

    def accepted_after_v0() -> int:
        db = sqlite3.connect(f"file:{coord.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            (n,) = db.execute("select count(*) from rollouts where version >= 1").fetchone()
        finally:
            db.close()
        return int(n)

    await until(accepted_after_v0, "rollouts of a published version after v0", 60)
    text = (
        urllib.request.urlopen(
            json.loads((coord.state / "coordinator.json").read_text())["http_url"] + "/metrics",
            timeout=3.0,
        )
        .read()
        .decode()
    )
    passed = [
        line for line in text.splitlines()
        if line.startswith('swarm_intake_spot_checks_total{result="pass"}')
    ]  # fmt: skip
    assert passed and float(passed[0].split()[-1]) >= 3, passed
    assert 'swarm_intake_spot_checks_total{result="fail"}' not in text
