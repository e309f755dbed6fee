"""Control ahead of bulk: a delay-based window on this peer's bulk bytes in flight (uplink-wide).

Why. Every stream to a peer (our RPCs, the DHT's messages, chunk answers) shares one libp2p
connection: p2pd multiplexes them with yamux over one TCP connection. A chunk answer written into
its stream goes through yamux's send queue (frames of at most 64 KiB, a queue of 64 frames per
connection, a per-stream window of 256 KiB growing to 16 MiB) and the kernel's TCP send buffer
(autotuned, up to MiBs) before it reaches the uplink; a DHT message or an RPC answer opened after
it waits behind all of that, seconds on a slow uplink shared by several connections. Nothing in
p2pd can be told to prefer the small message. So the bulk sender itself must keep those queues
short: it writes a windowed answer only while fewer than :attr:`BulkWindow.window` bytes it wrote
(over all its windowed streams together) are not yet acknowledged by their readers, and the
readers acknowledge as bytes arrive (``transport.call(windowed=True)``).

How large. The window must cover the path's bandwidth-delay product (else the uplink idles) and
little more (else the excess queues). Neither is known, so the window is steered by the measured
round-trip time of the acknowledgements, like LEDBAT (RFC 6817, what BitTorrent's uTP uses so that
its bulk traffic does not delay interactive traffic on the same uplink): the lowest RTT seen
recently is the path's base delay; the excess over it is queueing. Each acknowledgement moves the
window by ``gain * off_target * acked`` bytes, ``off_target = (target - queueing) / target``
clamped to [-1, 1]: with no queue the window grows by up to ``gain`` times itself per round trip,
with a queue of twice the target it shrinks by up to ``gain`` times itself per round trip. A
control message then waits behind about ``target`` seconds of bulk data, not the whole buffers.

Which delay. The queueing estimate is the lowest of the last ``delay_filter`` (8) samples, not the
last one (RFC 6817 §3.4.2's filter of the current delay). A queue at the uplink delays every byte
that passes it, so it shows in every sample; a lost packet delays only the bytes behind it on one
TCP connection until its retransmission arrives, a round trip later (the reader gets bytes in
order), which reads as a round trip of queueing in the samples of those bytes: at most about a
window's worth, and a slice is a quarter of the window, so 8 samples reach back past them. The
filter delays the reaction to a real queue by as many samples, about two round trips.
Unfiltered, each loss cut the window by up to ``gain`` times the bytes behind the hole: with 50 ms
each way and 0.1 % loss a third of the samples read over the target, the window stayed at
400-500 KiB against a 1 MiB bandwidth-delay product and the broadcast took twice as long as
unpaced; 4 samples got it to 1.4 times unpaced, 8 to 1.15 times (docs/swarm.md, with the cost in
control latency).

In what order. Room goes to the *oldest answer* first (the order answers were opened), not to
slices first come, first served: interleaving the slices of every answer in flight would share the
uplink evenly among them, so that with 32 answers queued each progresses at 1/32 of the uplink and
every chunk completes late (a chunk can only be relayed once it is whole). One after another, each
answer takes the uplink's full rate and its chunk can be relayed at once. One exception, only
while another answer waits (the order never leaves the uplink idle): an answer holding
``stream_window`` bytes (256 KiB) gets no more. Every answer is a new stream, and a new yamux
stream in p2pd may have only 256 KiB unacknowledged (its window grows later, but an answer is over
by then), so more would only wait in p2pd's buffers while the uplink idles: one answer moves at
most 256 KiB per round trip (6.4 MiB/s with 20 ms each way), the window's other bytes go to the
next answer. (Passing over an answer whose reader was silent for 1 s was tried and reverted:
on a loaded machine honest readers fall silent that long; docs/swarm.md.)

How many. An answer queued behind others gets no byte until they are written, and the asker gives
a holder up as slow when a request receives too little for a while (``DownloadConfig.min_rate``
over ``stall_timeout``). So a holder refuses a new answer ``busy`` (the asker tries another holder
or comes back shortly) once the answers it has already accepted would take more than ``horizon``
seconds at the rate its acknowledgements arrived recently (:meth:`BulkWindow.crowded`). Stricter
admission (counting an answer from before its handler runs, accepting one instead of
``min_answers`` (2), refusing while no rate is measured) was tried and reverted: askers refused
more often retry every 0.2 s (docs/swarm.md).

A stream whose reader does not acknowledge ``min_progress`` more bytes (or all it was sent) within
each ``ack_timeout`` while bytes are unacknowledged is ended (its bytes are released), so a peer
that never acknowledges, repeats its count or trickles cannot hold the window.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from swarm.ratelimit import TokenBucket


async def drain_within(writer: asyncio.StreamWriter, timeout: float) -> None:
    """``writer.drain()`` bounded by ``timeout``; free when nothing is queued in the transport."""
    transport = writer.transport
    if transport.get_write_buffer_size() == 0 and not transport.is_closing():
        return
    async with asyncio.timeout(timeout):
        await writer.drain()


ACK = struct.Struct(">Q")
"""An acknowledgement: the number of body bytes received so far (cumulative), 8 bytes."""
BULK_SLICE = 32 * 1024
"""A unit of bulk bytes (the default window bounds are multiples of it)."""
SETTLE_BYTES = 64 * 1024
"""A read of fewer bytes than this is followed by ``read_acked``'s ``settle`` pause."""
MIN_SLICE, MAX_SLICE = 16 * 1024, 256 * 1024
"""Bytes per write of a windowed answer: a quarter of the window within these bounds (small on a
slow link, where one slice is itself queueing delay; large on a fast one, fewer writes)."""


