"""The ``vllm`` backend on a CUDA host (marker ``gpu``; run with ``bench/vllm_gpu.sh``).

A random Qwen2 (hidden 256, 4 layers, head_dim 64, fp16 weights) is saved to a temp dir; vLLM
samples from it and the HF model (same fp16 weights, upcast to fp32) re-scores the samples with
:func:`policy.scoring.score_logprobs` under the same processed distribution. fp16 vs fp32 differ,
so the tolerance is calibrated, not exact.
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
from policy.model import CharTokenizer, ModelSpec, scaled_config  # noqa: E402
from policy.scoring import score_logprobs  # noqa: E402

pytestmark = pytest.mark.gpu

TOK = CharTokenizer()
EOS = TOK.eos_token_id
PROMPTS = ["abc", "a", "dcbadcba", "bd", "abcdabcda", "cab"]


def small_qwen(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(scaled_config()).half().eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-small")
    small_qwen(0).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Iterator[InferenceBackend]:
    b = make_backend(
        "vllm", ModelSpec(path=str(model_dir), dtype="float16"), gpu_memory_utilization=0.3
    )
    yield b
    b.close()


def requests(n: int, seed: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(TOK.encode_prompt(p), n, seed + i) for i, p in enumerate(PROMPTS)]


def rescore_errors(
    model: torch.nn.Module, groups: list[list[SampleOut]], n: int, cfg: SamplingConfig
) -> list[float]:
    model = model.float().cuda()
    prompts = [r.prompt_token_ids for r in requests(n) for _ in range(n)]
    comps = [s.token_ids for g in groups for s in g]
    scored = score_logprobs(
        model, prompts, comps, cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k
    )
    got = [s.logprobs for g in groups for s in g]
    return [
        abs(a - b) for xs, ys in zip(got, scored, strict=True) for a, b in zip(xs, ys, strict=True)
    ]


def check_well_formed(groups: list[list[SampleOut]], cfg: SamplingConfig) -> None:
    for group in groups:
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert all(0 <= t < TOK.vocab_size for t in s.token_ids)
            assert EOS not in s.token_ids[:-1]
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == EOS
            else:
                assert len(s.token_ids) == cfg.max_new_tokens


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=48),
        SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=48),
    ],
    ids=["plain", "t0.7-p0.9"],
)
def test_vllm_logprobs_match_hf_rescoring(backend: InferenceBackend, cfg: SamplingConfig) -> None:
    groups = backend.generate(requests(4), cfg)
    assert [len(g) for g in groups] == [4] * len(PROMPTS)
    check_well_formed(groups, cfg)
    errors = rescore_errors(small_qwen(0), groups, 4, cfg)
    assert statistics.median(errors) < 0.02, statistics.median(errors)
    assert max(errors) < 0.2, max(errors)


def test_vllm_seeded_reproducible(backend: InferenceBackend) -> None:
    cfg = SamplingConfig(temperature=0.9, max_new_tokens=24)
    a = backend.generate(requests(3, seed=5), cfg)
    b = backend.generate(requests(3, seed=5), cfg)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    c = backend.generate(requests(3, seed=6), cfg)
    assert [[s.token_ids for s in g] for g in a] != [[s.token_ids for s in g] for g in c]


def test_vllm_weight_swap_without_restart(backend: InferenceBackend) -> None:
    cfg = SamplingConfig(max_new_tokens=24)
    new = small_qwen(1)
    backend.load_state_dict(7, new.state_dict())
    assert backend.loaded_version == 7
    groups = backend.generate(requests(2), cfg)  # same prompts as before: prefix cache reset
    check_well_formed(groups, cfg)
    err_new = rescore_errors(new, groups, 2, cfg)
    err_old = rescore_errors(small_qwen(0), groups, 2, cfg)
    assert statistics.median(err_new) < 0.02
    assert statistics.median(err_old) > 5 * statistics.median(err_new)
    backend.load_state_dict(8, small_qwen(0).state_dict())  # back for other tests
