"""One side of the control-latency measurement (``test_control_latency.py``, ``bench/bulk_cpu.py``).

python control_latency_peer.py server --host IP
    serves /t/ping (control: a few bytes), /t/bulk/1 (SIZE bytes, unpaced) and /t/bulk/2
    (SIZE bytes through the transport's bulk window); prints "READY <maddr>", runs until
    stdin closes.
python control_latency_peer.py client --host IP --server MADDR --mode windowed|plain
    measures /t/ping and a DHT store (round trips to the server, which holds the DHT's only
    other replica) while idle, then while ``--streams`` loops fetch bulk answers from the
    server; prints one JSON line with the latencies (seconds) and the bulk rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from swarm.dht import PeerConfig, SwarmPeer
from swarm.errors import RemoteError
from swarm.transport import P2PTransport

PING, BULK, BULK_W, PULL = "/t/ping", "/t/bulk/1", "/t/bulk/2", "/t/pull"


async def serve(args: argparse.Namespace) -> None:
    peer = SwarmPeer(PeerConfig(host_maddrs=[f"/ip4/{args.host}/tcp/0"]))
    await peer.start()
    rpc = P2PTransport(peer.p2p)
    payload = os.urandom(args.size)

    async def ping(_peer: str, request: bytes) -> bytes:
        return b"pong" + request[:8]

    async def bulk(_peer: str, _request: bytes) -> bytes:
        return payload

    pulls: list[asyncio.Task[None]] = []

    async def pull_loop(peer_id: str) -> None:
        while True:
            try:
                await rpc.call(peer_id, BULK_W, b"", timeout=120.0, stall_timeout=60.0,
                               max_response_bytes=args.size, windowed=True)  # fmt: skip
            except RemoteError:
                await asyncio.sleep(0.2)

    async def pull(peer_id: str, request: bytes) -> bytes:
        # the caller's uplink carries bulk back to us meanwhile (as a relaying receiver's does)
        pulls.extend(asyncio.create_task(pull_loop(peer_id)) for _ in range(int(request)))
        return b"ok"

    await rpc.register(PING, ping)
    await rpc.register(PULL, pull)
    await rpc.register(BULK, bulk, max_streams_per_peer=64)
    await rpc.register(BULK_W, bulk, max_streams_per_peer=64, windowed=True)
    maddr = next(m for m in await peer.visible_maddrs() if f"/{args.host}/" in m)
    print(f"READY {maddr}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    stats = rpc.bulk_window.statistics()
    print(f"WINDOW {json.dumps(stats.__dict__)}", flush=True)
    await peer.stop()


async def measure(args: argparse.Namespace) -> None:
    config = PeerConfig(initial_peers=[args.server], host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    peer = SwarmPeer(config)
    await peer.start()
    rpc = P2PTransport(peer.p2p)
    server = args.server.rsplit("/p2p/", 1)[1]
    windowed = args.mode == "windowed"

    async def ping() -> float:
        t0 = time.monotonic()
        await rpc.call(server, PING, b"x", timeout=30.0)
        return time.monotonic() - t0

    async def store(i: int) -> float:
        t0 = time.monotonic()
        await peer.store(f"lat-{i}", b"v", expiration_time=time.time() + 60, timeout=30.0)
        return time.monotonic() - t0

    async def sample(n: int, tag: int) -> tuple[list[float], list[float]]:
        pings, stores = [], []
        for i in range(n):
            pings.append(await ping())
            stores.append(await store(tag + i))
            await asyncio.sleep(args.gap)
        return pings, stores

    payload = os.urandom(args.size)

    async def bulk(_peer: str, _request: bytes) -> bytes:
        return payload

    await rpc.register(BULK_W, bulk, max_streams_per_peer=64, windowed=True)
    for _ in range(3):  # warm up: connection, DHT routing
        await ping()
    idle_ping, idle_store = await sample(args.samples, 0)
    moved, refused = [0], [0]
    stop = asyncio.Event()

    async def fetch_loop() -> None:
        name = BULK_W if windowed else BULK
        while not stop.is_set():
            try:
                body = await rpc.call(server, name, b"", timeout=120.0, stall_timeout=60.0,
                                      max_response_bytes=args.size, windowed=windowed)  # fmt: skip
            except RemoteError as exc:  # a holder booked for the next seconds: ask again soon,
                if exc.code != "busy":  # as a downloader does (DownloadConfig.busy_backoff)
                    raise
                refused[0] += 1
                await asyncio.sleep(0.2)
                continue
            moved[0] += len(body)

    if args.reverse:
        await rpc.call(server, PULL, str(args.reverse).encode(), timeout=30.0)
    loops = [asyncio.create_task(fetch_loop()) for _ in range(args.streams)]
    await asyncio.sleep(args.settle)  # let the queues fill (or not)
    t0, m0 = time.monotonic(), moved[0]
    busy_ping, busy_store = await sample(args.samples * 2, 10_000)
    rate = (moved[0] - m0) / (time.monotonic() - t0)
    stop.set()
    for task in loops:
        task.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    print(json.dumps({"idle_ping": idle_ping, "idle_store": idle_store, "busy_ping": busy_ping,
                      "busy_store": busy_store, "bulk_rate": rate,
                      "refused_busy": refused[0]}), flush=True)  # fmt: skip
    await peer.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--server", default="")
    p.add_argument("--mode", choices=["windowed", "plain"], default="windowed")
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--gap", type=float, default=0.1)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--reverse", type=int, default=0, help="bulk loops the server runs from us")
    args = p.parse_args()
    asyncio.run(serve(args) if args.role == "server" else measure(args))


if __name__ == "__main__":
    main()
