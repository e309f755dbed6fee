"""LoRA versions on the real vLLM engine (marker ``gpu``; run with ``bash bench/vllm_gpu.sh``).

The small random Qwen2 of ``test_backends_vllm.py`` (fp16) is the base; the engine starts with
``enable_lora`` (``max_lora_rank=8``) and each version's adapter reaches it as a
``LoRARequest`` naming the peft directory the backend wrote. The HF model with the same adapter
merged (:func:`policy.lora.merged_copy`, fp32) re-scores the samples with the calibrated margins
of ``test_backends_vllm.py``; a switch back to an earlier adapter samples the same tokens again.
Not run here: no GPU on the development machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from node.backends import GenerationRequest, SamplingConfig, make_backend  # noqa: E402
from node.backends.base import InferenceBackend, SampleOut  # noqa: E402
from policy.lora import adapter_state, base_fingerprint, inject_lora, merged_copy  # noqa: E402
from policy.model import CharTokenizer, ModelSpec, scaled_config  # noqa: E402
from policy.scoring import score_logprobs  # noqa: E402

pytestmark = pytest.mark.gpu
TOK = CharTokenizer()
PROMPTS = ["abc", "a", "dcbadcba", "bd", "abcdabcda", "cab"]
RANK, ALPHA = 8, 16.0


def small_qwen(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(scaled_config()).half().eval()


def adapter(seed: int) -> dict[str, torch.Tensor]:
    model = small_qwen(0).float()
    torch.manual_seed(seed)
    inject_lora(model, rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)
    return {k: v.half() for k, v in adapter_state(model.named_parameters()).items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-small-lora")
    small_qwen(0).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Iterator[InferenceBackend]:
    b = make_backend(
        "vllm",
        ModelSpec(path=str(model_dir), dtype="float16"),
        gpu_memory_utilization=0.3,
        max_lora_rank=RANK,
        max_loras=3,
    )
    yield b
    b.close()


def requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(TOK.encode_prompt(p), n, 40 + i) for i, p in enumerate(PROMPTS)]


def errors(
    model: torch.nn.Module, groups: list[list[SampleOut]], cfg: SamplingConfig
) -> list[float]:
    prompts = [r.prompt_token_ids for r in requests(4) for _ in range(4)]
    comps = [s.token_ids for g in groups for s in g]
    scored = score_logprobs(
        model.float().cuda(), prompts, comps, cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k
    )
    got = [s.logprobs for g in groups for s in g]
    return [abs(a - b) for x, y in zip(got, scored, strict=True) for a, b in zip(x, y, strict=True)]


def test_vllm_applies_each_adapter_per_request_and_switches_back(
    backend: InferenceBackend, model_dir: Path
) -> None:
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24)
    assert backend.base_fingerprint() == base_fingerprint(ModelSpec(path=str(model_dir)))
    first = adapter(1)
    backend.load_adapter(1, first, rank=RANK, alpha=ALPHA, keep=3)
    groups = backend.generate(requests(4), cfg)
    with_adapter = errors(merged_copy(small_qwen(0).float(), first, rank=RANK, alpha=ALPHA),
                          groups, cfg)  # fmt: skip
    without = errors(small_qwen(0), groups, cfg)
    assert statistics.median(with_adapter) < 0.02, statistics.median(with_adapter)
    assert max(with_adapter) < 0.2, max(with_adapter)
    assert statistics.median(without) > 5 * statistics.median(with_adapter)
    backend.load_adapter(2, adapter(2), rank=RANK, alpha=ALPHA, keep=3)
    other = backend.generate(requests(4), cfg)
    assert [s.token_ids for g in other for s in g] != [s.token_ids for g in groups for s in g]
    backend.activate_adapter(1)  # a lease at v1 again: no reload, the same seeded samples
    again = backend.generate(requests(4), cfg)
    assert [s.token_ids for g in again for s in g] == [s.token_ids for g in groups for s in g]
