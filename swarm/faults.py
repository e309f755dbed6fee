"""Fault-injection points for the reliability suite (inert unless the environment names one).

A process started with ``RSWARM_FAULTS="name[@n],..."`` SIGKILLs itself the ``n``-th time (default:
the first) execution reaches ``fault_point(name)``: the same abrupt end as a power cut or the OOM
killer, at an exact place, so a test can show what survives it. Points in the code:

==============================  ============================================================
``submit.before_commit``        coordinator: a submission passed verification, nothing stored
``submit.after_commit``         coordinator: rollouts and verdict committed, reply not sent
``publish.after_commit``        coordinator: a new version recorded, reply not sent
==============================  ============================================================

Unset (always, outside tests), :func:`fault_point` is one dictionary lookup.

``RSWARM_STALLS="name=SECONDS,..."`` makes :func:`stall_point` block the calling thread that long
each time it is reached (a learner step that outlasts the stop grace, for the stop tests):

==============================  ============================================================
``trainer.step``                trainer: the end of each learner step, on the step's thread
==============================  ============================================================
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "RSWARM_FAULTS"


def _parse(spec: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("@")
        try:
            armed[name] = int(nth) if nth else 1
        except ValueError:
            raise ValueError(f"{ENV}: {item!r} is not name or name@N") from None
        if armed[name] < 1:
            raise ValueError(f"{ENV}: {item!r}: N must be >= 1")
    return armed


_armed = _parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """SIGKILL this process if ``name`` is armed and this is its ``n``-th hit."""
    if name not in _armed:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == _armed[name]:
        log.warning("fault injection: %s reached (hit %d): SIGKILL", name, _hits[name])
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


STALLS_ENV = "RSWARM_STALLS"


def _parse_stalls(spec: str) -> dict[str, float]:
    stalls: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, seconds = item.partition("=")
        try:
            stalls[name] = float(seconds)
        except ValueError:
            raise ValueError(f"{STALLS_ENV}: {item!r} is not name=SECONDS") from None
    return stalls


_stalls = _parse_stalls(os.environ.get(STALLS_ENV, ""))


def stall_point(name: str) -> None:
    """Block this thread for the seconds ``RSWARM_STALLS`` gives ``name`` (none: return)."""
    seconds = _stalls.get(name)
    if seconds:
        import time

        log.warning("fault injection: %s stalls for %.0f s", name, seconds)
        time.sleep(seconds)
