"""The coordinator killed at exact points of a submission or publication (``RSWARM_FAULTS``, see
:mod:`swarm.faults`), then restarted on the same state: the node's retry is accepted exactly
once, and a clean restart restores every lease, prompt and rollout (DESIGN.md §6, §7).

Real ``swarm coordinator launch`` processes on 127.0.0.1; honest rollouts from the ``hf`` backend
on the published weights (see :mod:`swarm_harness`).
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from swarm_harness import (
    FAST_CALIBRATION,
    CoordinatorProc,
    Proc,
    TestNode,
    Trainer,
    coordinator_toml,
    launch_coordinator,
    start_node,
    until,
    until_in_feed,
)

from protocol.identity import Identity
from protocol.messages import AcceptedRollout, Ack, Lease

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@dataclass
class Rig:
    """One coordinator state dir, restarted at will; everything started is stopped at the end."""

    tmp: Path
    config: Path
    trainer_id: Identity
    coord: CoordinatorProc | None = None
    trainer: Trainer | None = None
    nodes: list[TestNode] = field(default_factory=list)

    async def start(self, faults: str | None = None) -> None:
        env = {"RSWARM_FAULTS": faults} if faults else None
        self.coord = await launch_coordinator(self.tmp, self.config, env)
        self.trainer = Trainer(self.coord, self.trainer_id, self.tmp)
        await self.trainer.start()
        for node in self.nodes:  # identities and registrations live on in SQLite
            node.connect(self.trainer.transport, self.coord.peer_id)

    async def down(self, *, crashed: bool) -> None:
        """Stop the trainer's peer and the coordinator (SIGKILL its group if ``crashed``)."""
        assert self.coord is not None and self.trainer is not None
        await self.trainer.stop()
        if crashed:
            self.coord.proc.crash()
        else:
            self.coord.proc.stop()
            assert self.coord.proc.popen.returncode == 0, self.coord.proc.text()[-2000:]
        self.coord, self.trainer = None, None

    async def node(self) -> TestNode:
        assert self.coord is not None and self.trainer is not None
        node = TestNode(self.trainer.transport, self.coord.peer_id)
        await node.register()
        self.nodes.append(node)
        return node

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.tmp / 'coord' / 'state.sqlite'}?mode=ro", uri=True)


@pytest_asyncio.fixture(loop_scope="module")
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    trainer_id = Identity.generate()
    config = coordinator_toml(
        tmp_path,
        trainer_id,
        leases={"min_deadline_s": 120.0, "target_lease_s": 100.0},
        intake=FAST_CALIBRATION,
    )
    r = Rig(tmp_path, config, trainer_id)
    try:
        yield r
    finally:
        if r.trainer is not None:
            await r.trainer.stop()
        if r.coord is not None:
            r.coord.proc.stop()


def keys(rows: list[AcceptedRollout]) -> list[tuple[str, str, int]]:
    return [(r.lease_id, r.prompt_id, r.sample_index) for r in rows]


def expected(lease: Lease) -> set[tuple[str, str, int]]:
    g = lease.group_size
    return {(lease.lease_id, p.prompt_id, j) for p in lease.prompts for j in range(g)}


async def killed_by_fault(rig: Rig, send: asyncio.Task[Any]) -> None:
    """The in-flight call fails (no verdict) and the coordinator died by its own SIGKILL."""
    assert rig.coord is not None
    proc = rig.coord.proc
    with pytest.raises(Exception):  # noqa: B017 - transport error of any kind: no verdict
        await asyncio.wait_for(send, 60)
    await until(lambda: proc.popen.poll() is not None, "the coordinator to die", 30)
    assert proc.popen.returncode == -9, proc.popen.returncode
    assert "fault injection: submit." in proc.text() or "fault injection: publish." in proc.text()
    await rig.down(crashed=True)


async def test_killed_at_each_commit_point_every_retry_is_accepted_exactly_once(rig: Rig) -> None:
    """One state dir, killed three times: after recording a version (before answering the
    trainer), after verifying a submission (before storing it), after storing it (before
    answering). Each restart serves the retries as if nothing had happened, exactly once."""
    # 1. publish.after_commit: the version is recorded, the trainer gets no answer.
    await rig.start(faults="publish.after_commit")
    assert rig.trainer is not None
    await killed_by_fault(rig, asyncio.create_task(rig.trainer.publish(1, held=False)))

    # 2. submit.before_commit: verified, nothing stored.
    await rig.start(faults="submit.before_commit")
    assert rig.trainer is not None
    assert (await rig.trainer.status())["policy_version"] == 1  # committed: survived the kill
    await rig.trainer.publish(2)  # the trainer goes on (a re-publish of v1 is not newer)
    node = await rig.node()
    lease = await node.lease()
    assert lease.policy_version == 2
    sub = node.rollouts(lease)
    await killed_by_fault(rig, asyncio.create_task(node.submit(sub)))
    assert stored(rig, lease) == 0

    # 3. submit.after_commit: the node's retry is stored, then the answer is lost again.
    await rig.start(faults="submit.after_commit")
    await killed_by_fault(rig, asyncio.create_task(node.submit(sub)))
    assert stored(rig, lease) == len(expected(lease))

    # 4. no fault: the next retry gets the stored verdict; nothing is stored twice.
    await rig.start()
    assert rig.trainer is not None
    retry = await node.submit(sub)
    assert isinstance(retry, Ack), retry
    assert await node.submit(sub) == retry
    feed = await until_in_feed(rig.trainer, expected(lease))  # re-scored after the restart
    assert keys(feed) and len(feed) == len(set(keys(feed)))
    assert set(keys(feed)) == expected(lease)
    assert (await rig.trainer.status())["rollouts_accepted"] == len(feed)
    nxt = await node.lease()  # and work goes on
    assert isinstance(await node.submit(node.rollouts(nxt)), Ack)
    await rig.down(crashed=False)


