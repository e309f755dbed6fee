"""Read-only HTTP observability: the dashboard (``/``), ``/status`` (JSON), ``/api/history``
(JSON) and ``/metrics`` (Prometheus).

Served by :class:`swarm.web.server.ReadOnlyHttpServer` (stdlib, daemon threads, GET/HEAD only,
strict Content-Security-Policy). It never touches the coordinator's state: the event loop hands it
a fresh status snapshot every tick (:meth:`StatusHttpServer.set_status`), the history
(:class:`~coordinator.history.StatusHistory`) is read under its own lock, and Prometheus metrics
come from the (thread-safe) registry. Bound to localhost unless configured.

The page polls ``/status`` and ``/api/history?since=SEQ&epoch=E`` every two seconds rather than
holding a server-sent-event stream: the snapshot changes once a tick (1 s), so a stream would buy
at most a second, at the price of a server thread held per open tab and of proxies and SSH tunnels
that buffer streams; polling also recovers by itself from a coordinator restart (a new ``epoch``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
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
    ) -> None:
        self._registry = core_registry
        self._history = history if history is not None else StatusHistory()
        self._status: bytes = b"{}"
        self._lock = threading.Lock()
        self.app = WebApp(
            {
                "/status": self._get_status,
                "/metrics": self._get_metrics,
                "/api/history": self._get_history,
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
