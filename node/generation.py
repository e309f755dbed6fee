"""The generation thread: ``backend.generate`` off the event loop.

Generation runs on one dedicated thread so heartbeats, adverts and chunk serving go on while a
lease is generated. :class:`GenerationThread` owns that thread and the call in flight.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.backends.base import GenerationRequest, InferenceBackend, SampleOut, SamplingConfig

__all__ = ["GenerationThread"]


class GenerationThread:
    """Runs ``backend.generate`` (or, with ``greedy``, the testing-only
    :func:`node.byzantine.greedy_generate`) on its own thread, one call at a time."""

    def __init__(self, backend: InferenceBackend, *, greedy: bool = False) -> None:
        self._backend = backend
        self._greedy = greedy
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self._future: asyncio.Future[list[list[SampleOut]]] | None = None

    @property
    def in_flight(self) -> bool:
        """True while a generate call runs on the thread."""
        return self._future is not None and not self._future.done()

    def submit(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> asyncio.Future[list[list[SampleOut]]]:
        """Start generating ``requests`` on the thread; the future ends with the samples."""
        generate: Callable[..., list[list[SampleOut]]] = self._backend.generate
        if self._greedy:  # testing only: swarm demo --byzantine
            from node.byzantine import greedy_generate

            generate = functools.partial(greedy_generate, self._backend)
        loop = asyncio.get_running_loop()
        self._future = loop.run_in_executor(self._executor, generate, requests, sampling)
        return self._future

    def shutdown(self) -> None:
        """Let the thread go; a call still running is abandoned, not awaited."""
        self._executor.shutdown(wait=False, cancel_futures=True)
