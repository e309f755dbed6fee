"""Read-only HTTP observability: ``GET /status`` (JSON) and ``GET /metrics`` (Prometheus).

A stdlib ``ThreadingHTTPServer`` in a daemon thread. It never touches the coordinator's state: the
event loop hands it a fresh status snapshot every tick (:meth:`StatusHttpServer.set_status`), and
Prometheus metrics are read from the (thread-safe) registry. Bound to localhost unless configured.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class StatusHttpServer:
    """Serves the latest status snapshot and the metrics of ``core_registry``."""

    def __init__(self, host: str, port: int, *, core_registry: CollectorRegistry) -> None:
        self._registry = core_registry
        self._status: bytes = b"{}"
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/status":
                    with outer._lock:
                        body, ctype = outer._status, "application/json"
                elif path == "/metrics":
                    body, ctype = generate_latest(outer._registry), CONTENT_TYPE_LATEST
                else:
                    body, ctype = b'{"error": "not found: try /status or /metrics"}', "text/plain"
                    self.send_response(404)
                    self._finish(body, ctype)
                    return
                self.send_response(200)
                self._finish(body, ctype)

            def _finish(self, body: bytes, ctype: str) -> None:
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet access log
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="status-http", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def set_status(self, status: dict[str, Any]) -> None:
        body = json.dumps(status, default=str, allow_nan=False, sort_keys=True).encode()
        with self._lock:
            self._status = body

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
