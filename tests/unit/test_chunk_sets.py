"""Chunk sets at the size of a real checkpoint: the bitmap codecs (``swarm.keys``) against a
plain reference, and the caches that keep a chunk request's bookkeeping from growing with the
number of chunks (the holder book, the store's holdings, the seed's least-sent choice).

Before these, every chunk request rebuilt and re-parsed each holder's bitmap one chunk at a
time in Python: 14 ms per request at 8,192 chunks with 8 holders known, about two minutes of
CPU per receiver for one 8 GB checkpoint (``python bench/bulk_cpu.py --scaling``)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from swarm import keys
from swarm.broadcast import ChunkServer
from swarm.chunks import ChunkStore
from swarm.holders import HolderBook
from swarm.wire import HolderEntry


def reference_bitmap(indices: set[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def reference_indices(bitmap: bytes, n: int) -> frozenset[int]:
    limit = min(n, len(bitmap) * 8)
    return frozenset(i for i in range(limit) if bitmap[i // 8] >> (i % 8) & 1)


@st.composite
def chunk_sets(draw: st.DrawFn) -> tuple[int, set[int]]:
    n = draw(st.integers(0, 3000))
    picked = draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=64)) if n else set()
    return n, picked


@settings(max_examples=200, deadline=None)
@given(chunk_sets(), st.binary(max_size=400))
def test_bitmaps_match_the_reference_both_ways(case: tuple[int, set[int]], junk: bytes) -> None:
    """Packing and unpacking agree with the one-chunk-at-a-time definition of docs/swarm.md,
    including bitmaps shorter than ``n`` and stray bits past it (ignored)."""
    n, picked = case
    bitmap = keys.bitmap_from_indices(picked, n)
    assert bitmap == reference_bitmap(picked, n)
    assert keys.indices_from_bitmap(bitmap, n) == picked
    assert keys.indices_from_bitmap(junk, n) == reference_indices(junk, n)
    bits = keys.bits_from_bitmap(junk, n)
    assert keys.indices_from_bits(bits) == reference_indices(junk, n)
    assert keys.bitmap_from_bits(bits, n) == reference_bitmap(set(reference_indices(junk, n)), n)
    assert keys.bits_from_indices(picked) == keys.bits_from_bitmap(bitmap, n)


def test_bad_chunk_sets_are_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        keys.bitmap_from_indices({8}, 8)
    with pytest.raises(ValueError, match="out of range"):
        keys.bitmap_from_indices({-1}, 8)
    with pytest.raises(ValueError, match="outside"):
        keys.bitmap_from_bits(1 << 8, 8)
    with pytest.raises(ValueError, match="negative"):
        keys.bits_from_indices([3, -2])


def test_a_holder_table_heard_again_keeps_what_the_book_built_from_it() -> None:
    """A reply's table names holders whose holdings mostly did not change since the last one:
    merging an entry that adds nothing keeps the holding (and the index set built from it), so
    the receiver does not rebuild thousands of indices per holder per chunk. An entry that adds
    chunks is merged by union, as before."""
    n = 8192
    book = HolderBook()
    have = frozenset(range(0, n, 3))
    entry = HolderEntry(peer_id="peer-a", have=keys.bitmap_from_indices(have, n), dialable=True)
    book.learn_table(1, n, [entry])
    first = book.view(1)["peer-a"]
    assert first == have
    book.learn_table(1, n, [entry])  # nothing new
    assert book.view(1)["peer-a"] is first
    more = HolderEntry(peer_id="peer-a", have=keys.bitmap_from_indices({1}, n), dialable=True)
    book.learn_table(1, n, [more])
    assert book.view(1)["peer-a"] == have | {1}
    # and the table a server sends carries the merged set, packed from the book's bits
    table = book.table(1, n, me="me", my_have=frozenset({5}), my_dialable=True)
    assert [e.peer_id for e in table] == ["me", "peer-a"]
    assert keys.indices_from_bitmap(table[1].have, n) == have | {1}
    assert keys.indices_from_bitmap(table[0].have, n) == {5}


def _seeded(tmp_path: Path, n_chunks: int) -> ChunkStore:
    signer = Identity.generate()
    now = time.time()
    manifest, chunks = build_manifest(
        {"model.safetensors": os.urandom(n_chunks * 1024)}, version=1, parent_version=None,
        model_config_hash="00", tokenizer_hash="00", created_at=now, expires_at=now + 600,
        chunk_size=1024,
    )  # fmt: skip
    store = ChunkStore(tmp_path / "store")
    store.seed(sign_manifest(manifest, signer, now), manifest, chunks)
    return store


def test_the_stores_holdings_are_one_object_until_they_change(tmp_path: Path) -> None:
    """Callers pack the store's holdings into a bitmap once per change, keyed by the object."""
    store = _seeded(tmp_path, 40)
    held = store.have(1)
    assert held == frozenset(range(40)) and store.have(1) is held
    assert store.get_chunk(1, 7) is not None
    store._chunk_path(1, 7).unlink()  # a file lost under the store
    assert store.get_chunk(1, 7) is None  # the missing file is noticed and forgotten
    after = store.have(1)
    assert after == frozenset(range(40)) - {7} and after is not held


