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

from collections.abc import Iterable

import numpy as np

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


# Chunk sets travel as bitmaps (bit i of byte i // 8 = chunk i) and are kept in memory as Python
# ints with the same bits (``bits``): a union, a comparison or a conversion to and from a bitmap
# then costs a few machine words per 64 chunks in C, not a Python step per chunk. A checkpoint of
# a few GB has thousands of chunks, and every chunk request carries bitmaps both ways.


def _pack(arr: np.ndarray, n_bits: int) -> bytes:
    """Indices (all in [0, n_bits)) as a bitmap of ``ceil(n_bits / 8)`` bytes."""
    flags = np.zeros((n_bits + 7) // 8 * 8, np.uint8)
    flags[arr] = 1
    return np.packbits(flags, bitorder="little").tobytes()


def bitmap_from_indices(indices: Iterable[int], n_chunks: int) -> bytes:
    """Pack chunk indices into a bitmap of ``ceil(n_chunks / 8)`` bytes (bit i of byte i//8)."""
    arr = np.fromiter(indices, np.int64)
    bad = arr[(arr < 0) | (arr >= n_chunks)]
    if bad.size:
        raise ValueError(f"chunk index {int(bad[0])} out of range [0, {n_chunks})")
    return _pack(arr, n_chunks)


def bits_from_bitmap(bitmap: bytes, n_chunks: int) -> int:
    """A bitmap as an int, bit i = chunk i; bits past ``n_chunks`` are ignored."""
    return int.from_bytes(bitmap[: (n_chunks + 7) // 8], "little") & ((1 << n_chunks) - 1)


def bitmap_from_bits(bits: int, n_chunks: int) -> bytes:
    """Inverse of :func:`bits_from_bitmap`: ``ceil(n_chunks / 8)`` bytes."""
    if bits < 0 or bits >> n_chunks:
        raise ValueError(f"chunk set has bits outside [0, {n_chunks})")
    return bits.to_bytes((n_chunks + 7) // 8, "little")


def bits_from_indices(indices: Iterable[int]) -> int:
    """Chunk indices as an int, bit i = chunk i (indices must be >= 0)."""
    arr = np.fromiter(indices, np.int64)
    if not arr.size:
        return 0
    if arr.min() < 0:
        raise ValueError(f"chunk index {int(arr.min())} is negative")
    return int.from_bytes(_pack(arr, int(arr.max()) + 1), "little")


def indices_from_bits(bits: int) -> frozenset[int]:
    """The chunk indices of an int's set bits."""
    if bits <= 0:
        if bits < 0:
            raise ValueError("a chunk set cannot be negative")
        return frozenset()
    if not bits & (bits - 1):  # one chunk: the common request
        return frozenset((bits.bit_length() - 1,))
    raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
    return frozenset(np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist())


def indices_from_bitmap(bitmap: bytes, n_chunks: int) -> frozenset[int]:
    """Inverse of :func:`bitmap_from_indices`; bits past ``n_chunks`` are ignored."""
    return indices_from_bits(bits_from_bitmap(bitmap, n_chunks))
