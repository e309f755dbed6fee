"""The ``vllm`` backend's LoRA path without a GPU: the adapter directory it writes is peft's format
(peft loads it and computes what the swarm's adapter means), and every request names the loaded
version's adapter (``LoRARequest``), on the fake engine of ``test_backends_vllm_fake.py`` whose
``generate`` applies the named adapter from its directory. The real engine: the ``gpu`` test in
``test_backends_vllm_lora_gpu.py``."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_backends_vllm_fake import PROMPTS, TOK, FakeLLM, make

from node.backends import GenerationRequest, SamplingConfig
from node.backends.hf import HFBackend
from node.backends.vllm import write_peft_adapter
from policy.lora import AdapterSet, adapter_modules, adapter_state, inject_lora
from policy.model import ModelSpec, build_model

torch.set_num_threads(1)
CFG = SamplingConfig(temperature=1.0, max_new_tokens=8)


def adapter(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    model = build_model(ModelSpec())
    torch.manual_seed(seed)
    inject_lora(model, rank=rank, alpha=8.0, target_modules=["all-linear"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.2)
    return adapter_state(model.named_parameters())


def test_the_adapter_directory_is_peft_format_and_means_the_same(tmp_path: Path) -> None:
    from peft import PeftModel

    tensors = adapter(1)
    write_peft_adapter(tmp_path / "v1", tensors, adapter_modules(tensors, 4), rank=4, alpha=8.0)
    config = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    saved = load_file(str(tmp_path / "v1" / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.layers.") for k in saved)
    ids = torch.tensor([[1, 4, 5, 6, 3, 7]])
    peft_model = PeftModel.from_pretrained(build_model(ModelSpec()), str(tmp_path / "v1"))
    ours = build_model(ModelSpec())
    held = AdapterSet(ours, keep=1, mode="unmerged")
    held.add(1, tensors, rank=4, alpha=8.0)
    held.activate(1)
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        got = peft_model(input_ids=ids).logits
        assert not torch.allclose(want, build_model(ModelSpec())(input_ids=ids).logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@dataclass
class LoRARequest:
    """``vllm.lora.request.LoRARequest``'s three positional fields (vLLM 0.33)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LoraLLM(FakeLLM):
    """The fake engine, started with ``enable_lora``: ``generate(..., lora_request=r)`` samples
    with the adapter stored at ``r.lora_path`` (peft format) over its base weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.requests: list[LoRARequest | None] = []
        self.removed: list[int] = []
        self.llm_engine.remove_lora = self.removed.append  # type: ignore[attr-defined]
        self._held = AdapterSet(self.model, keep=100, mode="unmerged")

    def generate(
        self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool, **kw: Any
    ) -> list:
        request = kw.get("lora_request")
        self.requests.append(request)
        if request is not None:
            cfg = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
            raw = load_file(str(Path(request.lora_path) / "adapter_model.safetensors"))
            tensors = {k.removeprefix("base_model.model."): v for k, v in raw.items()}
            self._held.add(request.lora_int_id, tensors, rank=cfg["r"], alpha=cfg["lora_alpha"])
        self._held.activate(None if request is None else request.lora_int_id)
        try:
            return super().generate(prompts, params, use_tqdm)
        finally:
            self._held.activate(None)


@pytest.fixture
def vllm_lora_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm.lora.request`` as the backend imports it (vLLM is not installed here)."""
    for name in ("vllm", "vllm.lora"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("vllm.lora.request")
    module.LoRARequest = LoRARequest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.lora.request", module)


def test_each_request_names_the_loaded_versions_adapter(vllm_lora_module: None) -> None:
    llm = LoraLLM(build_model(ModelSpec()))
    backend = make(llm)
    backend.max_lora_rank = 8
    reqs = [GenerationRequest(TOK.encode_prompt(p), 2, seed=30 + i) for i, p in enumerate(PROMPTS)]
    hf = HFBackend(ModelSpec(), device="cpu", lora_mode="unmerged", lora_base="sha256:00")
    adapters = {v: adapter(v) for v in (1, 2, 3)}
    outs = {}
    for v in (1, 2):
        backend.load_adapter(v, adapters[v], rank=4, alpha=8.0, keep=2)
        hf.load_adapter(v, adapters[v], rank=4, alpha=8.0, keep=2)
        assert backend.loaded_version == v and backend.holds_adapter(v)
        outs[v] = backend.generate(reqs, CFG)
        assert llm.requests[-1] is not None and llm.requests[-1].lora_name == f"v{v}"
        want = hf.generate(reqs, CFG)
        for wg, gg in zip(want, outs[v], strict=True):
            for w, g in zip(wg, gg, strict=True):
                assert g.token_ids == w.token_ids
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert outs[1] != outs[2]
    # a lease at v1 again: a switch, the same samples
    backend.activate_adapter(1)
    assert backend.generate(reqs, CFG) == outs[1]
    # keep = 2: a third adapter drops the oldest from the engine and the disk
    path_v1 = Path(backend._loras[1].lora_path)
    backend.load_adapter(3, adapters[3], rank=4, alpha=8.0, keep=2)
    assert not backend.holds_adapter(1) and llm.removed == [2] and not path_v1.exists()
    # a rank above the engine's limit is refused in one line, nothing changes
    with pytest.raises(Exception, match="max_lora_rank >= 16"):
        backend.load_adapter(4, adapter(4, rank=16), rank=16, alpha=8.0, keep=2)
    assert backend.loaded_version == 3
    # full weights afterwards: no adapter named any more, the held ones dropped
    backend.load_state_dict(5, build_model(ModelSpec()).state_dict())
    backend.generate(reqs, CFG)
    assert llm.requests[-1] is None and not backend.holds_adapter(3)


def test_a_backend_started_without_lora_has_no_base_to_offer() -> None:
    backend = make(FakeLLM(build_model(ModelSpec())))
    assert backend.base_fingerprint() is None  # a LoRA version is refused (lora_base_missing)
