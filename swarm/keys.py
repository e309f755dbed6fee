"""The DHT key schema of rollout-swarm (documented in docs/swarm.md).

All keys live under the ``rollout-swarm/v1/`` prefix so a swarm can share a DHT with other
hivemind applications and a schema change can bump the prefix. Each entry names the key, the
subkey and the value stored there.

=========================  ============================  ==========================================
key                        subkey                        value
=========================  ============================  ==========================================
``ADVERTS``                node key fingerprint          encoded ``SignedEnvelope`` of a
                                                         ``CapabilityAdvert`` signed by that node
``POLICY_VERSION``         coordinator fingerprint       encoded ``SignedEnvelope`` of a
                                                         ``PolicyVersionRecord`` (swarm.records)
                                                         signed by the coordinator
``holders_key(v)``         libp2p peer id (base58)       bitmap (bytes, bit i = chunk i verified)
``COORDINATOR``            coordinator fingerprint       encoded ``SignedEnvelope`` of a
                                                         ``CoordinatorAddress`` (swarm.records)
=========================  ============================  ==========================================

Signed keys (``ADVERTS``, ``POLICY_VERSION``, ``COORDINATOR``) are checked by
:func:`swarm.records.signed_record_validator` on every honest peer: the subkey must equal the
fingerprint of the envelope's signer, so nobody can overwrite another node's record.
"""

from __future__ import annotations

PREFIX = "rollout-swarm/v1"

ADVERTS = f"{PREFIX}/adverts"
"""Capability adverts, one subkey per node; expire ~2 announce periods after the last refresh."""

POLICY_VERSION = f"{PREFIX}/policy-version"
"""The newest published policy version, one subkey per coordinator key."""

COORDINATOR = f"{PREFIX}/coordinator"
"""Where to reach the coordinator: libp2p peer id and multiaddrs, signed by its key."""

SIGNED_KEYS = (ADVERTS, POLICY_VERSION, COORDINATOR)
"""Keys whose subkeys must be the signer's fingerprint (enforced by the record validator)."""


def holders_key(version: int) -> str:
    """Key of the chunk-holder bitmaps of checkpoint ``version`` (subkey = holder's peer id)."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"{PREFIX}/holders/{version}"


def bitmap_from_indices(indices: set[int] | frozenset[int], n_chunks: int) -> bytes:
    """Pack chunk indices into a bitmap of ``ceil(n_chunks / 8)`` bytes (bit i of byte i//8)."""
    out = bytearray((n_chunks + 7) // 8)
    for i in indices:
        if not 0 <= i < n_chunks:
            raise ValueError(f"chunk index {i} out of range [0, {n_chunks})")
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def indices_from_bitmap(bitmap: bytes, n_chunks: int) -> frozenset[int]:
    """Inverse of :func:`bitmap_from_indices`; bits past ``n_chunks`` are ignored."""
    limit = min(n_chunks, len(bitmap) * 8)
    return frozenset(i for i in range(limit) if bitmap[i // 8] >> (i % 8) & 1)
