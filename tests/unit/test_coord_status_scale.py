"""The status document at 10,000 nodes (issue 35): above ``NODE_MAPS_MAX`` registered nodes the
per-tick document reads counts, not rows, and the dashboard reads its node table a page at a time
from ``/api/nodes``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from coord_harness import Harness

from coordinator.core import Coordinator
from coordinator.http import MAX_PAGE, StatusHttpServer
from coordinator.status import build_status, node_page
from coordinator.store import NodeRecord, Store
from coordinator.tasks import ReverseTask
from protocol.identity import Identity
from protocol.messages import Heartbeat

HB = Heartbeat(peer_id="p", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)


class RowCountingStore(Store):
    """Counts the node rows the status reads (what grew with the swarm every tick)."""

    rows_read = 0

    def nodes(self) -> list[NodeRecord]:
        out = super().nodes()
        self.rows_read += len(out)
        return out

    def live_nodes(self, seen_after: float, now: float) -> list[NodeRecord]:
        out = super().live_nodes(seen_after, now)
        self.rows_read += len(out)
        return out


def _swarm(tmp_path: Path, n: int) -> tuple[Harness, list[Identity]]:
    h = Harness(tmp_path)
    h.store.close()
    h.store = RowCountingStore(h.cfg.db_path)
    h.core = Coordinator(
        h.cfg, store=h.store, task=ReverseTask(), tokenizer=h.core.tokenizer, clock=h.clock,
        publisher_key=h.publisher.public_key,
    )  # fmt: skip
    nodes = [h.node() for _ in range(n)]
    return h, nodes


def _status(h: Harness, **kw: Any) -> dict[str, Any]:
    return build_status(
        h.core, fingerprint="f", peer_id="p", started_at=0.0, trainer_stats={}, broadcast=None, **kw
    )


def test_a_large_swarms_status_reads_counts_not_rows(tmp_path: Path) -> None:
    h, nodes = _swarm(tmp_path, 12)
    h.clock.advance(h.cfg.heartbeat_interval_s * h.cfg.heartbeat_misses + 1)  # all gone ...
    for ident in nodes[:7]:  # ... but 7
        h.core.heartbeat(ident.public_key, HB)
    h.store.put_ban(nodes[0].public_key, 1, h.clock() + 3600, "test")
    store = h.store
    assert isinstance(store, RowCountingStore)
    small = _status(h)  # 12 <= NODE_MAPS_MAX: the per-node maps, as before
    assert len(small["node_states"]) == 12 and "node_maps_omitted" not in small
    assert small["node_counts"] == {"banned": 1, "active": 6, "gone": 5}
    store.rows_read = 0
    large = _status(h, node_maps_max=5)
    # before issue 35 every tick read every node row twice (store.nodes() and alive_nodes())
    assert store.rows_read == 0
    assert large["node_maps_omitted"] == 12
    assert not [k for k in large if k.startswith("node_") and isinstance(large[k], dict)
                and k != "node_counts"]  # fmt: skip
    assert large["node_counts"] == small["node_counts"]
    assert (large["nodes_registered"], large["nodes_alive"]) == (12, 6)
    assert large["nodes_banned"] == small["nodes_banned"] == [nodes[0].fingerprint]
    json.dumps(large, allow_nan=False)


def test_node_pages_walk_the_table_in_fingerprint_order(tmp_path: Path) -> None:
    h, nodes = _swarm(tmp_path, 7)
    everyone = sorted(n.fingerprint for n in nodes)
    seen: list[str] = []
    for offset in range(0, 9, 3):
        page = node_page(h.core, offset, 3)
        assert page["total"] == 7 and page["offset"] == offset
        fps = list(page["node_states"])
        assert fps == sorted(fps) and len(fps) == min(3, 7 - offset)
        assert set(page["node_hardware"]) == set(fps)  # every map covers the page's nodes
        seen += fps
    assert seen == everyone
    full = _status(h)
    first = node_page(h.core, 0, 7)
    for key in ("node_states", "node_backend", "node_leases_completed", "node_trust"):
        assert first[key] == full[key], key  # the same figures as the small swarm's document


def test_api_nodes_serves_pages_and_refuses_bad_bounds() -> None:
    asked: list[tuple[int, int]] = []

    def pages(offset: int, limit: int) -> dict[str, Any]:
        asked.append((offset, limit))
        return {"total": 1000, "offset": offset, "limit": limit, "node_states": {}}

    app = StatusHttpServer("127.0.0.1", 0, core_registry=None, node_pages=pages).app  # type: ignore[arg-type]
    status, body, _ = app.answer("/api/nodes?offset=200&limit=50")
    assert status == 200 and json.loads(body)["offset"] == 200
    assert app.answer("/api/nodes")[0] == 200 and asked[-1] == (0, 100)
    app.answer(f"/api/nodes?limit={10 * MAX_PAGE}")
    assert asked[-1] == (0, MAX_PAGE)
    for bad in ("-1", "x", "1e3", "9" * 12):
        status, body, _ = app.answer(f"/api/nodes?offset={bad}")
        assert status == 400 and b"offset" in body
    none = StatusHttpServer("127.0.0.1", 0, core_registry=None).app  # type: ignore[arg-type]
    assert none.answer("/api/nodes")[0] == 404


def test_api_nodes_answers_busy_when_the_page_times_out() -> None:
    def slow(offset: int, limit: int) -> dict[str, Any]:
        raise TimeoutError("node page")

    app = StatusHttpServer("127.0.0.1", 0, core_registry=None, node_pages=slow).app  # type: ignore[arg-type]
    status, body, _ = app.answer("/api/nodes")
    assert status == 503 and b"busy" in body


@pytest.mark.parametrize("n", [3])
def test_history_counts_nodes_from_the_counts(tmp_path: Path, n: int) -> None:
    from coordinator.history import StatusHistory

    h, _ = _swarm(tmp_path, n)
    hist = StatusHistory()
    hist.record_tick(_status(h, node_maps_max=0), None)
    assert hist.since(None, None)["ticks"][-1]["nodes"] == {"active": n}
