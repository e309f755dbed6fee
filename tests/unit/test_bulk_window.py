"""The bulk window's controller (``swarm.bulkwindow.BulkWindow``) on a fake clock, and the urgent
path of the token bucket: deterministic, no sockets."""

from __future__ import annotations

import asyncio

import pytest

from swarm.bulkwindow import BULK_SLICE, BulkWindow
from swarm.ratelimit import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_window_grows_without_queueing_and_shrinks_with_it() -> None:
    clock = Clock()  # every sample counts alone (delay_filter=1): the controller's arithmetic
    w = BulkWindow(target=0.025, initial=128 * 1024, gain=0.5, delay_filter=1, clock=clock)
    start = w.window
    # RTT at the base (no queueing): each acked byte adds gain * 1 bytes -> x1.5 per window
    for _ in range(4):
        fut = w.reserve(BULK_SLICE)
        assert fut.done()
        w.ack(BULK_SLICE, 0.040)
    assert w.window == start + int(0.5 * 4 * BULK_SLICE)
    grown = w.window
    # 50 ms of queueing = twice the target: off_target = -1, each acked byte takes gain bytes
    for _ in range(4):
        w.reserve(BULK_SLICE)
        w.ack(BULK_SLICE, 0.090)
    assert w.window == grown - int(0.5 * 4 * BULK_SLICE)
    # half the target: off_target = 0.5, grows at half speed
    before = w.window
    w.reserve(BULK_SLICE)
    w.ack(BULK_SLICE, 0.040 + 0.0125)
    assert w.window == pytest.approx(before + 0.5 * 0.5 * BULK_SLICE, abs=1)
    assert w.inflight == 0 and w.acked == 9 * BULK_SLICE
    assert w.base_rtt == pytest.approx(0.040)


async def test_a_delay_spike_does_not_shrink_the_window_a_lasting_queue_does() -> None:
    """A lost packet delays the bytes behind it by a round trip on one connection (a few
    samples); a queue at the uplink delays every sample. The window reads the lowest of the
    last ``delay_filter`` (by default 8) samples, so it goes on growing through spikes and
    shrinks once a queue lasts that many samples."""
    clock = Clock()
    w = BulkWindow(target=0.025, initial=128 * 1024, gain=0.5, clock=clock)
    w.reserve(BULK_SLICE)
    w.ack(BULK_SLICE, 0.100)  # the base: 100 ms round trips
    for _ in range(10):  # a loss's extra round trip in every third sample
        for rtt in (0.100, 0.100, 0.200):
            w.reserve(BULK_SLICE)
            w.ack(BULK_SLICE, rtt)
    # every acked byte grew the window by gain (no queueing read): spikes cost nothing
    assert w.window == 128 * 1024 + int(0.5 * 31 * BULK_SLICE)
    grown = w.window
    # a queue of 100 ms begins: the last base sample is the 7th newest of 8 at first, so six
    # samples still read no queueing
    for _ in range(6):
        w.reserve(BULK_SLICE)
        w.ack(BULK_SLICE, 0.200)
    assert w.window == grown + int(0.5 * 6 * BULK_SLICE)
    top = w.window
    for _ in range(4):  # from then on it is read: each acked byte takes gain bytes
        w.reserve(BULK_SLICE)
        w.ack(BULK_SLICE, 0.200)
    assert w.window == pytest.approx(top - 4 * 0.5 * BULK_SLICE, abs=4)
    # unfiltered (delay_filter=1), the same spikes shrink it: each costs gain x its bytes
    raw = BulkWindow(target=0.025, initial=128 * 1024, gain=0.5, delay_filter=1, clock=clock)
    raw.reserve(BULK_SLICE)
    raw.ack(BULK_SLICE, 0.100)
    for _ in range(10):
        for rtt in (0.100, 0.100, 0.200):
            raw.reserve(BULK_SLICE)
            raw.ack(BULK_SLICE, rtt)
    assert raw.window == 128 * 1024 + int(0.5 * (21 - 10) * BULK_SLICE)


async def test_window_stays_within_its_bounds() -> None:
    clock = Clock()
    w = BulkWindow(initial=BULK_SLICE * 2, min_window=BULK_SLICE * 2, max_window=BULK_SLICE * 3,
                   clock=clock)  # fmt: skip
    w.reserve(BULK_SLICE)
    w.ack(BULK_SLICE, 0.01)  # base
    for _ in range(20):
        w.reserve(BULK_SLICE)
        w.ack(BULK_SLICE, 5.0)  # huge queueing
    assert w.window == BULK_SLICE * 2
    for _ in range(20):
        w.reserve(BULK_SLICE)
        w.ack(BULK_SLICE, 0.01)
    assert w.window == BULK_SLICE * 3


