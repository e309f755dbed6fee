"""Size limits: static schema maxima and configurable per-frame limits.

Two layers, both enforced before or during decoding, never after:

* **Static maxima** (module constants) are baked into the message schemas as msgspec ``Meta``
  constraints: string, bytes and array lengths. They are generous upper bounds that hold for every
  deployment; changing one changes the protocol.
* **Frame limits** (:class:`Limits`) are configurable per receiver. The length prefix of a frame is
  checked against them before the body is read, so a peer cannot make us allocate more than the
  limit for the message type we expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# --- static schema maxima (part of protocol version 1) ---------------------------------------
MAX_ID_LEN = 128  # chars: lease ids, prompt ids, peer ids, fingerprints, hashes in hex
MAX_NAME_LEN = 256  # chars: GPU names, software versions, file names
MAX_TEXT_LEN = 4096  # chars: human-readable details and reasons
MAX_SEQ_TOKENS = 131_072  # tokens in one prompt or one completion
MAX_PACKED_LEN = 4 * MAX_SEQ_TOKENS  # bytes of one packed uint32 / float32 sequence
MAX_STOP_TOKENS = 64  # stop_token_ids per lease
MAX_GPUS = 64  # GPU entries in one capability advert
MAX_PROMPTS = 1024  # prompts per lease / groups per submission
MAX_GROUP_SIZE = 256  # samples per prompt (G)
MAX_ACTIVE_LEASES = 1024  # lease ids listed in one heartbeat
MAX_BATCH_ROLLOUTS = 65_536  # rollouts in one RolloutBatch
MAX_STATUS_KEYS = 256  # keys in a status map (and in each nested map / list)
MAX_CHUNKS_SCHEMA = 1 << 20  # chunk entries a Manifest may list at all
MAX_TENSORS_SCHEMA = 1 << 20  # tensor entries a Manifest may list at all
MAX_TENSOR_DIMS = 16  # dimensions of one listed tensor
MAX_DELTA_FILES = 64  # delta files of one version
MAX_BLOB_LEN = 256 * MIB  # bytes: envelope payload, chunk data, embedded manifest
MAX_U32 = 2**32 - 1
MAX_I64 = 2**63 - 1  # largest msgpack-portable non-negative integer we use
MAX_FLOAT = 1.7976931348623157e308  # largest finite float64

# --- defaults for the configurable limits -----------------------------------------------------
DEFAULT_CHUNK_SIZE = 4 * MIB
CHUNK_FRAME_OVERHEAD = 64 * KIB  # room for the Chunk message around its data bytes


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-receiver frame and manifest limits (bytes unless stated)."""

    control_frame: int = 1 * MIB
    """Max frame for control messages (register, heartbeat, lease, ack, ...)."""
    bulk_frame: int = 16 * MIB
    """Max frame for rollout submissions/batches, manifests and envelopes that carry them."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Checkpoint chunk size this receiver accepts; a Chunk frame may be this + chunk_overhead."""
    chunk_overhead: int = CHUNK_FRAME_OVERHEAD
    """Bytes allowed around a chunk's data in a Chunk frame."""
    max_chunks: int = 65_536
    """Max chunks in one manifest (count)."""
    max_total_size: int = 256 * GIB
    """Max sum of chunk sizes in one manifest."""

    def __post_init__(self) -> None:
        for name in ("control_frame", "bulk_frame", "chunk_size", "max_chunks", "max_total_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive")
        if self.chunk_overhead < 0:
            raise ValueError("Limits.chunk_overhead must be >= 0")
        if self.chunk_frame > MAX_BLOB_LEN or self.bulk_frame > MAX_BLOB_LEN + MIB:
            raise ValueError(f"Limits: frames above {MAX_BLOB_LEN} bytes are not supported")

    @property
    def chunk_frame(self) -> int:
        """Max frame for a Chunk message."""
        return self.chunk_size + self.chunk_overhead

    def max_frame(self, type_: Any) -> int:
        """Largest frame accepted when decoding ``type_`` (a message class or a union of them)."""
        members = get_args(type_) or (type_,)
        return max(self._for_class(m) for m in members)

    def _for_class(self, cls: Any) -> int:
        name = getattr(cls, "__name__", "")
        if name == "Chunk":
            return self.chunk_frame
        if name in _BULK:
            return self.bulk_frame
        return self.control_frame


_BULK = frozenset(
    {
        "SignedEnvelope",
        "RolloutSubmission",
        "RolloutBatch",
        "Manifest",
        "ManifestResponse",
        "PublishVersion",
        "VerifyJob",
    }
)

DEFAULT_LIMITS = Limits()

# --- what one lease can produce ---------------------------------------------------------------
BYTES_PER_COMPLETION_TOKEN = 8  # packed uint32 token id + packed float32 log-prob
SAMPLE_OVERHEAD = 128  # bytes of one encoded Sample besides its packed arrays (keys, headers)
GROUP_OVERHEAD = 256  # bytes of one GroupResult besides its samples (prompt id, keys)
SUBMISSION_OVERHEAD = 4 * KIB  # bytes of a RolloutSubmission besides its groups


def worst_case_submission_bytes(prompts: int, group_size: int, max_new_tokens: int) -> int:
    """Upper bound of the encoded RolloutSubmission of a lease whose every sample runs to
    ``max_new_tokens``. A lease above ``Limits.bulk_frame`` may produce results that cannot be
    submitted: the coordinator does not size one, a node does not run one."""
    per_sample = max_new_tokens * BYTES_PER_COMPLETION_TOKEN + SAMPLE_OVERHEAD
    return prompts * (group_size * per_sample + GROUP_OVERHEAD) + SUBMISSION_OVERHEAD
