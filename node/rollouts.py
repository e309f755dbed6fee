"""Pure helpers of the node's work: a lease -> generation requests -> wire samples -> submission.

No I/O and no state: :class:`~node.worker.NodeWorker` calls them around ``backend.generate``, and
the integration harness and ``bench/intake.py`` use them to build honest results exactly as a node
does.

* :func:`lease_problem`      -- why a lease must not be run here (over local limits), or None
* :func:`to_sampling_config` -- the lease's sampling parameters as the backend's
                                :class:`~node.backends.base.SamplingConfig`
* :func:`lease_requests`     -- one :class:`~node.backends.base.GenerationRequest` per prompt,
                                prompt ``i`` seeded with
                                :func:`~policy.sampling.prompt_seed` ``(lease seed, i)``
* :func:`wire_samples`       -- one request's backend outputs in wire form (sample ``j`` records
                                :func:`~policy.sampling.sample_seed` ``(prompt seed, j)``)
* :func:`wire_finish_reason` -- backend finish reason -> wire ``eos`` / ``stop`` / ``length``
* :func:`build_submission`   -- the honest :class:`~protocol.messages.RolloutSubmission`
"""

from __future__ import annotations

from typing import Any

from node.backends.base import GenerationRequest, SampleOut
from policy.sampling import SamplingConfig, prompt_seed, sample_seed
from protocol.limits import DEFAULT_LIMITS, worst_case_submission_bytes
from protocol.messages import (
    GroupResult,
    Lease,
    RolloutSubmission,
    Sample,
    Timings,
    pack_logprobs,
    pack_tokens,
    unpack_tokens,
)

__all__ = [
    "build_submission",
    "lease_problem",
    "lease_requests",
    "to_sampling_config",
    "wire_finish_reason",
    "wire_samples",
]


def lease_problem(lease: Lease, max_prompts: int) -> str | None:
    """Why this node must not run ``lease`` (None: run it): more prompts than it asked for, or
    results that could outgrow one submission frame (and the node's memory) before they are sent.
    """
    n, g, length = len(lease.prompts), lease.group_size, lease.sampling.max_new_tokens
    if n > max_prompts:
        return f"{n} prompts, this node asked for at most {max_prompts}"
    worst = worst_case_submission_bytes(n, g, length)
    if worst > DEFAULT_LIMITS.bulk_frame:
        return (
            f"{n} prompts x {g} samples x {length} tokens could need {worst / 2**20:.0f} MiB, "
            f"one submission carries {DEFAULT_LIMITS.bulk_frame // 2**20} MiB"
        )
    return None


def lease_requests(lease: Lease) -> list[GenerationRequest]:
    """A request per prompt of ``lease``: ``group_size`` samples seeded by
    :func:`~policy.sampling.prompt_seed`."""
    base = lease.sampling.seed
    return [
        GenerationRequest(unpack_tokens(p.token_ids), lease.group_size, prompt_seed(base, i))
        for i, p in enumerate(lease.prompts)
    ]


def wire_samples(
    request: GenerationRequest, samples: list[SampleOut], eos_token_ids: set[int]
) -> list[Sample]:
    """The wire form of one request's samples; sample ``j`` records ``sample_seed(seed, j)``."""
    return [
        Sample(
            token_ids=pack_tokens(s.token_ids),
            logprobs=pack_logprobs(s.logprobs),
            finish_reason=wire_finish_reason(s, eos_token_ids),
            seed=sample_seed(request.seed, j),
        )
        for j, s in enumerate(samples)
    ]


def build_submission(
    lease: Lease,
    requests: list[GenerationRequest],
    outs: list[list[SampleOut]],
    eos_token_ids: set[int],
    *,
    backend: str,
    dtype: str,
    timings: Timings,
) -> RolloutSubmission:
    """The honest submission of ``lease`` from the backend's outputs for :func:`lease_requests`."""
    groups = [
        GroupResult(prompt_id=prompt.prompt_id, samples=wire_samples(req, samples, eos_token_ids))
        for prompt, req, samples in zip(lease.prompts, requests, outs, strict=True)
    ]
    return RolloutSubmission(
        lease_id=lease.lease_id,
        epoch=lease.epoch,
        policy_version=lease.policy_version,
        backend=backend,
        dtype=dtype,  # type: ignore[arg-type]
        groups=groups,
        timings=timings,
    )


def to_sampling_config(lease: Lease) -> SamplingConfig:
    """The backend's :class:`SamplingConfig` for a lease (``ValueError`` if unsupported). The
    stop set is exactly the lease's (the coordinator's: the model's EOS ids plus extras), never
    the node's own guess."""
    s = lease.sampling
    return SamplingConfig(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
    )


def wire_finish_reason(sample: SampleOut, eos_token_ids: set[int]) -> Any:
    """Backend "stop" -> wire "eos" (last token is one of the model's EOS ids) or "stop" (another
    token of the lease's stop set); the coordinator accepts either label for a stop token."""
    if sample.finish_reason == "length":
        return "length"
    if sample.token_ids and sample.token_ids[-1] in eos_token_ids:
        return "eos"
    return "stop"
