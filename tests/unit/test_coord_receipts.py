"""Receipts (coordinator/receipts.py, ``swarm audit``): every rollout the trainer learns from is
traceable to its lease, node, version, checks, verdict and learner step through an append-only,
hash-chained log sealed with the coordinator key; any tampering with the stored log is detected."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from coord_harness import Harness, submission

from coordinator.audit_cli import run_audit
from coordinator.receipts import entry_hash, load_entries, verify_chain
from protocol.identity import Identity
from protocol.messages import Ack, Reject

REPO = Path(__file__).resolve().parents[2]


async def busy_log(tmp_path: Path) -> tuple[Harness, Identity]:
    """A coordinator that accepted two leases, refused one, saw a learner step, and sealed."""
    key = Identity.generate()
    h = Harness(tmp_path, signer=key, receipts={"seal_every": 3})
    h.publish(1)
    node = h.node()
    for _ in range(2):
        assert isinstance(await h.core.submit(node.public_key, submission(h.lease(node))), Ack)
    bad = submission(h.lease(node, max_prompts=1), completions=[[[99, 2], [99, 2]]])
    assert isinstance(await h.core.submit(node.public_key, bad), Reject)
    h.core.learner_report(step=1, cursor=4, step_time_s=0.5)
    h.core.tick()  # seals: 3+ entries waiting
    return h, key


async def test_the_log_chains_every_verdict_and_learner_step(tmp_path: Path) -> None:
    h, key = await busy_log(tmp_path)
    entries = h.core.receipts.entries()
    kinds = [e.kind for e in entries]
    assert kinds == ["register", "verdict", "verdict", "verdict", "consumed", "seal"]
    report = verify_chain(entries, key.public_key)
    assert report.ok and report.seals == 1 and report.sealed_seq == 5 and report.unsealed == 0
    first = entries[1].data()
    assert first["verdict"] == "ack" and first["node"] == h.store.nodes()[0].fingerprint
    assert first["version"] == 1 and first["held_to"] == "hf/float32"
    assert first["seqs"] == [1, first["seqs"][1]] and first["checks"]["rate"] == 0.0
    assert entries[3].data()["verdict"] == "token_out_of_vocab"
    assert entries[3].data()["seqs"] is None
    assert entries[4].data() == {"step": 1, "seqs": [1, 4]}
    h.core.learner_report(step=1, cursor=9, step_time_s=0.5)  # same step again: nothing new
    assert len(h.core.receipts.entries()) == len(entries)
    h.core.close()  # closing seals nothing new (nothing waiting)
    assert [e.kind for e in load_entries(h.cfg.db_path)] == kinds


async def test_swarm_audit_traces_a_rollout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    h, key = await busy_log(tmp_path)
    h.core.close()
    rc = run_audit(
        state_dir=None, db=h.cfg.db_path, receipt="2", coordinator_key=key.fingerprint,
        json_out=False,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "receipt log verifies: 6 entries, 1 seals" in out
    assert "rollout #2: lease L00000001" in out
    assert "node ed25519:" in out and "held to hf/float32" in out
    assert "verdict   ack" in out and "consumed by step 1" in out and "sealed by #6" in out
    # the other key is not the pinned one
    rc = run_audit(
        state_dir=None, db=h.cfg.db_path, receipt=None,
        coordinator_key=Identity.generate().fingerprint, json_out=False,
    )  # fmt: skip
    assert rc == 1 and "not the pinned" in capsys.readouterr().out


def _tamper(db: Path, sql: str, *args: object) -> None:
    conn = sqlite3.connect(db)
    conn.execute(sql, args)
    conn.commit()
    conn.close()


async def test_tampering_with_the_stored_log_is_detected(tmp_path: Path) -> None:
    h, key = await busy_log(tmp_path)
    h.core.close()
    db = h.cfg.db_path
    good = load_entries(db)
    assert verify_chain(good, key.public_key).ok

    # 1. a refusal rewritten as an acceptance: its hash no longer matches
    body = good[3].body.replace(b'"token_out_of_vocab"', b'"ack"')
    _tamper(db, "UPDATE receipts SET body = ? WHERE seq = 4", body)
    report = verify_chain(load_entries(db), key.public_key)
    assert not report.ok and any("entry #4" in p and "edited" in p for p in report.problems)

    # 2. the same edit with every hash and link recomputed: the seal's signature gives it away
    prev = good[2].hash
    for e in load_entries(db)[3:]:
        digest = entry_hash(e.seq, prev, e.kind, e.body)
        _tamper(db, "UPDATE receipts SET prev = ?, hash = ? WHERE seq = ?", prev, digest, e.seq)
        prev = digest
    report = verify_chain(load_entries(db), key.public_key)
    assert not report.ok and any("seal #6" in p for p in report.problems), report.problems
    assert run_audit(state_dir=None, db=db, receipt=None, coordinator_key=None, json_out=True) == 1

    # 3. an entry deleted (restore the original first)
    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM receipts")
    conn.executemany(
        "INSERT INTO receipts (seq, kind, body, prev, hash, at) VALUES (?,?,?,?,?,?)",
        [(e.seq, e.kind, e.body, e.prev, e.hash, e.at) for e in good],
    )
    conn.commit()
    conn.close()
    assert verify_chain(load_entries(db), key.public_key).ok
    _tamper(db, "DELETE FROM receipts WHERE seq = 3")
    report = verify_chain(load_entries(db), key.public_key)
    assert any("missing" in p for p in report.problems), report.problems


async def test_swarm_audit_command_line(tmp_path: Path) -> None:
    h, key = await busy_log(tmp_path)
    lease = h.store.leases()[1]
    prompt = h.core.task.problem(lease.prompts[0]).prompt_id
    h.core.close()
    cmd = [
        sys.executable, "-m", "swarm.shell.cli", "audit", "--db", str(h.cfg.db_path),
        "--receipt", "L00000002", "--coordinator-key", key.fingerprint,
    ]  # fmt: skip
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --receipt"), bad.stderr
    cmd[7] = f"{lease.lease_id}/{prompt}/1"
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "verdict   ack" in ok.stdout and f"lease {lease.lease_id}" in ok.stdout
