"""A small read-only HTTP server for observability pages (stdlib, one daemon thread per request).

:class:`ReadOnlyHttpServer` answers ``GET`` and ``HEAD`` only (anything else: 405) with what its
:class:`WebApp` says. The app answers from, in this order: the route table (``path ->
function(query) -> Response``), the pages (``path -> static file name``, e.g. ``/`` ->
``dashboard.html``), or ``/static/<name>`` for the files packaged in :mod:`swarm.web`'s
``static/`` folder (read once at start-up; a name that is not one of them is a 404, so no path
ever reaches the file system). Every answer carries the headers of :data:`SECURITY_HEADERS`: the
Content-Security-Policy allows scripts, styles and fetches from this server only and no inline
script, so even markup that slipped into a page could not run.

Route functions run on the server's threads: they must only read state that is safe to read from
another thread (the coordinator hands over finished snapshots under a lock).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

#: (HTTP status, body, Content-Type) of one answer.
Response = tuple[int, bytes, str]
#: A route: the query string's parameters (last value wins) -> the answer.
Route = Callable[[Mapping[str, str]], Response]

JSON_TYPE = "application/json"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".LICENSE": "text/plain; charset=utf-8",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
#: Most query parameters parsed from one request (the pages send one or two).
MAX_QUERY_FIELDS = 16


def json_response(doc: Any, status: int = 200) -> Response:
    """``doc`` as compact JSON (NaN and infinities are refused: the caller cleans them)."""
    body = json.dumps(doc, default=str, allow_nan=False, separators=(",", ":")).encode()
    return status, body, JSON_TYPE


def static_files() -> dict[str, bytes]:
    """The packaged files of ``swarm/web/static`` by name (read once; about 70 KB)."""
    root = resources.files("swarm.web") / "static"
    return {
        entry.name: entry.read_bytes()
        for entry in root.iterdir()
        if entry.is_file() and _content_type(entry.name) is not None
    }


def _content_type(name: str) -> str | None:
    for suffix, ctype in CONTENT_TYPES.items():
        if name.endswith(suffix):
            return ctype
    return None


class WebApp:
    """What to answer (no socket): ``routes`` first, then ``pages``, then ``/static/<name>``."""

    def __init__(self, routes: Mapping[str, Route], pages: Mapping[str, str] | None = None) -> None:
        self.routes = dict(routes)
        self.static = static_files()
        self.pages = dict(pages or {})
        missing = [f for f in self.pages.values() if f not in self.static]
        if missing:  # a packaging mistake (package-data), not a user error
            raise RuntimeError(f"static files missing from the installed package: {missing}")

    def answer(self, target: str) -> Response:
        """The answer to ``GET target``."""
        parts = urlsplit(target)
        path = parts.path
        route = self.routes.get(path)
        if route is not None:
            try:
                fields = parse_qs(parts.query, max_num_fields=MAX_QUERY_FIELDS)
            except ValueError:
                return json_response({"error": "too many query parameters"}, 400)
            query = {k: v[-1] for k, v in fields.items()}
            try:
                return route(query)
            except Exception as exc:  # a bug in a route must not kill the server thread
                log.exception("HTTP route %s failed", path)
                return json_response({"error": f"{path} failed: {type(exc).__name__}"}, 500)
        page = self.pages.get(path)
        if page is not None:
            return 200, self.static[page], CONTENT_TYPES[".html"]
        if path.startswith("/static/"):
            name = path.removeprefix("/static/")
            body = self.static.get(name)
            ctype = _content_type(name)
            if body is not None and ctype is not None:
                return 200, body, ctype
        known = sorted([*self.routes, *self.pages])
        return json_response({"error": f"not found: {path[:200]}", "try": known}, 404)


class ReadOnlyHttpServer:
    """Serves a :class:`WebApp` on ``host:port`` (0 = any free port) from a daemon thread."""

    def __init__(self, host: str, port: int, app: WebApp, *, name: str = "http") -> None:
        self.app = app

        class Handler(BaseHTTPRequestHandler):
            server_version = "rollout-swarm"
            sys_version = ""

            def do_GET(self) -> None:
                self._send(*app.answer(self.path), head=False)

            def do_HEAD(self) -> None:
                self._send(*app.answer(self.path), head=True)

            def _refuse(self) -> None:
                body = b'{"error": "read-only: only GET and HEAD are served"}'
                self._send(405, body, JSON_TYPE, head=False, extra={"Allow": "GET, HEAD"})

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

            def _send(
                self,
                status: int,
                body: bytes,
                ctype: str,
                *,
                head: bool,
                extra: Mapping[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for key, value in {**SECURITY_HEADERS, **(extra or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet access log
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"{name}-http", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
