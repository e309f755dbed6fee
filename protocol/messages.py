"""Wire message schemas (msgspec Structs, MessagePack maps on the wire).

Every top-level message is a map with a ``"type"`` key holding the class name (msgspec tagged
union) and a ``protocol_version`` key (absent means 1; anything but :data:`PROTOCOL_VERSION` is
rejected with ``unsupported_version``). Unknown keys are rejected (``unknown_field``), every
string/bytes/array has a maximum length (``too_long``), every float must be finite
(``not_finite``). Nested structs (``GpuInfo``, ``Sample``, ...) are untagged maps.

Times are Unix seconds (float64). Sizes are bytes. Token ids and log-probs travel packed (see
:mod:`protocol.packed`). docs/protocol.md is the normative description of every field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from protocol import limits as L
from protocol.errors import ReasonCode, SchemaViolation
from protocol.packed import (
    check_finite_f32,
    check_packed,
    logprobs_array,
    pack_logprobs,
    pack_tokens,
    tokens_array,
    unpack_logprobs,
    unpack_tokens,
)
from protocol.schema import (
    PROTOCOL_VERSION,
    U32,
    U64,
    Blob,
    Digest,
    Dtype,
    FileName,
    FinishReason,
    Finite,
    HexDigest,
    Id,
    MessageBase,
    Name,
    PackedLogprobs,
    PackedTokens,
    PublicKey,
    Reachability,
    SafetensorsDtype,
    Slug,
    StatusValue,
    Text,
    WireStruct,
    check_range,
)

__all__ = [
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "AcceptedRollout",
    "Ack",
    "CapabilityAdvert",
    "Chunk",
    "ChunkInfo",
    "ChunkRequest",
    "CpuInfo",
    "DeltaInfo",
    "FetchRollouts",
    "GpuInfo",
    "GroupResult",
    "Heartbeat",
    "HeartbeatAck",
    "Lease",
    "LeaseRequest",
    "LoraInfo",
    "Manifest",
    "ManifestRequest",
    "ManifestResponse",
    "Message",
    "MessageBase",
    "PromptItem",
    "PublishVersion",
    "Register",
    "RegisterAck",
    "Reject",
    "ReleaseLease",
    "RolloutBatch",
    "RolloutSubmission",
    "Sample",
    "SamplingParams",
    "SignedEnvelope",
    "Standby",
    "StatusRequest",
    "StatusResponse",
    "TensorInfo",
    "Timings",
    "VerifyGroup",
    "VerifyJob",
    "VerifySample",
    "VerifyTake",
    "VerifyVerdict",
    "logprobs_array",
    "pack_logprobs",
    "pack_tokens",
    "tokens_array",
    "unpack_logprobs",
    "unpack_tokens",
]


# --- envelope ----------------------------------------------------------------------------------
class SignedEnvelope(MessageBase):
    """A message signed by an Ed25519 key (see protocol.envelope for the signed bytes)."""

    signer: PublicKey  # 32-byte raw Ed25519 public key of the signer
    nonce: Annotated[bytes, Meta(min_length=16, max_length=16)]  # 16 random bytes
    ts: Finite  # signing time, Unix seconds
    payload: Blob  # msgpack bytes of exactly one tagged message
    signature: Annotated[bytes, Meta(min_length=64, max_length=64)]  # Ed25519 signature


# --- capability advert, registration, heartbeat ------------------------------------------------
class GpuInfo(WireStruct):
    name: Name  # e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: U64  # total device memory per GPU, bytes
    compute_capability: Annotated[str, Meta(pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$")]  # e.g. "9.0"
    count: Annotated[int, Meta(ge=1, le=1024)]  # identical GPUs of this kind


class CpuInfo(WireStruct):
    cores: Annotated[int, Meta(ge=1, le=65_536)]  # logical cores usable for inference
    memory_bytes: U64  # host memory, bytes


class CapabilityAdvert(MessageBase):
    """What a node can do; signed by its node key, published in the DHT and sent on Register."""

    peer_id: Id  # libp2p peer ID (base58) the node is reachable at
    node_key: PublicKey  # the node's Ed25519 public key (must equal the envelope signer)
    gpus: Annotated[list[GpuInfo], Meta(max_length=L.MAX_GPUS)]  # empty for CPU-only nodes
    cpu: CpuInfo | None  # host CPU; None when not reported (then gpus must be non-empty)
    backend: Slug  # inference backend: "hf", "vllm", "fake", ...
    dtype: Dtype  # compute dtype of the loaded policy
    tokens_per_s: Finite  # measured generated tokens per second, >= 0
    rollouts_per_s: Finite  # measured completed samples per second, >= 0
    price_per_hour: Finite | None  # asking price (USD/h, >= 0); None = unpriced/free
    policy_version: U64 | None  # checkpoint version loaded; None = none yet
    reachability: Reachability  # "public" / "private": measured (dial-back); "relayed"; "unknown"
    software_version: Name  # rollout-swarm version string of the node
    expires_at: Finite  # advert not valid after this time, Unix seconds

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.gpus and self.cpu is None:
            raise SchemaViolation(ReasonCode.SCHEMA, "advert lists neither GPUs nor a CPU")
        check_range("tokens_per_s", self.tokens_per_s, 0.0, L.MAX_FLOAT)
        check_range("rollouts_per_s", self.rollouts_per_s, 0.0, L.MAX_FLOAT)
        if self.price_per_hour is not None:
            check_range("price_per_hour", self.price_per_hour, 0.0, L.MAX_FLOAT)


class Register(MessageBase):
    """Node -> coordinator (signed): join the swarm."""

    advert: CapabilityAdvert  # current capabilities; advert.node_key must be the signer


def check_interval(seconds: float) -> None:
    """A heartbeat interval must lie in (0, 86400] seconds (``out_of_range``)."""
    if not 0.0 < seconds <= 86400.0:
        raise SchemaViolation(
            ReasonCode.OUT_OF_RANGE, f"heartbeat_interval_s={seconds} not in (0, 86400]"
        )


class RegisterAck(MessageBase):
    """Coordinator -> node: registration accepted."""

    node_fingerprint: Id  # fingerprint of the registered node key ("ed25519:...")
    heartbeat_interval_s: Finite  # send a Heartbeat at least this often, seconds in (0, 86400]
    current_policy_version: U64 | None  # the version new leases name (held); None = none yet
    server_time: Finite  # coordinator clock, Unix seconds (for skew diagnosis)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_interval(self.heartbeat_interval_s)


class Heartbeat(MessageBase):
    """Node -> coordinator (signed): liveness and current state."""

    peer_id: Id  # libp2p peer ID of the node
    seq: U64  # monotonically increasing per node process
    policy_version: U64 | None  # version loaded now; None = none
    active_leases: Annotated[list[Id], Meta(max_length=L.MAX_ACTIVE_LEASES)]  # lease ids held
    tokens_per_s: Finite | None  # recent measured throughput; None = no recent work


class HeartbeatAck(MessageBase):
    """Coordinator -> node."""

    server_time: Finite  # coordinator clock, Unix seconds
    current_policy_version: U64 | None  # the version new leases name (held); None = none yet
    active: bool  # False: the node is on standby (capacity planner) and should not ask for work
    # the heartbeat interval asked for from now on (it grows with the swarm), seconds in
    # (0, 86400]; None: keep the one you follow
    heartbeat_interval_s: Finite | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heartbeat_interval_s is not None:
            check_interval(self.heartbeat_interval_s)


# --- leases ------------------------------------------------------------------------------------
class LeaseRequest(MessageBase):
    """Node -> coordinator (signed): ask for work."""

    peer_id: Id  # libp2p peer ID of the node
    policy_version: U64 | None  # version loaded; None = none (coordinator may answer Standby)
    max_prompts: Annotated[int, Meta(ge=1, le=L.MAX_PROMPTS)]  # upper bound on prompts wanted


class SamplingParams(WireStruct):
    temperature: Finite  # >= 0; 0 means greedy
    top_p: Finite  # in (0, 1]; 1 disables nucleus filtering
    top_k: Annotated[int, Meta(ge=0, le=L.MAX_U32)]  # 0 disables top-k filtering
    max_new_tokens: Annotated[int, Meta(ge=1, le=L.MAX_SEQ_TOKENS)]  # per sample
    stop_token_ids: Annotated[list[U32], Meta(max_length=L.MAX_STOP_TOKENS)]  # besides EOS
    seed: U64  # base seed; the node reports the per-sample seed it used in Sample.seed

    def __post_init__(self) -> None:
        check_range("temperature", self.temperature, 0.0, 1e6)
        if not 0.0 < self.top_p <= 1.0:
            raise SchemaViolation(ReasonCode.OUT_OF_RANGE, f"top_p={self.top_p} not in (0, 1]")


class PromptItem(WireStruct):
    prompt_id: Id  # coordinator-assigned, unique within the lease
    token_ids: PackedTokens  # prompt tokens, packed little-endian uint32

    def __post_init__(self) -> None:
        check_packed("token_ids", self.token_ids)


class Lease(MessageBase):
    """Coordinator -> node: a batch of prompts, each to be sampled group_size times."""

    lease_id: Id  # unique lease id
    epoch: U64  # fencing epoch; results must echo it, a reassigned lease gets a higher one
    policy_version: U64  # version to sample with (whole lease on this version)
    # prompts to sample, each group_size times; 1..MAX_PROMPTS
    prompts: Annotated[list[PromptItem], Meta(min_length=1, max_length=L.MAX_PROMPTS)]
    group_size: Annotated[int, Meta(ge=1, le=L.MAX_GROUP_SIZE)]  # samples per prompt (G)
    sampling: SamplingParams  # same parameters for every prompt of the lease
    issued_at: Finite  # Unix seconds
    deadline: Finite  # results after this time are refused (lease_expired), Unix seconds


class Standby(MessageBase):
    """Coordinator -> node: no work for you now."""

    retry_after_s: Finite  # ask again after this many seconds, in [0, 86400]
    reason: Text  # human-readable

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("retry_after_s", self.retry_after_s, 0.0, 86400.0)


# --- rollouts ----------------------------------------------------------------------------------
class Sample(WireStruct):
    token_ids: PackedTokens  # completion tokens (EOS included if generated), packed uint32
    logprobs: PackedLogprobs  # behaviour log-prob of each completion token, packed float32
    finish_reason: FinishReason  # "eos", "stop" (stop token) or "length" (max_new_tokens)
    seed: U64  # seed the backend used for this sample

    def __post_init__(self) -> None:
        check_packed("token_ids", self.token_ids)
        check_finite_f32("logprobs", self.logprobs)
        if len(self.token_ids) != len(self.logprobs):
            raise SchemaViolation(
                ReasonCode.SCHEMA,
                f"{len(self.token_ids) // 4} tokens but {len(self.logprobs) // 4} logprobs",
            )


class GroupResult(WireStruct):
    prompt_id: Id  # from the lease
    # exactly Lease.group_size samples (checked by the coordinator: incomplete_group)
    samples: Annotated[list[Sample], Meta(min_length=1, max_length=L.MAX_GROUP_SIZE)]


class Timings(WireStruct):
    started_at: Finite  # generation start, Unix seconds
    finished_at: Finite  # generation end, Unix seconds
    generate_s: Finite  # seconds spent inside the backend, >= 0
    # seconds this lease waited for its policy version (download, verify, load), >= 0; 0 = loaded
    load_s: Finite = 0.0
    # seconds between the previous lease's generation and this one's spent on round trips
    # (submitting it, asking for this lease), loads and deliberate waits excluded, >= 0
    overhead_s: Finite = 0.0

    def __post_init__(self) -> None:
        for name in ("generate_s", "load_s", "overhead_s"):
            check_range(name, getattr(self, name), 0.0, L.MAX_FLOAT)


class RolloutSubmission(MessageBase):
    """Node -> coordinator (signed): the results of one lease."""

    lease_id: Id  # lease being answered
    epoch: U64  # fencing epoch of that lease
    policy_version: U64  # version actually used to sample
    backend: Slug  # backend that generated ("hf", "vllm", ...)
    dtype: Dtype  # compute dtype used
    # one group per leased prompt; 1..MAX_PROMPTS
    groups: Annotated[list[GroupResult], Meta(min_length=1, max_length=L.MAX_PROMPTS)]
    timings: Timings  # wall-clock figures for capacity planning


class Ack(MessageBase):
    """Acknowledges the message identified by ``ref``."""

    ref: Id  # what is acknowledged (lease id, version, ...)
    detail: Text = ""  # optional human-readable note


class Reject(MessageBase):
    """Refuses the message identified by ``ref`` with a stable reason code."""

    ref: Id  # what is refused (lease id, version, "-" when unknown)
    code: ReasonCode  # stable reason code
    detail: Text  # one human-readable line
    retry_after_s: Finite | None = None  # when retrying may help, seconds; None = do not retry


class ReleaseLease(MessageBase):
    """Node -> coordinator (signed): give a lease back unfinished."""

    lease_id: Id  # lease being released
    epoch: U64  # its fencing epoch
    reason: Text  # human-readable (shutdown, out of memory, ...)


# --- checkpoints -------------------------------------------------------------------------------
class ManifestRequest(MessageBase):
    """Ask a peer for the signed manifest of a checkpoint version."""

    version: U64 | None  # None = the latest version the peer has


class ChunkInfo(WireStruct):
    index: U32  # position in Manifest.chunks, 0-based, dense
    file: FileName  # safetensors file the chunk belongs to (plain name, no directories)
    offset: U64  # byte offset of the chunk inside that file
    size: Annotated[int, Meta(ge=1, le=L.MAX_BLOB_LEN)]  # chunk length, bytes
    hash: Digest  # 32-byte digest of the chunk bytes (Manifest.hash_algorithm)


class TensorInfo(WireStruct):
    """One tensor of a checkpoint, as a node will load it (docs/protocol.md §8.4)."""

    name: Name  # tensor name in the safetensors header (unique across the checkpoint's files)
    dtype: SafetensorsDtype  # safetensors dtype string, e.g. "BF16"
    shape: Annotated[list[U64], Meta(max_length=L.MAX_TENSOR_DIMS)]  # dimensions, outermost first
    hash: Digest  # tensor digest (Manifest.hash_algorithm) over dtype, shape and raw data bytes


class DeltaInfo(WireStruct):
    """This version also travels as a sparse delta against ``base_version`` (protocol §8.5)."""

    base_version: U64  # the version the delta applies to; < Manifest.version
    base_root_hash: Digest  # root hash of that version's manifest (names the exact base bytes)
    # names of the files in Manifest.chunks that hold the delta (ascending); every other file
    # is part of the full checkpoint
    files: Annotated[list[FileName], Meta(min_length=1, max_length=L.MAX_DELTA_FILES)]


class LoraInfo(WireStruct):
    """This version is a LoRA adapter over a base model the receiver holds (protocol §8.6)."""

    # hex SHA-256 fingerprint of the base model (policy.lora.base_fingerprint; for a model
    # directory, what `swarm model import` prints after "sha256:")
    base_model: HexDigest
    rank: Annotated[int, Meta(ge=1, le=65536)]  # r: A is [r, in], B is [out, r]
    alpha: Annotated[float, Meta(gt=0.0, le=L.MAX_FLOAT)]  # the adapter is scaled by alpha / r


class Manifest(MessageBase):
    """Checkpoint version description; signed by the coordinator key in a SignedEnvelope."""

    version: U64  # checkpoint (policy) version, strictly increasing
    parent_version: U64 | None  # version this one was trained from; None = initial
    model_config_hash: HexDigest  # hex digest of the model config (opaque to the protocol)
    tokenizer_hash: HexDigest  # hex digest of the tokenizer (opaque to the protocol)
    hash_algorithm: Literal["sha256", "blake3"]  # for chunk hashes and the root hash
    chunk_size: Annotated[int, Meta(ge=1, le=L.MAX_BLOB_LEN)]  # nominal chunk size, bytes
    total_size: U64  # sum of chunk sizes, bytes
    # chunk list in index order; files in ascending name order (see protocol.manifest)
    chunks: Annotated[list[ChunkInfo], Meta(max_length=L.MAX_CHUNKS_SCHEMA)]
    root_hash: Digest  # digest over the chunk list (docs/protocol.md, "root hash")
    created_at: Finite  # Unix seconds
    expires_at: Finite  # nodes refuse the manifest after this time, Unix seconds
    # every tensor of the full checkpoint, ascending by name; None = not listed (then no delta)
    tensors: Annotated[list[TensorInfo], Meta(max_length=L.MAX_TENSORS_SCHEMA)] | None = None
    delta: DeltaInfo | None = None  # None = a keyframe: this version travels in full only
    # present: the full part is a LoRA adapter over lora.base_model (no delta); None = weights
    lora: LoraInfo | None = None


class ManifestResponse(MessageBase):
    manifest: SignedEnvelope | None  # envelope whose payload is a Manifest; None = unknown version


class ChunkRequest(MessageBase):
    version: U64  # checkpoint version
    index: U32  # chunk index in that version's manifest


class Chunk(MessageBase):
    """One checkpoint chunk; verified against the manifest, not signed itself."""

    version: U64  # checkpoint version
    index: U32  # chunk index
    data: Blob  # chunk bytes (len == ChunkInfo.size)


class PublishVersion(MessageBase):
    """Trainer -> coordinator: a new checkpoint version is ready to be signed and seeded."""

    manifest: Blob  # msgpack bytes of the unsigned Manifest
    source: Text  # the publishing trainer's libp2p peer id (informational; it seeds the chunks)


# --- trainer feed ------------------------------------------------------------------------------
class FetchRollouts(MessageBase):
    """Trainer -> coordinator: give me accepted rollouts after ``after_seq``."""

    after_seq: U64  # return rollouts with seq > after_seq (0 = from the start)
    max_rollouts: Annotated[int, Meta(ge=1, le=L.MAX_BATCH_ROLLOUTS)]  # batch size cap
    min_policy_version: U64 | None  # skip older rollouts; None = no filter
    wait_s: Finite  # long-poll up to this many seconds when none are ready, in [0, 3600]
    # learner figures the coordinator re-exports on /status (step, idle fraction, staleness
    # histogram, ...); same bounded shape as StatusResponse.status; empty = nothing to report
    trainer_stats: Annotated[dict[Name, StatusValue], Meta(max_length=L.MAX_STATUS_KEYS)] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("wait_s", self.wait_s, 0.0, 3600.0)


class AcceptedRollout(WireStruct):
    seq: U64  # coordinator-assigned, strictly increasing, >= 1
    lease_id: Id  # lease that produced it
    prompt_id: Id  # prompt within that lease
    sample_index: Annotated[int, Meta(ge=0, le=L.MAX_GROUP_SIZE - 1)]  # position in its group
    group_size: Annotated[int, Meta(ge=1, le=L.MAX_GROUP_SIZE)]  # G of the group
    prompt_token_ids: PackedTokens  # packed uint32
    completion_token_ids: PackedTokens  # packed uint32
    behaviour_logprobs: PackedLogprobs  # packed float32, one per completion token
    finish_reason: FinishReason  # as reported by the node and checked by the coordinator
    policy_version: U64  # version that generated the sample
    reward: Finite  # reward recomputed by the coordinator's task verifier
    node_fingerprint: Id  # "ed25519:..." of the node that generated it

    def __post_init__(self) -> None:
        check_packed("prompt_token_ids", self.prompt_token_ids)
        check_packed("completion_token_ids", self.completion_token_ids)
        check_finite_f32("behaviour_logprobs", self.behaviour_logprobs)
        if len(self.completion_token_ids) != len(self.behaviour_logprobs):
            raise SchemaViolation(ReasonCode.SCHEMA, "completion and logprob lengths differ")


class RolloutBatch(MessageBase):
    # accepted rollouts in ascending seq order; may be empty after a long-poll timeout
    rollouts: Annotated[list[AcceptedRollout], Meta(max_length=L.MAX_BATCH_ROLLOUTS)]
    last_seq: U64  # highest seq in this batch, or FetchRollouts.after_seq if empty


# --- status ------------------------------------------------------------------------------------
class StatusRequest(MessageBase):
    verbose: bool = False  # include per-node details


class StatusResponse(MessageBase):
    # free-form, bounded: <= 256 string keys; values are scalars (bool/int/finite float/str/nil),
    # lists of <= 256 scalars, or maps of <= 256 string keys to scalars (nesting depth <= 2)
    status: Annotated[dict[Name, StatusValue], Meta(max_length=L.MAX_STATUS_KEYS)]


# --- remote verification (coordinator <-> the operator's verifier processes) -----------------
class VerifyTake(MessageBase):
    """Verifier -> coordinator: the next re-score job, waiting up to ``wait_s`` for one."""

    wait_s: Finite  # long-poll bound, seconds in [0, 30]; the coordinator waits at most that

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("wait_s", self.wait_s, 0.0, 30.0)


class VerifySample(WireStruct):
    token_ids: PackedTokens  # completion tokens as the node submitted them, packed uint32
    logprobs: PackedLogprobs  # the node's claimed log-prob of each, packed float32
    seed: U64  # the lease's seed of this sample (VerifyJob.replay), else 0

    def __post_init__(self) -> None:
        check_packed("token_ids", self.token_ids)
        check_finite_f32("logprobs", self.logprobs)
        if len(self.token_ids) != len(self.logprobs):
            raise SchemaViolation(ReasonCode.SCHEMA, "token_ids and logprobs lengths differ")


class VerifyGroup(WireStruct):
    prompt_token_ids: PackedTokens  # the prompt of every sample below, packed uint32
    samples: Annotated[list[VerifySample], Meta(min_length=1, max_length=L.MAX_GROUP_SIZE)]

    def __post_init__(self) -> None:
        check_packed("prompt_token_ids", self.prompt_token_ids)


class VerifyJob(MessageBase):
    """Coordinator -> verifier: re-score these samples at ``version`` (check 7, §12.2)."""

    job_id: Id  # answer with it in VerifyVerdict.job_id
    version: U64  # the policy version the samples claim (fetch it from the coordinator)
    backend: Slug  # what the node is held to (its registration), used without calibration
    dtype: Dtype
    steps: U32 | None  # the lease's max_new_tokens (the replay's uniform width); nil = longest
    replay: bool  # true: each Sample.seed is the lease's seed of that sample; replay the draws
    groups: Annotated[list[VerifyGroup], Meta(min_length=1, max_length=L.MAX_PROMPTS)]
    deadline: Finite  # Unix seconds; a verdict after it is refused and the job was given again


VerifyOutcome = Literal["pass", "fail", "unavailable", "error"]


class VerifyVerdict(MessageBase):
    """Verifier -> coordinator: the verdict of one job."""

    job_id: Id  # from the VerifyJob
    # pass / fail: the check's verdict; unavailable: this verifier cannot hold the version (not
    # fetched, another base model); error: its re-score failed (its fault, not the node's);
    # either way the job goes to another verifier
    outcome: VerifyOutcome
    metric: Name  # the statistic that decided (max_abs, median_rel, tail_share, sampling_z, ...)
    value: Finite  # its value
    threshold: Finite  # its limit
    detail: Text  # one human-readable line (the node's Reject detail on a fail)
    code: ReasonCode  # on a fail: logprob_mismatch or sampling_mismatch
    figures: Annotated[dict[Name, Finite], Meta(max_length=L.MAX_STATUS_KEYS)]  # for the receipt
    compute_s: Finite  # seconds the re-score took on the verifier, >= 0 (V of the budget)
    tokens: U64  # prompt + completion tokens re-scored

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("compute_s", self.compute_s, 0.0, L.MAX_FLOAT)


Message = (
    SignedEnvelope
    | CapabilityAdvert
    | Register
    | RegisterAck
    | Heartbeat
    | HeartbeatAck
    | LeaseRequest
    | Lease
    | Standby
    | RolloutSubmission
    | Ack
    | Reject
    | ReleaseLease
    | ManifestRequest
    | Manifest
    | ManifestResponse
    | ChunkRequest
    | Chunk
    | PublishVersion
    | FetchRollouts
    | RolloutBatch
    | StatusRequest
    | StatusResponse
    | VerifyTake
    | VerifyJob
    | VerifyVerdict
)
"""Union of every top-level message; ``codec.decode(data)`` decodes into one of these."""

MESSAGE_TYPES: tuple[type[MessageBase], ...] = (
    SignedEnvelope,
    CapabilityAdvert,
    Register,
    RegisterAck,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    Lease,
    Standby,
    RolloutSubmission,
    Ack,
    Reject,
    ReleaseLease,
    ManifestRequest,
    Manifest,
    ManifestResponse,
    ChunkRequest,
    Chunk,
    PublishVersion,
    FetchRollouts,
    RolloutBatch,
    StatusRequest,
    StatusResponse,
    VerifyTake,
    VerifyJob,
    VerifyVerdict,
)
