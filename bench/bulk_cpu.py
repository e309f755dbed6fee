"""Benchmark: CPU cost of moving checkpoint chunks one hop, by component.

One process runs two swarm peers on 127.0.0.1 (each with its own hivemind DHT process and p2pd),
a seed ``BroadcastNode`` holding a version of M bytes and a receiver that fetches its chunks (the
real chunk server, exchange RPC, transport, verification and store; holder records in memory so
the DHT stays out of the data path; assembling the files afterwards is not counted). No link
cap: the figures are CPU, not time. Both ends of the hop are measured together:

* ``p2pd``: both daemons' CPU from /proc/<pid>/stat (``bench/_cpu.py``);
* ``python``: this process (both peers' Python side), ``time.process_time``;
* components of the Python side, timed on the same chunks in this process: ``hashing`` (the
  receiver's sha256 check, ``protocol.manifest.verify_chunk``), ``framing`` (``ExchangeReply``
  encode at the server + decode at the receiver), ``copies`` (the byte copies the transport's
  read path makes per chunk), ``disk`` (the receiver's store write + the server's read, page
  cache); ``python other`` = python less those (event loop, stream I/O, acknowledgements).

Figures are CPU-seconds per GiB moved one hop, medians of ``--repeats`` runs, with the load
average printed (this machine is shared: other jobs slow p2pd and Python down alike).

    python bench/bulk_cpu.py                       # 256 MiB, 1 MiB chunks: paced, unpaced, direct
    python bench/bulk_cpu.py --size-mib 64 --repeats 1 --no-report
    python bench/bulk_cpu.py --scaling             # 512 to 8,192 chunks of 128 KiB, paced

``--scaling`` asks whether the cost per GiB grows with the number of chunks (a checkpoint of a
few GB has thousands): the same hop at 512, 2,048 and 8,192 chunks of 128 KiB, and the holder
bookkeeping one chunk request costs at each count with 8 holders known (``HolderBook.table`` at
the server, ``learn_table`` at the receiver, the request's two bitmaps packed and one unpacked),
timed in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # first: bench/protocol.py must not shadow the protocol package

from _cpu import tree_cpu  # noqa: E402
from _report import write_section  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


def components(chunks: list[bytes], manifest: Any, tmp: Path) -> dict[str, float]:
    """CPU seconds of each Python component for moving ``chunks`` one hop (both ends)."""
    from protocol.codec import decode, encode
    from protocol.limits import CHUNK_FRAME_OVERHEAD, Limits
    from protocol.manifest import verify_chunk
    from swarm.wire import TABLE_OVERHEAD, ExchangeReply, HolderEntry

    out: dict[str, float] = {}
    t = time.process_time()
    for i, c in enumerate(chunks):
        verify_chunk(manifest, i, c)
    out["hashing"] = time.process_time() - t
    limits = Limits(control_frame=manifest.chunk_size + CHUNK_FRAME_OVERHEAD + TABLE_OVERHEAD)
    table = [HolderEntry(peer_id="12D3KooW" + "x" * 44, have=b"\xff" * 8, dialable=True)]
    t = time.process_time()
    for i, c in enumerate(chunks):
        raw = encode(ExchangeReply(version=1, index=i, data=c, holders=table))
        decode(raw, ExchangeReply, limits)
    out["framing"] = time.process_time() - t
    t = time.process_time()
    for c in chunks:  # the read path: pieces into a buffer, the buffer into bytes
        buf = bytearray(len(c))
        view = memoryview(c)
        for s in range(0, len(c), 64 * 1024):
            buf[s : s + 64 * 1024] = view[s : s + 64 * 1024]
        bytes(buf)
    out["copies"] = time.process_time() - t
    t = time.process_time()
    for i, c in enumerate(chunks):  # the store: temp file + rename, then a read (page cache)
        p = tmp / f"{i}.bin"
        with open(p.with_suffix(".tmp"), "wb") as f:
            f.write(c)
        os.replace(p.with_suffix(".tmp"), p)
        p.read_bytes()
    out["disk"] = time.process_time() - t
    return out


async def one_run(args: argparse.Namespace, mode: str, tmp: Path) -> dict[str, float]:
    from protocol.identity import Identity
    from protocol.manifest import build_manifest, sign_manifest
    from swarm.broadcast import BroadcastNode
    from swarm.chunks import ChunkStore
    from swarm.direct import DirectSettings
    from swarm.holders import MemoryHolderDirectory
    from swarm.testing import start_loopback_peer
    from swarm.transport import P2PTransport

    size = int(args.size_mib * MIB)
    coord = Identity.generate()
    now = time.time()
    manifest, chunks = build_manifest(
        {"model.safetensors": os.urandom(size)}, version=1, parent_version=None,
        model_config_hash="00", tokenizer_hash="00", created_at=now, expires_at=now + 3600,
        chunk_size=int(args.chunk_kib * 1024),
    )  # fmt: skip
    env = sign_manifest(manifest, coord, now)
    a = await start_loopback_peer()
    b = await start_loopback_peer(await a.visible_maddrs())
    directory = MemoryHolderDirectory()
    direct = DirectSettings(host="127.0.0.1") if mode == "direct" else None
    seed = BroadcastNode(P2PTransport(a.p2p), ChunkStore(tmp / "seed"), directory,
                         coord.public_key, direct=direct)  # fmt: skip
    recv = BroadcastNode(P2PTransport(b.p2p), ChunkStore(tmp / "recv"), directory,
                         coord.public_key, direct=direct)  # fmt: skip
    if mode == "unpaced":
        recv.downloader.windowed_exchange = None
    try:
        await seed.start()
        await recv.start()
        await seed.seed_version(env, chunks)
        idle0, i0 = tree_cpu(os.getpid()), time.monotonic()
        await asyncio.sleep(1.0)
        cpu0, idle_s = tree_cpu(os.getpid()), time.monotonic() - i0
        got_env, got = await recv.downloader.fetch_manifest(1, [a.peer_id])
        c0, t0 = time.process_time(), time.monotonic()
        await recv.downloader.fetch_part(got_env, got, [a.peer_id], "full")  # the chunks only
        c1, wall = time.process_time(), time.monotonic() - t0
        cpu1 = tree_cpu(os.getpid())
        if recv.direct is not None and recv.direct.direct_calls != len(chunks):
            raise RuntimeError(f"{recv.direct.direct_calls} of {len(chunks)} chunks came direct")
        p2pd_idle = (cpu0["p2pd"] - idle0["p2pd"]) / idle_s
        gib = size / GIB
        out = {
            "p2pd": max(0.0, cpu1["p2pd"] - cpu0["p2pd"] - p2pd_idle * wall) / gib,
            "python": (c1 - c0) / gib,
            "wall_s": wall,
        }
        parts = components(chunks, manifest, tmp)
        for k, v in parts.items():
            out[k] = v / gib
        out["python other"] = out["python"] - sum(parts.values()) / gib
        out["total"] = out["p2pd"] + out["python"]
        return out
    finally:
        await recv.stop()
        await seed.stop()
        await asyncio.gather(a.stop(), b.stop())


async def run(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix="bench-bulk-cpu-") as d:
                r = await one_run(args, mode, Path(d))
            results.setdefault(mode, []).append(r)
            print(f"{mode:8s} " + ", ".join(f"{k} {v:.2f}" for k, v in r.items())
                  + f" (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    return results


KEYS = ["total", "p2pd", "python", "hashing", "framing", "copies", "disk", "python other"]
LABELS = {
    "paced": "paced (bulk window)",
    "unpaced": "unpaced",
    "direct": "paced, direct TCP connection (swarm.direct)",
}


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> str:
    lines = [
        "## CPU cost of the chunk data path (`bench/bulk_cpu.py`)",
        "",
        "CPU-seconds per GiB moved one hop (both ends together: seed and receiver, each with "
        'its p2pd), loopback, no link cap; "direct": the chunk answers over a direct TCP '
        "connection instead of a libp2p stream (the ticket over libp2p; the p2pd figure is "
        "then the daemons' idle upkeep, less the rate measured at rest); the components of the "
        "Python side timed on the same "
        f"chunks. M = {args.size_mib:g} MiB, {args.chunk_kib:g} KiB chunks; median of "
        f"{args.repeats} run(s); machine: {os.cpu_count()} CPU cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        "| chunk answers | " + " | ".join(KEYS) + " | wall s |",
        "|---|" + "---|" * (len(KEYS) + 1),
    ]
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in [*KEYS, "wall_s"]}
        label = LABELS[mode]
        lines.append(f"| {label} | " + " | ".join(f"{med[k]:.2f}" for k in KEYS)
                     + f" | {med['wall_s']:.1f} |")  # fmt: skip
    lines += ["", f"Command: `{args.command}`"]
    return "\n".join(lines)


SCALING_CHUNKS = [512, 2048, 8192]


def bookkeeping_ms(n: int, holders: int = 8) -> float:
    """Milliseconds of holder bookkeeping per chunk request at ``n`` chunks (module doc)."""
    import random
    import timeit

    from swarm import keys
    from swarm.holders import HolderBook

    rng = random.Random(0)
    half = frozenset(rng.sample(range(n), n // 2))
    book = HolderBook()
    for p in range(holders):
        book.learn(1, f"peer-{p}", frozenset(rng.sample(range(n), n // 2)), dialable=True)
    table = book.table(1, n, me="me", my_have=half, my_dialable=True)
    bitmap = keys.bitmap_from_indices(half, n)

    def request() -> None:
        mine = frozenset(half)  # a new holding each time, as after every verified chunk
        book.table(1, n, me="me", my_have=mine, my_dialable=True)
        book.learn_table(1, n, table)
        keys.bitmap_from_indices(mine, n)
        keys.bitmap_from_indices({n // 3}, n)
        keys.indices_from_bitmap(bitmap, n)

    return min(timeit.repeat(request, number=20, repeat=3)) / 20 * 1e3


def scaling(args: argparse.Namespace) -> str:
    rows = []
    for n in SCALING_CHUNKS:
        sub = argparse.Namespace(**vars(args))
        sub.chunk_kib, sub.size_mib = 128.0, n * 128 / 1024
        sub.modes = ["paced"]
        runs = asyncio.run(run(sub))["paced"]
        med = {k: statistics.median(r[k] for r in runs) for k in [*KEYS, "wall_s"]}
        rows.append((n, med, bookkeeping_ms(n)))
        print(f"{n} chunks: {med} bookkeeping {rows[-1][2]:.2f} ms per request", flush=True)
    lines = [
        "## CPU of the chunk data path against the number of chunks (`bench/bulk_cpu.py "
        "--scaling`)",
        "",
        "The hop of the section above (paced answers) at 128 KiB chunks and 512, 2,048 and "
        "8,192 chunks (64 MiB to 1 GiB), CPU-seconds per GiB; bookkeeping: milliseconds of "
        "holder bookkeeping per chunk request with 8 holders known (the server's holder table, "
        "the receiver's merge of it, the request's bitmaps), timed in-process. Median of "
        f"{args.repeats} run(s); machine: {os.cpu_count()} CPU cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        "| chunks | total | p2pd | python | python other | disk | wall s | bookkeeping ms "
        "per request |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, med, ms in rows:
        lines.append(f"| {n:,} | {med['total']:.2f} | {med['p2pd']:.2f} | {med['python']:.2f} | "
                     f"{med['python other']:.2f} | {med['disk']:.2f} | {med['wall_s']:.1f} | "
                     f"{ms:.3f} |")  # fmt: skip
    lines += ["", f"Command: `{args.command}`"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=float, default=256.0)
    p.add_argument("--chunk-kib", type=float, default=1024.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["paced", "unpaced", "direct"],
                   choices=["paced", "unpaced", "direct"])  # fmt: skip
    p.add_argument("--no-report", action="store_true", help="print only, leave docs/ alone")
    p.add_argument(
        "--scaling", action="store_true", help="512 to 8,192 chunks of 128 KiB; bookkeeping"
    )
    args = p.parse_args()
    args.command = "python bench/bulk_cpu.py " + " ".join(sys.argv[1:])
    if args.scaling:
        text = scaling(args)
        print(text)
        if not args.no_report:
            write_section("bulk-cpu-chunks", text)
            print("wrote the bulk-cpu-chunks section of docs/benchmarks.md")
        return
    results = asyncio.run(run(args))
    text = report(args, results)
    print(text)
    if not args.no_report:
        write_section("bulk-cpu", text)
        print("wrote the bulk-cpu section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
