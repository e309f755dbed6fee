"""A broadcast peer as a separate OS process, driven over stdin/stdout (tests and benchmarks).

Child protocol (one line each, stdout)::

    READY <peer id>                 started and serving; waits for "GO" on stdin
    PROGRESS <done bytes> <total>   while downloading (about every 5 %)
    DONE <unix time> <json stats>   version complete and written to --out
    FAIL <one-line error>
    SERVED <chunks>                 on exit: how many chunks this peer served

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
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m swarm.peerproc", description=__doc__)
    p.add_argument("--bootstrap", action="append", default=[], help="initial peer multiaddr")
    p.add_argument("--store", required=True, help="chunk store directory")
    p.add_argument("--coordinator-key", required=True, help="pinned coordinator key, hex")
    p.add_argument("--seed", action="append", default=[], help="seed peer id (repeatable)")
    p.add_argument("--version", type=int, default=None, help="version to fetch (default: newest)")
    p.add_argument("--upload-rate", type=float, default=0.0, help="upload cap, bytes/s (0: none)")
    p.add_argument("--no-relay", action="store_true", help="do not serve chunks (star baseline)")
    p.add_argument("--corrupt", action="store_true", help="serve corrupted chunks (tests)")
    p.add_argument("--out", default=None, help="write the received files here")
    p.add_argument("--max-parallel", type=int, default=8)
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

    peer = SwarmPeer(PeerConfig(initial_peers=args.bootstrap), record_validators=swarm_validators())
    await peer.start()
    limiter = TokenBucket(args.upload_rate) if args.upload_rate > 0 else None
    transport = P2PTransport(peer.p2p, upload_limiter=limiter)
    node = BroadcastNode(
        transport,
        ChunkStore(args.store),
        DhtHolderDirectory(peer),
        bytes.fromhex(args.coordinator_key),
        config=DownloadConfig(max_parallel=args.max_parallel),
        relay=not args.no_relay,
    )
    if args.corrupt:
        original = node.server.load_chunk

        def corrupt(version: int, index: int) -> bytes | None:
            data = original(version, index)
            return None if data is None else bytes([data[0] ^ 0xFF]) + data[1:]

        node.server.load_chunk = corrupt  # type: ignore[method-assign]
    await node.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # diagnostics: kill -USR1 <pid>
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(f"READY {peer.peer_id}", flush=True)
    try:
        if (await reader.readline()).strip() == b"GO":
            await _download(node, args)
        while await reader.readline():  # serve until stdin closes
            pass
        print(f"SERVED {node.server.chunks_served}", flush=True)
    finally:
        await node.stop()
        await peer.stop()
    return 0


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
    sources = dict(transfer.sources) if transfer is not None else {}
    stats = {"seconds": done_at - t0, "scores": node.scores.snapshot(), "sources": sources}
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


class PeerProcess:
    """Parent-side handle of a ``python -m swarm.peerproc`` child in its own process group."""

    def __init__(self, args: list[str], *, log_path: str | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.peer_id = ""
        self.progress = (0, 0)
        self.done_at: float | None = None
        self.stats: dict[str, object] = {}
        self.error: str | None = None
        self.served: int | None = None  # chunks this peer served (reported on close)

    async def start(self, timeout: float = 60.0) -> str:
        """Spawn the child and wait for READY; returns its peer id."""
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - owned by the child
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "swarm.peerproc", *self.args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        line = await asyncio.wait_for(self._line(), timeout)
        if not line.startswith("READY "):
            raise RuntimeError(f"peer process did not start: {line!r}")
        self.peer_id = line.split()[1]
        return self.peer_id

    async def _line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        return (await self.proc.stdout.readline()).decode().strip()

    def go(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"GO\n")

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
