"""Cross-check: the trainer's update equals TRL's GRPO loss written from its published formula.

The reference below shares no code with ``trainer/``: it scores every sequence on its own (no
padding, default positions), loops over groups, samples and tokens, and follows TRL's
``GRPOTrainer``: advantages ``(r − mean) / (std + 1e-4)`` with the unbiased std, per-token
``−min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A)`` with ``ρ = exp(logp − logp.detach())`` (one iteration
per generation), the completion mask up to and including the first EOS, the "bnpo"/"dapo"
normalisation (sum over tokens / number of tokens), no KL (β = 0), and, for the second case, TRL's
``vllm_importance_sampling_correction``: the per-token loss times ``min(exp(old − sampling), cap)``.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from policy.model import CharTokenizer, ModelSpec, build_model
from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.recipe import Trainer

torch.set_num_threads(1)
EOS = 2


def _seq_logps(
    model: torch.nn.Module, prompt: list[int], completion: list[int]
) -> list[torch.Tensor]:
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0]
    out = []
    for t, tok in enumerate(completion):
        row = logits[len(prompt) - 1 + t].double()
        out.append(row[tok] - torch.logsumexp(row, dim=0))
    return out


def _trl_loss(
    model: torch.nn.Module,
    groups: list[list[Rollout]],
    eps_low: float,
    eps_high: float,
    tis_cap: float | None,
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for group in groups:
        rewards = [r.reward for r in group]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
        for r in group:
            adv = (r.reward - mean) / (std + 1e-4)
            comp = list(r.completion_ids)
            n_tok = comp.index(EOS) + 1 if EOS in comp else len(comp)
            logps = _seq_logps(model, list(r.prompt_ids), comp[:n_tok])
            for t in range(n_tok):
                old = logps[t].detach()
                coef1 = torch.exp(logps[t] - old)
                coef2 = torch.clamp(coef1, 1 - eps_low, 1 + eps_high)
                loss_t = -torch.min(coef1 * adv, coef2 * adv)
                if tis_cap is not None:
                    is_ratio = torch.exp(old - float(r.behaviour_logprobs[t]))
                    loss_t = loss_t * torch.clamp(is_ratio, max=tis_cap)
                total = total + loss_t
                count += 1
    return total / count


def _groups(model: torch.nn.Module, noise: float, seed: int) -> list[list[Rollout]]:
    """4 groups × 4 samples: prompts of different lengths, completions with and without EOS and
    with tokens after EOS; behaviour log-probs = the model's own minus ``noise``·U(0, 1)."""
    rng = random.Random(seed)
    tok = CharTokenizer()
    groups = []
    for g in range(4):
        prompt = tok.encode_prompt("".join(rng.choice("abcd") for _ in range(2 + g)))
        group = []
        for _ in range(4):
            comp = [rng.randrange(4, 10) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.7:
                comp.insert(rng.randint(0, len(comp)), EOS)
            with torch.no_grad():
                exact = [float(x) for x in _seq_logps(model, prompt, comp)]
            behaviour = [x - noise * rng.random() for x in exact]
            group.append(
                Rollout(f"g{g}", prompt, comp, behaviour, 0, rng.choice([0.0, 0.25, 0.5, 1.0]))
            )
        if len({r.reward for r in group}) == 1:
            group[0] = Rollout(**{**group[0].__dict__, "reward": 0.75})
        groups.append(group)
    return groups


@pytest.mark.parametrize(
    ("mode", "noise", "tis_cap"),
    [("mask", 0.0, None), ("off", 0.0, None), ("truncate", 1.5, 2.0)],
    ids=["no-staleness-default-mode", "weights-off", "token-TIS"],
)
def test_update_matches_trl_grpo_reference(mode: str, noise: float, tis_cap: float | None) -> None:
    model = build_model(ModelSpec(), seed=3)
    reference = copy.deepcopy(model)
    groups = _groups(reference, noise, seed=11)
    cfg = TrainerConfig(
        minibatches=1,
        entropy_coef=0.0,
        max_grad_norm=None,
        weight_mode=mode,  # type: ignore[arg-type]
        weight_cap=2.0,
        clip_eps=0.2,
        clip_eps_high=0.28,
        ess_lr_scaling=False,  # TRL has no step-size factor; the SGD step below is the reference
        target_step_kl=None,  # nor a KL-adaptive learning rate
        out_dir="unused",
    )
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # Δθ = −∇L exactly
    trainer = Trainer(cfg, model, pad_token_id=0, eos_token_id=EOS, optimizer=sgd)
    before = {k: v.clone() for k, v in model.named_parameters()}
    record = trainer.train_step([r for g in groups for r in g])

    ref_loss = _trl_loss(reference, groups, 0.2, 0.28, tis_cap)
    ref_loss.backward()
    assert record["loss"] == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    ref_grads = dict(reference.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        ref_grad = ref_grads[name].grad
        assert ref_grad is not None
        torch.testing.assert_close(before[name] - p.detach(), ref_grad, atol=1e-6, rtol=1e-5)
        checked += int(ref_grad.abs().sum() > 0)
    assert checked > 5  # the comparison is not between zero gradients
    if mode == "truncate":
        assert record["weight_modified_frac"] > 0  # the cap was exercised
