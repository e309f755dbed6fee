"""The volunteer's view: a node's own status page (``swarm node run --status-port PORT``).

:class:`NodeStatusPage` serves, read-only, on ``status_host:status_port`` (127.0.0.1 by default):

* ``/``             -- the page (``swarm/web/static/node.html``): what the node is doing, its
                       lease, tokens/s, the versions it holds, accepted/rejected counts and its
                       last refusal reason, refreshed every two seconds;
* ``/status``       -- the same figures as JSON (:func:`node_status`);
* ``/api/history``  -- tokens/s, accepted samples and rejections every two seconds over the last
                       half hour (a bounded deque, sampled by a task of the page).

It only reads the worker's counters; it never acts on the node. The figures are this process's
own: they agree with the node's log lines (same counters as its periodic ``status:`` line).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from node.presence import node_state
from swarm.display import describe_hardware
from swarm.tasks import cancel_and_wait
from swarm.web.server import ReadOnlyHttpServer, Response, WebApp, json_response

if TYPE_CHECKING:
    from node.worker import NodeWorker

__all__ = ["NodeStatusPage", "node_status"]

log = logging.getLogger(__name__)

#: Seconds between two history samples, and how many are kept (half an hour).
SAMPLE_S = 2.0
MAX_SAMPLES = 900


def node_status(worker: NodeWorker, started_at: float, now: float) -> dict[str, Any]:
    """The node's figures (the page's ``/status``)."""
    s = worker.stats
    lease = worker.current_lease
    advert = worker.build_advert()
    broadcast = worker.broadcast
    store = broadcast.store if broadcast is not None else None
    held = [v for v in store.versions() if store.is_complete(v)] if store is not None else []
    # "failed": stopped taking leases after identical generation failures (node.failures)
    state = node_state(worker.failures, stopping=worker.stopping, active=worker.active)
    return {
        "fingerprint": worker.identity.fingerprint,
        "peer_id": worker.peer_id,
        "coordinator_peer_id": worker.coordinator_peer_id,
        "state": state,
        "doing": worker.phase,
        "backend": f"{worker.backend.name}/{worker.backend.dtype}",
        "hardware": describe_hardware(advert),
        "price_per_hour": worker.config.price_per_hour,
        "software_version": advert.software_version,
        "uptime_s": round(now - started_at, 1),
        "lease": None
        if lease is None
        else {
            "lease_id": lease.lease_id,
            "policy_version": lease.policy_version,
            "prompts": len(lease.prompts),
            "group_size": lease.group_size,
            "deadline_in_s": round(lease.deadline - now, 1),
        },
        "loaded_version": worker.backend.loaded_version,
        "versions_held": held,
        "tokens_per_s": s.tokens_per_s,
        "tokens_generated": s.tokens_generated,
        "generate_s": round(s.generate_s, 3),
        "leases_done": s.leases_done,
        "leases_accepted": s.leases_accepted,
        "leases_rejected": s.leases_rejected,
        "leases_released": s.leases_released,
        "samples_accepted": s.samples_accepted,
        "coordinator_errors": s.coordinator_errors,
        "problem": worker.failures.problem,  # the last generation failure (node/failures.py)
        "last_reject": s.last_reject,
        "last_reject_age_s": None if s.last_reject_at is None else round(now - s.last_reject_at, 1),
    }


class NodeStatusPage:
    """The page of one node: :attr:`app` answers requests (no socket), :meth:`serve` binds it,
    :meth:`start` takes the first snapshot and starts the sampling task."""

    def __init__(self, worker: NodeWorker) -> None:
        self.worker = worker
        self.started_at = time.time()
        self._status = json.dumps({"state": "starting"}).encode()
        self._samples: deque[dict[str, Any]] = deque(maxlen=MAX_SAMPLES)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._server: ReadOnlyHttpServer | None = None
        self.app = WebApp(
            {"/status": self._get_status, "/api/history": self._get_history},
            {"/": "node.html", "/index.html": "node.html"},
        )

    def serve(self, host: str, port: int) -> str:
        """Bind ``host:port`` (raises OSError, e.g. port in use) and serve; returns the URL."""
        self._server = ReadOnlyHttpServer(host, port, self.app, name="node-status")
        self._server.start()
        return self._server.url

    @property
    def url(self) -> str | None:
        return self._server.url if self._server is not None else None

    async def start(self) -> None:
        """First snapshot now, then one every second (history every :data:`SAMPLE_S`)."""
        self._refresh()
        self._task = asyncio.create_task(self._sample_loop(), name="node-status-page")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def _refresh(self, *, sample: bool = True) -> None:
        """Take a snapshot on the event loop (the worker is not thread-safe; the HTTP threads
        only read the finished bytes) and, with ``sample``, add it to the history."""
        now = time.time()
        doc = node_status(self.worker, self.started_at, now)
        self._status = json.dumps(doc, default=str, allow_nan=False).encode()
        if sample:
            self._seq += 1
            self._samples.append(
                {
                    "seq": self._seq,
                    "t": round(now, 3),
                    "tokens_per_s": doc["tokens_per_s"],
                    "samples_accepted": doc["samples_accepted"],
                    "leases_rejected": doc["leases_rejected"],
                    "loaded_version": doc["loaded_version"],
                }
            )

    async def _sample_loop(self) -> None:
        """The JSON every second, a history sample every :data:`SAMPLE_S`."""
        tick = 0
        while True:
            await asyncio.sleep(SAMPLE_S / 2)
            tick += 1
            try:
                self._refresh(sample=tick % 2 == 0)
            except Exception:  # the page is observability: it must never stop the node
                log.exception("status page snapshot failed; retrying")

    # --- routes (server threads: they read finished bytes / copy the deque) ----------------------
    def _get_status(self, query: Mapping[str, str]) -> Response:
        return 200, self._status, "application/json"

    def _get_history(self, query: Mapping[str, str]) -> Response:
        since = query.get("since")
        after = int(since) if since is not None and since.isdigit() and len(since) <= 18 else 0
        seq = self._seq
        full = after > seq  # a restarted node: the page starts over
        rows = [r for r in list(self._samples) if full or r["seq"] > after]
        return json_response({"seq": seq, "full": full, "samples": rows, "sample_s": SAMPLE_S})
