"""node.toml's ``vllm_max_lora_rank`` reaches the vLLM engine without a GPU: the node's config is
read from TOML, ``node.main.vllm_options`` and ``make_backend`` hand it to :class:`VLLMBackend`,
whose constructor starts a stand-in for ``vllm.LLM`` (vLLM is not importable here; CUDA is
reported present) that records the engine arguments. The real engine: the ``gpu`` test in
``test_backends_vllm_lora_gpu.py``."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from node.backends import BackendError, make_backend
from node.backends.fake import FakeBackend
from node.config import ConfigError, NodeConfig, load_node_config
from node.main import vllm_options
from policy.model import ModelSpec


class RecordingLLM:
    """``vllm.LLM``'s constructor and what the backend reads of a started engine."""

    started: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        RecordingLLM.started.append(kwargs)
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))

    def collective_rpc(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def reset_prefix_cache(self) -> bool:
        return True


@dataclass
class SamplingParams:
    """``vllm.SamplingParams``' default the backend reads (top-k off)."""

    top_k: int = 0


@dataclass
class EngineArgs:
    """``vllm.engine.arg_utils.EngineArgs`` of an old vLLM: none of the optional fields."""


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModelSpec:
    """A CUDA host with a ``vllm`` package whose ``LLM`` records its arguments; returns the spec
    of a model directory it can be started on."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.0-test"  # type: ignore[attr-defined]
    vllm.LLM = RecordingLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = EngineArgs  # type: ignore[attr-defined]
    modules = {"vllm": vllm, "vllm.engine": engine, "vllm.engine.arg_utils": arg_utils}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    RecordingLLM.started = []
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 32, "eos_token_id": 2}))
    return ModelSpec(path=str(model))


def _node_config(tmp_path: Path, toml: str) -> NodeConfig:
    path = tmp_path / "node.toml"
    path.write_text(f'state_dir = "{tmp_path / "state"}"\n{toml}')
    return load_node_config(path)


@pytest.mark.parametrize("kind", ["vllm", "auto"])
def test_node_toml_sets_the_engines_lora_rank(
    fake_vllm: ModelSpec, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("node.backends.auto_kind", lambda spec: "vllm")  # a CUDA host with vLLM
    cfg = _node_config(
        tmp_path, f'backend = "{kind}"\nvllm_max_lora_rank = 16\nkeep_versions = 3\n'
    )
    backend: Any = make_backend(cfg.backend, fake_vllm, "cuda", vllm_options=vllm_options(cfg))
    (args,) = RecordingLLM.started
    assert (args["enable_lora"], args["max_lora_rank"]) == (True, 16)
    assert args["max_loras"] == args["max_cpu_loras"] == 3  # keep_versions: S + 1 adapters
    assert (backend.max_lora_rank, backend.max_loras) == (16, 3)
    with pytest.raises(BackendError, match="rank 32; restart the node with vllm_max_lora_rank"):
        backend.load_adapter(1, {}, rank=32, alpha=8.0, keep=3)


def test_unset_starts_no_lora_and_the_environment_no_longer_sets_it(
    fake_vllm: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank was read from $ROLLOUT_SWARM_VLLM_MAX_LORA_RANK before it was a node.toml setting:
    node.toml is now the one place (a variable left in an operator's shell changes nothing)."""
    monkeypatch.setenv("ROLLOUT_SWARM_VLLM_MAX_LORA_RANK", "16")
    cfg = _node_config(tmp_path, 'backend = "vllm"\n')
    backend: Any = make_backend(cfg.backend, fake_vllm, "cuda", vllm_options=vllm_options(cfg))
    (args,) = RecordingLLM.started
    assert "enable_lora" not in args and "max_lora_rank" not in args
    assert backend.max_lora_rank is None and backend.base_fingerprint() is None
    with pytest.raises(BackendError, match=r"vllm_max_lora_rank >= 4 in node\.toml"):
        backend.load_adapter(1, {}, rank=4, alpha=8.0, keep=5)


def test_another_backend_is_built_without_the_vllm_options(tmp_path: Path) -> None:
    """An "auto" node that resolves to another kind gets none of the vllm options (its
    constructor would refuse ``max_lora_rank``)."""
    cfg = _node_config(tmp_path, 'backend = "auto"\nvllm_max_lora_rank = 8\n')
    backend = make_backend("fake", ModelSpec(), "cpu", vllm_options=vllm_options(cfg))
    assert isinstance(backend, FakeBackend)


@pytest.mark.parametrize(
    ("toml", "error"),
    [
        ('backend = "hf"\nvllm_max_lora_rank = 8\n', "vllm_max_lora_rank: set for backend='hf'"),
        ('backend = "vllm"\nvllm_max_lora_rank = 0\n', "vllm_max_lora_rank: Input should be"),
        ('backend = "vllm"\nvllm_max_lora_rank = "16x"\n', "vllm_max_lora_rank: Input should be"),
    ],
)
def test_a_bad_lora_rank_is_one_line_naming_the_field(
    tmp_path: Path, toml: str, error: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        _node_config(tmp_path, toml)
    assert error in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
