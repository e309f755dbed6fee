"""The raw key of a pinned fingerprint, from the signer of a manifest that names it.

Nodes and verifier processes are told the coordinator's key as a fingerprint (what `swarm
coordinator launch` prints); the manifests it signs carry the raw Ed25519 key. The first manifest
whose signer has exactly that fingerprint (on disk, else asked of the seeds) gives the key every
later download is verified with.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.identity import fingerprint_of, short_fingerprint
from protocol.messages import ManifestRequest, ManifestResponse
from swarm.broadcast import MANIFEST_RPC
from swarm.chunks import ChunkStore
from swarm.errors import ManifestUnavailable, TransportError
from swarm.transport import Transport

#: each seed has this long to answer the manifest request (seconds)
MANIFEST_TIMEOUT_S = 10.0


async def resolve_pinned_key(
    fingerprint: str,
    version: int,
    *,
    store: ChunkStore,
    transport: Transport,
    seeds: Iterable[str],
    timeout: float = MANIFEST_TIMEOUT_S,
) -> bytes:
    """The raw public key whose fingerprint is ``fingerprint``: from a stored manifest, else
    from the manifest of ``version`` each of ``seeds`` returns (in order). Raises
    :class:`ManifestUnavailable` naming what each seed answered."""
    for v in reversed(store.versions()):
        entry = store.manifest(v)
        if entry is not None and fingerprint_of(entry[0].signer) == fingerprint:
            return entry[0].signer
    request = encode(ManifestRequest(version=version))
    problems = []
    for peer in seeds:
        try:
            raw = await transport.call(peer, MANIFEST_RPC, request, timeout=timeout)
            env = decode(raw, ManifestResponse).manifest
        except (TransportError, ProtocolError) as exc:
            problems.append(f"{peer[:12]}: {exc}")
            continue
        if env is None:
            problems.append(f"{peer[:12]}: does not hold v{version}")
        elif fingerprint_of(env.signer) != fingerprint:
            signer = short_fingerprint(fingerprint_of(env.signer))
            problems.append(f"{peer[:12]}: manifest signed by {signer}")
        else:
            return env.signer
    raise ManifestUnavailable(
        f"no manifest of v{version} signed by the pinned key {short_fingerprint(fingerprint)} "
        f"({'; '.join(problems) or 'no seeds'})"
    )
