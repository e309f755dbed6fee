"""Process-wide signal plumbing shared by the ``swarm`` entry points (no heavy imports).

The coordinator, node and trainer entry points call :func:`install_fork_signal_reset` before they
start a swarm peer; ``swarm.cli.main`` calls it too. It lives here, not in :mod:`swarm.cli`, so the
entry points do not import the CLI that imports them (no import cycle).
"""

from __future__ import annotations

__all__ = ["install_fork_signal_reset"]


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
