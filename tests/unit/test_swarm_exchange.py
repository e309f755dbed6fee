"""Holder information in the chunk exchange, NATed holders, progress-rate stalls and manifest
retries, on the in-memory transport (``set_private`` emulates a NAT: only peers a node called
itself can reach it)."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from pathlib import Path

from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import Manifest, SignedEnvelope
from swarm import delayline, keys
from swarm.broadcast import EXCHANGE_RPC, EXCHANGE_WINDOWED_RPC, BroadcastNode
from swarm.chunks import ChunkStore
from swarm.errors import DialFailed
from swarm.fetcher import DownloadConfig
from swarm.holders import HolderBook, MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork, InMemoryTransport
from swarm.reachability import dialable_addrs
from swarm.transport import ProgressFn
from swarm.wire import MAX_TABLE_ENTRIES

CHUNK = 4096
FAST = DownloadConfig(
    holders_refresh=0.01, busy_backoff=0.01, seed_backoff=0.01, seed_grace=0.2,
    manifest_deadline=2.0, seed_parallel=1,
)  # fmt: skip


Version = tuple[SignedEnvelope, Manifest, list[bytes]]


def version(coord: Identity, v: int, n_chunks: int = 12) -> Version:
    now = time.time()
    manifest, chunks = build_manifest(
        {"w.bin": os.urandom(n_chunks * CHUNK)}, version=v, parent_version=None,
        model_config_hash="ab", tokenizer_hash="cd", created_at=now, expires_at=now + 600,
        chunk_size=CHUNK,
    )  # fmt: skip
    return sign_manifest(manifest, coord, now), manifest, chunks


class NoDirectory(MemoryHolderDirectory):
    """A DHT that never answers with anything: holder information must come another way."""

    async def lookup(self, version: int) -> dict[str, bytes]:
        return {}


def make(net: InMemoryNetwork, dirs: MemoryHolderDirectory, tmp: Path, name: str, key: bytes,
         cfg: DownloadConfig = FAST) -> BroadcastNode:  # fmt: skip
    return BroadcastNode(net.endpoint(name), ChunkStore(tmp / name), dirs, key, config=cfg,
                         announce_interval=0.005)  # fmt: skip


async def test_holders_are_learned_from_the_exchange_without_the_dht(tmp_path: Path) -> None:
    coord = Identity.generate()
    env, _, chunks = version(coord, 1, n_chunks=24)
    net, dirs = InMemoryNetwork(latency=0.01), NoDirectory()
    seed = make(net, dirs, tmp_path, "seed", coord.public_key)
    receivers = [make(net, dirs, tmp_path, f"r{i}", coord.public_key) for i in range(4)]
    for n in (seed, *receivers):
        await n.start()
    await seed.seed_version(env, chunks)
    await asyncio.gather(*(r.download(1, ["seed"]) for r in receivers))
    relayed = sum(
        c
        for r in receivers
        for p, c in r.downloader.last_transfer.sources.items()  # type: ignore[union-attr]
        if p != "seed"
    )
    assert relayed > 0, "receivers never learned of each other (the DHT here knows nothing)"
    assert seed.server.chunks_served < 4 * len(chunks)
    # the seed's book holds every receiver's own report, marked dialable
    assert set(seed.book.view(1)) == {f"r{i}" for i in range(4)}
    for n in (seed, *receivers):
        await n.stop()


async def test_not_dialable_node_is_never_announced_nor_passed_on(tmp_path: Path) -> None:
    coord = Identity.generate()
    env, _, chunks = version(coord, 1)
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = make(net, dirs, tmp_path, "seed", coord.public_key)
    natted = make(net, dirs, tmp_path, "nat", coord.public_key)
    net.set_private("nat")
    natted.dialable = False  # as measured
    other = make(net, dirs, tmp_path, "other", coord.public_key)
    for n in (seed, natted, other):
        await n.start()
    await seed.seed_version(env, chunks)
    await natted.download(1, ["seed"])
    await natted.announcer.flush()
    assert "nat" not in dirs.bitmaps.get(1, {}), "a NATed node announced itself in the DHT"
    # the seed knows (first-hand) what it holds, but never tells others it can be dialled
    assert "nat" in seed.book.view(1)
    table = seed.book.table(1, len(chunks), me="seed", my_have=frozenset(), my_dialable=True)
    assert "nat" not in {e.peer_id for e in table}
    await other.download(1, ["seed"])
    assert "nat" not in other.book.view(1)
    assert other.downloader.last_transfer.sources.get("nat", 0) == 0  # type: ignore[union-attr]
    for n in (seed, natted, other):
        await n.stop()


async def test_unreachable_holders_cost_one_bounded_dial_then_a_backoff(tmp_path: Path) -> None:
    """Holders announced but not dialable (a stale record, a misconfigured NATed node): the
    downloader falls back to the seed within the connect timeout, and does not dial them again
    for the next version (back-off), instead of paying the dial for every chunk or version."""
    coord = Identity.generate()
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    cfg = DownloadConfig(holders_refresh=0.01, connect_timeout=0.5, seed_parallel=1)
    seed = make(net, dirs, tmp_path, "seed", coord.public_key)
    ghosts = [make(net, dirs, tmp_path, f"ghost{i}", coord.public_key) for i in range(3)]
    r = make(net, dirs, tmp_path, "r", coord.public_key, cfg)
    for n in (seed, *ghosts, r):
        await n.start()
    for v in (1, 2):
        env, _, chunks = version(coord, v)
        for n in (seed, *ghosts):
            await n.seed_version(env, chunks)  # the ghosts announce every chunk ...
    for g in ghosts:
        net.set_private(g.server.transport.peer_id, dial_delay=30.0)  # ... but cannot be dialled
    t0 = time.monotonic()
    await r.download(1, ["seed"])
    first = time.monotonic() - t0
    t0 = time.monotonic()
    await r.download(2, ["seed"])
    second = time.monotonic() - t0
    assert first < 0.5 + 2.0, f"v1 took {first:.1f} s: unreachable holders held the download"
    assert second < 0.4, f"v2 took {second:.1f} s: the unreachable holders were dialled again"
    for g in ghosts:
        stats = r.scores.stats(g.server.transport.peer_id)
        assert stats.dial_failures == 1 and stats.successes == 0
        assert r.scores.backed_off(g.server.transport.peer_id, time.monotonic())
    for n in (seed, *ghosts, r):
        await n.stop()


class TrickleTransport(InMemoryTransport):
    """Calls to ``slow`` answer a few bytes a second and never finish (a congested peer)."""

    slow = "trickler"

    async def call(self, peer_id: str, name: str, request: bytes, *, timeout: float = 10.0,
                   on_progress: ProgressFn | None = None, **kw: object) -> bytes:  # fmt: skip
        if peer_id != self.slow or name not in (EXCHANGE_RPC, EXCHANGE_WINDOWED_RPC):
            return await super().call(peer_id, name, request, timeout=timeout,
                                      on_progress=on_progress, **kw)  # type: ignore[arg-type]  # fmt: skip
        got = 0
        while True:  # 400 B/s: bytes keep coming, so a silence timeout never fires
            await asyncio.sleep(0.05)
            got += 20
            if on_progress is not None:
                on_progress(got, CHUNK)


async def test_a_trickling_request_is_given_up_by_its_progress_rate(tmp_path: Path) -> None:
    coord = Identity.generate()
    env, _, chunks = version(coord, 1)
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = make(net, dirs, tmp_path, "seed", coord.public_key)
    trickler = make(net, dirs, tmp_path, "trickler", coord.public_key)
    for n in (seed, trickler):
        await n.start()
        await n.seed_version(env, chunks)
    cfg = DownloadConfig(holders_refresh=0.01, stall_timeout=0.5, min_rate=4096,
                         hedge_after=60.0, chunk_timeout=60.0)  # fmt: skip
    ep = TrickleTransport(net, "r")
    net._endpoints["r"] = ep
    r = BroadcastNode(ep, ChunkStore(tmp_path / "r"), dirs, coord.public_key, config=cfg)
    await r.start()
    t0 = time.monotonic()
    await asyncio.wait_for(r.download(1, ["seed"]), 20.0)
    assert time.monotonic() - t0 < 5.0
    transfer = r.downloader.last_transfer
    assert transfer is not None and transfer.stalls >= 1
    assert transfer.sources["trickler"] == 0 and r.scores.stats("trickler").stalls >= 1
    for n in (seed, trickler, r):
        await n.stop()


async def test_manifest_request_is_retried_until_the_seed_answers(tmp_path: Path) -> None:
    """The seed cannot be reached at first (a dial in libp2p's back-off, a restart): the
    downloader retries instead of failing the whole version."""
    coord = Identity.generate()
    env, _, chunks = version(coord, 1)
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = make(net, dirs, tmp_path, "seed", coord.public_key)
    await seed.start()
    await seed.seed_version(env, chunks)
    endpoint = net.lookup("seed")
    net.disconnect("seed")
    r = make(net, dirs, tmp_path, "r", coord.public_key)
    await r.start()

    async def come_back() -> None:
        await asyncio.sleep(0.6)
        assert endpoint is not None
        net._endpoints["seed"] = endpoint

    back = asyncio.create_task(come_back())
    got = await asyncio.wait_for(r.download(1, ["seed"]), 10.0)
    await back
    assert len(b"".join(got.values())) == len(chunks) * CHUNK
    for n in (seed, r):
        await n.stop()


def test_holder_table_is_bounded_and_lists_the_answerer_first() -> None:
    book = HolderBook()
    n = 8 * 1024
    for i in range(100):
        book.learn(1, f"p{i}", {i}, dialable=i % 2 == 0)
    table = book.table(1, n, me="me", my_have=frozenset({1, 2}), my_dialable=False, exclude="p0")
    assert table[0].peer_id == "me" and not table[0].dialable
    assert keys.indices_from_bitmap(table[0].have, n) == {1, 2}
    others = [e.peer_id for e in table[1:]]
    assert len(table) <= MAX_TABLE_ENTRIES and "p0" not in others
    assert all(int(p[1:]) % 2 == 0 for p in others), "a non-dialable peer was passed on"
    assert others[0] == "p98", "most recently heard first"


def test_dialable_addrs_keeps_plain_tcp_addresses_only() -> None:
    pid = "/p2p/12D3KooWCdWhTtNKCdK6gVhzE2oxfPXS53QUQs1WtcA6FTZgMc9s"
    got = dialable_addrs([
        f"/ip4/10.0.0.1/tcp/4001{pid}", "/ip4/10.0.0.1/tcp/4001", "/ip6/::1/tcp/5",
        f"/ip4/1.2.3.4/tcp/1{pid}/p2p-circuit{pid}", "/ip4/1.2.3.4/udp/1/quic",
        "/ip4/1.2.3.4/tcp/0", "/dns4/example.org/tcp/31337",
    ])  # fmt: skip
    assert got == ["/ip4/10.0.0.1/tcp/4001", "/ip6/::1/tcp/5", "/dns4/example.org/tcp/31337"]
    assert len(dialable_addrs([f"/ip4/10.0.0.{i}/tcp/1" for i in range(50)])) == 8


async def test_memtransport_nat_emulation_raises_dial_failed() -> None:
    net = InMemoryNetwork()
    a, b, c = net.endpoint("a"), net.endpoint("b"), net.endpoint("c")

    async def echo(peer: str, req: bytes) -> bytes:
        return req

    for ep in (a, b, c):
        await ep.register("echo", echo)
    net.set_private("a", dial_delay=0.05)
    try:
        await b.call("a", "echo", b"x")
        raise AssertionError("a NATed peer was dialled")
    except DialFailed:
        pass
    assert await a.call("b", "echo", b"x") == b"x"  # a opens a connection to b ...
    assert await b.call("a", "echo", b"y") == b"y"  # ... which b can then use
    try:
        await c.call("a", "echo", b"x")
        raise AssertionError("a NATed peer was dialled")
    except DialFailed:
        pass


def test_delay_line_reads_packet_ids_from_netlink_messages() -> None:
    hdr = struct.pack(">IHB", 4711, 0x0800, 1)  # packet id, hw protocol, hook
    payload = delayline._NFGENMSG.pack(2, 0, 0) + delayline._attr(delayline.NFQA_PACKET_HDR, hdr)
    kind = (delayline.NFNL_SUBSYS_QUEUE << 8) | delayline.NFQNL_MSG_PACKET
    msg = delayline._NLMSGHDR.pack(16 + len(payload), kind, 0, 0, 0) + payload
    parsed = list(delayline._messages(msg + msg))
    assert [k for k, _ in parsed] == [kind, kind]
    assert delayline._packet_id(parsed[0][1]) == 4711
    verdict = delayline._message(delayline.NFQNL_MSG_VERDICT_BATCH, 3, b"")
    length, vkind, flags, _, _ = delayline._NLMSGHDR.unpack_from(verdict)
    assert length == len(verdict) == 20 and flags == delayline.NLM_F_REQUEST
    assert vkind == (3 << 8) | delayline.NFQNL_MSG_VERDICT_BATCH
    assert struct.unpack(">H", verdict[18:20]) == (3,)  # queue number, big-endian


def test_exchange_request_matches_the_vector_in_protocol_md() -> None:
    from protocol.codec import decode, encode
    from swarm.wire import ExchangeRequest

    wanted, have = keys.bitmap_from_indices({0, 9}, 16), keys.bitmap_from_indices({7}, 16)
    assert (wanted.hex(), have.hex()) == ("0102", "8000")
    msg = ExchangeRequest(version=7, wanted=wanted, have=have, dialable=False)
    vector = (
        "86a474797065af45786368616e676552657175657374a776657273696f6e07a677616e746564c4020102"
        "a468617665c4028000a86469616c61626c65c2b070726f746f636f6c5f76657273696f6e01"
    )
    assert encode(msg).hex() == vector
    assert decode(bytes.fromhex(vector), ExchangeRequest) == msg


class CountingDirectory(MemoryHolderDirectory):
    """Counts holder lookups; ``ghosts``: every lookup also names a holder never seen before
    (holding nothing, so never asked for a chunk)."""

    def __init__(self, *, ghosts: bool = False) -> None:
        super().__init__()
        self.lookups, self.ghosts = 0, ghosts

    async def lookup(self, version: int) -> dict[str, bytes]:
        self.lookups += 1
        found = await super().lookup(version)
        if self.ghosts:
            found[f"ghost{self.lookups}"] = bytes(2)
        return found


async def test_holder_lookups_back_off_once_they_find_no_one_new(tmp_path: Path) -> None:
    """A lookup costs every DHT node it visits CPU: re-read only while the DHT still names
    holders not met yet, else the pause doubles up to ``holders_refresh_max``."""
    coord = Identity.generate()
    env, _, chunks = version(coord, 1, n_chunks=16)
    cfg = DownloadConfig(holders_refresh=0.01, holders_refresh_max=0.16, busy_backoff=0.01,
                         seed_parallel=1, max_parallel=1, first_lookup=0.0)  # fmt: skip
    counts = {}
    for ghosts in (False, True):
        net, dirs = InMemoryNetwork(latency=0.05), CountingDirectory(ghosts=ghosts)
        seed = make(net, dirs, tmp_path / str(ghosts), "seed", coord.public_key)
        receiver = make(net, dirs, tmp_path / str(ghosts), "r", coord.public_key, cfg)
        for n in (seed, receiver):
            await n.start()
        await seed.seed_version(env, chunks)
        t0 = time.monotonic()
        await receiver.download(1, ["seed"])
        took = time.monotonic() - t0
        transfer = receiver.downloader.last_transfer
        assert transfer is not None and transfer.lookups == dirs.lookups
        counts[ghosts] = (dirs.lookups, took)
        for n in (seed, receiver):
            await n.stop()
    (quiet, took), (fresh, took_fresh) = counts[False], counts[True]
    assert took > 0.6, f"the download took {took:.2f} s: too short to tell the cadences apart"
    # backing off: 0.01, 0.02, 0.04, 0.08 and then every 0.16 s (the first few, +1 to spare)
    assert quiet <= took / 0.16 + 6, (quiet, took)
    # a lookup that names someone new keeps the pause at holders_refresh (0.01 s)
    assert fresh >= 2 * quiet and fresh >= took_fresh / 0.16 + 10, (fresh, took_fresh, quiet)
