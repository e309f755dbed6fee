"""The inference-backend interface every backend implements (``hf``, ``vllm``, ``fake``).

A backend turns a batch of :class:`GenerationRequest` (prompt token ids, group size ``n``, seed)
into ``n`` :class:`SampleOut` per request: the sampled token ids, the log-probability of each
sampled token under the *exact sampling distribution* (after temperature, top-k and top-p), and
why the sample ended. The coordinator re-scores a fraction of samples with
:func:`policy.scoring.score_logprobs`, so the log-probs must be those of the distribution the token
was actually drawn from, computed in fp32 from the raw logits.

Seeding and the sampling rule: sample ``j`` of a request with seed ``s`` has its own uniforms,
``policy.draw.sample_uniforms(sample_seed(s, j), ·)``, so a sample does not depend on the other
requests in the batch nor on ``n``; token ``t`` is ``policy.draw.draw_tokens`` of its logits at
``u[t]`` (the processed distribution's inverse-CDF draw). The coordinator replays those draws for
every backend, so a backend that samples any other way has its samples refused: it declares the
rule it implements in :attr:`InferenceBackend.sampling_rule`, and a node refuses to run one that
implements none.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from policy.sampling import SamplingConfig, sample_seed

FinishReason = Literal["stop", "length"]

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "FinishReason",
    "GenerationRequest",
    "InferenceBackend",
    "SampleOut",
    "SamplingConfig",
    "sample_seed",
]


class BackendError(RuntimeError):
    """A backend failed; the message says what to do (one line)."""


class BackendUnavailable(BackendError):
    """The requested backend cannot run on this machine (missing package or device)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to be sampled ``n`` times (a GRPO group)."""

    #: prompt tokens (not empty), each in ``[0, vocab_size)``.
    prompt_token_ids: list[int]
    #: samples to draw for this prompt (>= 1).
    n: int
    #: base seed of this request (derived from the lease by the caller); sample ``j`` uses
    #: ``sample_seed(seed, j)``.
    seed: int

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(
                "GenerationRequest.prompt_token_ids is empty; a prompt needs >= 1 token"
            )
        if self.n < 1:
            raise ValueError(f"GenerationRequest.n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class SampleOut:
    """One completion."""

    #: generated tokens; ends with the stop token when ``finish_reason == "stop"``, nothing after.
    token_ids: list[int]
    #: ``logprobs[i]`` = log p(token_ids[i]) under the exact sampling distribution (fp32).
    logprobs: list[float]
    #: "stop": a stop/EOS token was sampled (and is the last token); "length": max_new_tokens hit.
    finish_reason: FinishReason


class InferenceBackend(ABC):
    """Generates sampled completions with per-token log-probs for the current policy version."""

    #: backend kind: "hf", "vllm" or "fake".
    name: str = ""
    #: dtype the weights are held in ("float32", "bfloat16", "float16").
    dtype: str = "float32"
    #: checkpoint version whose weights are loaded; None = the initial weights of the spec.
    loaded_version: int | None = None
    #: vocabulary size of the model (token ids are in ``[0, vocab_size)``).
    vocab_size: int = 0
    #: the model's EOS token ids (always stop a sample).
    eos_token_ids: tuple[int, ...] = ()
    #: the sampling rule this backend draws with: ``policy.draw.SAMPLING_RULE`` when every token is
    #: ``draw_tokens`` at the sample's seeded uniform; None = another sampler (the node refuses to
    #: run it: its samples would fail the coordinator's replay).
    sampling_rule: str | None = None

    @abstractmethod
    def load_state_dict(
        self,
        version: int,
        state_dict: Mapping[str, Any],
        changed: Collection[str] | None = None,
    ) -> None:
        """Swap the weights in place to checkpoint ``version`` (name -> tensor, HF names).

        ``changed`` names the tensors that differ from the loaded version (their signed digests
        differ; the others are bit-identical): a backend may update only those. None = all."""

    # ------------------------------------------------------------------ LoRA versions
    def base_fingerprint(self) -> str | None:
        """``sha256:<hex>`` of the base model this backend applies LoRA adapters to
        (:func:`policy.lora.base_fingerprint`); None: it applies none."""
        return None

    def holds_adapter(self, version: int) -> bool:
        """``version``'s adapter is in memory (accepted earlier): :meth:`activate_adapter`
        switches to it without a download or a reload of the base."""
        return False

    def load_adapter(
        self, version: int, tensors: Mapping[str, Any], *, rank: int, alpha: float, keep: int
    ) -> None:
        """Hold LoRA ``version`` (adapter tensors, docs/protocol.md §8.6) over the base and make
        it the active weights, keeping at most ``keep`` adapters in memory (S + 1: a lease at
        any of the last S versions switches without a download); the base is not reloaded."""
        raise BackendError(
            f"the {self.name} backend cannot apply LoRA adapters; run the hf or vllm backend"
        )

    def activate_adapter(self, version: int) -> None:
        """Make the held adapter of ``version`` the active weights (``loaded_version``)."""
        raise BackendError(f"the {self.name} backend holds no LoRA adapters")

    @abstractmethod
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        """``n`` samples for every request, in request order."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to free by default
        """Free the device memory / engine processes held by the backend."""

    def stop_set(self, sampling: SamplingConfig) -> frozenset[int]:
        """Token ids that end a sample under ``sampling``: exactly its stop set (a lease's),
        or this backend's EOS ids when it names none (local use)."""
        if sampling.stop_token_ids is None:
            return frozenset(self.eos_token_ids)
        return frozenset(sampling.stop_token_ids)

    def check_requests(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> None:
        """Reject token ids outside the vocabulary (one-line ValueError naming the request)."""
        for i, req in enumerate(requests):
            bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"request {i}: prompt token {bad[0]} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        bad_stop = [t for t in sampling.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token {bad_stop[0]} is outside [0, {self.vocab_size})")

    def __enter__(self) -> InferenceBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
