"""A ``swarm demo`` run as the tests start and end it (shared by test_demo_e2e and the browser
tests): its own session, its output in a file, the process checks that prove it left nothing.

The demo's children are its own business (it ends them by PID). If it does not end in time, the
tests SIGTERM it (it then stops its children) and, as a last resort, SIGKILL the process groups
of the PIDs it recorded in ``demo.json``, and only those.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def demo_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def status_of(http_url: str, path: str = "/status") -> dict[str, Any]:
    """A JSON document of a coordinator or node page (``/status`` unless told)."""
    with urllib.request.urlopen(http_url + path, timeout=3.0) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def wait_for(what: str, ready: Any, demo: subprocess.Popen[bytes], out: Path, limit: float) -> Any:
    """Poll ``ready()`` until it returns something truthy; fail if the demo exits meanwhile."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            value = ready()
            if value:
                return value
        if demo.poll() is not None:
            pytest.fail(
                f"demo exited ({demo.returncode}) before {what}:\n{out.read_text()[-3000:]}"
            )
        time.sleep(0.5)
    pytest.fail(f"timed out after {limit:.0f}s waiting for {what}:\n{out.read_text()[-3000:]}")


def stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state first), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    fields = stat(pid)
    return fields is not None and fields[0] != "Z"


def leftovers(run_dir: Path | None, sessions: set[int]) -> dict[int, str]:
    """Live processes (pid -> command line) in one of ``sessions`` (each child of the demo leads
    its own session, and its p2pd daemon stays in it) or whose command line names ``run_dir``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        fields = stat(pid)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields is None or fields[0] == "Z":
            continue
        if int(fields[3]) in sessions or (run_dir is not None and str(run_dir) in cmdline):
            found[pid] = cmdline[:200]
    return found


def last_resort_cleanup(run_dir: Path, demo_pid: int) -> None:
    """SIGKILL the process groups of the demo's children (recorded in demo.json) and of the demo
    itself. A process group ID is not reused while any member lives, so this ends only ours."""
    try:
        groups = [demo_pid, *json.loads((run_dir / "demo.json").read_text())["pids"].values()]
    except (OSError, ValueError, KeyError):
        groups = [demo_pid]
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


class DemoRun:
    """``swarm demo --no-live --run-dir RUN_DIR FLAGS`` in its own session, output in ``out``."""

    def __init__(self, run_dir: Path, out: Path, *flags: str) -> None:
        self.run_dir = run_dir
        self.out = out
        argv = [sys.executable, "-m", "swarm.shell.cli", "demo", "--no-live"]
        argv += ["--run-dir", str(run_dir)]
        with open(out, "wb") as fh:
            self.popen = subprocess.Popen(
                [*argv, *flags], cwd=REPO, env=demo_env(), stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def wait_for(self, what: str, ready: Any, limit: float) -> Any:
        return wait_for(what, ready, self.popen, self.out, limit)

    def coordinator(self, limit: float = 120) -> dict[str, Any]:
        """The coordinator's ``coordinator.json`` once it is up."""
        info = self.run_dir / "coordinator" / "coordinator.json"
        doc: dict[str, Any] = self.wait_for(
            "coordinator.json", lambda: json.loads(info.read_text()), limit
        )
        return doc

    def stop(self) -> None:
        """End the demo as Ctrl-C would, then check that none of its processes is left."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)  # the demo stops its children on SIGTERM
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        try:
            pids = json.loads((self.run_dir / "demo.json").read_text())["pids"]
        except (OSError, ValueError, KeyError):
            pids = {}
        sessions = {self.popen.pid, *pids.values()}
        deadline = time.monotonic() + 10
        while (left := leftovers(self.run_dir, sessions)) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            last_resort_cleanup(self.run_dir, self.popen.pid)
        assert not left, f"processes of the demo are still running: {left}"
