"""A token bucket that caps a byte rate (used to cap a peer's upload, e.g. to emulate a WAN uplink).

Waiters are served first-come first-served, except urgent (control) ones, which go first.
Callers should acquire in small slices (the transport writes 64 KiB at a time) so the cap is
smooth rather than bursty.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class TokenBucket:
    """Allow ``rate`` bytes per second on average with bursts of at most ``burst`` bytes.

    ``clock`` and ``sleep`` are injectable so tests can run on a fake clock.
    """

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 20, 64 * 1024))
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = asyncio.Lock()
        self.total_bytes = 0

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    async def acquire(self, nbytes: int, *, urgent: bool = False) -> None:
        """Wait until ``nbytes`` may be sent (may go into debt up to one request).

        ``urgent`` (control messages) does not queue behind the waiting writers: its bytes are
        taken at once, possibly into debt, which the next writers wait off. It still waits while
        the debt is over two bursts (the slice of the writer sleeping now, at most one burst,
        plus one burst of urgent bytes), so urgent traffic cannot exceed the rate for long."""
        if urgent:
            self._refill()
            self._tokens -= nbytes
            self.total_bytes += nbytes
            if self._tokens < -2 * self.burst:
                await self._sleep((-self._tokens - 2 * self.burst) / self.rate)
            return
        async with self._lock:
            self._refill()
            self._tokens -= nbytes
            self.total_bytes += nbytes
            if self._tokens < 0:
                await self._sleep(-self._tokens / self.rate)