class _NoTransport:
    peer_id = "server"


def test_the_seed_sends_the_wanted_chunk_it_sent_least_often(tmp_path: Path) -> None:
    """Among the wanted chunks the server holds it picks one sent least often, uniformly among
    those: a seed asked for any of thousands spreads them over its receivers."""
    n = 64
    store = _seeded(tmp_path, n)
    server = ChunkServer(store, _NoTransport())  # type: ignore[arg-type]
    everything = keys.bitmap_from_indices(range(n), n)
    first = []
    for _ in range(n):
        first.append(server._choose(1, everything))
        server._load(1, first[-1])  # sent: counted at once
    # the first n picks, each sent at once, are n different chunks
    assert sorted(first) == list(range(n))
    # chunks 0..9 sent twice more: asked for 0..19, the server picks among 10..19 only
    for i in range(10):
        server._load(1, i)
        server._load(1, i)
    some = keys.bitmap_from_indices(range(20), n)
    picks = Counter(server._choose(1, some) for _ in range(400))
    assert set(picks) == set(range(10, 20))
    assert min(picks.values()) > 10  # uniform among the ties (400 draws over 10: ~40 each)
    # after forgetting the version the counts start over
    server.forget_except([])
    assert server._choose(1, keys.bitmap_from_indices({3}, n)) == 3


def test_a_transfer_asks_the_rarest_chunks_first_and_leaves_the_rest_to_the_seed(
    tmp_path: Path,
) -> None:
    """The scheduler at 4,096 chunks: the free slots go to the chunks fewest peers hold, each
    asked of a holder with a free slot (2 per peer); chunks no such holder has go to the seed
    as one request for any of them; a full transfer asks nothing."""
    from swarm.fetcher import DownloadConfig, Flight, Transfer
    from swarm.holders import MemoryHolderDirectory
    from swarm.scoring import PeerScores

    n = 4096
    store = _seeded(tmp_path, n)
    manifest = store.manifest(1)
    assert manifest is not None
    receiver = ChunkStore(tmp_path / "receiver")
    receiver.put_manifest(*manifest)

    class Me:
        peer_id = "me"

    t = Transfer(
        manifest[1],
        transport=Me(),  # type: ignore[arg-type]
        store=receiver,
        directory=MemoryHolderDirectory(),
        seeds=["seed"],
        scores=PeerScores(),
        config=DownloadConfig(max_parallel=8),
        chunk_rpc="c",
        chunk_any_rpc="ca",
    )
    # a and b hold the common chunks 0..3999; c alone holds 4000..4009; 4010.. only the seed
    common = frozenset(range(4000))
    t.book.learn(1, "a", common, dialable=True)
    t.book.learn(1, "b", common, dialable=True)
    t.book.learn(1, "c", frozenset(range(4000, 4010)), dialable=True)
    asked: list[tuple[str, frozenset[int]]] = []
    t._request = lambda peer, wanted: (peer, wanted)  # type: ignore[assignment,method-assign,return-value]

    def launch(request: tuple[str, frozenset[int]], index: int, peer: str) -> None:
        asked.append(request)
        t.load[peer] += 1
        t.inflight[object()] = Flight(index, peer, 0.0)  # type: ignore[index]

    t._launch = launch  # type: ignore[assignment,method-assign]
    t._schedule()
    by_peer = Counter(peer for peer, _ in asked)
    assert len(asked) == 8 and by_peer == {"a": 2, "b": 2, "c": 2, "seed": 2}, asked
    # c's two are its own rare chunks; a's and b's come from the common ones
    assert all(w <= frozenset(range(4000, 4010)) for p, w in asked if p == "c")
    assert all(len(w) == 1 and w <= common for p, w in asked if p in "ab")
    # the seed is asked, twice (its 2 slots), for any chunk not asked of a peer: those no peer
    # holds, c's other 8, and the common ones (a and b have no free slot left)
    singles = {i for p, w in asked if p != "seed" for i in w}
    assert [w for p, w in asked if p == "seed"] == [frozenset(range(n)) - singles] * 2
    t._schedule()  # every slot taken: nothing more
    assert len(asked) == 8
