"""The browser pages' server side without sockets: routing, static files, and the rules the pages'
own code keeps (data never becomes markup, no inline script, vendored chart library present)."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import pytest

from coordinator.history import StatusHistory
from swarm.web.server import CSP, WebApp, json_response

STATIC = resources.files("swarm.web") / "static"
OUR_JS = ["common.js", "dashboard.js", "node.js"]


def _app(**routes: Any) -> WebApp:
    return WebApp(
        {"/status": lambda q: json_response({"ok": 1}), **routes},
        {"/": "dashboard.html"},
    )


def test_routes_pages_and_static_files() -> None:
    app = _app()
    status, body, ctype = app.answer("/status?x=1")
    assert (status, json.loads(body), ctype) == (200, {"ok": 1}, "application/json")
    status, body, ctype = app.answer("/")
    assert status == 200 and ctype.startswith("text/html") and b"dashboard.js" in body
    files = [("dashboard.js", "text/javascript"), ("uPlot.iife.min.js", "text/javascript"),
             ("style.css", "text/css"), ("uPlot.LICENSE", "text/plain")]  # fmt: skip
    for name, kind in files:
        status, body, ctype = app.answer(f"/static/{name}")
        assert status == 200 and ctype.startswith(kind) and body, name


@pytest.mark.parametrize(
    "path",
    ["/nope", "/static/", "/static/../server.py", "/static/%2e%2e/server.py", "/static/x.py",
     "/static/__init__.py", "//etc/passwd", "/static/style.css/.."],
)  # fmt: skip
def test_anything_else_is_not_found(path: str) -> None:
    status, body, ctype = _app().answer(path)
    assert status == 404 and ctype == "application/json"
    assert "/status" in json.loads(body)["try"]


def test_a_failing_route_answers_500_and_bad_queries_400() -> None:
    def boom(query: Any) -> Any:
        raise RuntimeError("secret detail")

    app = _app(**{"/boom": boom})
    status, body, _ = app.answer("/boom")
    assert status == 500 and b"secret detail" not in body
    status, _, _ = app.answer("/status?" + "&".join(f"k{i}=1" for i in range(50)))
    assert status == 400


def test_coordinator_app_serves_status_history_and_metrics() -> None:
    from prometheus_client import CollectorRegistry, Counter

    from coordinator.http import StatusHttpServer

    registry = CollectorRegistry()
    Counter("swarm_test_things", "things", registry=registry).inc(3)
    history = StatusHistory()
    history.record_trainer({"step": 1, "reward_mean": 0.5})
    server = StatusHttpServer("127.0.0.1", 0, core_registry=registry, history=history)  # unbound
    server.set_status({"policy_version": 3, "node_hardware": {"ed25519:x": "<script>"}})
    app = server.app
    status, body, _ = app.answer("/status")
    assert json.loads(body)["node_hardware"] == {"ed25519:x": "<script>"}  # raw: pages escape
    for bad in ["abc", "-1", "9" * 40]:
        assert app.answer(f"/api/history?since={bad}")[0] == 400
    status, body, _ = app.answer("/api/history")
    doc = json.loads(body)
    assert status == 200 and doc["steps"][0]["reward_mean"] == 0.5 and doc["full"]
    status, body, _ = app.answer(f"/api/history?since={doc['seq']}&epoch={doc['epoch']}")
    assert json.loads(body)["steps"] == []
    status, body, _ = app.answer("/metrics")
    assert status == 200 and b"swarm_test_things_total 3.0" in body
    assert app.answer("/")[1] == app.answer("/static/dashboard.html")[1]


def test_pages_never_turn_data_into_markup() -> None:
    """The rule that makes a hostile advert harmless, checked on the source of our scripts."""
    forbidden = re.compile(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
        r"setAttribute\(\s*[\"']on|\.src\s*=|srcdoc"
    )
    for name in OUR_JS:
        code = "\n".join(  # comments may name what the code avoids
            line for line in (STATIC / name).read_text().splitlines()
            if not line.lstrip().startswith("//")
        )  # fmt: skip
        text = code
        assert not forbidden.search(text), f"{name}: {forbidden.search(text)}"
    for page in ["dashboard.html", "node.html"]:
        html = (STATIC / page).read_text()
        scripts = re.findall(r"<script\b[^>]*>", html)
        assert scripts and all('src="/static/' in tag for tag in scripts), scripts  # no inline
        assert not re.search(r"<[^>]*\son[a-z]+\s*=", html, re.I)  # no inline handlers
        assert "http://" not in html and "https://" not in html  # nothing from a CDN


def test_csp_allows_only_this_server() -> None:
    assert "script-src 'self'" in CSP and "default-src 'none'" in CSP
    assert "unsafe-inline" not in CSP and "unsafe-eval" not in CSP


def test_vendored_chart_library_and_its_licence() -> None:
    lib = (STATIC / "uPlot.iife.min.js").read_text()
    assert lib.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()


def test_every_static_file_is_package_data() -> None:
    """A wheel carries only what pyproject's package-data names: every file the pages need must
    match one of its patterns (an installed coordinator would otherwise refuse to start)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    web = patterns["swarm.web"]
    for entry in STATIC.iterdir():
        assert any(fnmatch.fnmatch(f"static/{entry.name}", p) for p in web), entry.name
