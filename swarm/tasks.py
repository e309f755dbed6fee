"""Small asyncio helpers for owned background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait at most ``timeout`` seconds for them to end.

    Bounded on purpose: in Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that races
    with its inner future (hivemind's DHT futures do this), so a task may outlive its cancel.
    Owners therefore also stop their loops with a flag; a straggler is logged, not awaited forever.
    """
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _done, still = await asyncio.wait(pending, timeout=timeout)
    for task in still:
        logger.warning("task %s did not stop within %.1f s after cancel", task.get_name(), timeout)
