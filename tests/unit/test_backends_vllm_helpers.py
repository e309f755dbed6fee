"""CPU-side pieces of the ``vllm`` backend: output conversion and the worker-side weight load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from node.backends.base import BackendError
from node.backends.vllm import VLLMWorkerExtension, _to_sample


@dataclass
class Logprob:
    logprob: float


def completion(tokens: list[int], reason: str, lps: list[float] | None = None) -> SimpleNamespace:
    lps = lps if lps is not None else [-0.5] * len(tokens)
    return SimpleNamespace(
        token_ids=tokens,
        logprobs=[{t: Logprob(lp)} for t, lp in zip(tokens, lps, strict=True)],
        finish_reason=reason,
    )


def test_to_sample_converts_and_checks() -> None:
    s = _to_sample(completion([5, 6, 2], "stop", [-1.0, -2.0, -0.25]), {2})
    assert s.token_ids == [5, 6, 2] and s.logprobs == [-1.0, -2.0, -0.25]
    assert s.finish_reason == "stop"
    assert _to_sample(completion([5, 6], "length"), {2}).finish_reason == "length"
    with pytest.raises(BackendError, match="without a stop token"):
        _to_sample(completion([5, 6], "stop"), {2})
    with pytest.raises(BackendError, match="abort"):
        _to_sample(completion([5], "abort"), {2})
    missing = completion([5, 6], "length")
    missing.logprobs = None
    with pytest.raises(BackendError, match="logprobs"):
        _to_sample(missing, {2})


def test_worker_extension_loads_safetensors_into_model(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3))

        def load_weights(self, weights: object) -> set[str]:  # vLLM: an iterable of (name, tensor)
            names = set()
            for name, tensor in weights:  # type: ignore[attr-defined]
                getattr(self, name).data.copy_(tensor)
                names.add(name)
            return names

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.tensor([1.0, 2.0, 3.0])}, str(path))
    worker = type("Worker", (VLLMWorkerExtension,), {})()
    worker.model_runner = SimpleNamespace(model=Model())
    assert worker.rollout_swarm_load_file(str(path)) == 1
    assert worker.model_runner.model.w.tolist() == [1.0, 2.0, 3.0]
