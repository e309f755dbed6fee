"""A userspace delay line on NFQUEUE: adds a fixed one-way delay (and optional random loss) to the
packets entering a network namespace. For tests and benchmarks on kernels without ``netem``.

The kernel hands every packet matched by an ``iptables ... -j NFQUEUE --queue-num Q`` rule to this
process, which copies only the packet's metadata (id), holds the id for ``delay`` seconds and then
accepts it (one batch verdict for every id due); with ``loss`` > 0 a packet is dropped at once with
that probability. The packet bytes never leave the kernel, and with ``NFQA_CFG_F_GSO`` large
(GSO) packets are queued whole, so the cost is per packet, not per byte: give the links a large
MTU to keep the packet rate low.

One process serves any number of namespaces: it enters each (``setns``), opens its netlink socket
there, and returns; a socket stays bound to the namespace it was opened in.

Run as ``python -m swarm.delayline --netns NS [--netns NS ...] --delay-ms 20 [--loss 0.001]``:
it prints ``READY`` once every queue is bound and runs until its stdin closes or SIGTERM.
:mod:`swarm.netns` installs the ``iptables`` rules (``--queue-bypass``: with no listener the
packets pass undelayed) and starts this process.

Netlink wire (``linux/netfilter/nfnetlink_queue.h``): every message is ``nlmsghdr`` (16 bytes) +
``nfgenmsg`` (family, version, queue number big-endian) + attributes (``nlattr``: u16 length, u16
type, value, padded to 4 bytes). Integers inside attributes are big-endian.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NETLINK_NO_ENOBUFS = 5
SOL_NETLINK = 270
CLONE_NEWNET = 0x40000000

_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big-endian, packed by hand)
_NLATTR = struct.Struct("=HH")

T = TypeVar("T")


def _attr(kind: int, value: bytes) -> bytes:
    body = _NLATTR.pack(_NLATTR.size + len(value), kind) + value
    return body + b"\0" * (-len(body) % 4)


def _message(msg_type: int, queue: int, attrs: bytes, *, flags: int = NLM_F_REQUEST) -> bytes:
    payload = _NFGENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg_type
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(payload), kind, flags, 0, 0) + payload


def _messages(buf: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink message in one datagram."""
    pos = 0
    while pos + _NLMSGHDR.size <= len(buf):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(buf, pos)
        if length < _NLMSGHDR.size:
            return
        yield kind, buf[pos + _NLMSGHDR.size : pos + length]
        pos += (length + 3) & ~3


