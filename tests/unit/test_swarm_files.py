"""swarm.files.atomic_write_text: a polled document is either the old one or the whole new one."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from swarm import files
from swarm.files import atomic_write_text


def test_writes_and_replaces_leaving_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    atomic_write_text(path, '{"a": 1}')
    atomic_write_text(path, '{"a": 2, "é": "ü"}')
    assert json.loads(path.read_text(encoding="utf-8")) == {"a": 2, "é": "ü"}
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.json"]


def test_a_failed_write_keeps_the_previous_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename is the only step that touches the path: if anything before or at it fails, a
    reader still finds the previous document, and the temporary file is gone (a plain
    ``write_text`` would have truncated the path first)."""
    path = tmp_path / "node.json"
    atomic_write_text(path, '{"status_url": "http://127.0.0.1:1"}')

    def boom(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(path, '{"status_url": "http://127.0.0.1:2"}')
    assert json.loads(path.read_text()) == {"status_url": "http://127.0.0.1:1"}
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]


def test_a_reader_polling_the_path_never_sees_a_partial_document(tmp_path: Path) -> None:
    """What the launchers do (wait for the file, then parse it) while it is rewritten."""
    path = tmp_path / "demo.json"
    doc = json.dumps({"pids": {f"node-{i}": i for i in range(2000)}})
    atomic_write_text(path, doc)
    stop = threading.Event()
    seen: list[str] = []

    def read() -> None:
        while not stop.is_set():
            text = path.read_text()
            if text != doc:
                seen.append(text[:40])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(300):
            atomic_write_text(path, doc)
    finally:
        stop.set()
        reader.join(timeout=10)
    assert seen == []
    assert os.listdir(tmp_path) == ["demo.json"]
