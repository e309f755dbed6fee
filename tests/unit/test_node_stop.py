"""NodeWorker.stop() ends even when a background task swallows its cancellation.

On Python 3.11 ``asyncio.wait_for`` returns the inner result instead of raising when the
cancellation arrives as the inner call completes; the heartbeat loop then carries on and a single
``cancel()`` + ``await`` in ``stop()`` hung a SIGTERMed node (seen in
``tests/integration/test_process_faults.py`` under load: "stopping" status lines for 30 s).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_node_worker import LaterBlocks, Swarm, until

from protocol.messages import Heartbeat, HeartbeatAck


async def test_stop_ends_a_heartbeat_that_swallowed_one_cancellation(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path)
    await swarm.coord.start()
    try:
        await swarm.coord.publish(1)
        w = swarm.worker(heartbeat_interval_s=0.05)
        await w.start()
        assert w.client is not None
        real = w.client.heartbeat
        calls = {"n": 0, "swallowed": 0}

        async def heartbeat(hb: Heartbeat, **kw: Any) -> HeartbeatAck:
            calls["n"] += 1
            if calls["swallowed"]:
                return await real(hb, **kw)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # what the wait_for race amounts to: the call
                calls["swallowed"] += 1  # completes and the cancellation is gone
                task = asyncio.current_task()
                assert task is not None
                task.uncancel()
            return await real(hb, **kw)

        w.client.heartbeat = heartbeat  # type: ignore[method-assign]
        await until(lambda: calls["n"] >= 1, "a heartbeat in flight")
        beating = next(t for t in asyncio.all_tasks() if t.get_name() == "node-heartbeat")
        # asyncio.wait, not wait_for: a stop() that swallows CancelledError would hide its own
        # timeout from wait_for and seem to return
        stopping = asyncio.create_task(w.stop())
        done, _ = await asyncio.wait({stopping}, timeout=20)
        assert stopping in done, "stop() hung on a task that swallowed its cancellation"
        assert calls["swallowed"] == 1 and beating.done()
    finally:
        if swarm.coord.broadcast is not None:
            await swarm.coord.broadcast.stop()
        swarm.coord.core.close()


async def test_a_lease_not_handed_back_within_the_drain_time_is_abandoned(
    tmp_path: Path,
) -> None:
    """``swarm node run`` after a signal: a submission the coordinator holds (frozen, not gone)
    is given ``drain_s`` (node.toml); then the work loop is cancelled and ``stop()`` no longer
    waits for it."""
    import node.main

    swarm = Swarm(tmp_path)
    await swarm.coord.start()
    swarm.coord.submit_gate = asyncio.Event()  # never set: the verdict never comes
    backend = LaterBlocks()
    try:
        await swarm.coord.publish(1)
        w = swarm.worker(backend)
        await w.start()
        await swarm.coord.submit_entered.wait()
        # the next lease is generating (held there), not yet in hand: a lease in hand would wait
        # for the held submission and be abandoned with it, one generating is handed back
        await until(backend.entered.is_set, "the next lease's generation")
        stop = asyncio.Event()
        stop.set()
        w.request_stop()
        await asyncio.wait_for(node.main._work_until_drained(w, stop, drain_s=0.2), 5)
        work = next((t for t in asyncio.all_tasks() if t.get_name() == "node-work"), None)
        assert work is None  # cancelled and ended
        await asyncio.wait_for(w.stop(), 5)  # does not wait for the abandoned submission
        assert w.stats.leases_done == 0  # the submission was abandoned, not counted
        # the lease taken while that verdict was held was handed back at the stop
        assert len(swarm.coord.leases) == 2 and w.stats.leases_released == 1
    finally:
        backend.release.set()
        swarm.coord.submit_gate.set()
        if swarm.coord.broadcast is not None:
            await swarm.coord.broadcast.stop()
        swarm.coord.core.close()
