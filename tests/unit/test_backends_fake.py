"""The ``fake`` backend and the backend factory."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from node.backends import (
    BackendUnavailable,
    GenerationRequest,
    SamplingConfig,
    make_backend,
    sample_seed,
)
from node.backends.fake import FakeBackend
from policy.model import CharTokenizer, ModelSpec

TOK = CharTokenizer()


def reqs(seed: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(TOK.encode_prompt(p), 4, seed=seed + i)
        for i, p in enumerate(["abc", "dd", "bcad"])
    ]


def test_fake_is_deterministic_and_keyed_by_prompt_seed_version() -> None:
    cfg = SamplingConfig(max_new_tokens=6)
    a, b = FakeBackend(), FakeBackend()
    assert a.generate(reqs(), cfg) == b.generate(reqs(), cfg)
    assert a.generate(reqs(), cfg) != a.generate(reqs(seed=1), cfg)
    b.load_state_dict(3, {})
    assert b.loaded_version == 3
    assert a.generate(reqs(), cfg) != b.generate(reqs(), cfg)
    # batch composition does not matter
    assert a.generate(reqs()[1:2], cfg)[0] == a.generate(reqs(), cfg)[1]


def test_fake_samples_are_valid() -> None:
    backend = make_backend("fake", ModelSpec())
    assert isinstance(backend, FakeBackend)
    cfg = SamplingConfig(max_new_tokens=5)
    reasons = set()
    for group in backend.generate(reqs(), cfg):
        assert len(group) == 4
        for s in group:
            reasons.add(s.finish_reason)
            assert 1 <= len(s.token_ids) <= 5 and len(s.logprobs) == len(s.token_ids)
            assert all(0 <= t < TOK.vocab_size for t in s.token_ids)
            assert all(math.isfinite(lp) for lp in s.logprobs)
            assert s.logprobs[0] == pytest.approx(-math.log(TOK.vocab_size))
            assert TOK.eos_token_id not in s.token_ids[:-1]
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == TOK.eos_token_id
            else:
                assert len(s.token_ids) == 5
    assert reasons == {"stop", "length"}


def test_fake_respects_extra_stop_tokens_and_vocab_check() -> None:
    backend = FakeBackend(stop_probability=0.0)
    stop = TOK.encode("a")[0]
    out = backend.generate(reqs(), SamplingConfig(max_new_tokens=40, stop_token_ids=(stop,)))
    assert all(stop not in s.token_ids for g in out for s in g)  # never emitted as a plain token
    with pytest.raises(ValueError, match="vocabulary"):
        backend.generate([GenerationRequest([500], 1, 0)], SamplingConfig())


def test_fake_imports_no_torch() -> None:
    code = (
        "import sys; from node.backends import make_backend; "
        "make_backend('fake'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sample_seed_is_stable_and_distinct() -> None:
    assert sample_seed(1, 0) == sample_seed(1, 0)
    assert len({sample_seed(s, j) for s in range(20) for j in range(20)}) == 400
    assert 0 <= sample_seed(2**70, 3) < 2**63


def test_factory_errors() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("bogus")


def test_vllm_unavailable_is_one_clear_line() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA host: covered by the gpu tests")
    except ImportError:
        pass
    with pytest.raises(BackendUnavailable) as info:
        make_backend("vllm", ModelSpec(path="/nonexistent"))
    msg = str(info.value)
    assert "rollout-swarm[vllm]" in msg and "CUDA" in msg and "\n" not in msg
