"""Per-node figures of the ``/status`` document beyond state and throughput: what the dashboard's
node table shows.

Every field is a flat map ``{node fingerprint: value}`` (the shape of the other ``node_*`` maps,
so it fits :func:`coordinator.status.wire_status`). Strings that come from a node's advert
(``node_hardware`` with its GPU names, ``node_software``) are the node's own words, unescaped:
whoever renders them must treat them as text (the dashboard sets ``textContent``).

| key | value |
|---|---|
| ``node_peer_id`` | libp2p peer id from the registration advert |
| ``node_hardware`` | ``2× NVIDIA H100 ... (80 GiB)`` or ``CPU 8 cores, 31 GiB`` |
| ``node_backend`` | ``hf/float32``, ``vllm/bfloat16`` |
| ``node_price_per_hour`` | asking price in USD per hour; None = free / unpriced |
| ``node_rollouts_per_s`` | measured completed samples per second (advert, then leases) |
| ``node_software`` | the node's rollout-swarm version string |
| ``node_versions_held`` | versions it holds in full (DHT holder census), ascending |
| ``node_strikes`` | strikes ever recorded (failed verification checks that are its fault) |
| ``node_suspect`` | a suspect now: its work is re-checked in full (operator only) |
| ``node_last_error`` | the latest strike, ``reason: detail``; None = never struck |
| ``node_last_error_age_s`` | seconds since that strike |
| ``node_ban_reason`` | why it is banned, while a ban is in force; else None |
| ``node_banned_for_s`` | seconds of ban left, while in force; else None |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from coordinator.store import NodeRecord, Store
from protocol.codec import decode
from protocol.errors import ProtocolError
from protocol.messages import CapabilityAdvert
from swarm.display import describe_hardware

__all__ = ["NODE_FIELDS", "OPERATOR_ONLY_FIELDS", "advert_of", "node_details"]

#: Keys of the status document that say how closely each node is watched: its check rate, trust
#: level and clean-check count, whether it is under full checks, whether the reward audit flagged
#: it. A node that could read them would forge while its rate sits at the floor and learn from
#: ``node_clean_checks`` rising which of its leases were checked (issue 34, finding 4). They are
#: on the operator's ``/status`` (HTTP, bound to localhost by default) only, never in the unsigned
#: ``rswarm/status`` answer any peer can call (:func:`coordinator.status.wire_status`).
OPERATOR_ONLY_FIELDS = frozenset(
    {"node_check_rate", "node_trust", "node_clean_checks", "node_suspect", "nodes_flagged"}
)

NODE_FIELDS = (
    "node_peer_id",
    "node_hardware",
    "node_backend",
    "node_price_per_hour",
    "node_rollouts_per_s",
    "node_software",
    "node_versions_held",
    "node_strikes",
    "node_suspect",
    "node_last_error",
    "node_last_error_age_s",
    "node_ban_reason",
    "node_banned_for_s",
)


def advert_of(raw: bytes | None) -> CapabilityAdvert | None:
    """The stored registration advert, or None when absent or unreadable (an older schema)."""
    if raw is None:
        return None
    try:
        advert = decode(raw, CapabilityAdvert)
    except ProtocolError:
        return None
    return advert


def node_details(
    store: Store,
    nodes: Iterable[NodeRecord],
    versions_by_peer: Mapping[str, list[int]],
    now: float,
    suspects: frozenset[bytes] | None = None,
) -> dict[str, dict[str, Any]]:
    """The maps of :data:`NODE_FIELDS` for ``nodes`` (the registered nodes, already read by the
    caller: the status document reads them once) with two queries for the whole swarm;
    ``suspects``: the node keys checked in full now (:mod:`coordinator.trust`)."""
    out: dict[str, dict[str, Any]] = {key: {} for key in NODE_FIELDS}
    strikes = store.strike_summaries()
    bans = store.bans()
    for node in nodes:
        fp = node.fingerprint
        advert = advert_of(node.advert)
        peer_id = advert.peer_id if advert is not None else None
        out["node_peer_id"][fp] = peer_id
        out["node_hardware"][fp] = describe_hardware(advert) if advert is not None else None
        out["node_backend"][fp] = f"{node.backend}/{node.dtype}" if node.backend else None
        out["node_price_per_hour"][fp] = node.price_per_hour
        out["node_rollouts_per_s"][fp] = node.rollouts_per_s
        out["node_software"][fp] = advert.software_version if advert is not None else None
        out["node_versions_held"][fp] = list(versions_by_peer.get(peer_id or "", []))
        strike = strikes.get(node.node_key)
        ban = bans.get(node.node_key)
        in_force = ban is not None and ban[1] > now
        out["node_strikes"][fp] = strike[0] if strike else 0
        out["node_suspect"][fp] = (
            node.node_key in suspects
            if suspects is not None
            else strike is not None or ban is not None
        )
        out["node_last_error"][fp] = f"{strike[1]}: {strike[2]}" if strike else None
        out["node_last_error_age_s"][fp] = round(now - strike[3], 1) if strike else None
        out["node_ban_reason"][fp] = ban[2] if ban is not None and in_force else None
        out["node_banned_for_s"][fp] = round(ban[1] - now, 1) if ban and in_force else None
    return out
