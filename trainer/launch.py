"""``swarm trainer run`` on several processes: the local launcher (``--nproc N``) and the ranks that
do not talk to the swarm.

Two ways to start the sharded trainer, the same code in every rank (docs/trainer.md):

* ``swarm trainer run --nproc N ...`` — :func:`launch_local` starts N copies of
  ``swarm trainer run ...`` on this machine with torchrun's environment (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), forwards SIGINT/SIGTERM to
  them, and when one rank fails stops the others and exits 1 with one line naming it;
* ``torchrun ... -m swarm.shell.cli trainer run ...`` (one machine or several): torchrun sets the
  same environment; use it across machines.

In a rank, ``WORLD_SIZE > 1`` selects the sharded path: rank 0 runs the network process
(:func:`trainer.network.run_trainer`), every other rank :func:`run_follower`: the same recipe, no
sockets but the process group's. A stop request (SIGINT/SIGTERM) is rank 0's to act on: it finishes
the step, tells the others, and all write the final checkpoint; the other ranks only log it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: after a failure, seconds the other ranks get before SIGKILL.
KILL_AFTER_S = 30.0
#: after a stop request, seconds past rank 0's ``stop_grace_s`` for the final checkpoint and the
#: swarm peer's shutdown, before the ranks still running are killed (the trainer's stop bound,
#: ``swarm.signals.STOP_BOUND_S``, minus a margin for the launcher's own exit)
STOP_TEARDOWN_S = 8.0
#: once rank 0 exited 0 after a stop, seconds the other ranks get to follow it
FOLLOW_EXIT_S = 5.0


class _FollowerSource:
    """A rank other than 0 never fetches: rank 0 scatters each batch."""

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Any] | None:
        raise AssertionError("only rank 0 fetches rollouts")


async def run_follower(config: Any, dist: Any) -> int:
    """A rank > 0: set up the sharded model, then train on what rank 0 scatters until it stops."""
    from trainer.recipe import Trainer

    trainer = Trainer.setup(config, dist=dist)
    await trainer.run(_FollowerSource(), None)
    return 0


def ignore_stop_signals(rank: int) -> None:
    """A follower logs SIGINT/SIGTERM and goes on: rank 0 stops the job cleanly (a follower that
    left on its own would make every other rank fail in its next collective)."""

    def note(signum: int, _frame: Any) -> None:
        log.info(
            "rank %d: %s received; rank 0 ends the job (finishes the step, then checkpoints)",
            rank, signal.Signals(signum).name,
        )  # fmt: skip

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note)


#: set by :func:`launch_local` in each rank's environment: the launcher's pid.
LAUNCHER_ENV = "RSWARM_LAUNCHER_PID"


def stop_with_launcher() -> None:
    """In a rank started by :func:`launch_local` (Linux): SIGTERM when the launcher dies, even by
    SIGKILL, so no rank trains on alone (rank 0 then stops the job as on any stop request).
    Called first thing in the rank (no ``preexec_fn``: forking with threads around is unsafe)."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def launch_local(nproc: int, argv: Sequence[str], *, stop_grace_s: float) -> int:
    """Run ``swarm trainer run ARGV`` as ``nproc`` ranks on this machine; returns the exit code
    (0 when every rank exited 0; else 2 when the first rank to fail rejected its input; else 1).

    ``stop_grace_s``: how long rank 0 may take to stop after SIGINT/SIGTERM (it finishes a step
    or a publication, then all ranks checkpoint); ranks still running ``STOP_TEARDOWN_S`` after
    that are killed. After a stop, the job ended cleanly when rank 0 exited 0 (the other ranks
    may have failed on losing it, when it abandoned a step: exit 0). The launcher is the
    subreaper of its ranks' process trees and ends what is left of them before it exits."""
    from swarm.signals import become_subreaper, end_descendants

    become_subreaper()
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    env[LAUNCHER_ENV] = str(os.getpid())
    cmd = [sys.executable, "-m", "swarm.shell.cli", "trainer", "run", *argv]
    # (rank, exit code) from the waiter threads; (_STOP, signal) from the signal handler
    # (SimpleQueue.put is reentrant: safe in a handler that interrupts a get()).
    events: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)
        events.put((_STOP, signum))

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen(cmd, env=rank_env))
        for rank, p in enumerate(procs):
            threading.Thread(
                target=lambda r=rank, q=p: events.put((r, q.wait())),
                name=f"rank-{rank}-wait",
                daemon=True,
            ).start()
        return _supervise(procs, events, stop_grace_s)
    finally:
        for p in procs:  # nothing outlives the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        end_descendants()  # a killed rank's DHT process and p2pd, adopted by the launcher
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP = -1


def _supervise(
    procs: list[subprocess.Popen[bytes]],
    events: queue.SimpleQueue[tuple[int, int]],
    stop_grace_s: float,
) -> int:
    """Wait for every rank. The first failure stops the others (SIGTERM, SIGKILL after
    ``KILL_AFTER_S``); a stop request gives them ``stop_grace_s + STOP_TEARDOWN_S``, and once
    rank 0 has exited 0 the others get ``FOLLOW_EXIT_S`` (their failures then are not the job's:
    rank 0 ended it)."""
    codes: dict[int, int] = {}
    failed: int | None = None  # the first failure's exit code
    stopping = False
    kill_at: float | None = None
    while len(codes) < len(procs):
        timeout = None if kill_at is None else max(0.0, kill_at - time.monotonic())
        try:
            rank, code = events.get(timeout=timeout)
        except queue.Empty:  # past the deadline
            for r, p in enumerate(procs):
                if r not in codes and p.poll() is None:
                    log.warning("rank %d did not stop in time; killing it", r)
                    p.kill()
            kill_at = None
            continue
        if rank == _STOP:
            if not stopping:
                stopping = True
                deadline = time.monotonic() + stop_grace_s + STOP_TEARDOWN_S
                kill_at = deadline if kill_at is None else min(kill_at, deadline)
            continue
        codes[rank] = code
        if stopping and rank == 0 and code == 0:
            deadline = time.monotonic() + FOLLOW_EXIT_S
            kill_at = deadline if kill_at is None else min(kill_at, deadline)
            continue
        if stopping and rank != 0 and 0 not in codes:
            continue  # judged once rank 0 is done: losing a rank 0 that stopped is no failure
        if code != 0 and failed is None:
            failed = _report_failure(procs, codes, rank, code)
            kill_at = time.monotonic() + KILL_AFTER_S
    if stopping and codes.get(0) == 0:
        others = {r: c for r, c in codes.items() if c != 0}
        if others:
            log.info("rank 0 stopped the job; the other ranks exited with %s", others)
        return 0
    if failed is None:  # a follower's failure left for rank 0 to judge, and rank 0 failed too
        bad = [(r, c) for r, c in sorted(codes.items()) if c != 0]
        if not bad:
            return 0
        failed = _report_failure(procs, codes, *bad[0])
    return 2 if failed == 2 else 1


def _report_failure(
    procs: list[subprocess.Popen[bytes]], codes: dict[int, int], rank: int, code: int
) -> int:
    """Say which rank failed (one line), stop the ranks still running; returns ``code``."""
    print(
        f"error: rank {rank} (pid {procs[rank].pid}) {_describe(code)}; stopping the "
        "other ranks; run the same command again to resume from the last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    for r, p in enumerate(procs):
        if r not in codes and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    return code
