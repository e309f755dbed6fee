"""Process-wide signal plumbing shared by the ``swarm`` entry points (no heavy imports).

The coordinator, node and trainer entry points call :func:`install_fork_signal_reset` before they
start a swarm peer; ``swarm.shell.cli.main`` calls it too. It lives here, in the peer layer, not in
:mod:`swarm.shell.cli`, so the entry points do not import the CLI that imports them (no import
cycle, and no role imports the shell: tests/unit/test_layering.py).

Stopping (docs/operations.md, "Stopping"): every process exits within :data:`STOP_BOUND_S` of
SIGINT/SIGTERM and leaves no process of its own behind. The entry points call
:func:`become_subreaper` first, so a helper orphaned on the way out (a libp2p daemon whose DHT
process was terminated the hard way) is re-parented to them rather than to init, and
:func:`end_descendants` last: whatever of their process tree is still there is ended by PID.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import NoReturn

__all__ = [
    "STOP_BOUND_S",
    "become_subreaper",
    "descendants",
    "end_descendants",
    "exit_now",
    "install_fork_signal_reset",
    "process_name",
]

log = logging.getLogger(__name__)

#: Seconds from SIGINT/SIGTERM to exit, at most, per process role (docs/operations.md); the
#: integration tests (tests/integration/test_process_stop.py) hold each process to its bound.
STOP_BOUND_S: dict[str, float] = {
    "coordinator": 10.0,
    "node": 15.0,
    # STOP_GRACE_S (10 s) for the step, publication or set-up in progress, then the final
    # checkpoint and the swarm peer's shutdown (the embedded model: well under 10 s)
    "trainer": 20.0,
    # swarm demo: the nodes and the trainer together, then the coordinator (each + 2 s margin)
    "demo": 35.0,
}


def _reset_signals_in_child() -> None:
    """After ``fork``: drop the parent's asyncio signal set-up in the child.

    ``loop.add_signal_handler`` installs a no-op Python handler for SIGTERM/SIGINT plus a wakeup
    fd shared with the parent's loop. A child forked afterwards (hivemind's DHT process) inherits
    both: it shrugs off ``terminate()`` (so the parent hangs joining it at exit) and its signals
    would wake the parent's loop. Restore what a fresh Python process has.
    """
    import contextlib
    import signal

    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    defaults = ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))
    for sig, default in defaults:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) not in (signal.SIG_IGN, default):
                signal.signal(sig, default)


_FORK_HOOK: list[bool] = []


def install_fork_signal_reset() -> None:
    """Register :func:`_reset_signals_in_child` as an after-fork hook (once per process).

    Entry points that call ``loop.add_signal_handler`` before starting a swarm peer (coordinator,
    node, trainer) call this, so the DHT process stays killable by SIGTERM.
    """
    import os

    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_reset_signals_in_child)
        _FORK_HOOK.append(True)


def become_subreaper() -> None:
    """Linux: adopt orphaned descendants (``PR_SET_CHILD_SUBREAPER``), so that a grandchild whose
    parent died (p2pd after its DHT process was terminated) is still found and ended by
    :func:`end_descendants`. A no-op elsewhere."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie is not: it has exited and only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (default: this one), parents before children, from
    ``/proc/<pid>/task/*/children`` (Linux; empty elsewhere)."""
    out: list[int] = []
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in out:
                out.append(child)
                todo.append(child)
    return [p for p in out if _alive(p)]


#: helpers that end by themselves when this process exits: torch's shared-memory manager
#: (``/proc/<pid>/comm``, 15 characters at most) waits for its clients to disconnect and ignores
#: SIGTERM; killing it early could strand shared-memory segments
SELF_ENDING = frozenset({"torch_shm_manag"})


def process_name(pid: int) -> str:
    """``/proc/<pid>/comm``: the executable's name, 15 characters at most ("" if gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def end_descendants(grace_s: float = 2.0) -> list[int]:
    """SIGTERM every live descendant of this process (but :data:`SELF_ENDING` helpers), SIGKILL
    those still there after ``grace_s``, reap them; returns the PIDs that had to be ended
    (logged: the regular shutdown should have stopped them)."""
    left = [p for p in descendants() if process_name(p) not in SELF_ENDING]
    if not left:
        return []
    log.warning("ending %d process(es) left behind: pids %s", len(left), left)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            _reap(left)
            if not any(_alive(p) for p in left):
                return left
            time.sleep(0.05)
    return left


def _reap(pids: list[int]) -> None:
    """Collect those of ``pids`` that are exited children of this process (orphans it adopted as
    a subreaper included), without blocking; other PIDs are their own parents' to reap."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` now, once its own shutdown is done: end what is left of its
    process tree, flush the logs and stdio, and skip the interpreter's teardown, which would join
    a thread that cannot be interrupted (a learner step, a generation) and spends seconds
    collecting torch's and transformers' modules (about 6 s at a load average of 8, a third of a
    stop bound). Only for the end of an entry point: nothing after it runs."""
    import sys

    end_descendants()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
