"""swarm.direct without sockets: the ticket messages against docs/protocol.md's vectors, the
address a direct connection dials, and the reader's settle pause."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from protocol.codec import decode, encode
from protocol.errors import DecodeError
from swarm.bulkwindow import ACK, read_acked
from swarm.direct import DirectTicket, DirectTicketRequest, dial_host

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def vector(name: str) -> bytes:
    """The hex after ``<name> =`` in docs/protocol.md's direct-connection section."""
    text = PROTOCOL_MD.read_text()
    m = re.search(re.escape(name) + r" =\n((?:[0-9a-f]+\n)+)", text)
    assert m, f"no vector {name} in docs/protocol.md"
    return bytes.fromhex(m.group(1).replace("\n", ""))


def test_ticket_messages_match_the_vectors_in_protocol_md() -> None:
    request = DirectTicketRequest()
    assert encode(request) == vector("DirectTicketRequest()")
    ticket = DirectTicket(port=40123, ticket=bytes(range(16)), ttl_s=600)
    assert encode(ticket) == vector("DirectTicket(port=40123, ticket=000102…0f, ttl_s=600)")
    assert decode(vector("DirectTicketRequest()"), DirectTicketRequest) == request


@pytest.mark.parametrize("bad", [{"port": 0}, {"port": 65536}, {"ticket": bytes(15)},
                                 {"ticket": bytes(17)}])  # fmt: skip
def test_a_ticket_out_of_bounds_is_refused(bad: dict[str, object]) -> None:
    import msgspec

    fields: dict[str, object] = {"port": 40123, "ticket": bytes(16), "ttl_s": 600} | bad
    raw = msgspec.msgpack.encode({"type": "DirectTicket", "protocol_version": 1, **fields})
    with pytest.raises(DecodeError):
        decode(raw, DirectTicket)


@pytest.mark.parametrize(
    ("maddr", "host"),
    [
        ("/ip4/10.1.2.3/tcp/4001", "10.1.2.3"),
        ("/ip4/10.1.2.3/tcp/4001/p2p/QmPeer", "10.1.2.3"),
        ("/ip6/::1/tcp/4001", "::1"),
        ("/ip4/10.1.2.3/udp/4001/quic", None),  # not TCP
        ("/dns4/example.org/tcp/4001", None),  # not an address
        ("/ip4/10.1.2.3/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmPeer", None),  # relayed
        ("/ip4/999.1.2.3/tcp/4001", None),
        ("", None),
    ],
)
def test_a_direct_connection_dials_only_a_plain_ip_address(maddr: str, host: str | None) -> None:
    assert dial_host(maddr) == host


class _Writer:
    def __init__(self) -> None:
        self.acks: list[int] = []

    def write(self, data: bytes) -> None:
        self.acks.append(ACK.unpack(data)[0])


async def _trickle(reader: asyncio.StreamReader, data: bytes, piece: int, gap: float) -> None:
    for i in range(0, len(data), piece):
        reader.feed_data(data[i : i + piece])
        await asyncio.sleep(gap)


@pytest.mark.parametrize("settle", [0.0, 0.02])
async def test_a_settling_reader_acknowledges_a_trickle_in_fewer_reads(settle: float) -> None:
    """Bytes arriving a segment at a time: without the pause every segment is a read and an
    acknowledgement; with it the segments that arrive meanwhile are read together."""
    data = bytes(range(256)) * 64  # 16 KiB in 64 pieces of 256 B, one every 2 ms
    reader, writer = asyncio.StreamReader(), _Writer()
    feeder = asyncio.create_task(_trickle(reader, data, 256, 0.002))
    loop = asyncio.get_running_loop()
    got = await read_acked(reader, writer, len(data), stall_timeout=5.0,  # type: ignore[arg-type]
                           deadline=loop.time() + 10.0, settle=settle)  # fmt: skip
    await feeder
    assert got == data and writer.acks[-1] == len(data)
    assert writer.acks == sorted(writer.acks)
    if settle:
        assert len(writer.acks) <= 16  # ~10 pieces per 20 ms pause
    else:
        assert len(writer.acks) >= 48  # about one per piece
