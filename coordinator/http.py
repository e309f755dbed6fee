"""Read-only HTTP observability: the dashboard (``/``), ``/status`` (JSON), ``/api/history``
(JSON), ``/api/nodes`` (JSON, the node table a page at a time) and ``/metrics`` (Prometheus).

Served by :class:`swarm.web.server.ReadOnlyHttpServer` (stdlib, daemon threads, GET/HEAD only,
strict Content-Security-Policy). It never touches the coordinator's state: the event loop hands it
a fresh status snapshot every tick (:meth:`StatusHttpServer.set_status`), the history
(:class:`~coordinator.history.StatusHistory`) is read under its own lock, and Prometheus metrics
come from the (thread-safe) registry. Bound to localhost unless configured.

The page polls ``/status`` and ``/api/history?since=SEQ&epoch=E`` every two seconds rather than
holding a server-sent-event stream: the snapshot changes once a tick (1 s), so a stream would buy
at most a second, at the price of a server thread held per open tab and of proxies and SSH tunnels
that buffer streams; polling also recovers by itself from a coordinator restart (a new ``epoch``).

``/api/nodes?offset=O&limit=L`` answers one page of the node table (the per-node maps of
:func:`coordinator.status.node_page`, at most :data:`MAX_PAGE` nodes). A large swarm's ``/status``
carries node counts only (:data:`coordinator.status.NODE_MAPS_MAX`), and the dashboard reads its
table from here. The page is built by ``node_pages`` — the service hands the work to its event
loop, which owns the coordinator's state, and waits at most :data:`PAGE_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from coordinator.history import StatusHistory
from swarm.web.server import (
    JSON_TYPE,
    ReadOnlyHttpServer,
    Response,
    WebApp,
    json_response,
)

#: What ``GET /`` serves.
DASHBOARD_PAGE = "dashboard.html"
#: Most nodes one ``/api/nodes`` answer holds.
MAX_PAGE = 500
#: How long a request waits for its page (seconds).
PAGE_TIMEOUT_S = 5.0

#: ``(offset, limit) -> page``: builds one page of the node table (None: no table served).
NodePages = Callable[[int, int], dict[str, Any]]


class StatusHttpServer:
    """Serves the dashboard, the latest status snapshot, its history and ``core_registry``;
    :attr:`app` answers without a socket, :meth:`start` binds ``host:port``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        core_registry: CollectorRegistry,
        history: StatusHistory | None = None,
        node_pages: NodePages | None = None,
    ) -> None:
        self._registry = core_registry
        self._node_pages = node_pages
        self._history = history if history is not None else StatusHistory()
        self._status: bytes = b"{}"
        self._lock = threading.Lock()
        self.app = WebApp(
            {
                "/status": self._get_status,
                "/metrics": self._get_metrics,
                "/api/history": self._get_history,
                "/api/nodes": self._get_nodes,
            },
            {"/": DASHBOARD_PAGE, "/index.html": DASHBOARD_PAGE},
        )
        self._bind = (host, port)
        self._server: ReadOnlyHttpServer | None = None

    @property
    def url(self) -> str:
        return self._server.url if self._server is not None else ""

    def start(self) -> None:
        """Bind (an OSError if the port is taken) and serve from a daemon thread."""
        self._server = ReadOnlyHttpServer(*self._bind, self.app, name="status")
        self._server.start()

    def set_status(self, status: dict[str, Any]) -> None:
        body = json.dumps(status, default=str, allow_nan=False, sort_keys=True).encode()
        with self._lock:
            self._status = body

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    # --- routes (run on the server's threads) ----------------------------------------------------
    def _get_status(self, query: Mapping[str, str]) -> Response:
        with self._lock:
            return 200, self._status, JSON_TYPE

    def _get_metrics(self, query: Mapping[str, str]) -> Response:
        return 200, generate_latest(self._registry), CONTENT_TYPE_LATEST

    def _get_history(self, query: Mapping[str, str]) -> Response:
        since = query.get("since")
        if since is not None and not (since.isdigit() and len(since) <= 18):
            return json_response({"error": f"since={since[:40]!r}: expected a row number"}, 400)
        return json_response(self._history.since(int(since) if since else None, query.get("epoch")))

    def _get_nodes(self, query: Mapping[str, str]) -> Response:
        if self._node_pages is None:
            return json_response({"error": "this server has no node table"}, 404)
        bounds = []
        for name, default in (("offset", 0), ("limit", 100)):
            raw = query.get(name)
            if raw is not None and not (raw.isdigit() and len(raw) <= 9):
                return json_response(
                    {"error": f"{name}={raw[:40]!r}: expected a whole number >= 0"}, 400
                )
            bounds.append(int(raw) if raw is not None else default)
        offset, limit = bounds[0], min(bounds[1], MAX_PAGE)
        try:
            page = self._node_pages(offset, limit)
        except TimeoutError:
            return json_response({"error": "the coordinator is busy: try again"}, 503)
        return json_response(page)
