"""A broadcast peer as a separate OS process, driven over stdin/stdout (tests and benchmarks).

Child protocol (one line each, stdout)::

    READY <peer id> <json maddrs>   started and serving; "GO" on stdin starts the download
    PROGRESS <done bytes> <total>   while downloading (about every 5 %)
    DONE <unix time> <json stats>   version complete and written to --out
    FAIL <one-line error>
    SERVED <chunks>                 on exit: how many chunks this peer served
    HOLDERS <json>                  answer to "HOLDERS <version>" on stdin (after GO/DONE):
                                    {peer id: chunks} of that version's DHT holder records

After the first GO, "GO <version>" on stdin downloads that version too (DONE/FAIL again).

After DONE the child keeps serving (relaying) until its stdin closes. A seed is simply a child
whose ``--store`` already holds the complete version. ``--corrupt`` makes it serve every chunk with
one byte flipped (an adversarial peer for tests). The parent side is :class:`PeerProcess`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m swarm.peerproc", description=__doc__)
    p.add_argument("--bootstrap", action="append", default=[], help="initial peer multiaddr")
    p.add_argument("--host", default="127.0.0.1", help="IP to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any free port)")
    p.add_argument("--store", required=True, help="chunk store directory")
    p.add_argument("--coordinator-key", required=True, help="pinned coordinator key, hex")
    p.add_argument("--seed", action="append", default=[], help="seed peer id (repeatable)")
    p.add_argument("--version", type=int, default=None, help="version to fetch (default: newest)")
    p.add_argument("--upload-rate", type=float, default=0.0, help="upload cap, bytes/s (0: none)")
    p.add_argument("--no-relay", action="store_true", help="do not serve chunks (star baseline)")
    p.add_argument("--corrupt", action="store_true", help="serve corrupted chunks (tests)")
    p.add_argument("--out", default=None, help="write the received files here")
    p.add_argument("--max-parallel", type=int, default=8)
    p.add_argument("--seed-parallel", type=int, default=None, help="requests to one seed at once")
    p.add_argument("--peer-parallel", type=int, default=None, help="requests to one peer at once")
    p.add_argument("--no-exchange", action="store_true", help="old per-chunk RPCs only (A/B)")
    p.add_argument("--no-window", action="store_true", help="unpaced chunk answers only (A/B)")
    p.add_argument("--direct", action="store_true", help="chunks over direct TCP (swarm.direct)")
    p.add_argument("--dialback-server", action="store_true", help="serve reachability dial-backs")
    p.add_argument(
        "--probe-reachability", default=None, metavar="PEER_ID",
        help="measure reachability with this dial-back server; announce only if public",
    )  # fmt: skip
    p.add_argument(
        "--assume-dialable", action="store_true",
        help="announce held chunks whatever the measurement says (a misconfigured peer; tests)",
    )  # fmt: skip
    return p.parse_args(argv)


async def _amain(args: argparse.Namespace) -> int:
    from swarm.adverts import swarm_validators
    from swarm.broadcast import BroadcastNode
    from swarm.chunks import ChunkStore
    from swarm.dht import PeerConfig, SwarmPeer
    from swarm.fetcher import DownloadConfig
    from swarm.holders import DhtHolderDirectory
    from swarm.ratelimit import TokenBucket
    from swarm.transport import P2PTransport

    config = PeerConfig(
        initial_peers=args.bootstrap, host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"]
    )
    peer = SwarmPeer(config, record_validators=swarm_validators())
    await peer.start()
    limiter = TokenBucket(args.upload_rate) if args.upload_rate > 0 else None
    transport = P2PTransport(peer.p2p, upload_limiter=limiter)
    knobs = {"max_parallel": args.max_parallel}
    if args.seed_parallel:
        knobs["seed_parallel"] = args.seed_parallel
    if args.peer_parallel:
        knobs["per_peer_parallel"] = args.peer_parallel
    from swarm.direct import DirectSettings

    node = BroadcastNode(
        transport,
        ChunkStore(args.store),
        DhtHolderDirectory(peer),
        bytes.fromhex(args.coordinator_key),
        config=DownloadConfig(**knobs),
        relay=not args.no_relay,
        direct=DirectSettings(host=args.host) if args.direct else None,
    )
    if args.corrupt:
        original = node.server.load_chunk

        def corrupt(version: int, index: int) -> bytes | None:
            data = original(version, index)
            return None if data is None else bytes([data[0] ^ 0xFF]) + data[1:]

        node.server.load_chunk = corrupt  # type: ignore[method-assign]
    if args.no_exchange:
        node.downloader.exchange = None
    if args.no_window:
        node.downloader.windowed_exchange = None
    if args.probe_reachability:
        node.dialable = False  # nothing is announced before the measurement says otherwise
    await node.start()
    dialback = None
    if args.dialback_server:
        from swarm.reachability import DialbackServer

        dialback = DialbackServer(transport, host=args.host)
        await dialback.start()
    reach = "unknown"
    if args.probe_reachability:
        from swarm.reachability import measure_reachability

        maddrs = await peer.visible_maddrs()
        reach, detail = await measure_reachability(transport, maddrs, args.probe_reachability)
        logging.getLogger("swarm.peerproc").info("reachability: %s (%s)", reach, detail)
        node.dialable = reach == "public" or args.assume_dialable
    args.reachability = reach
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # diagnostics: kill -USR1 <pid>
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(f"READY {peer.peer_id} {json.dumps(await peer.visible_maddrs())}", flush=True)
    try:
        while line := await reader.readline():  # serve (and answer queries) until stdin closes
            if line.strip() == b"GO":
                await _download(node, args)
            elif line.startswith(b"HOLDERS "):
                found = await _holders(peer, int(line.split()[1]))
                print(f"HOLDERS {json.dumps(found)}", flush=True)
            elif line.startswith(b"GO "):
                args.version = int(line.split()[1])
                await _download(node, args)
        print(f"SERVED {node.server.chunks_served}", flush=True)
    finally:
        if dialback is not None:
            await dialback.stop()
        await node.stop()
        await peer.stop()
    return 0


async def _holders(peer: object, version: int) -> dict[str, int]:
    from swarm.dht import SwarmPeer
    from swarm.errors import SwarmError
    from swarm.holders import DhtHolderDirectory

    assert isinstance(peer, SwarmPeer)
    try:
        found = await DhtHolderDirectory(peer, timeout=10.0).lookup(version)
    except SwarmError:
        return {}
    return {p: sum(bin(b).count("1") for b in bitmap) for p, bitmap in found.items()}


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


async def _download(node: object, args: argparse.Namespace) -> None:
    from swarm.broadcast import BroadcastNode
    from swarm.errors import SwarmError

    assert isinstance(node, BroadcastNode)
    last = [-1.0]

    def progress(done: int, total: int) -> None:
        if done == total or done - last[0] >= total / 20:
            last[0] = done
            print(f"PROGRESS {done} {total}", flush=True)

    t0 = time.time()
    try:
        files = await node.download(args.version, args.seed, on_progress=progress)
    except SwarmError as exc:
        print(f"FAIL {exc}", flush=True)
        return
    done_at = time.time()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out / name).write_bytes(data)
    transfer = node.downloader.last_transfer
    stats: dict[str, object] = {
        "seconds": done_at - t0,
        "scores": node.scores.snapshot(),
        "reachability": args.reachability,
        # DHT holder publications (a timeout: a DHT message stuck behind bulk data)
        "dht_published": node.announcer.published,
        "dht_failures": node.announcer.failures,
        "dht_timeouts": node.announcer.timeouts,
        "cpu_s": time.process_time(),  # this process only (not its DHT process nor p2pd)
    }
    if node.direct is not None:  # --direct: chunk answers that came over direct connections
        stats |= {
            "direct_calls": node.direct.direct_calls,
            "direct_fallbacks": node.direct.fallbacks,
        }
    if transfer is not None:
        stats |= {
            "sources": dict(transfer.sources),
            "stalls": transfer.stalls,
            "dht_lookups": transfer.lookups,
            "timeline": [(round(t - t0, 3), i, p) for t, i, p in transfer.timeline],
            "marks": {k: round(t - t0, 3) for k, t in transfer.marks.items()},
        }
    if node.sync.last is not None:  # "full", "delta", "chain" or "held" (swarm.deltasync)
        stats["path"] = node.sync.last.path
    print(f"DONE {done_at} {json.dumps(stats)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with contextlib.suppress(ImportError):
        import torch

        torch.set_num_threads(1)
    return asyncio.run(_amain(_parse(argv)))


STATUS_LINE_LIMIT = 16 << 20
"""Longest status line read from the child: its DONE line carries the per-chunk timeline, about
70 bytes a chunk (asyncio's default of 64 KiB ended at ~900 chunks)."""


class PeerProcess:
    """Parent-side handle of a ``python -m swarm.peerproc`` child in its own process group.

    ``prefix`` is prepended to the command line (e.g. ``Host.argv([])`` of :mod:`swarm.netns`:
    ``ip netns exec <ns>``, which execs the child in place, so the PID is still the child's)."""

    def __init__(
        self, args: list[str], *, log_path: str | None = None, prefix: Sequence[str] = ()
    ) -> None:
        self.args = args
        self.log_path = log_path
        self.prefix = list(prefix)
        self.proc: asyncio.subprocess.Process | None = None
        self.peer_id = ""
        self.maddrs: list[str] = []  # the child's visible multiaddrs (from READY)
        self.progress = (0, 0)
        self.done_at: float | None = None
        self.stats: dict[str, object] = {}
        self.error: str | None = None
        self.served: int | None = None  # chunks this peer served (reported on close)

    async def start(self, timeout: float = 60.0) -> str:
        """Spawn the child and wait for READY; returns its peer id."""
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - owned by the child
        self.proc = await asyncio.create_subprocess_exec(
            *self.prefix, sys.executable, "-m", "swarm.peerproc", *self.args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            start_new_session=True, limit=STATUS_LINE_LIMIT,
        )  # fmt: skip
        log.close()
        line = await asyncio.wait_for(self._line(), timeout)
        if not line.startswith("READY "):
            raise RuntimeError(f"peer process did not start: {line!r}")
        _, self.peer_id, *rest = line.split(" ", 2)
        self.maddrs = json.loads(rest[0]) if rest else []
        return self.peer_id

    async def _line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        return (await self.proc.stdout.readline()).decode().strip()

    def go(self, version: int | None = None) -> None:
        """Start the download (the first time), or download ``version`` too (later)."""
        assert self.proc is not None and self.proc.stdin is not None
        if version is not None:
            self.done_at = self.error = None
        self.proc.stdin.write(b"GO\n" if version is None else f"GO {version}\n".encode())

    async def wait_progress(self, fraction: float) -> None:
        """Read status lines until at least ``fraction`` of the bytes are in (or DONE/FAIL)."""
        while self.done_at is None and self.error is None:
            done, total = self.progress
            if total and done >= fraction * total:
                return
            await self._read_status()

    async def wait_done(self) -> None:
        while self.done_at is None and self.error is None:
            await self._read_status()

    async def _read_status(self) -> None:
        line = await self._line()
        if not line:
            self.error = self.error or "process exited"
        elif line.startswith("PROGRESS "):
            _, done, total = line.split()
            self.progress = (int(done), int(total))
        elif line.startswith("DONE "):
            _, when, stats = line.split(" ", 2)
            self.done_at, self.stats = float(when), json.loads(stats)
        elif line.startswith("FAIL "):
            self.error = line[5:]

    async def holders(self, version: int, timeout: float = 20.0) -> dict[str, int]:
        """``{peer id: chunks held}`` of ``version`` as the child reads the DHT holder records."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"HOLDERS {version}\n".encode())
        async with asyncio.timeout(timeout):
            while True:
                line = await self._line()
                if not line:
                    raise RuntimeError("peer process exited")
                if line.startswith("HOLDERS "):
                    found: dict[str, int] = json.loads(line[8:])
                    return found

    def dump_tasks(self) -> None:
        """Ask the child to print the stacks of its asyncio tasks to its log (diagnostics)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGUSR1)

    def kill(self) -> None:
        """SIGKILL the child's whole process group (Python, DHT process, p2pd): a vanished peer."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self, timeout: float = 10.0) -> None:
        """Close stdin (graceful stop); kill the process group if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            async with asyncio.timeout(timeout):
                while line := await self._line():
                    if line.startswith("SERVED "):
                        self.served = int(line.split()[1])
                await self.proc.wait()
        except TimeoutError:
            self.kill()
            await self.proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
