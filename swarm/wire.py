"""Swarm-local wire messages (not part of the coordinator protocol; same codec and limits).

``ChunkAnyRequest`` is the "super-seeding" request a receiver sends to a seed: *give me any one
of these chunks*. The seed answers with a ``protocol.messages.Chunk`` for the wanted chunk it has
sent least often, so receivers that ask at the same time get different chunks.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from protocol.schema import U64, MessageBase

MAX_BITMAP_BYTES = (1 << 20) // 8  # bitmaps of up to 2**20 chunks (Manifest schema maximum)


class ChunkAnyRequest(MessageBase):
    """Ask a seed for any one chunk of ``version`` whose bit is set in ``wanted``."""

    version: U64  # checkpoint version
    wanted: Annotated[bytes, Meta(max_length=MAX_BITMAP_BYTES)]  # bit i (byte i//8) = chunk i