@dataclass
class WindowStats:
    """A snapshot of :class:`BulkWindow` (``statistics()``)."""

    window: int  # bytes allowed in flight now
    inflight: int  # bytes written, not yet acknowledged
    base_rtt: float | None  # lowest recent acknowledgement RTT, seconds
    last_rtt: float | None  # latest sample, seconds
    waiting: int  # writers waiting for room
    acked: int  # bytes acknowledged in all
    answers: int  # answers accepted and not yet fully written
    queued: int  # bytes of those answers not yet written
    rate: float | None  # bytes/s acknowledged recently (None: not measured yet)


@dataclass
class _Answer:
    unwritten: int  # bytes not yet written
    held: int = 0  # bytes granted to it and not yet acknowledged or released


class BulkWindow:
    """Bytes of windowed answers in flight over all streams of one transport (see module doc).

    ``target`` is the queueing delay to aim at (seconds), read as the lowest of the last
    ``delay_filter`` samples over the base delay; the window stays within
    [``min_window``, ``max_window``] bytes. ``horizon`` (seconds): how long the answers already
    accepted may take at the recent rate before a new one is refused (:meth:`crowded`; at least
    ``min_answers`` are always accepted); the rate is measured over the last ``rate_window``
    seconds of acknowledgements. ``stream_window``: what one answer may hold while another
    waits (module doc). ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        *,
        target: float = 0.025,
        initial: int = 128 * 1024,
        min_window: int = 2 * MIN_SLICE,
        max_window: int = 16 << 20,
        gain: float = 0.5,
        delay_filter: int = 8,
        base_history: float = 60.0,
        horizon: float = 3.0,
        min_answers: int = 2,
        rate_window: float = 2.0,
        stream_window: int = 256 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if target <= 0 or not 0 < min_window <= initial <= max_window or gain <= 0:
            raise ValueError(
                "BulkWindow needs target > 0, gain > 0 and 0 < min_window <= initial <= max_window"
            )
        if horizon <= 0 or min_answers < 1 or rate_window <= 0:
            raise ValueError("BulkWindow needs horizon > 0, min_answers >= 1 and rate_window > 0")
        if stream_window <= 0:
            raise ValueError("BulkWindow needs stream_window > 0")
        if delay_filter < 1:
            raise ValueError("BulkWindow needs delay_filter >= 1")
        self.horizon, self.min_answers, self.rate_window = horizon, min_answers, rate_window
        self.stream_window = stream_window
        self.target = target
        self.min_window, self.max_window = min_window, max_window
        self.gain = gain
        self.clock = clock
        self._window = float(initial)
        self.inflight = 0
        self.acked = 0
        #: (answer, arrival, bytes, future), oldest answer first (see the module doc)
        self._waiters: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._answer_ids = itertools.count()
        self._answers: dict[int, _Answer] = {}  # open answers, by id (= age)
        self._busy_since: float | None = None  # when answers last went from none to some
        self._recent: deque[tuple[float, int]] = deque()  # (time, bytes) of recent acks
        # base delay: minimum per bucket of base_history/4 seconds, the last 4 buckets kept
        self._bucket_s = base_history / 4
        self._minima: deque[tuple[float, float]] = deque()  # (bucket start, min rtt)
        self.last_rtt: float | None = None
        self._delays: deque[float] = deque(maxlen=delay_filter)  # the last RTT samples

    @property
    def window(self) -> int:
        return int(self._window)

    @property
    def base_rtt(self) -> float | None:
        return min((m for _, m in self._minima), default=None)

    def statistics(self) -> WindowStats:
        return WindowStats(self.window, self.inflight, self.base_rtt, self.last_rtt,
                           len(self._waiters), self.acked, len(self._answers),
                           self.queued(), self.rate())  # fmt: skip

    # -- answers: their order and how many are accepted -----------------------------------------
    def open_answer(self, size: int) -> int:
        """Register an answer of ``size`` bytes about to be written; returns its id (answers
        are granted room in the order they were opened)."""
        if not self._answers:
            self._busy_since = self.clock()
        answer = next(self._answer_ids)
        self._answers[answer] = _Answer(size)
        return answer

    def wrote(self, answer: int, n: int) -> None:
        """``n`` more bytes of ``answer`` were written."""
        if answer in self._answers:
            rec = self._answers[answer]
            rec.unwritten = max(0, rec.unwritten - n)

    def close_answer(self, answer: int) -> None:
        """``answer`` ended (written whole, or failed)."""
        self._answers.pop(answer, None)
        if not self._answers:
            self._busy_since = None

    def queued(self) -> int:
        """Bytes the open answers have still to write."""
        return sum(a.unwritten for a in self._answers.values())

    def rate(self) -> float | None:
        """Bytes per second acknowledged over the last ``rate_window`` seconds while answers
        were open; None until answers have been open for a quarter of that."""
        now = self.clock()
        self._forget(now)
        if self._busy_since is None:
            return None
        span = min(self.rate_window, now - self._busy_since)
        if span < self.rate_window / 4:
            return None
        return sum(n for t, n in self._recent if t >= now - span) / span

    def crowded(self) -> bool:
        """Whether a new answer should be refused ``busy``: at least ``min_answers`` are open
        and their unwritten bytes would take over ``horizon`` seconds at :meth:`rate`."""
        if len(self._answers) < self.min_answers:
            return False
        rate = self.rate()
        return rate is not None and self.queued() > rate * self.horizon

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.rate_window:
            self._recent.popleft()

    def slice_size(self) -> int:
        """Bytes for the next write: a quarter of the window, a multiple of :data:`MIN_SLICE`
        within [:data:`MIN_SLICE`, :data:`MAX_SLICE`]."""
        quarter = int(self._window) // 4 // MIN_SLICE * MIN_SLICE
        return max(MIN_SLICE, min(MAX_SLICE, quarter))

    def _fits(self, n: int) -> bool:
        return self.inflight == 0 or self.inflight + n <= self._window

    def _passed_over(self, key: int, n: int) -> bool:
        """Whether answer ``key`` waits its turn although first: it holds bytes and ``n`` more
        would pass ``stream_window`` while another answer waits (module doc)."""
        rec = self._answers.get(key)
        if rec is None or rec.held == 0 or rec.held + n <= self.stream_window:
            return False
        return any(w[0] != key and not w[3].cancelled() for w in self._waiters)

    def reserve(self, n: int, answer: int = -1) -> asyncio.Future[None]:
        """A future done once ``n`` bytes may be written; waiting reservations are granted
        oldest ``answer`` first (first come, first served among one answer's, or when ``answer``
        is not given), an answer passed over while it holds ``stream_window`` bytes and
        another waits. Cancel it to give up waiting (:meth:`withdraw`)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        key = answer if answer >= 0 else 1 << 62
        bisect.insort(self._waiters, (key, next(self._arrivals), n, fut),
                      key=lambda w: (w[0], w[1]))  # fmt: skip
        self._grant()
        return fut

    def withdraw(self, n: int, fut: asyncio.Future[None], answer: int = -1) -> None:
        """Give up a reservation from :meth:`reserve` (granted or not)."""
        if fut.done() and not fut.cancelled():
            self.release(n, answer)
            return
        fut.cancel()
        self._waiters = [w for w in self._waiters if w[3] is not fut]
        self._grant()

    def release(self, n: int, answer: int = -1) -> None:
        """``n`` bytes (of ``answer``) no longer in flight without a measurement (a stream
        ended)."""
        self.inflight = max(0, self.inflight - n)
        if answer in self._answers:
            rec = self._answers[answer]
            rec.held = max(0, rec.held - n)
        self._grant()

    def ack(self, n: int, rtt: float, answer: int = -1) -> None:
        """``n`` bytes (of ``answer``) acknowledged ``rtt`` seconds after they were written:
        steer the window."""
        now = self.clock()
        self.acked += n
        self._recent.append((now, n))
        self._forget(now)
        self.last_rtt = rtt
        start = now - now % self._bucket_s
        if self._minima and self._minima[-1][0] == start:
            self._minima[-1] = (start, min(self._minima[-1][1], rtt))
        else:
            self._minima.append((start, rtt))
            while len(self._minima) > 4:
                self._minima.popleft()
        self._delays.append(rtt)
        queueing = min(self._delays) - (self.base_rtt or rtt)
        off_target = max(-1.0, min(1.0, (self.target - queueing) / self.target))
        grown = self._window + self.gain * off_target * n
        self._window = max(float(self.min_window), min(float(self.max_window), grown))
        self.release(n, answer)

    def _grant(self) -> None:
        """Grant waiting reservations in order while the window has room: one whose answer is
        passed over (:meth:`_passed_over`) is skipped; the first other that does not fit stops
        the line."""
        i = 0
        while i < len(self._waiters):
            key, _arrival, n, fut = self._waiters[i]
            if fut.cancelled():
                self._waiters.pop(i)
                continue
            if self._passed_over(key, n):
                i += 1
                continue
            if not self._fits(n):
                return
            self._waiters.pop(i)
            self.inflight += n
            if key in self._answers:
                self._answers[key].held += n
            fut.set_result(None)


