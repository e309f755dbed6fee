"""rollout-swarm wire protocol: everything that crosses the wire between peers.

No torch, vLLM or hivemind imports here (numpy, msgspec, cryptography, blake3 and zstandard
only), so a node's config and messages load without the ML stack. docs/protocol.md is the
normative specification.

Modules:

* :mod:`protocol.errors`   -- :class:`ReasonCode` (stable wire codes), :class:`ProtocolError` tree
* :mod:`protocol.limits`   -- static schema maxima and the configurable :class:`Limits`
* :mod:`protocol.schema`   -- constrained field types and the message base classes
* :mod:`protocol.packed`   -- packed uint32 token ids / float32 log-probs helpers
* :mod:`protocol.messages` -- every wire message (msgspec Structs) and the :data:`Message` union
* :mod:`protocol.codec`    -- MessagePack encode/decode and length-prefixed framing with limits
* :mod:`protocol.identity` -- Ed25519 identities, key files (0600), fingerprints
* :mod:`protocol.envelope` -- signed envelopes, canonical signed bytes, :class:`ReplayGuard`
* :mod:`protocol.manifest` -- checkpoint manifests: chunking, hashing, signing, reassembly
* :mod:`protocol.delta`    -- delta versions (RSDELTA1): tensor digests, encode, verified apply
* :mod:`protocol.safetensors_layout` -- where each tensor lies in safetensors bytes
"""

from protocol.errors import ProtocolError, ReasonCode
from protocol.schema import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "ReasonCode"]
