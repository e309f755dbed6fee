"""Building blocks of ``test_malformed_inputs.py``: a raw libp2p client that can send any bytes on
any RPC stream (the real ``P2PTransport.call`` only sends well-framed requests), the classified
outcome of one exchange, and generators of malformed requests.

A generated input carries the reason code the receiver must answer with, computed by decoding the
same bytes locally with the receiving side's own types (``protocol.codec.decode``); inputs that
decode fine locally are dropped, so every input sent is malformed.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from coordinator.service import request_limits
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import signed_bytes
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    CapabilityAdvert,
    ChunkRequest,
    CpuInfo,
    FetchRollouts,
    GpuInfo,
    GroupResult,
    Heartbeat,
    LeaseRequest,
    Manifest,
    ManifestRequest,
    Message,
    PublishVersion,
    Register,
    Reject,
    ReleaseLease,
    RolloutSubmission,
    Sample,
    SignedEnvelope,
    StatusRequest,
    Timings,
    pack_logprobs,
    pack_tokens,
)
from swarm.broadcast import CHUNK_ANY_RPC, CHUNK_RPC, EXCHANGE_RPC, MANIFEST_RPC
from swarm.reachability import DIALBACK_RPC, DialbackReply, DialbackRequest
from swarm.transport import DEFAULT_MAX_REQUEST, decode_error
from swarm.wire import TABLE_OVERHEAD, ChunkAnyRequest, ExchangeReply, ExchangeRequest

HEADER = struct.Struct(">I")
ANSWER_LIMITS = Limits(control_frame=DEFAULT_LIMITS.chunk_frame + TABLE_OVERHEAD)
COORD_SIGNED = (rpc.REGISTER, rpc.HEARTBEAT, rpc.LEASE, rpc.SUBMIT, rpc.RELEASE)
TRAINER_SIGNED = (rpc.PUBLISH, rpc.FETCH)
COORD_METHODS = (*COORD_SIGNED, *TRAINER_SIGNED, rpc.STATUS)
CHUNK_METHODS = (MANIFEST_RPC, CHUNK_RPC, CHUNK_ANY_RPC, EXCHANGE_RPC, DIALBACK_RPC)
ALL_METHODS = (*COORD_METHODS, *CHUNK_METHODS)
PAYLOAD_TYPE: dict[str, type[msgspec.Struct]] = {
    rpc.REGISTER: Register,
    rpc.HEARTBEAT: Heartbeat,
    rpc.LEASE: LeaseRequest,
    rpc.SUBMIT: RolloutSubmission,
    rpc.RELEASE: ReleaseLease,
    rpc.PUBLISH: PublishVersion,
    rpc.FETCH: FetchRollouts,
    rpc.STATUS: StatusRequest,
    MANIFEST_RPC: ManifestRequest,
    CHUNK_RPC: ChunkRequest,
    CHUNK_ANY_RPC: ChunkAnyRequest,
    EXCHANGE_RPC: ExchangeRequest,
    DIALBACK_RPC: DialbackRequest,
}


def max_request(method: str) -> int:
    """The request size limit the serving side enforces for ``method``."""
    return request_limits().get(method, DEFAULT_MAX_REQUEST)


def frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


# --- one exchange on a raw stream --------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What the client saw: ``reject`` (a decoded Reject), ``error`` (the transport's error frame,
    ``code: detail``), ``answer`` (any other decoded message; code = its type) or ``closed``
    (the stream ended without an answer)."""

    kind: str
    code: str
    seconds: float
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}({self.code}) after {self.seconds:.2f}s {self.detail[:120]!r}"


