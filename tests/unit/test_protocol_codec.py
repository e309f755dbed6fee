"""Codec and framing: limits before allocation, timeouts, fuzzing (only ProtocolError escapes)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode, frame, read_frame, write_frame
from protocol.errors import DecodeError, ProtocolError, ReasonCode, TransportError
from protocol.examples import example_messages
from protocol.limits import MIB, Limits
from protocol.messages import Chunk, Heartbeat, Message, RolloutSubmission, SignedEnvelope

VALID = [encode(m) for m in example_messages()]


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_frame_layout() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"


async def test_read_frame_round_trip() -> None:
    data = VALID[3]
    reader = _reader(frame(data) + frame(b"\x80"))
    assert await read_frame(reader, max_bytes=1 * MIB, timeout=1.0) == data
    assert await read_frame(reader, max_bytes=1 * MIB, timeout=1.0) == b"\x80"
    with pytest.raises(TransportError) as info:
        await read_frame(reader, max_bytes=1 * MIB, timeout=1.0)
    assert info.value.code is ReasonCode.CLOSED
    assert "frame boundary" in info.value.detail


async def test_oversized_length_prefix_rejected_before_body_is_read() -> None:
    # Only the header is available and the stream stays open: a reader that tried to buffer the
    # body would hang until the timeout instead of failing at once.
    reader = _reader(struct.pack(">I", 2**31), eof=False)
    with pytest.raises(DecodeError) as info:
        await read_frame(reader, max_bytes=1 * MIB, timeout=5.0)
    assert info.value.code is ReasonCode.FRAME_TOO_LARGE
    assert "2147483648" in str(info.value)


async def test_read_frame_times_out_on_a_stalled_peer() -> None:
    reader = _reader(struct.pack(">I", 10) + b"abc", eof=False)
    with pytest.raises(TransportError) as info:
        await read_frame(reader, max_bytes=100, timeout=0.05)
    assert info.value.code is ReasonCode.TIMEOUT


async def test_truncated_frame_and_empty_frame() -> None:
    with pytest.raises(TransportError) as info:
        await read_frame(_reader(struct.pack(">I", 10) + b"abc"), max_bytes=100, timeout=1.0)
    assert info.value.code is ReasonCode.CLOSED and "mid-frame" in info.value.detail
    with pytest.raises(DecodeError) as info2:
        await read_frame(_reader(struct.pack(">I", 0)), max_bytes=100, timeout=1.0)
    assert info2.value.code is ReasonCode.MALFORMED


async def test_write_frame_over_a_real_stream() -> None:
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await read_frame(reader, max_bytes=1 * MIB, timeout=2.0))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await write_frame(writer, VALID[1], timeout=2.0)
        writer.close()
        await writer.wait_closed()
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.01)
    assert received == [VALID[1]]


def test_per_type_frame_limits() -> None:
    limits = Limits(control_frame=1000, bulk_frame=5000, chunk_size=8000, chunk_overhead=100)
    assert limits.max_frame(Heartbeat) == 1000
    assert limits.max_frame(RolloutSubmission) == 5000
    assert limits.max_frame(SignedEnvelope) == 5000
    assert limits.max_frame(Chunk) == 8100
    assert limits.max_frame(Message) == 8100
    big = encode(Chunk(version=1, index=0, data=b"x" * 8200))
    with pytest.raises(DecodeError) as info:
        decode(big, Chunk, limits)
    assert info.value.code is ReasonCode.FRAME_TOO_LARGE
    ok = encode(Chunk(version=1, index=0, data=b"x" * 8000))
    assert decode(ok, Chunk, limits).data == b"x" * 8000
    hb = next(m for m in example_messages() if isinstance(m, Heartbeat))
    padded = encode(msgspec.structs.replace(hb, peer_id="p" * 128))
    with pytest.raises(DecodeError):
        decode(padded, Heartbeat, Limits(control_frame=len(padded) - 1))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x91" * 100_000,  # deeply nested arrays
        b"\x81" * 100_000,  # deeply nested maps
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion entries
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\x81\xa4type\xa8Chunk\xff",
        b"\x82\xa4type\xa5Chunk\xa4data\xc4\x05ab",  # truncated bytes
        b"\x81\xa4type\xd4\x01\x00",  # ext type
        b"\x81\xa4type\xa2\xff\xfe",  # invalid utf-8
    ],
)
def test_hostile_inputs_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def _decode_any(data: bytes, type_: Any = Message) -> Any:
    """Decode hostile bytes: either a ProtocolError (the only acceptable failure) or a message
    that survives its own round trip (so nothing half-validated gets through). Returns the
    message, or None when it was refused."""
    try:
        msg = decode(data, type_)
    except ProtocolError:
        return None
    assert decode(encode(msg), type(msg)) == msg
    return msg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    msg = _decode_any(data)
    assert msg is None or isinstance(msg, Message.__args__)  # type: ignore[attr-defined]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, 10**6),
    st.binary(max_size=16),
)
def test_fuzz_mutated_valid_frames(
    base: bytes, edits: list[tuple[int, int]], cut: int, tail: bytes
) -> None:
    data = bytearray(base)
    for pos, value in edits:
        data[pos % len(data)] = value
    mutated = bytes(data[: max(1, cut % (len(data) + 1))]) + tail
    msg = _decode_any(mutated)
    assert msg is None or isinstance(msg, Message.__args__)  # type: ignore[attr-defined]
    env = _decode_any(mutated, SignedEnvelope)
    assert env is None or isinstance(env, SignedEnvelope)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=30,
    ),
    st.sampled_from([m.__name__ for m in Message.__args__]),  # type: ignore[attr-defined]
)
def test_fuzz_structured_garbage_under_a_valid_tag(body: Any, tag: str) -> None:
    obj = {"type": tag, "protocol_version": 1, "x": body}
    assert _decode_any(msgspec.msgpack.encode(obj)) is None  # "x" is an unknown field everywhere
    if isinstance(body, dict):
        msg = _decode_any(msgspec.msgpack.encode({**body, "type": tag}))
        assert msg is None or type(msg).__name__ == tag
