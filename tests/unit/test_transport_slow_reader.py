"""An answer's reader must keep up a minimum average rate: a peer taking a byte now and then
cannot hold a stream (and the answer's memory) for the per-slice timeout × every slice."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarm import transport


class Transport:
    """Bytes are always queued (a slow reader), so every slice waits for ``drain``."""

    def get_write_buffer_size(self) -> int:
        return 1

    def is_closing(self) -> bool:
        return False


class Writer:
    """The part of ``asyncio.StreamWriter`` that ``write_sliced`` uses; ``drain`` takes
    ``delay`` seconds per call, as a reader that slow would make it."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.written = 0
        self.transport = Transport()

    def write(self, data: memoryview) -> None:
        self.written += len(data)

    async def drain(self) -> None:
        await asyncio.sleep(self.delay)


async def test_a_reader_slower_than_the_minimum_rate_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "MIN_READ_BPS", 4 << 20)  # 4 MiB/s: budget 0.5 s + 1 s
    data = bytes(4 << 20)  # 16 slices of 256 KiB (no upload cap)
    slow = Writer(0.2)  # every slice within the 0.5 s slice timeout, 3.2 s in all
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await transport.write_sliced(slow, data, timeout=0.5, limiter=None)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 2.5
    assert slow.written < len(data)
    fast = Writer(0.0)
    await transport.write_sliced(fast, data, timeout=0.5, limiter=None)  # type: ignore[arg-type]
    assert fast.written == len(data)