def stored(rig: Rig, lease: Lease) -> int:
    """The lease's acknowledged rows: in the feed, or held for their re-score (issue 34)."""
    with rig.db() as db:
        sql = "SELECT COUNT(*) FROM rollouts WHERE lease_id=?"
        n = int(db.execute(sql, (lease.lease_id,)).fetchone()[0])
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'held_rollouts'").fetchone():
            sql = "SELECT COUNT(*) FROM held_rollouts WHERE lease_id=?"
            n += int(db.execute(sql, (lease.lease_id,)).fetchone()[0])
        return n


async def test_clean_restart_restores_state_and_loses_or_duplicates_no_task(rig: Rig) -> None:
    await rig.start()
    assert rig.trainer is not None
    await rig.trainer.publish(1)
    a, b = await rig.node(), await rig.node()
    done = await a.lease()
    assert isinstance(await a.submit(a.rollouts(done)), Ack)
    held = await b.lease()  # outstanding across the restart
    before = await rig.trainer.status()
    feed_before = await until_in_feed(rig.trainer, expected(done))  # after its re-score
    await rig.down(crashed=False)

    await rig.start()
    assert rig.trainer is not None
    after = await rig.trainer.status()
    for key in ("policy_version", "versions", "nodes_registered", "leases", "rollouts_accepted"):
        assert after[key] == before[key], (key, before[key], after[key])
    assert keys(await rig.trainer.fetch(0)) == keys(feed_before)
    assert isinstance(await b.submit(b.rollouts(held)), Ack)  # the outstanding lease: honoured
    fresh = await a.lease()  # the prompt stream continues: nothing handed out twice
    issued = [p.prompt_id for lease in (done, held) for p in lease.prompts]
    assert set(issued).isdisjoint(p.prompt_id for p in fresh.prompts)
    assert fresh.epoch > max(done.epoch, held.epoch)
    with rig.db() as db:
        states = dict(db.execute("SELECT state, COUNT(*) FROM prompts GROUP BY state").fetchall())
    assert states == {"done": len(issued), "leased": len(fresh.prompts)}, states


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_real_nodes_retry_after_a_crash_before_commit_is_accepted_once(
    tmp_path: Path,
) -> None:
    """A ``swarm node run`` process submits; the coordinator dies after verifying, before
    storing; it restarts on the same address and the node's own retry loop gets its lease
    accepted, exactly once, and goes on working."""
    trainer_id = Identity.generate()
    config = coordinator_toml(
        tmp_path,
        trainer_id,
        leases={"min_deadline_s": 180.0},
        intake={"spot_check_fraction": 1.0, **FAST_CALIBRATION},
        network={"port": free_port()},
    )
    rig = Rig(tmp_path, config, trainer_id)
    node: Proc | None = None
    try:
        await rig.start(faults="submit.before_commit")
        assert rig.trainer is not None and rig.coord is not None
        await rig.trainer.publish(1)
        # its retries back off to at most 1 s (default 30 s: doubling from 0.5 s, the retry after
        # the restart came up to ~8 s late); the lease's deadline (180 s) bounds them either way
        node = start_node(tmp_path, rig.coord, "n1", "backoff_max_s = 1.0\n", max_prompts=2)
        proc = rig.coord.proc
        await until(lambda: proc.popen.poll() is not None, "the fault to kill it", 90, node)
        assert "fault injection: submit.before_commit" in proc.text()
        await rig.down(crashed=True)
        with rig.db() as db:
            assert db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0] == 0
            (crashed_lease,) = db.execute("SELECT lease_id FROM leases").fetchone()

        await rig.start()  # same port, same peer ID: the node finds it again by itself
        assert rig.trainer is not None
        seen: list[AcceptedRollout] = []

        async def accepted(leases: int) -> bool:
            seen.extend(await rig.trainer.fetch(seen[-1].seq if seen else 0))  # type: ignore
            return len({r.lease_id for r in seen}) >= leases

        await until(lambda: accepted(3), "the retry and two more leases accepted", 90, node)
        assert "submit failed" in node.text()  # the node saw the crash and retried
        assert crashed_lease in {r.lease_id for r in seen}
        assert len(seen) == len(set(keys(seen)))  # nothing counted twice
        status = await rig.trainer.status()
        assert status["rejected_by_reason"] == {}, status
    finally:
        if node is not None:
            node.stop()
        if rig.trainer is not None:
            await rig.trainer.stop()
        if rig.coord is not None:
            rig.coord.proc.stop()
