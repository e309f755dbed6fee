"""Measured reachability without sockets: the dial-back client and monitor on the in-memory
transport, and where the result shows (advert, ``swarm inspect`` rows)."""

from __future__ import annotations

from protocol.codec import decode, encode
from protocol.identity import Identity
from swarm.memtransport import InMemoryNetwork
from swarm.reachability import (
    DIALBACK_RPC,
    DialbackReply,
    DialbackRequest,
    ReachabilityMonitor,
    measure_reachability,
)
from swarm.shell.inspect import _advert_row
from swarm.testing import sample_advert


async def test_monitor_applies_the_measurement_and_keeps_it_when_the_server_is_away() -> None:
    net = InMemoryNetwork()
    node, coord = net.endpoint("node"), net.endpoint("coord")
    asked: list[list[str]] = []
    answer = ["private"]

    async def dialback(caller: str, request: bytes) -> bytes:
        asked.append(list(decode(request, DialbackRequest).maddrs))
        return encode(DialbackReply(reachability=answer[0], detail="test"))  # type: ignore[arg-type]

    await coord.register(DIALBACK_RPC, dialback)
    changes: list[str] = []

    async def maddrs() -> list[str]:
        return ["/ip4/192.168.1.2/tcp/4001/p2p/QmX", "/ip4/1.2.3.4/udp/1/quic"]

    monitor = ReachabilityMonitor(node, maddrs, lambda: "coord", on_change=changes.append)
    assert monitor.state == "unknown"
    assert await monitor.measure_once() == "private"
    assert asked == [["/ip4/192.168.1.2/tcp/4001"]]  # TCP only, /p2p/ suffix removed
    answer[0] = "public"
    assert await monitor.measure_once() == "public"
    assert changes == ["private", "public"] and monitor.measured.is_set()
    await coord.unregister(DIALBACK_RPC)  # an older coordinator, or one that is down
    assert await monitor.measure_once() == "public", "a failed re-measurement must not reset it"
    assert changes == ["private", "public"]


async def test_measure_reports_unknown_when_it_cannot_ask() -> None:
    net = InMemoryNetwork()
    node = net.endpoint("node")
    state, detail = await measure_reachability(node, [], "nobody", timeout=1.0)
    assert state == "unknown" and "unavailable" in detail
    garbage = net.endpoint("garbage")

    async def bad(caller: str, request: bytes) -> bytes:
        return b"\x81\xa4type\xa3Foo"

    await garbage.register(DIALBACK_RPC, bad)
    state, _ = await measure_reachability(node, [], "garbage", timeout=1.0)
    assert state == "unknown"


def test_inspect_prefers_the_coordinators_measurement_over_the_advert() -> None:
    advert = sample_advert()
    fp = Identity.generate().fingerprint
    assert _advert_row(fp, advert, {})["reachability"] == "unknown"
    measured = {"node_reachability": {fp: "private"}}
    assert _advert_row(fp, advert, measured)["reachability"] == "private"
    # "unknown" from the coordinator (not measured yet) does not hide what the node advertises
    public = type(advert)(**{**{f: getattr(advert, f) for f in advert.__struct_fields__},
                            "reachability": "public"})  # fmt: skip
    assert _advert_row(fp, public, {"node_reachability": {fp: "unknown"}})["reachability"] == (
        "public"
    )


def test_the_measurement_goes_into_the_advert() -> None:
    from node.config import NodeConfig
    from node.status import make_advert

    class Backend:
        name, dtype, loaded_version = "fake", "float32", None

    advert = make_advert(
        NodeConfig(), Identity.generate(), Backend(), None,  # type: ignore[arg-type]
        peer_id="QmX", tokens_per_s=None, now=0.0, reachability="private",
    )  # fmt: skip
    assert advert.reachability == "private"
    # announce_maddrs alone no longer claims "public": only a dial-back does
    cfg = NodeConfig(announce_maddrs=["/ip4/1.2.3.4/tcp/1"])
    guess = make_advert(cfg, Identity.generate(), Backend(), None, peer_id="QmX",  # type: ignore[arg-type]
                        tokens_per_s=None, now=0.0)  # fmt: skip
    assert guess.reachability == "unknown"
