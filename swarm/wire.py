"""Swarm-local wire messages (not part of the coordinator protocol; same codec and limits).

``ChunkAnyRequest`` is the "super-seeding" request a receiver sends to a seed: *give me any one
of these chunks*. The seed answers with a ``protocol.messages.Chunk`` for the wanted chunk it has
sent least often, so receivers that ask at the same time get different chunks.

``ExchangeRequest`` / ``ExchangeReply`` (``/rollout-swarm/exchange/1``) generalise both chunk
requests and carry holder information both ways: the asker's verified chunks go up with every
request, the holder's table of who holds what comes back with every chunk.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from protocol.schema import U32, U64, Blob, Id, MessageBase, WireStruct

MAX_BITMAP_BYTES = (1 << 20) // 8  # bitmaps of up to 2**20 chunks (Manifest schema maximum)


class ChunkAnyRequest(MessageBase):
    """Ask a seed for any one chunk of ``version`` whose bit is set in ``wanted``."""

    version: U64  # checkpoint version
    wanted: Annotated[bytes, Meta(max_length=MAX_BITMAP_BYTES)]  # bit i (byte i//8) = chunk i


MAX_TABLE_ENTRIES = 32  # holder entries in one ExchangeReply
MAX_TABLE_BYTES = 64 * 1024  # ... and at most this many bitmap bytes in all
TABLE_OVERHEAD = MAX_TABLE_BYTES + MAX_TABLE_ENTRIES * 128 + 256  # reply bytes beyond the chunk


class ExchangeRequest(MessageBase):
    """Ask a holder for one chunk of ``version`` and tell it what the asker holds.

    The holder answers with the wanted chunk it has sent least often (so one set bit asks for a
    specific chunk, several let a seed choose), plus its table of who holds what: holder
    information travels with the chunks instead of only through the DHT, where it queues behind
    bulk data on a busy link."""

    version: U64  # checkpoint version
    wanted: Annotated[bytes, Meta(max_length=MAX_BITMAP_BYTES)]  # bit i (byte i//8) = chunk i
    have: Annotated[bytes, Meta(max_length=MAX_BITMAP_BYTES)]  # the asker's verified chunks
    dialable: bool  # the asker accepts new connections (measured); False: download-only


class HolderEntry(WireStruct):
    """One peer's verified chunks of a version, as that peer itself reported them."""

    peer_id: Id  # libp2p peer ID (base58)
    have: Annotated[bytes, Meta(max_length=MAX_BITMAP_BYTES)]  # bit i = chunk i verified
    dialable: bool  # False: reachable only over a connection it opened (not to be shared)


class ExchangeReply(MessageBase):
    """A chunk plus the answering holder's view of the other holders of its version."""

    version: U64  # checkpoint version
    index: U32  # chunk index
    data: Blob  # chunk bytes (len == ChunkInfo.size); verified by the receiver
    holders: Annotated[list[HolderEntry], Meta(max_length=MAX_TABLE_ENTRIES)]  # incl. the answerer