async def exchange(
    p2p: Any,
    peer_id: str,
    method: str,
    wire: bytes,
    *,
    eof: bool = False,
    drip: tuple[int, float] | None = None,
    timeout: float = 30.0,
) -> Outcome:
    """Open a stream to ``method`` on ``peer_id``, write ``wire`` verbatim (``drip=(n, s)``: n
    bytes every s seconds), optionally half-close, and read one answer frame."""
    from hivemind.p2p import PeerID

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    _info, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), method), timeout
    )
    dripper: asyncio.Task[None] | None = None
    try:
        if drip is None:
            writer.write(wire)
            if eof:
                writer.write_eof()
        else:

            async def trickle() -> None:
                step, pause = drip
                for i in range(0, len(wire), step):
                    writer.write(wire[i : i + step])
                    await writer.drain()
                    await asyncio.sleep(pause)

            dripper = asyncio.create_task(trickle(), name="slow-loris")
        try:
            (size,) = HEADER.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))
            if not 1 <= size <= 128 << 20:
                return Outcome("bad-answer", f"size {size}", loop.time() - t0)
            body = await asyncio.wait_for(reader.readexactly(size), timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            return Outcome("closed", "", loop.time() - t0)
    finally:
        if dripper is not None:
            dripper.cancel()
            await asyncio.gather(dripper, return_exceptions=True)
        writer.close()
    seconds = loop.time() - t0
    if body[0] == 1:
        err = decode_error(body[1:])
        return Outcome("error", err.code, seconds, err.detail)
    try:
        # the protocol's messages, or the swarm-local answers of the exchange and dial-back
        msg = decode(body[1:], Message | ExchangeReply | DialbackReply, ANSWER_LIMITS)
    except ProtocolError as exc:
        return Outcome("bad-answer", exc.code.value, seconds, exc.detail)
    if isinstance(msg, Reject):
        return Outcome("reject", msg.code.value, seconds, msg.detail)
    return Outcome("answer", type(msg).__name__, seconds)


# --- inputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bad:
    """One malformed request: ``wire`` bytes for ``method``; ``code`` the reason code it must be
    refused with (None: any clean refusal). ``eof``: the client half-closes after writing."""

    category: str
    method: str
    wire: bytes
    code: str | None
    what: str
    eof: bool = False


def local_code(data: bytes, type_: Any) -> str | None:
    """The reason code ``decode(data, type_)`` fails with, None if it decodes."""
    try:
        decode(data, type_)
    except ProtocolError as exc:
        return exc.code.value
    return None


def sign_raw(identity: Identity, payload: bytes) -> bytes:
    """An encoded envelope with a valid signature over arbitrary ``payload`` bytes."""
    nonce, ts = os.urandom(16), time.time()
    sig = identity.sign(signed_bytes(identity.public_key, nonce, ts, payload))
    env = SignedEnvelope(
        signer=identity.public_key, nonce=nonce, ts=ts, payload=payload, signature=sig
    )
    return encode(env)


@dataclass
class Keys:
    node: Identity  # a registered node (its malformed payloads are authenticated; no strike)
    trainer: Identity  # the configured trainer key
    node_peer_id: str  # the libp2p peer the node registered from (the attacker's)
    manifest: Manifest  # the manifest of the published version 1


def templates(keys: Keys) -> dict[str, msgspec.Struct]:
    """A well-formed request per method, the starting point of every mutation."""
    now = time.time()
    sample = Sample(
        token_ids=pack_tokens([5, 6]),
        logprobs=pack_logprobs([-0.5, -1.5]),
        finish_reason="eos",
        seed=3,
    )
    advert = CapabilityAdvert(
        peer_id=keys.node_peer_id,
        node_key=keys.node.public_key,
        gpus=[GpuInfo(name="g", memory_bytes=1 << 30, compute_capability="8.0", count=1)],
        cpu=CpuInfo(cores=2, memory_bytes=1 << 30),
        backend="hf",
        dtype="float32",
        tokens_per_s=10.0,
        rollouts_per_s=1.0,
        price_per_hour=0.5,
        policy_version=None,
        reachability="unknown",
        software_version="t",
        expires_at=now + 600,
    )
    return {
        rpc.REGISTER: Register(advert=advert),
        rpc.HEARTBEAT: Heartbeat(
            peer_id=keys.node_peer_id,
            seq=1,
            policy_version=None,
            active_leases=["L1"],
            tokens_per_s=1.0,
        ),
        rpc.LEASE: LeaseRequest(peer_id=keys.node_peer_id, policy_version=1, max_prompts=1),
        rpc.SUBMIT: RolloutSubmission(
            lease_id="L1",
            epoch=1,
            policy_version=1,
            backend="hf",
            dtype="float32",
            groups=[GroupResult(prompt_id="p", samples=[sample])],
            timings=Timings(started_at=now, finished_at=now, generate_s=0.1),
        ),
        rpc.RELEASE: ReleaseLease(lease_id="L1", epoch=1, reason="r"),
        rpc.PUBLISH: PublishVersion(manifest=encode(keys.manifest), source="s"),
        rpc.FETCH: FetchRollouts(
            after_seq=0,
            max_rollouts=1,
            min_policy_version=None,
            wait_s=0.0,
            trainer_stats={"a": 1, "b": [1.5], "c": {"d": "e"}},
        ),
        rpc.STATUS: StatusRequest(verbose=False),
        MANIFEST_RPC: ManifestRequest(version=1),
        CHUNK_RPC: ChunkRequest(version=1, index=0),
        CHUNK_ANY_RPC: ChunkAnyRequest(version=1, wanted=b"\x01"),
        EXCHANGE_RPC: ExchangeRequest(version=1, wanted=b"\x01", have=b"", dialable=True),
        DIALBACK_RPC: DialbackRequest(maddrs=["/ip4/127.0.0.1/tcp/9"]),
    }


def signer_for(method: str, keys: Keys) -> Identity | None:
    if method in COORD_SIGNED:
        return keys.node
    if method in TRAINER_SIGNED:
        return keys.trainer
    return None


# Deep nesting: a placeholder string swapped for raw msgpack bytes after encoding.
DEEP = "\x00deep-nesting-goes-here\x00"
DEEP_ARRAY = b"\x91" * 50_000 + b"\xc0"  # [[[[...nil...]]]], 50 000 levels
DEEP_MAP = b"\x81\xa1k" * 30_000 + b"\xc0"  # {"k": {"k": ...}}, 30 000 levels

# Wrong-typed values tried in every field position (NaN/inf are a category of their own).
WRONG_TYPES: list[Any] = [
    None,
    True,
    -1,
    2**64 - 1,
    -(2**63),
    0.5,
    "x",
    "é" * 5000,
    b"\x00\x01\x02",
    [],
    [None],
    {},
    {"k": 1},
    {1: 2},
]
NON_FINITE: list[float] = [float("nan"), float("inf"), float("-inf")]


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field position of a message tree (first element of each list)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list) and obj:
        yield (*prefix, 0)
        yield from paths(obj[0], (*prefix, 0))