def _packet_id(payload: bytes) -> int | None:
    """The id in the ``NFQA_PACKET_HDR`` attribute of a queued-packet message."""
    pos = _NFGENMSG.size
    while pos + _NLATTR.size <= len(payload):
        length, kind = _NLATTR.unpack_from(payload, pos)
        if length < _NLATTR.size:
            return None
        if kind & 0x3FFF == NFQA_PACKET_HDR:
            return int(struct.unpack_from(">I", payload, pos + _NLATTR.size)[0])
        pos += (length + 3) & ~3
    return None


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` with this thread inside network namespace ``/run/netns/<name>``, then return."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
        try:
            return fn()
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - would be a kernel bug
                raise OSError(ctypes.get_errno(), "setns back to the original namespace failed")
    finally:
        os.close(target)
        os.close(home)


@dataclass
class Queue:
    """One bound NFQUEUE (a netlink socket in one namespace)."""

    netns: str
    num: int
    sock: socket.socket
    pending: list[tuple[float, int]] = field(default_factory=list)  # (due, packet id), FIFO
    queued: int = 0  # packets seen
    dropped: int = 0  # packets dropped on purpose (loss)

    @classmethod
    def open(cls, netns: str, num: int, maxlen: int = 1 << 16) -> Queue:
        def make() -> socket.socket:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
            s.bind((0, 0))
            return s

        sock = make() if netns == "" else in_netns(netns, make)
        q = cls(netns, num, sock)
        q._request(_attr(NFQA_CFG_CMD, struct.pack(">BxH", NFQNL_CFG_CMD_BIND, 0)))
        q._request(
            _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
            + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen))
            + _attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO))
            + _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO))
        )
        sock.setblocking(False)
        return q

    def _request(self, attrs: bytes) -> None:
        """Send one config message and wait for its acknowledgement (raises on error)."""
        flags = NLM_F_REQUEST | NLM_F_ACK
        self.sock.sendall(_message(NFQNL_MSG_CONFIG, self.num, attrs, flags=flags))
        for kind, payload in _messages(self.sock.recv(65536)):
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", payload)
                if code != 0:
                    raise OSError(-code, f"NFQUEUE {self.num} in {self.netns or 'this netns'}: "
                                  f"{os.strerror(-code)}")  # fmt: skip

    def read(self, now: float, delay: float, loss: float, rng: random.Random) -> None:
        """Take every queued-packet message waiting on the socket."""
        packet = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
        while True:
            try:
                buf = self.sock.recv(1 << 18)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # pragma: no cover - NO_ENOBUFS is set
                    continue
                raise
            for kind, payload in _messages(buf):
                pid = _packet_id(payload) if kind == packet else None
                if pid is None:
                    continue
                self.queued += 1
                if loss > 0 and rng.random() < loss:
                    self.dropped += 1
                    self.verdict(pid, NF_DROP, batch=False)
                else:
                    self.pending.append((now + delay, pid))

    def release(self, now: float) -> None:
        """Accept every packet whose delay is over (one batch verdict)."""
        last = None
        n = 0
        for due, pid in self.pending:
            if due > now:
                break
            last, n = pid, n + 1
        if last is not None:
            del self.pending[:n]
            self.verdict(last, NF_ACCEPT, batch=True)

    def verdict(self, pid: int, verdict: int, *, batch: bool) -> None:
        kind = NFQNL_MSG_VERDICT_BATCH if batch else NFQNL_MSG_VERDICT
        msg = _message(kind, self.num, _attr(NFQA_VERDICT_HDR, struct.pack(">II", verdict, pid)))
        while True:
            try:
                self.sock.send(msg)
                return
            except BlockingIOError:  # pragma: no cover - the kernel side never blocks for long
                select.select([], [self.sock], [], 0.01)


def run(queues: list[Queue], delay: float, loss: float, stop: Callable[[], bool]) -> None:
    """Serve ``queues`` until ``stop()``: the loop wakes for packets and for due verdicts."""
    rng = random.Random()
    socks = {q.sock.fileno(): q for q in queues}
    poller = select.poll()
    for fd in socks:
        poller.register(fd, select.POLLIN)
    while not stop():
        now = time.monotonic()
        heads = [q.pending[0][0] for q in queues if q.pending]
        wait = min(heads) - now if heads else 0.2
        for fd, _ev in poller.poll(max(0.0, min(wait, 0.2)) * 1000):
            socks[fd].read(time.monotonic(), delay, loss, rng)
        now = time.monotonic()
        for q in queues:
            q.release(now)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.delayline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--netns", action="append", default=[], help="namespace to serve (repeatable)")
    p.add_argument("--queue", type=int, default=0, help="NFQUEUE number used by the rules")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added, ms")
    p.add_argument("--loss", type=float, default=0.0, help="probability of dropping a packet")
    args = p.parse_args(argv)
    if not args.netns:
        p.error("give at least one --netns")
    if not (0.0 <= args.loss < 1.0) or args.delay_ms < 0:
        p.error("--loss must be in [0, 1) and --delay-ms >= 0")
    queues = [Queue.open(ns, args.queue) for ns in args.netns]
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    os.set_blocking(sys.stdin.fileno(), False)

    def stop() -> bool:
        if not stopping[0]:
            with contextlib.suppress(BlockingIOError):
                stopping[0] = sys.stdin.buffer.read() == b""  # None: no data; b"": parent gone
        return stopping[0]

    print("READY", flush=True)
    try:
        run(queues, args.delay_ms / 1000.0, args.loss, stop)
    finally:
        stats = " ".join(f"{q.netns}={q.queued}/{q.dropped}" for q in queues)
        print(f"STATS queued/dropped {stats}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