async def test_base_delay_forgets_old_minima() -> None:
    """A route change to a longer path must not read as queueing forever: minima older than
    ``base_history`` are dropped."""
    clock = Clock()
    w = BulkWindow(base_history=60.0, clock=clock)
    w.reserve(1)
    w.ack(1, 0.010)
    for _ in range(5):
        clock.t += 15.0
        w.reserve(1)
        w.ack(1, 0.100)
    assert w.base_rtt == pytest.approx(0.100)


async def test_room_is_granted_first_come_first_served_and_withdrawn_on_give_up() -> None:
    w = BulkWindow(initial=2 * BULK_SLICE, min_window=BULK_SLICE)
    a = w.reserve(BULK_SLICE)
    b = w.reserve(BULK_SLICE)
    assert a.done() and b.done() and w.inflight == 2 * BULK_SLICE
    c = w.reserve(BULK_SLICE)  # no room: waits
    d = w.reserve(1)  # would fit after c only: FIFO, waits too
    assert not c.done() and not d.done()
    w.withdraw(BULK_SLICE, c)  # c gives up; d now first in line but still no room
    assert c.cancelled() and not d.done()
    w.release(BULK_SLICE)  # a stream ended: its bytes leave the window
    await asyncio.sleep(0)
    assert d.done() and w.inflight == BULK_SLICE + 1
    w.withdraw(1, d)  # a granted reservation given back releases its bytes
    assert w.inflight == BULK_SLICE
    # one slice always fits into an empty window, however small it is
    e = BulkWindow(initial=BULK_SLICE, min_window=BULK_SLICE)
    assert e.reserve(4 * BULK_SLICE).done()


async def test_room_goes_to_the_oldest_answer_first() -> None:
    """Waiting slices are granted by answer age, not arrival: the older answer finishes first
    (interleaving every answer's slices would make every chunk complete late)."""
    w = BulkWindow(initial=2 * BULK_SLICE, min_window=BULK_SLICE)
    older, newer = w.open_answer(4 * BULK_SLICE), w.open_answer(4 * BULK_SLICE)
    assert w.reserve(BULK_SLICE, older).done() and w.reserve(BULK_SLICE, older).done()
    b = w.reserve(BULK_SLICE, newer)  # the window is full: waits
    a = w.reserve(BULK_SLICE, older)  # asks later, but for the older answer
    assert not a.done() and not b.done()
    w.ack(BULK_SLICE, 0.01, older)
    assert a.done() and not b.done()
    w.ack(BULK_SLICE, 0.01, older)
    assert b.done()
    # an older answer that gives up leaves the line: the newer one is served next
    w.release(w.inflight)
    hog = w.reserve(4 * w.window, older)  # one reservation always fits an empty window
    waiting_old, waiting_new = w.reserve(BULK_SLICE, older), w.reserve(BULK_SLICE, newer)
    assert hog.done() and not waiting_old.done() and not waiting_new.done()
    w.withdraw(BULK_SLICE, waiting_old)
    w.withdraw(4 * w.window, hog)
    assert waiting_old.cancelled() and waiting_new.done()


async def test_a_holder_is_crowded_once_its_answers_take_longer_than_the_horizon() -> None:
    clock = Clock()
    w = BulkWindow(horizon=3.0, min_answers=2, rate_window=2.0, clock=clock)
    first = w.open_answer(1 << 20)
    second = w.open_answer(1 << 20)
    assert w.rate() is None and not w.crowded()  # no rate measured yet: accepted
    for _ in range(8):  # 256 KiB acknowledged over one second
        clock.t += 0.125
        w.reserve(BULK_SLICE, first)
        w.wrote(first, BULK_SLICE)
        w.ack(BULK_SLICE, 0.01, first)
    assert w.rate() == pytest.approx(8 * BULK_SLICE / 1.0)
    # 2 MiB - 256 KiB queued against 768 KiB in the horizon: refuse a third answer
    assert w.statistics().queued == 2 * (1 << 20) - 8 * BULK_SLICE and w.crowded()
    w.close_answer(second)
    assert not w.crowded()  # fewer than min_answers open: always accepted
    third = w.open_answer(1 << 20)
    assert w.crowded()
    clock.t += 1.0  # 1 MiB more acknowledged: (256 KiB + 1 MiB) over the last 2 s = 640 KiB/s
    for _ in range(8):
        w.reserve(4 * BULK_SLICE, first)
        w.ack(4 * BULK_SLICE, 0.01, first)
    assert w.rate() == pytest.approx((8 * BULK_SLICE + (1 << 20)) / 2.0)
    w.wrote(third, 1 << 20)
    assert not w.crowded()
    w.close_answer(first)
    w.close_answer(third)
    assert w.rate() is None and w.statistics().answers == 0


