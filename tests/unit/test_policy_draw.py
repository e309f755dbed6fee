"""The sampling rule of every backend (policy/draw.py, docs/protocol.md §11): the documented
derivations and test vectors hold, and the pure draw function reproduces the ``hf`` backend token
for token, so any backend that calls it is replayable by the coordinator."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from node.backends import GenerationRequest, SamplingConfig
from node.backends.hf import HFBackend
from policy.draw import (
    SAMPLING_RULE,
    draw_tokens,
    processed_logprobs,
    sample_uniforms,
    splitmix64,
    uniform_at,
)
from policy.model import CharTokenizer, ModelSpec, build_model
from policy.sampling import prompt_seed, sample_seed

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TOK = CharTokenizer()


def vectors() -> dict[str, Any]:
    """The JSON block after ``<!-- vectors:sampling`` in docs/protocol.md."""
    text = DOC.read_text()
    found = re.search(r"<!-- vectors:sampling.*?-->\s*```json\n(.*?)```", text, re.S)
    assert found, "docs/protocol.md lost its sampling test vectors"
    data: dict[str, Any] = json.loads(found.group(1))
    return data


def test_seed_vectors_in_the_protocol_doc() -> None:
    v = vectors()
    assert v["prompt_seed"] and v["sample_seed"]
    for row in v["prompt_seed"]:
        assert prompt_seed(row["lease_seed"], row["index"]) == row["prompt_seed"]
    for row in v["sample_seed"]:
        assert sample_seed(row["prompt_seed"], row["index"]) == row["sample_seed"]
    # the definition in §11.1, written out independently of policy.sampling
    import hashlib

    def blake(text: str) -> int:
        digest = hashlib.blake2b(text.encode("ascii"), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1

    row = v["sample_seed"][1]
    assert blake(f"rollout-swarm/sample/{row['prompt_seed']}/{row['index']}") == row["sample_seed"]


def test_uniform_vectors_in_the_protocol_doc() -> None:
    u = vectors()["uniforms"]
    seed = u["sample_seed"]
    assert [uniform_at(seed, t) for t in range(len(u["u"]))] == u["u"]
    assert [int(x * 2**24) for x in u["u"]] == u["u_times_2^24"]
    assert sample_uniforms(seed, len(u["u"])).tolist() == u["u"]  # exact in float32
    # §11.2 is standard SplitMix64 (published outputs for state 1234567)
    gamma, mask = 0x9E3779B97F4A7C15, 2**64 - 1
    outs = [splitmix64((1234567 + (t + 1) * gamma) & mask) for t in range(3)]
    assert outs == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_draw_vectors_in_the_protocol_doc() -> None:
    rows = vectors()["draw"]
    assert len(rows) >= 12
    for row in rows:
        logits = torch.tensor([row["logits"]])
        cfg = {"temperature": row["temperature"], "top_p": row["top_p"], "top_k": row["top_k"]}
        logp = processed_logprobs(logits, **cfg)[0]
        kept = [i for i in range(logp.numel()) if math.isfinite(logp[i].item())]
        assert kept == row["kept"], row
        for got, want in zip(logp.tolist(), row["logprobs"], strict=True):
            if want is None:
                assert got == -math.inf
            else:
                assert got == pytest.approx(want, abs=2e-6)
        tok, lp = draw_tokens(logits, torch.tensor([row["u"]]), **cfg)
        assert int(tok) == row["token"], row
        assert lp.item() == pytest.approx(row["token_logprob"], abs=2e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=10),
        SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=10),
        SamplingConfig(temperature=1.3, top_k=5, top_p=0.8, max_new_tokens=10),
    ],
    ids=["plain", "t0.7-p0.9", "t1.3-k5-p0.8"],
)
def test_the_pure_draw_reproduces_the_hf_backend_token_for_token(cfg: SamplingConfig) -> None:
    """Decode step by step with a fresh, unbatched forward per position and ``draw_tokens`` at
    the sample's uniforms: the tokens are the ``hf`` backend's (batched, KV-cached, left-padded),
    the log-probs equal within fp32 rounding. What another backend must do to be replayable."""
    torch.set_num_threads(1)
    model = build_model(ModelSpec(), seed=0)
    backend = HFBackend(ModelSpec(), device="cpu", model=model)
    assert backend.sampling_rule == SAMPLING_RULE
    requests = [
        GenerationRequest(TOK.encode_prompt(p), 2, seed=100 + i)
        for i, p in enumerate(["abc", "d", "bcadb"])
    ]
    groups = backend.generate(requests, cfg)
    stops = {TOK.eos_token_id}
    for req, group in zip(requests, groups, strict=True):
        for j, sample in enumerate(group):
            u = sample_uniforms(sample_seed(req.seed, j), cfg.max_new_tokens)
            seq = list(req.prompt_token_ids)
            tokens, logps = [], []
            for t in range(cfg.max_new_tokens):
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([seq])).logits[:, -1, :]
                tok, lp = draw_tokens(
                    logits,
                    u[t : t + 1],
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                )
                tokens.append(int(tok))
                logps.append(float(lp))
                seq.append(int(tok))
                if int(tok) in stops:
                    break
            assert tokens == sample.token_ids
            assert logps == pytest.approx(sample.logprobs, abs=1e-5)


def test_draws_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 26, generator=gen)
    u = torch.rand(6, generator=gen)
    tok, lp = draw_tokens(logits, u, temperature=0.9, top_p=0.95, top_k=7)
    for i in range(6):
        one, one_lp = draw_tokens(
            logits[i : i + 1], u[i : i + 1], temperature=0.9, top_p=0.95, top_k=7
        )
        assert int(one) == int(tok[i]) and float(one_lp) == pytest.approx(float(lp[i]))


def test_a_node_refuses_a_backend_without_the_sampling_rule(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """The coordinator replays every draw: a backend with another sampler (today's vllm) would
    have every sample refused, so the node will not run it (one line, exit 2)."""
    import node.backends as backends
    from node import main as node_main
    from node.backends.fake import FakeBackend
    from node.config import NodeConfig

    class OtherSampler(FakeBackend):
        name = "vllm"
        sampling_rule = None

    monkeypatch.setattr(backends, "make_backend", lambda *a, **k: OtherSampler())
    cfg = NodeConfig(state_dir=str(tmp_path), backend="hf", device="cpu")
    with pytest.raises(node_main._Fail) as e:
        node_main._build_backend(cfg)
    assert "sampling rule" in str(e.value) and "--backend hf" in str(e.value)
    from node.backends import auto_kind

    assert auto_kind(ModelSpec(path=str(tmp_path))) == "hf"  # auto never picks it
