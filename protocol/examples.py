"""One valid, deterministic instance of every top-level message.

Used by the round-trip and fuzz tests, the benchmark, and handy for fake transports in other
packages' tests. Values are plausible but made up.
"""

from __future__ import annotations

from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import (
    AcceptedRollout,
    Ack,
    CapabilityAdvert,
    Chunk,
    ChunkInfo,
    ChunkRequest,
    CpuInfo,
    FetchRollouts,
    GpuInfo,
    GroupResult,
    Heartbeat,
    HeartbeatAck,
    Lease,
    LeaseRequest,
    Manifest,
    ManifestRequest,
    ManifestResponse,
    MessageBase,
    PromptItem,
    PublishVersion,
    Register,
    RegisterAck,
    Reject,
    ReleaseLease,
    RolloutBatch,
    RolloutSubmission,
    Sample,
    SamplingParams,
    SignedEnvelope,
    Standby,
    StatusRequest,
    StatusResponse,
    Timings,
    VerifyGroup,
    VerifyJob,
    VerifySample,
    VerifyTake,
    VerifyVerdict,
    pack_logprobs,
    pack_tokens,
)

__all__ = ["EXAMPLE_SEED", "example_identity", "example_messages", "rollout_submission"]

EXAMPLE_SEED = bytes(range(32))
T0 = 1_700_000_000.0


def example_identity() -> Identity:
    """A fixed identity (private key bytes 0x00..0x1f). Never use it for real."""
    return Identity.from_private_bytes(EXAMPLE_SEED)


def rollout_submission(
    n_samples: int = 8, n_tokens: int = 256, n_groups: int = 1
) -> RolloutSubmission:
    """A submission of ``n_groups`` groups x ``n_samples`` samples x ``n_tokens`` tokens."""
    tokens = pack_tokens([(7 * i) % 151_936 for i in range(n_tokens)])
    logprobs = pack_logprobs([-0.01 * (i % 100) for i in range(n_tokens)])
    samples = [
        Sample(token_ids=tokens, logprobs=logprobs, finish_reason="length", seed=1234 + j)
        for j in range(n_samples)
    ]
    return RolloutSubmission(
        lease_id="lease-0001",
        epoch=3,
        policy_version=12,
        backend="hf",
        dtype="bfloat16",
        groups=[GroupResult(prompt_id=f"p{g}", samples=samples) for g in range(n_groups)],
        timings=Timings(started_at=T0, finished_at=T0 + 2.5, generate_s=2.4),
    )


def _advert(key: bytes) -> CapabilityAdvert:
    return CapabilityAdvert(
        peer_id="12D3KooWExamplePeer",
        node_key=key,
        gpus=[
            GpuInfo(
                name="NVIDIA H100 80GB HBM3",
                memory_bytes=80 * 2**30,
                compute_capability="9.0",
                count=2,
            )
        ],
        cpu=CpuInfo(cores=32, memory_bytes=256 * 2**30),
        backend="vllm",
        dtype="bfloat16",
        tokens_per_s=15_000.0,
        rollouts_per_s=12.5,
        price_per_hour=1.8,
        policy_version=12,
        reachability="relayed",
        software_version="0.1.0",
        expires_at=T0 + 120,
    )


