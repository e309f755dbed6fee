"""The ``--nproc`` launcher's supervision of its ranks after a stop request (issue 36 item 6).

Real child processes stand in for the ranks (``python -c``: exit codes and timing, no torch). After
SIGINT/SIGTERM rank 0 ends the job: when it exits 0 the job stopped cleanly even if another rank
failed on losing it first (rank 0 abandoned a step the other rank was in); the ranks still running
``stop_grace_s + STOP_TEARDOWN_S`` after the stop are killed; without a stop, the first failure
is the job's.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import pytest

from trainer import launch


def _ranks(
    *scripts: str,
) -> tuple[list[subprocess.Popen[bytes]], queue.SimpleQueue[tuple[int, int]]]:
    events: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    procs = [subprocess.Popen([sys.executable, "-c", s]) for s in scripts]
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, q=p: events.put((r, q.wait())), daemon=True).start()
    return procs, events


def test_a_follower_lost_after_a_stop_is_not_a_failure() -> None:
    # rank 1 fails first (it lost rank 0, which abandoned a step), then rank 0 exits 0
    procs, events = _ranks("import time; time.sleep(0.6)", "import sys; sys.exit(1)")
    events.put((launch._STOP, 15))
    assert launch._supervise(procs, events, stop_grace_s=5.0) == 0


def test_a_stop_kills_ranks_that_outlive_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "STOP_TEARDOWN_S", 0.5)
    procs, events = _ranks("import time; time.sleep(60)", "import time; time.sleep(60)")
    events.put((launch._STOP, 15))
    t0 = time.monotonic()
    code = launch._supervise(procs, events, stop_grace_s=0.5)
    took = time.monotonic() - t0
    assert code == 1  # rank 0 was killed: the job did not stop cleanly
    assert took < 5.0, took  # 1 s of bound, not the ranks' 60 s
    assert all(p.poll() is not None for p in procs)


def test_without_a_stop_the_first_failure_is_the_jobs() -> None:
    procs, events = _ranks("import time; time.sleep(60)", "import sys; sys.exit(1)")
    assert launch._supervise(procs, events, stop_grace_s=5.0) == 1
    assert procs[0].wait(10) != 0  # stopped by the launcher
