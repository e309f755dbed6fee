"""Small asyncio helpers for owned background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


#: While tasks run on after a cancel, it is repeated this often (seconds).
RECANCEL_S = 0.2


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait at most ``timeout`` seconds for them to end; collect their
    exceptions (so asyncio does not log them as never retrieved).

    In Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that races with its inner
    future (hivemind's DHT futures do this), so a task — a ``while True`` loop such as a heartbeat
    — may run on after one cancel: the cancel is repeated every :data:`RECANCEL_S` while it does.
    Bounded on purpose: a straggler is logged, not awaited forever.
    """
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
    for task in pending:
        logger.warning("task %s did not stop within %.1f s after cancel", task.get_name(), timeout)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.debug("task %s ended with %r", task.get_name(), task.exception())