def example_messages() -> list[MessageBase]:
    """One instance of every member of :data:`protocol.messages.Message`."""
    key = example_identity().public_key
    digest = bytes(range(32))
    manifest = Manifest(
        version=12,
        parent_version=11,
        model_config_hash="ab" * 32,
        tokenizer_hash="cd" * 32,
        hash_algorithm="sha256",
        chunk_size=4,
        total_size=6,
        chunks=[
            ChunkInfo(index=0, file="model.safetensors", offset=0, size=4, hash=digest),
            ChunkInfo(index=1, file="model.safetensors", offset=4, size=2, hash=digest),
        ],
        root_hash=digest,
        created_at=T0,
        expires_at=T0 + 3600,
    )
    envelope = SignedEnvelope(
        signer=key, nonce=bytes(16), ts=T0, payload=b"\x80", signature=bytes(64)
    )
    sampling = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256, stop_token_ids=[2], seed=7
    )
    rollout = AcceptedRollout(
        seq=1,
        lease_id="lease-0001",
        prompt_id="p0",
        sample_index=0,
        group_size=8,
        prompt_token_ids=pack_tokens([1, 5, 6, 3]),
        completion_token_ids=pack_tokens([6, 5, 2]),
        behaviour_logprobs=pack_logprobs([-0.5, -0.25, -0.125]),
        finish_reason="eos",
        policy_version=12,
        reward=0.75,
        node_fingerprint="ed25519:" + "a" * 52,
    )
    return [
        envelope,
        _advert(key),
        Register(advert=_advert(key)),
        RegisterAck(
            node_fingerprint="ed25519:" + "a" * 52,
            heartbeat_interval_s=10.0,
            current_policy_version=12,
            server_time=T0,
        ),
        Heartbeat(
            peer_id="12D3KooWExamplePeer",
            seq=5,
            policy_version=12,
            active_leases=["lease-0001"],
            tokens_per_s=14_000.0,
        ),
        HeartbeatAck(
            server_time=T0, current_policy_version=12, active=True, heartbeat_interval_s=40.0
        ),
        LeaseRequest(peer_id="12D3KooWExamplePeer", policy_version=12, max_prompts=4),
        Lease(
            lease_id="lease-0001",
            epoch=3,
            policy_version=12,
            prompts=[PromptItem(prompt_id="p0", token_ids=pack_tokens([1, 5, 6, 3]))],
            group_size=8,
            sampling=sampling,
            issued_at=T0,
            deadline=T0 + 60,
        ),
        Standby(retry_after_s=30.0, reason="capacity planner: enough active nodes"),
        rollout_submission(n_samples=2, n_tokens=3),
        Ack(ref="lease-0001", detail="16 rollouts accepted"),
        Reject(ref="lease-0001", code=ReasonCode.STALE_EPOCH, detail="epoch 2 < 3"),
        ReleaseLease(lease_id="lease-0001", epoch=3, reason="shutting down"),
        ManifestRequest(version=None),
        manifest,
        ManifestResponse(manifest=envelope),
        ChunkRequest(version=12, index=1),
        Chunk(version=12, index=1, data=b"\x00\x01"),
        PublishVersion(manifest=b"\x80", source="/var/lib/swarm/ckpt/v12"),
        FetchRollouts(after_seq=0, max_rollouts=256, min_policy_version=10, wait_s=5.0),
        RolloutBatch(rollouts=[rollout], last_seq=1),
        StatusRequest(verbose=True),
        StatusResponse(status={"nodes": 3, "versions": [11, 12], "rates": {"accept": 0.97}}),
        VerifyTake(wait_s=10.0),
        VerifyJob(
            job_id="vj-1",
            version=12,
            backend="hf",
            dtype="float32",
            steps=256,
            replay=True,
            groups=[
                VerifyGroup(
                    prompt_token_ids=pack_tokens([1, 5, 6, 3]),
                    samples=[
                        VerifySample(
                            token_ids=pack_tokens([9, 4, 2]),
                            logprobs=pack_logprobs([-0.5, -1.25, -0.125]),
                            seed=1234 + j,
                        )
                        for j in range(2)
                    ],
                )
            ],
            deadline=T0 + 120,
        ),
        VerifyVerdict(
            job_id="vj-1",
            outcome="pass",
            metric="max_abs",
            value=2e-4,
            threshold=1e-3,
            detail="max_abs=0.0002, z=0.3 over 6 tokens of 2 samples at version 12",
            code=ReasonCode.LOGPROB_MISMATCH,
            figures={"tokens": 6.0, "samples": 2.0, "max_abs": 2e-4},
            compute_s=0.05,
            tokens=14,
        ),
    ]
