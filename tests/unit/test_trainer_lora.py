"""The trainer with LoRA (``lora_rank`` > 0): adapters only train, the objective is the same, the
published state is the adapter naming its base, and checkpoints resume the adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_recipe import make_rollouts

from policy.lora import AdapterSet, AdapterState, base_fingerprint
from policy.model import ModelSpec, build_model
from trainer.config import TrainerConfig
from trainer.recipe import Trainer

torch.set_num_threads(1)


def _trainer(tmp_path: Path, **kw: object) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"),
        batch_prompts=4,
        group_size=4,
        minibatches=2,
        **kw,  # type: ignore[arg-type]
    )
    return Trainer.setup(cfg)


def test_lora_trains_only_the_adapters(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lora_rank=4, lora_alpha=8.0, lr=1e-2)
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in tr.model.named_parameters() if n in trainable}
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n not in trainable}
    adapters = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n in trainable}
    rec = tr.train_step(make_rollouts(0, 4, 4, version=0))
    assert rec["updates"] == 2
    now = dict(tr.model.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())
    assert any(not torch.equal(now[n], v) for n, v in adapters.items())


def test_lora_starts_as_the_base_model(tmp_path: Path) -> None:
    """lora_B starts at zero: version 0 of a LoRA run is the base model's policy."""
    tr = _trainer(tmp_path, lora_rank=2)
    base = build_model(ModelSpec(), seed=0)
    ids = torch.tensor([[1, 4, 5, 6, 3]])
    with torch.no_grad():
        assert torch.equal(tr.model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_published_state_is_the_adapter_naming_its_base(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lora_rank=4, lora_alpha=8.0, lr=1e-2, seed=3)
    tr.train_step(make_rollouts(1, 4, 4, version=0))
    state = tr.state_dict_for_publish()
    assert isinstance(state, AdapterState)
    assert (state.rank, state.alpha) == (4, 8.0)
    # the embedded base is its seed-0 weights whatever the run's seed (what nodes build);
    # the seed drew the adapters' initialisation
    assert state.base_model == base_fingerprint(ModelSpec(), seed=0)
    assert state.base_model != base_fingerprint(ModelSpec(), seed=3)
    # q, k, v, o, gate, up, down of 2 layers, A and B each
    assert len(state) == 2 * 7 * 2
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in state)
    # the adapter over a fresh base reproduces the trainer's policy (merged and unmerged)
    ids = torch.tensor([[1, 4, 5, 6, 3, 7, 8]])
    with torch.no_grad():
        want = tr.model(input_ids=ids).logits
        for mode in ("merged", "unmerged"):
            base = build_model(ModelSpec(), seed=0)
            adapters = AdapterSet(base, keep=2, mode=mode)  # type: ignore[arg-type]
            adapters.add(1, state, rank=4, alpha=8.0)
            adapters.activate(1)
            got = base(input_ids=ids).logits
            # fp32, same weights: merged rounds W0 + s·BA once (|Δlogit| ~1e-6 at this size),
            # unmerged is peft's own order of operations
            assert torch.allclose(got, want, atol=1e-5, rtol=0), mode


def test_checkpoint_resume_keeps_the_adapters_and_their_optimizer(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lora_rank=4, lr=1e-2)
    tr.train_step(make_rollouts(2, 4, 4, version=0))
    path = tr.save_checkpoint()
    saved = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    again = _trainer(tmp_path, lora_rank=4, lr=1e-2)
    assert again.step == 1 and path == again.latest_checkpoint()
    now = dict(again.model.named_parameters())
    assert saved.keys() == now.keys()
    assert all(torch.equal(now[n], v) for n, v in saved.items())
    moments = [s for s in again.optimizer.state.values() if "exp_avg" in s]
    assert len(moments) == sum(p.requires_grad for p in again.model.parameters())
    # the next step is the same as the uninterrupted trainer's
    batch = make_rollouts(3, 4, 4, version=1)
    tr.train_step(batch)
    again.train_step(batch)
    a, b = dict(tr.model.named_parameters()), dict(again.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_full_training_stays_the_default(tmp_path: Path) -> None:
    tr = _trainer(tmp_path)
    assert all(p.requires_grad for p in tr.model.parameters())
    assert not isinstance(tr.state_dict_for_publish(), AdapterState)


def test_bad_target_modules_fail_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora_target_modules") as info:
        _trainer(tmp_path, lora_rank=2, lora_target_modules=["no_such_proj"])
    assert "\n" not in str(info.value)
