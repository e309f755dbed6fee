"""Re-scores queued behind a slow one do not take the event loop's shared executor.

Found in a SmolLM2 demo on a 2-core CPU: the first check of v0 calibrated the version (minutes
with the full model in three precisions), the leases drawn after it queued for the verifier's
lock, each in a thread of the loop's default executor, until all of them were taken; the
answers' reward scoring (``asyncio.to_thread``) then waited behind the queue and the node's
submissions timed out ("submission lost"). The verifier now runs its re-scores on its own
thread, so the loop's executor stays free for the answers.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from coordinator.logprobs import InProcessLogprobVerifier


async def test_queued_rescores_leave_the_loops_executor_free() -> None:
    loop = asyncio.get_running_loop()
    shared = ThreadPoolExecutor(max_workers=4, thread_name_prefix="shared")
    loop.set_default_executor(shared)  # the size CI's CPU count would otherwise choose
    release = threading.Event()
    entered = threading.Event()

    def slow_loader(version: int) -> Any:  # a version whose weights take long (a calibration)
        entered.set()
        release.wait(30)
        raise RuntimeError("released: this test scores nothing")

    verifier = InProcessLogprobVerifier(slow_loader, {}, cache_size=2)  # the strict default
    checks = [
        asyncio.ensure_future(verifier.check(0, [[1, 2]], [[3]], [[-1.0]])) for _ in range(8)
    ]  # twice the shared executor's threads
    try:
        assert await asyncio.to_thread(entered.wait, 5)  # the first re-score holds the lock
        # an answer's reward scoring gets a thread at once, queued re-scores or not
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 41 + 1), timeout=3) == 42
    finally:
        release.set()
        results = await asyncio.gather(*checks, return_exceptions=True)
        shared.shutdown(wait=True)
    assert all(isinstance(r, RuntimeError) for r in results), results
