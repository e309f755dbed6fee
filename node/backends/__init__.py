"""Inference backends behind one interface, chosen by kind.

Modules:
- ``base``  — :class:`InferenceBackend` ABC, :class:`GenerationRequest`, :class:`SampleOut`,
  :class:`SamplingConfig`, :func:`sample_seed`, backend errors (no torch import).
- ``hf``    — transformers on CPU/GPU, batched KV-cache sampling loop with exact log-probs.
- ``vllm``  — vLLM engine on a CUDA host (imported lazily; ``pip install 'rollout-swarm[vllm]'``).
- ``fake``  — deterministic model-free samples for tests (never the default).

:func:`make_backend` is the factory; importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any, Literal

from node.backends.base import (
    BackendError,
    BackendUnavailable,
    FinishReason,
    GenerationRequest,
    InferenceBackend,
    SampleOut,
    SamplingConfig,
    sample_seed,
)
from policy.model import ModelSpec

BackendKind = Literal["auto", "hf", "vllm", "fake"]
KINDS: tuple[str, ...] = ("auto", "hf", "vllm", "fake")

__all__ = [
    "KINDS",
    "BackendError",
    "BackendKind",
    "BackendUnavailable",
    "FinishReason",
    "GenerationRequest",
    "InferenceBackend",
    "SampleOut",
    "SamplingConfig",
    "auto_kind",
    "make_backend",
    "sample_seed",
]


def auto_kind(spec: ModelSpec) -> str:
    """The kind "auto" resolves to: "vllm" when CUDA is available, vLLM is importable, ``spec`` is
    a model directory and the vllm backend draws with the swarm's sampling rule; otherwise "hf"
    (the embedded model is too small for vLLM)."""
    from node.backends.vllm import VLLMBackend

    if VLLMBackend.sampling_rule is None:  # its samples would fail the coordinator's replay
        return "hf"
    if spec.path is None or importlib.util.find_spec("vllm") is None:
        return "hf"
    import torch

    return "vllm" if torch.cuda.is_available() else "hf"


def make_backend(
    kind: str = "auto",
    spec: ModelSpec | None = None,
    device: str = "auto",
    *,
    vllm_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> InferenceBackend:
    """Build the backend ``kind`` ("auto" | "hf" | "vllm" | "fake") for ``spec`` on ``device``.

    ``options`` go to the backend's constructor; ``vllm_options`` to the vllm backend's only
    (also when "auto" resolves to it: a node's ``vllm_max_lora_rank``). Raises
    :class:`BackendUnavailable` (one line, says what to install) when the kind cannot run here,
    ``ValueError`` for an unknown kind.
    """
    spec = spec or ModelSpec()
    if kind == "auto":
        kind = auto_kind(spec)
    if kind == "vllm":
        options = {**options, **(vllm_options or {})}
    if kind == "fake":
        from node.backends.fake import FakeBackend

        return FakeBackend(spec, **options)
    if kind == "hf":
        from node.backends.hf import HFBackend

        return HFBackend(spec, device=device, **options)
    if kind == "vllm":
        from node.backends.vllm import VLLMBackend

        return VLLMBackend(spec, device=device, **options)
    raise ValueError(f"unknown backend {kind!r}; choose one of {', '.join(KINDS)}")
