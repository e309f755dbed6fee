"""The trainer weights samples with the same processed distribution the nodes drew them from.

μ (the node's logged log-probs) is a log-prob of the processed distribution (temperature → top-k →
top-p); π_prox and π_θ must be too, or the behaviour weights π_prox/μ are off even with no
staleness at all (on main before this: mismatch KL 0.013 and ESS 0.978 at T = 0.7).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from node.backends.base import GenerationRequest
from node.backends.hf import HFBackend
from policy.model import CharTokenizer, ModelSpec
from policy.sampling import SamplingConfig
from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.loss import LOGP_FLOOR, token_entropy, token_logprobs
from trainer.recipe import Trainer

torch.set_num_threads(1)
TOK = CharTokenizer()


def _rollouts(backend: HFBackend, sampling: SamplingConfig, version: int) -> list[Rollout]:
    prompts = ["abc", "dca", "bbd", "cab"]
    requests = [GenerationRequest(TOK.encode_prompt(p), 6, 100 + i) for i, p in enumerate(prompts)]
    outs = backend.generate(requests, sampling)
    rollouts = []
    for i, (req, group) in enumerate(zip(requests, outs, strict=True)):
        for j, s in enumerate(group):
            rollouts.append(
                Rollout(
                    group_id=f"g{i}",
                    prompt_ids=req.prompt_token_ids,
                    completion_ids=s.token_ids,
                    behaviour_logprobs=s.logprobs,
                    policy_version=version,
                    reward=float((i + j) % 3) / 2,
                )
            )
    return rollouts


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(0.7, 0.9, 0), (1.0, 0.8, 12), (1.3, 1.0, 10), (0.7, 1.0, 0), (1.3, 0.95, 20)],
)
def test_mismatch_kl_is_zero_at_staleness_zero(
    tmp_path: Path, temperature: float, top_p: float, top_k: int
) -> None:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=6, minibatches=1,
        temperature=temperature, top_p=top_p, top_k=top_k,
    )  # fmt: skip
    trainer = Trainer.setup(cfg)
    backend = HFBackend(ModelSpec(), device="cpu", model=copy.deepcopy(trainer.model))
    sampling = SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6, stop_token_ids=(2,)
    )
    record = trainer.train_step(_rollouts(backend, sampling, version=trainer.version))
    # fp32 on one CPU: the node's KV-cache decode and the trainer's full forward differ by
    # rounding only (~1e-6 in log-prob, KL ≈ Δ²/2 ≈ 1e-12 at most; measured 6–8e-15 with the
    # float64 k3). 1e-9 allows log-prob differences up to ~4e-5 on another CPU's kernels; the
    # fp32 k3 of before e396d0d reported ±1e-9 of rounding noise here, negative as often as not.
    assert 0.0 <= record["mismatch_kl"] < 1e-9
    assert abs(record["mismatch_kl_k1"]) < 1e-4
    assert record["ess_frac"] > 0.9999
    assert record["weight_modified_frac"] == 0.0


def test_raw_log_probs_would_not_match() -> None:
    """The same check with the raw distribution (what the trainer computed before) fails: the
    test above can tell the two apart."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 26) * 3
    targets = torch.randint(0, 26, (2, 5))
    processed = token_logprobs(logits, targets, temperature=0.7)
    raw = token_logprobs(logits, targets)
    assert (processed - raw).abs().max() > 0.1


def test_tokens_outside_the_support_get_a_floor_and_no_gradient() -> None:
    logits = torch.tensor([[[4.0, 3.0, 0.0, -1.0]]], requires_grad=True)
    kept, cut = torch.tensor([[0]]), torch.tensor([[3]])
    lp_cut = token_logprobs(logits, cut, top_k=2)
    assert float(lp_cut.detach()) == LOGP_FLOOR
    lp_cut.sum().backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0
    logits.grad = None
    lp = token_logprobs(logits, kept, top_k=2)
    lp.sum().backward()
    # d/dz log softmax over the kept set {0, 1}: (1 - p0, -p1, 0, 0)
    p0 = torch.softmax(torch.tensor([4.0, 3.0]), 0)[0]
    want = torch.tensor([1 - p0, -(1 - p0), 0.0, 0.0])
    assert torch.allclose(logits.grad[0, 0], want, atol=1e-6)
    ent = token_entropy(logits.detach(), top_k=2)
    assert torch.isfinite(ent).all()
    p = torch.softmax(torch.tensor([4.0, 3.0]), 0)
    assert abs(float(ent) - float(-(p * p.log()).sum())) < 1e-6


def test_trainer_config_refuses_nothing_it_can_match() -> None:
    cfg = TrainerConfig(temperature=0.5, top_p=0.3, top_k=7)
    assert cfg.processing == {"temperature": 0.5, "top_p": 0.3, "top_k": 7}
    assert TrainerConfig().processing == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
