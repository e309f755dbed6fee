"""A node's own status page (node.statuspage) against a real worker on the in-memory swarm of
test_node_worker: the figures agree with the worker's counters, the lease in hand is shown, a
refusal's reason reaches the page."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_node_worker import BlockingBackend, Swarm, until

from node.statuspage import NodeStatusPage


@pytest.fixture
async def mem_swarm(tmp_path: Path) -> AsyncIterator[Swarm]:
    s = Swarm(tmp_path)
    await s.coord.start()
    yield s
    for w in s.workers:
        await w.stop()
    if s.coord.broadcast is not None:
        await s.coord.broadcast.stop()
    s.coord.core.close()


def _get(page: NodeStatusPage, path: str) -> dict[str, object]:
    status, body, ctype = page.app.answer(path)
    assert status == 200 and ctype == "application/json"
    doc: dict[str, object] = json.loads(body)
    return doc


async def test_page_shows_the_lease_in_hand_and_the_counters(mem_swarm: Swarm) -> None:
    await mem_swarm.coord.publish(1)
    backend = BlockingBackend()
    w = mem_swarm.worker(backend)
    page = NodeStatusPage(w)
    await page.start()
    try:
        assert _get(page, "/status")["doing"] == "starting"
        await w.start()
        await until(backend.entered.is_set, "generation to start")
        page._refresh()
        doc = _get(page, "/status")
        lease = mem_swarm.coord.leases[-1]
        assert doc["fingerprint"] == w.identity.fingerprint
        assert doc["doing"] == f"generating {len(lease.prompts)} prompts × {lease.group_size}"
        assert doc["lease"] == {
            "lease_id": lease.lease_id, "policy_version": 1, "prompts": len(lease.prompts),
            "group_size": lease.group_size, "deadline_in_s": doc["lease"]["deadline_in_s"],  # type: ignore[index]
        }  # fmt: skip
        assert doc["loaded_version"] == 1 and doc["versions_held"] == [1]
        assert doc["backend"] == "fake/float32" and doc["state"] == "active"
        backend.release.set()
        await until(lambda: w.stats.leases_accepted >= 2, "two accepted leases")
        page._refresh()
        doc = _get(page, "/status")
        s = w.stats
        for key in ("leases_accepted", "samples_accepted", "leases_rejected", "tokens_generated"):
            assert doc[key] == getattr(s, key), key  # no await between snapshot and reading
        assert doc["last_reject"] is None
        hist = _get(page, "/api/history")
        assert hist["samples"] and hist["seq"] == len(hist["samples"])  # type: ignore[arg-type]
        assert _get(page, f"/api/history?since={hist['seq']}")["samples"] == []
        assert _get(page, "/api/history?since=99999")["full"] is True  # a restarted node
        status, body, _ = page.app.answer("/")
        assert status == 200 and b"node.js" in body
    finally:
        backend.release.set()
        await page.stop()


async def test_page_shows_the_last_refusal(mem_swarm: Swarm) -> None:
    await mem_swarm.coord.publish(1)
    w = mem_swarm.worker(misbehave=["oov_tokens"])
    page = NodeStatusPage(w)
    await page.start()
    try:
        await w.start()
        await until(lambda: w.stats.leases_rejected >= 1, "a rejected lease")
        page._refresh()
        doc = _get(page, "/status")
        assert doc["leases_rejected"] == w.stats.leases_rejected >= 1
        assert str(doc["last_reject"]).startswith("token_out_of_vocab")
        assert isinstance(doc["last_reject_age_s"], float) and doc["last_reject_age_s"] >= 0
    finally:
        await page.stop()
