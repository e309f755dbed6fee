"""Shared helpers for the coordinator unit tests: a fake clock, a core on a temp SQLite file,
registered nodes and honest submissions for the embedded reverse task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.intake import expected_seed
from coordinator.logprobs import LogprobVerifier
from coordinator.store import Store
from coordinator.tasks import ReverseTask
from policy.model import CharTokenizer
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import (
    CapabilityAdvert,
    CpuInfo,
    GroupResult,
    Lease,
    LeaseRequest,
    RolloutSubmission,
    Sample,
    Timings,
    pack_logprobs,
    pack_tokens,
    unpack_tokens,
)

TOK = CharTokenizer()


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def config(tmp_path: Path, **overrides: Any) -> CoordinatorConfig:
    data: dict[str, Any] = {
        "db_path": str(tmp_path / "state.sqlite"),
        "group_size": 2,
        "staleness_bound": 2,
        "sampling": {"max_new_tokens": 4},
        "leases": {"min_deadline_s": 30.0, "max_prompts_per_lease": 3, "target_lease_s": 1000.0},
        # fixed check rates (spot_check_fraction) unless a test asks for adaptive ones
        "intake": {"spot_check_fraction": 0.0, "new_node_check_rate": 0.0},
        "reward_audit": {"fraction": 0.0},
        "capacity": {"activation": False},
        "reputation": {"strikes_to_ban": 100},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return CoordinatorConfig.model_validate(data)


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        clock: FakeClock | None = None,
        verifier: LogprobVerifier | None = None,
        signer: Identity | None = None,
        **overrides: Any,
    ) -> None:
        self.tmp_path = tmp_path
        self.clock = clock or FakeClock()
        self.cfg = config(tmp_path, **overrides)
        self.publisher = Identity.generate()
        self.verifier = verifier
        self.signer = signer  # the coordinator key sealing the receipt log (None: no seals)
        self.core = self.reopen()

    def reopen(self) -> Coordinator:
        self.store = Store(self.cfg.db_path)
        self.core = Coordinator(
            self.cfg,
            store=self.store,
            task=ReverseTask(),
            tokenizer=TOK,
            clock=self.clock,
            verifier=self.verifier,
            publisher_key=self.publisher.public_key,
            signer=self.signer,
        )
        return self.core

    def publish(self, version: int) -> None:
        now = self.clock()
        manifest, _ = build_manifest(
            {"model.safetensors": b"w" * 64},
            version=version,
            parent_version=version - 1 if version > 1 else None,
            model_config_hash="ab",
            tokenizer_hash="cd",
            created_at=now,
            expires_at=now + 86400,
            chunk_size=32,
        )
        self.core.publish_version(sign_manifest(manifest, self.publisher, now))

    def node(
        self,
        *,
        price: float | None = None,
        rollouts_per_s: float = 0.0,
        backend: str = "hf",
        dtype: str = "float32",
    ) -> Identity:
        ident = Identity.generate()
        self.core.register(
            ident.public_key, advert(ident, self.clock(), price, rollouts_per_s, backend, dtype)
        )
        return ident

    def lease(self, ident: Identity, max_prompts: int = 3) -> Lease:
        out = self.core.request_lease(
            ident.public_key,
            LeaseRequest(peer_id="peer", policy_version=1, max_prompts=max_prompts),
        )
        assert isinstance(out, Lease), out
        return out


def advert(
    ident: Identity,
    now: float,
    price: float | None = None,
    rollouts_per_s: float = 0.0,
    backend: str = "hf",
    dtype: str = "float32",
) -> CapabilityAdvert:
    return CapabilityAdvert(
        peer_id="peer",
        node_key=ident.public_key,
        gpus=[],
        cpu=CpuInfo(cores=2, memory_bytes=1 << 30),
        backend=backend,
        dtype=dtype,  # type: ignore[arg-type]
        tokens_per_s=100.0,
        rollouts_per_s=rollouts_per_s,
        price_per_hour=price,
        policy_version=None,
        reachability="unknown",
        software_version="test",
        expires_at=now + 600,
    )


def answer(lease: Lease, prompt_index: int) -> list[int]:
    """Correct completion (reversed prompt + EOS) for one prompt of the lease."""
    prompt = unpack_tokens(lease.prompts[prompt_index].token_ids)[1:-1]  # strip <bos> and '>'
    return [*reversed(prompt), TOK.eos_token_id]


def submission(
    lease: Lease,
    *,
    completions: list[list[list[int]]] | None = None,
    logprobs: list[list[list[float]]] | None = None,
    finish: str = "eos",
    version: int | None = None,
    prompts: list[int] | None = None,
    samples: int | None = None,
) -> RolloutSubmission:
    """An honest-looking submission (optionally tampered)."""
    groups = []
    for gi in prompts if prompts is not None else range(len(lease.prompts)):
        rows = []
        for si in range(samples if samples is not None else lease.group_size):
            toks = completions[gi][si] if completions else answer(lease, gi)
            lps = logprobs[gi][si] if logprobs else [-0.5] * len(toks)
            rows.append(
                Sample(
                    token_ids=pack_tokens(toks),
                    logprobs=pack_logprobs(lps),
                    finish_reason=finish,  # type: ignore[arg-type]
                    seed=expected_seed(lease.sampling.seed, gi, si),
                )
            )
        groups.append(GroupResult(prompt_id=lease.prompts[gi].prompt_id, samples=rows))
    return RolloutSubmission(
        lease_id=lease.lease_id,
        epoch=lease.epoch,
        policy_version=lease.policy_version if version is None else version,
        backend="hf",
        dtype="float32",
        groups=groups,
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
    )


def sampled(
    lease: Lease,
    model: Any,
    *,
    greedy: bool = False,
    seed_offset: int = 0,
    backend: str = "hf",
    dtype: str = "float32",
    report_model: Any = None,
) -> RolloutSubmission:
    """The honest submission of ``lease`` sampled with the ``hf`` backend on ``model``, built as
    the node worker builds it. ``greedy`` decodes with top-k 1 and ``seed_offset`` draws from
    other seeds; both then report the honest log-probs of the lease's sampling distribution,
    so only the sampling audit can tell (what a careful cheat would do). ``backend``/``dtype``
    are the labels the submission carries; ``report_model`` (default ``model``) is the model
    whose log-probs are reported for re-drawn samples."""
    import dataclasses

    from node.backends.hf import HFBackend
    from node.byzantine import report_logprobs_of
    from node.rollouts import build_submission, lease_requests, to_sampling_config

    hf = HFBackend(model=model, device="cpu")
    requests = lease_requests(lease)
    honest_requests = requests
    if seed_offset:
        requests = [dataclasses.replace(r, seed=r.seed + seed_offset) for r in requests]
    sampling = to_sampling_config(lease)
    if greedy:
        sampling = dataclasses.replace(sampling, top_k=1)
    outs = hf.generate(requests, sampling)
    if greedy or seed_offset:
        reporter = report_model if report_model is not None else model
        report_logprobs_of(reporter, requests, outs, to_sampling_config(lease))
    return build_submission(
        lease,
        honest_requests,
        outs,
        set(hf.eos_token_ids),
        backend=backend,
        dtype=dtype,
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
    )