def replaced(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    tree = msgspec.msgpack.decode(msgspec.msgpack.encode(tree))  # deep copy
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def float_paths(tree: Any) -> list[tuple[Any, ...]]:
    out = []
    for p in paths(tree):
        node = tree
        for key in p:
            node = node[key]
        if isinstance(node, float):
            out.append(p)
    return out


def to_bytes(tree: Any) -> bytes:
    raw = msgspec.msgpack.encode(tree)
    marker = msgspec.msgpack.encode(DEEP)
    return raw.replace(marker, DEEP_ARRAY)


class Generator:
    """Malformed inputs per category for every method; payloads of signed methods are wrapped in
    an envelope with a valid signature (the node's or the trainer's key)."""

    def __init__(self, keys: Keys, seed: int = 8) -> None:
        self.keys = keys
        self.rng = random.Random(seed)

    def wrap(self, method: str, payload: bytes) -> bytes:
        signer = signer_for(method, self.keys)
        return payload if signer is None else sign_raw(signer, payload)

    def _expect(self, method: str, payload: bytes) -> str | None:
        """Reason code for a payload sent (signed if need be) to ``method``."""
        return local_code(payload, PAYLOAD_TYPE[method])

    def _bad(self, category: str, method: str, payload: bytes, what: str) -> Bad | None:
        code = self._expect(method, payload)
        if code is None:
            return None  # decodes: not malformed
        return Bad(category, method, frame(self.wrap(method, payload)), code, what)

    def _keep(self, items: Iterator[Bad | None]) -> list[Bad]:
        return [b for b in items if b is not None]

    # -- categories ----------------------------------------------------------------------------
    def wrong_types(self) -> list[Bad]:
        """Each field position of each request (and of the envelope) with each wrong type."""

        def gen() -> Iterator[Bad | None]:
            for method, msg in templates(self.keys).items():
                tree = tree_of(msg)
                for p in paths(tree):
                    for value in WRONG_TYPES:
                        what = f"{'.'.join(map(str, p))}={value!r:.20}"
                        yield self._bad(
                            "wrong_type", method, to_bytes(replaced(tree, p, value)), what
                        )
                if method in COORD_SIGNED or method in TRAINER_SIGNED:
                    yield from self._envelope_fields(method, msg)
            yield from self._inner_manifest()

        return self._keep(gen())

    def _envelope_fields(self, method: str, msg: msgspec.Struct) -> Iterator[Bad | None]:
        """Wrong types in the envelope itself (the signature cannot cover those)."""
        signer = signer_for(method, self.keys)
        assert signer is not None
        env = msgspec.msgpack.decode(sign_raw(signer, encode(msg)))
        for key in env:
            for value in WRONG_TYPES:
                wire = to_bytes(replaced(env, (key,), value))
                code = local_code(wire, SignedEnvelope)
                if code is not None:
                    yield Bad(
                        "wrong_type", method, frame(wire), code, f"envelope.{key}={value!r:.20}"
                    )

    def _inner_manifest(self) -> Iterator[Bad | None]:
        """Wrong types inside the manifest a PublishVersion carries (decoded second)."""
        tree = tree_of(self.keys.manifest)
        for p in paths(tree):
            for value in WRONG_TYPES[:8]:
                inner = to_bytes(replaced(tree, p, value))
                code = local_code(inner, Manifest)
                if code is None:
                    continue
                payload = encode(PublishVersion(manifest=inner, source="s"))
                wire = frame(sign_raw(self.keys.trainer, payload))
                yield Bad("wrong_type", rpc.PUBLISH, wire, code, f"manifest.{p}={value!r:.20}")

    def non_finite(self) -> list[Bad]:
        """NaN and +-inf in every float position, and NaN/inf packed float32 log-probs."""

        def gen() -> Iterator[Bad | None]:
            for method, msg in templates(self.keys).items():
                tree = tree_of(msg)
                for p in float_paths(tree):
                    for value in NON_FINITE:
                        what = f"{'.'.join(map(str, p))}={value}"
                        yield self._bad("nan_inf", method, to_bytes(replaced(tree, p, value)), what)
            sub = templates(self.keys)[rpc.SUBMIT]
            assert isinstance(sub, RolloutSubmission)
            for value in NON_FINITE:
                tree = tree_of(sub)
                tree["groups"][0]["samples"][0]["logprobs"] = struct.pack("<2f", -0.5, value)
                yield self._bad("nan_inf", rpc.SUBMIT, to_bytes(tree), f"packed logprob {value}")

        return self._keep(gen())

    def unknown_fields(self) -> list[Bad]:
        """An extra key in every map (message, nested structs, envelope)."""

        def gen() -> Iterator[Bad | None]:
            for method, msg in templates(self.keys).items():
                tree = tree_of(msg)
                maps = [()] + [p for p in paths(tree) if isinstance(_at(tree, p), dict)]
                for p in maps:
                    if p[:1] == ("trainer_stats",):
                        continue  # a free-form map: extra keys are legal there
                    t = msgspec.msgpack.decode(msgspec.msgpack.encode(tree))
                    _at(t, p)["zz_unknown"] = 1
                    yield self._bad("unknown_field", method, to_bytes(t), f"{p}+zz_unknown")
                signer = signer_for(method, self.keys)
                if signer is not None:
                    env = msgspec.msgpack.decode(sign_raw(signer, encode(msg)))
                    env["zz_unknown"] = 1
                    wire = msgspec.msgpack.encode(env)
                    yield Bad("unknown_field", method, frame(wire), "unknown_field", "envelope+zz")

        return self._keep(gen())

    def deep_nesting(self) -> list[Bad]:
        """Arrays and maps nested tens of thousands deep: whole frame, in a field, as payload."""

        def gen() -> Iterator[Bad | None]:
            limit_deep = b"\x91" * (DEFAULT_MAX_REQUEST - 4096) + b"\xc0"  # ~1 M levels
            for method, msg in templates(self.keys).items():
                for name, blob in (("array", DEEP_ARRAY), ("map", DEEP_MAP)):
                    code = local_code(
                        blob,
                        SignedEnvelope if signer_for(method, self.keys) else PAYLOAD_TYPE[method],
                    )
                    yield Bad("deep", method, frame(blob), code, f"whole frame deep {name}")
                yield self._bad("deep", method, limit_deep, "signed payload ~1M levels")
                tree = tree_of(msg)
                for key in tree:
                    yield self._bad("deep", method, to_bytes(replaced(tree, (key,), DEEP)), key)

        return self._keep(gen())

    def truncated(self) -> list[Bad]:
        """Valid requests cut short: inside a consistent frame (-> malformed), and frames whose
        header promises more than is sent before the client half-closes (-> stream closed)."""

        def gen() -> Iterator[Bad | None]:
            for method, msg in templates(self.keys).items():
                payload = encode(msg)
                for cut in sorted({1, 2, len(payload) // 2, len(payload) - 1}):
                    yield self._bad("truncated", method, payload[:cut], f"payload[:{cut}]")
                wire = frame(self.wrap(method, payload))
                for cut in (2, 4, len(wire) // 2, len(wire) - 1):
                    yield Bad("truncated", method, wire[:cut], None, f"frame[:{cut}]+EOF", eof=True)

        return self._keep(gen())

    def random_bytes(self, per_method: int = 30) -> list[Bad]:
        """Seeded random payloads (msgpack-ish and uniform), plus byte flips of valid requests."""

        def gen() -> Iterator[Bad | None]:
            for method, msg in templates(self.keys).items():
                for i in range(per_method):
                    n = self.rng.choice((0, 1, 3, 17, 200, 4000))
                    payload = self.rng.randbytes(n)
                    if i % 2:  # start like a message map so the decoder gets further
                        payload = b"\x82\xa4type" + payload
                    yield self._bad("random", method, payload, f"random {n} B")
                valid = encode(msg)
                for _ in range(per_method // 3):
                    pos = self.rng.randrange(len(valid))
                    flipped = valid[:pos] + bytes([valid[pos] ^ (1 << self.rng.randrange(8))])
                    yield self._bad("random", method, flipped + valid[pos + 1 :], f"flip @{pos}")

        return self._keep(gen())

    def oversized(self) -> list[Bad]:
        """Frames announcing more than the method's limit (with and without a body), frames at
        the limit full of garbage (buffered, then refused), and a signed payload above its type's
        frame limit inside an envelope that fits."""

        def gen() -> Iterator[Bad | None]:
            for method in ALL_METHODS:
                limit = max_request(method)
                yield Bad(
                    "oversized",
                    method,
                    HEADER.pack(0xFFFF_FFFF),
                    "frame_too_large",
                    "header 4 GiB, no body",
                )
                yield Bad(
                    "oversized",
                    method,
                    HEADER.pack(limit + 1),
                    "frame_too_large",
                    f"header {limit + 1} B, no body",
                )
            for method in (rpc.SUBMIT, rpc.PUBLISH, rpc.HEARTBEAT, MANIFEST_RPC):
                limit = max_request(method)
                body = b"\xc1" * (limit + 1)  # 0xc1 is never valid MessagePack
                yield Bad(
                    "oversized", method, frame(body), "frame_too_large", f"{limit + 1} B sent"
                )
                body = b"\xc1" * limit  # buffered in full by the transport, refused by decode
                code = local_code(
                    body, SignedEnvelope if signer_for(method, self.keys) else PAYLOAD_TYPE[method]
                )
                yield Bad("oversized", method, frame(body), code, f"{limit} B of garbage")
            for method in (rpc.SUBMIT, rpc.PUBLISH):
                type_ = PAYLOAD_TYPE[method]
                from protocol.limits import DEFAULT_LIMITS

                payload = b"\xc1" * (DEFAULT_LIMITS.max_frame(type_) + 1)
                wire = sign_raw(signer_for(method, self.keys) or self.keys.node, payload)
                assert len(wire) <= max_request(method)
                yield Bad("oversized", method, frame(wire), "frame_too_large", "signed payload")

        return self._keep(gen())

    def signed_garbage(self) -> list[Bad]:
        """Valid signatures over payloads that are not the method's message: another message
        type, empty bytes, random bytes, a message of the wrong protocol version."""

        def gen() -> Iterator[Bad | None]:
            msgs = templates(self.keys)
            for method in (*COORD_SIGNED, *TRAINER_SIGNED):
                others = [m for k, m in msgs.items() if k != method]
                for other in others:
                    yield self._bad("signed_garbage", method, encode(other), type(other).__name__)
                yield self._bad("signed_garbage", method, b"", "empty payload")
                yield self._bad("signed_garbage", method, self.rng.randbytes(64), "random 64 B")
                future = tree_of(msgs[method])
                future["protocol_version"] = 99
                yield self._bad("signed_garbage", method, to_bytes(future), "protocol_version 99")
                # A valid payload signed by one key, presented by another (signature mismatch).
                wire = msgspec.msgpack.decode(sign_raw(Identity.generate(), encode(msgs[method])))
                wire["signer"] = (signer_for(method, self.keys) or self.keys.node).public_key
                yield Bad(
                    "signed_garbage",
                    method,
                    frame(msgspec.msgpack.encode(wire)),
                    "bad_signature",
                    "signature by another key",
                )

        return self._keep(gen())

    def all(self) -> dict[str, list[Bad]]:
        return {
            "wrong_type": self.wrong_types(),
            "nan_inf": self.non_finite(),
            "unknown_field": self.unknown_fields(),
            "deep": self.deep_nesting(),
            "truncated": self.truncated(),
            "random": self.random_bytes(),
            "signed_garbage": self.signed_garbage(),
            "oversized": self.oversized(),
        }


def tree_of(msg: msgspec.Struct) -> Any:
    """A message as plain dicts/lists/bytes (what MessagePack carries), to mutate."""
    return msgspec.msgpack.decode(encode(msg))


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def expectation_problem(bad: Bad, got: Outcome) -> str | None:
    """Why ``got`` is not a clean refusal of ``bad`` (None if it is one).

    Clean: a coordinator method answers a well-framed request with a decoded ``Reject`` carrying
    the expected code; oversized frames are refused by the transport before the handler runs
    (error frame ``frame_too_large``); chunk methods answer with an error frame and the code;
    a request cut short by the client's half-close ends with the stream closed.
    """
    if bad.eof:
        return None if got.kind == "closed" else f"expected the stream closed, got {got}"
    if bad.code == "frame_too_large" and got.kind == "error" and got.code == bad.code:
        return None  # refused by the transport on the length prefix
    want_kind = "reject" if bad.method in COORD_METHODS else "error"
    if got.kind != want_kind:
        return f"expected {want_kind}({bad.code}), got {got}"
    if got.code == "internal":
        return f"internal error: {got}"
    if bad.code is not None and got.code != bad.code:
        return f"expected code {bad.code}, got {got}"
    return None