async def test_one_answer_holds_at_most_a_stream_window_while_another_waits() -> None:
    """Oldest first, but one answer (one new yamux stream, 256 KiB of window in p2pd) gets no
    more than ``stream_window`` while a younger one waits: the rest of the window goes to the
    younger, so a long path is not capped at one stream's window per round trip. Alone, the
    answer may hold more."""
    w = BulkWindow(initial=8 * BULK_SLICE, min_window=BULK_SLICE, stream_window=4 * BULK_SLICE)
    old, young = w.open_answer(1 << 20), w.open_answer(1 << 20)
    for _ in range(5):  # alone: past its stream window
        assert w.reserve(BULK_SLICE, old).done()
    assert w.reserve(3 * BULK_SLICE, young).done()  # the rest of the window
    o, y = w.reserve(BULK_SLICE, old), w.reserve(BULK_SLICE, young)
    assert not o.done() and not y.done()  # the window is full
    # room for one slice: the older answer holds 5 slices, past its stream window while the
    # younger waits, so the younger is served although the older comes first
    w.ack(BULK_SLICE, 0.01, young)
    assert not o.done() and y.done()
    w.ack(BULK_SLICE, 0.01, young)  # room again, and nobody else waits: it goes on
    assert o.done()
    assert w.inflight == 8 * BULK_SLICE


def test_bad_window_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_window"):
        BulkWindow(initial=1024, min_window=4096)
    with pytest.raises(ValueError, match="horizon"):
        BulkWindow(horizon=0)
    with pytest.raises(ValueError, match="stream_window"):
        BulkWindow(stream_window=0)
    with pytest.raises(ValueError, match="target"):
        BulkWindow(target=0.0)
    with pytest.raises(ValueError, match="delay_filter"):
        BulkWindow(delay_filter=0)


async def test_urgent_bytes_pass_the_queue_of_bulk_writers() -> None:
    clock = Clock()
    slept: list[float] = []
    gate = asyncio.Event()

    async def sleep(s: float) -> None:  # holds the sleeper until the test opens the gate
        slept.append(s)
        await gate.wait()
        clock.t += s

    bucket = TokenBucket(1000.0, burst=1000.0, clock=clock, sleep=sleep)
    await bucket.acquire(1000)  # the burst is spent
    bulk = asyncio.create_task(bucket.acquire(1000))  # one slice: sleeps 1 s holding the lock
    queued = asyncio.create_task(bucket.acquire(1000))  # the next bulk writer waits for the lock
    await asyncio.sleep(0)
    assert slept == [1.0] and not bulk.done()
    # a control answer does not queue behind them: it is through while they still wait
    await asyncio.wait_for(bucket.acquire(100, urgent=True), 1.0)
    assert slept == [1.0] and not bulk.done() and not queued.done()
    gate.set()
    await bulk
    await queued
    # ... but its bytes count: the queued writer waited them off as well
    assert slept[-1] == pytest.approx((1000 + 100 + 1000 - 1000) / 1000.0)
    # and urgent traffic alone cannot run above the rate for more than one burst
    clock.t += 100.0
    await bucket.acquire(4000, urgent=True)
    assert slept[-1] == pytest.approx((4000 - 1000 - 2 * 1000) / 1000.0)


def test_slices_follow_the_window() -> None:
    """Small writes on a slow link (a slice is queueing delay itself), large ones on a fast link
    (fewer writes, less CPU)."""
    from swarm.bulkwindow import MAX_SLICE, MIN_SLICE

    assert BulkWindow(initial=64 * 1024, min_window=32 * 1024).slice_size() == MIN_SLICE
    assert BulkWindow(initial=256 * 1024).slice_size() == 64 * 1024
    assert BulkWindow(initial=8 << 20).slice_size() == MAX_SLICE


async def test_a_failed_acknowledgement_reader_is_retrieved_when_the_write_fails_too() -> None:
    """The reader vanishes: the acknowledgement task fails (the stream's error) while the write
    path is still draining, then the drain fails too. The caller sees the drain's error; the
    task's must be retrieved as well, or asyncio logs "Task exception was never retrieved" with a
    traceback (seen in the trainer's log each time a downloader went away mid-answer)."""
    import gc

    from swarm.bulkwindow import BulkWindow, write_windowed

    class Transport:
        def get_write_buffer_size(self) -> int:
            return 1

        def is_closing(self) -> bool:
            return False

    class Writer:
        transport = Transport()

        def write(self, data: object) -> None:
            pass

        async def drain(self) -> None:
            await asyncio.sleep(0.05)  # the acknowledgement task fails meanwhile
            raise BrokenPipeError(32, "Broken pipe")

    class Reader:
        async def readexactly(self, n: int) -> bytes:
            raise BrokenPipeError(32, "Broken pipe")

    loop = asyncio.get_running_loop()
    seen: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        with pytest.raises(BrokenPipeError):
            await write_windowed(Writer(), Reader(), b"x" * 4096,  # type: ignore[arg-type]
                                 window=BulkWindow(), timeout=5.0, ack_timeout=5.0)  # fmt: skip
        gc.collect()
        await asyncio.sleep(0)
        assert not [c for c in seen if "never retrieved" in str(c.get("message"))], seen
    finally:
        loop.set_exception_handler(previous)