async def write_windowed(
    writer: asyncio.StreamWriter,
    reader: asyncio.StreamReader,
    data: bytes,
    *,
    window: BulkWindow,
    timeout: float,
    ack_timeout: float,
    limiter: TokenBucket | None = None,
    min_progress: int = 256 * 1024,
) -> None:
    """Write ``data`` in slices of :meth:`BulkWindow.slice_size`, each once ``window`` has room,
    reading the reader's cumulative :data:`ACK` acknowledgements meanwhile; returns when all are
    acknowledged.

    Raises ``TimeoutError`` when a write or the wait for room takes over ``timeout``, or when
    bytes are unacknowledged and the count has not advanced by ``min_progress`` bytes (or to all
    sent) for ``ack_timeout``; ``OSError``/``IncompleteReadError`` when the stream breaks,
    ``ValueError`` for an acknowledgement that is not a count of bytes sent."""
    loop = asyncio.get_running_loop()
    pending: deque[tuple[int, float, int]] = deque()  # (end offset, written at, bytes)
    state = {"sent": 0, "acked": 0}
    answer = window.open_answer(len(data))

    async def read_acks() -> None:
        mark = (loop.time(), 0)  # (when, count): the last acknowledgement that made progress
        while state["acked"] < len(data):
            # the clock runs from the last progress, or from when the oldest unacknowledged
            # byte was written if later: a count repeated or crawling does not reset it
            since = max(mark[0], pending[0][1]) if pending else loop.time()
            left = since + ack_timeout - loop.time()
            if left <= 0:
                raise TimeoutError(f"under {min_progress} B acknowledged in {ack_timeout:.0f} s")
            try:
                async with asyncio.timeout(left):
                    raw = await reader.readexactly(ACK.size)
            except TimeoutError:
                continue  # decided above, on the next turn
            (count,) = ACK.unpack(raw)
            if not state["acked"] <= count <= state["sent"]:
                raise ValueError(f"acknowledged {count} B, sent {state['sent']} B")
            now = loop.time()
            while pending and pending[0][0] <= count:
                _end, at, n = pending.popleft()
                window.ack(n, now - at, answer)
            state["acked"] = count
            if count - mark[1] >= min_progress or count == state["sent"]:
                mark = (now, count)

    acks = asyncio.create_task(read_acks(), name="bulk-acks")
    view = memoryview(data)
    start = 0
    try:
        while start < len(view):
            piece = view[start : start + window.slice_size()]
            room = window.reserve(len(piece), answer)
            done: set[asyncio.Future[None]] = {room} if room.done() else set()
            try:
                if not done:
                    done, _ = await asyncio.wait({room, acks}, timeout=timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            except BaseException:
                window.withdraw(len(piece), room, answer)
                raise
            if room not in done:
                window.withdraw(len(piece), room, answer)
                if acks in done:
                    acks.result()  # raises what ended the reader
                raise TimeoutError(f"no room in the bulk window for {timeout:.0f} s")
            written_at = loop.time()
            try:  # time spent waiting for the upload cap is not queueing on the path
                if acks.done():
                    acks.result()  # the reader ended (raises what ended it)
                if limiter is not None:
                    await limiter.acquire(len(piece))
                    written_at = loop.time()
                writer.write(piece)
            finally:  # granted bytes are in flight from here on (released in the end if unacked)
                state["sent"] = start = start + len(piece)
                pending.append((state["sent"], written_at, len(piece)))
                window.wrote(answer, len(piece))
            await drain_within(writer, timeout)
        await asyncio.wait_for(asyncio.shield(acks), timeout)
    finally:
        if not acks.done():
            acks.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await acks
        elif not acks.cancelled():
            acks.exception()  # retrieved: the caller sees the write path's error (or none)
        window.release(sum(n for _end, _at, n in pending), answer)
        window.close_answer(answer)


async def read_acked(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    n: int,
    *,
    stall_timeout: float,
    deadline: float,
    on_progress: Callable[[int, int], None] | None = None,
    settle: float = 0.0,
) -> bytes:
    """Read exactly ``n`` body bytes of a windowed answer, acknowledging after every read
    (the writer waits for the acknowledgement of its last byte). ``settle`` (seconds): after a
    read of fewer than :data:`SETTLE_BYTES` with more to come, wait this long before the next, so
    that bytes arriving a segment at a time are read (and acknowledged) together."""
    loop = asyncio.get_running_loop()
    buf = bytearray(n)
    got = 0
    while got < n:
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError
        async with asyncio.timeout(min(stall_timeout, left)):
            piece = await reader.read(min(n - got, 1 << 20))
        if not piece:
            raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
        buf[got : got + len(piece)] = piece
        got += len(piece)
        # every read: the writer shares one window among streams, so bytes held back here
        # could block them all (one read takes what has arrived: few acks on a fast link)
        writer.write(ACK.pack(got))
        if on_progress is not None:
            on_progress(got, n)
        if settle > 0 and len(piece) < SETTLE_BYTES and got < n:
            await asyncio.sleep(settle)
    return bytes(buf)
