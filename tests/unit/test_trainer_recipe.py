"""The recipe: admission, zero-advantage steps, the run loop, metrics, checkpoints and resume."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from policy.model import CharTokenizer, ModelSpec, build_model
from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.metrics import read_jsonl
from trainer.monitors import GradSpikeGuard
from trainer.progress import StepTiming
from trainer.recipe import Trainer
from trainer.sources import InProcessSource, MemoryPublisher

torch.set_num_threads(1)
EOS = 2


def make_rollouts(
    seed: int, n_groups: int, group_size: int, version: int, *, equal_rewards: bool = False
) -> list[Rollout]:
    """Random groups over the embedded vocabulary (behaviour log-probs near uniform)."""
    rng = random.Random(seed)
    tok = CharTokenizer()
    out = []
    for g in range(n_groups):
        prompt = tok.encode_prompt("".join(rng.choice("abcd") for _ in range(3)))
        for _ in range(group_size):
            comp = [rng.randrange(4, 8) for _ in range(rng.randint(1, 4))] + [EOS]
            out.append(
                Rollout(
                    group_id=f"s{seed}-g{g}",
                    prompt_ids=prompt,
                    completion_ids=comp,
                    behaviour_logprobs=[-3.2 + 0.2 * rng.random() for _ in comp],
                    policy_version=version,
                    reward=0.5 if equal_rewards else rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]),
                )
            )
    return out


def _trainer(
    tmp_path: Path, *, spike_guard: GradSpikeGuard | None = None, **kw: object
) -> Trainer:
    cfg = TrainerConfig(out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=4, **kw)  # type: ignore[arg-type]
    return Trainer.setup(cfg, spike_guard=spike_guard)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_rollouts_beyond_s_are_not_trained_on(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, max_staleness=2)
    tr.version = 5
    before = _params(tr.model)
    rec = tr.train_step(make_rollouts(0, 4, 4, version=2))  # Δ = 3 > S
    assert rec["admitted"] == 0 and rec["dropped_stale"] == 16 and rec["updates"] == 0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert rec["staleness_hist"] == {"3": 16}
    rec = tr.train_step(make_rollouts(0, 4, 4, version=4))  # Δ = 2 (version is now 6) → trained
    assert rec["admitted"] == 16 and rec["updates"] == tr.config.minibatches
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())


def test_equal_rewards_leave_weights_unchanged_without_entropy(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, entropy_coef=0.0)
    before = _params(tr.model)
    rec = tr.train_step(make_rollouts(1, 4, 4, version=0, equal_rewards=True))
    assert rec["updates"] == tr.config.minibatches and rec["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert (tr.step, tr.version) == (1, 1)


def test_informative_entropy_leaves_solved_groups_alone(tmp_path: Path) -> None:
    """entropy_groups = "informative": a batch whose groups all have equal rewards (A = 0
    everywhere) gets no bonus either, so the weights do not move; with "all" the bonus alone
    moves them (it pushes solved prompts away from their answer, unopposed)."""
    batch = make_rollouts(1, 4, 4, version=0, equal_rewards=True)
    tr = _trainer(tmp_path / "inf", entropy_coef=0.1, entropy_groups="informative")
    before = _params(tr.model)
    rec = tr.train_step(batch)
    assert rec["updates"] == tr.config.minibatches and rec["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    plain = _trainer(tmp_path / "all", entropy_coef=0.1)
    before = _params(plain.model)
    plain.train_step(batch)
    assert any(not torch.equal(before[k], v) for k, v in plain.model.state_dict().items())


def test_step_metrics_are_written(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, max_staleness=4)
    tr.version = 2
    seen: list[dict[str, object]] = []
    tr.on_step.append(seen.append)
    rec = tr.train_step(make_rollouts(2, 4, 4, version=0))
    assert seen == [rec]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["step"] == 1 and rows[0]["version"] == 3
    for key in ("mismatch_kl", "weight_modified_frac", "ess", "ess_frac", "idle_frac", "entropy"):
        assert key in rec
    assert rec["mismatch_kl"] > 0  # behaviour log-probs are not the model's
    assert 0 < rec["ess_frac"] <= 1
    assert rec["staleness_hist"] == {"2": 16}
    text = tr.metrics.registry  # gauges are registered and set
    assert text.get_sample_value("trainer_step") == 1.0
    assert text.get_sample_value("trainer_rollout_staleness_count") == 16.0


def test_stability_monitors_are_in_every_record_and_warn(tmp_path: Path) -> None:
    # behaviour log-probs ≈ −3.1 against the untrained model's ≈ −ln 26 = −3.26: a small, nonzero
    # mismatch; a KL bound below it warns from the first step (window 1), one above it does not.
    quiet = _trainer(tmp_path / "a", warn_window=1, warn_mismatch_kl_above=10.0)
    rec = quiet.train_step(make_rollouts(3, 4, 4, version=0))
    for key in ("ess_frac", "mismatch_kl", "clip_frac", "mask_frac", "grad_norm", "mismatch_m2"):
        assert isinstance(rec[key], float), key
    assert rec["stability_warning"] == ""
    loud = _trainer(
        tmp_path / "b", warn_window=1, warn_mismatch_kl_above=1e-6, ess_lr_scaling=False
    )
    rec = loud.train_step(make_rollouts(3, 4, 4, version=0))
    assert rec["stability_warning"].startswith("mismatch_kl ")
    assert rec["lr_scale"] == 1.0
    assert loud.optimizer.param_groups[0]["lr"] == loud.config.lr  # off: the lr is left alone
    # VCPO (the default): each update's learning rate is damped by the sequence-level ESS
    damped = _trainer(tmp_path / "d")
    rec = damped.train_step(make_rollouts(3, 4, 4, version=0))
    assert 0 < rec["lr_scale"] < 1
    assert damped.optimizer.param_groups[0]["lr"] < damped.config.lr
    # masking every token (band [0.99, 1.01] around ratios far from 1) shows in mask_frac
    masked = _trainer(tmp_path / "c", weight_mode="mask", weight_cap=1.01, weight_cap_low=0.99)
    rec = masked.train_step(make_rollouts(3, 4, 4, version=0))
    assert rec["mask_frac"] > 0.5 and rec["weight_modified_frac"] > 0.5


def test_grad_spike_guard_skips_updates_and_counts_them(tmp_path: Path) -> None:
    # a guard that judges after one norm and calls every later update a spike
    tr = _trainer(tmp_path, grad_spike_factor=5.0, spike_guard=GradSpikeGuard(1e-6, warmup=1))
    rec = tr.train_step(make_rollouts(4, 4, 4, version=0))
    assert (rec["updates"], rec["skipped_updates"]) == (4, 3)
    before = _params(tr.model)
    rec = tr.train_step(make_rollouts(5, 4, 4, version=1))
    assert rec["skipped_updates"] == 4
    after = _params(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was applied


def test_run_loop_publishes_every_kappa_and_resumes(tmp_path: Path) -> None:
    cfg_kw = {"max_staleness": 3, "publish_every": 2, "checkpoint_every": 2, "max_steps": 3}
    tr = _trainer(tmp_path, **cfg_kw)
    source = InProcessSource(wait_s=0.05)
    for step in range(5):  # five batches; the third stays in the source
        source.put(make_rollouts(10 + step, 4, 4, version=0))
    pub = MemoryPublisher()
    asyncio.run(tr.run(source, pub))
    assert (tr.step, tr.version) == (3, 3)
    assert sorted(pub.versions) == [0, 2]
    assert tr.cursor == 48  # 3 batches × 16 rollouts consumed, seq 1..48
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000003"]

    # Resume into a fresh trainer: weights, optimizer state, counters and cursor come back.
    tr2 = _trainer(tmp_path, **{**cfg_kw, "max_steps": 5})
    assert (tr2.step, tr2.version, tr2.published_version, tr2.cursor) == (3, 3, 2, 48)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, tr2.model.state_dict()[k]), k
    # Same next batch → identical weights (the optimizer moments were restored too).
    nxt = make_rollouts(99, 4, 4, version=2)
    tr.train_step(nxt)
    tr2.train_step(nxt)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, tr2.model.state_dict()[k]), k
    assert (tr2.step, tr2.version) == (4, 4)


def test_resume_never_reuses_a_published_version(tmp_path: Path) -> None:
    tr = _trainer(tmp_path)
    tr.train_step(make_rollouts(3, 4, 4, version=0))
    tr.save_checkpoint()
    # Later the run published version 7 and crashed before its next checkpoint.
    (tmp_path / "run" / "published.json").write_text(json.dumps({"version": 7}))
    tr2 = _trainer(tmp_path)
    assert tr2.step == 1 and tr2.version == 7 and tr2.published_version == 7
    tr2.train_step(make_rollouts(4, 4, 4, version=7))
    assert tr2.version == 8


def test_memory_publisher_rejects_old_versions() -> None:
    pub = MemoryPublisher()
    asyncio.run(pub.publish(3, {}))
    with pytest.raises(ValueError, match="not newer"):
        asyncio.run(pub.publish(3, {}))


def test_fetch_drops_too_stale_groups_and_counts_them(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, max_staleness=1, max_steps=1)
    tr.version = 3
    source = InProcessSource(wait_s=0.05)
    source.put(make_rollouts(5, 2, 4, version=0))  # Δ = 3: dropped at fetch
    source.put(make_rollouts(6, 4, 4, version=2))
    source.close()
    asyncio.run(tr.run(source, None))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["dropped_stale"] == 8 and rows[-1]["admitted"] == 16
    assert 0.0 <= rows[-1]["idle_frac"] <= 1.0


def test_model_is_embedded_default(tmp_path: Path) -> None:
    # Trainer.setup builds the same network as the nodes for the same seed.
    a = build_model(ModelSpec(), seed=0)
    b = Trainer.setup(TrainerConfig(out_dir=str(tmp_path), resume=False)).model
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])


def test_incomplete_group_that_turns_stale_is_evicted(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, max_staleness=1, max_steps=3)
    source = InProcessSource(wait_s=0.05)
    partial = make_rollouts(7, 1, 4, version=0)[:2]  # half a group, never completed
    source.put(partial)
    source.put(make_rollouts(8, 4, 4, version=0))
    source.put(make_rollouts(9, 4, 4, version=1))
    source.put(make_rollouts(10, 4, 4, version=2))
    source.close()
    asyncio.run(tr.run(source, None))
    assert tr.step == 3
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["dropped_stale"] for r in rows] == [0, 0, 2]  # evicted once Δ = 2 > S
    assert tr.cursor == 2 + 48  # nothing pending pins the cursor


def test_step_time_variability_is_reported(tmp_path: Path) -> None:
    """``t_train_cv``: the coefficient of variation of the step time, from running means of the
    step time and its square (weight 0.2), reported with every step (the capacity rule's fluid
    model uses it: a learner whose steps vary outruns its rollouts after the short ones); and
    ``trace_rollouts`` adds the step's times and each rollout's seq, version and fetch time."""
    tr = _trainer(tmp_path, max_staleness=4, trace_rollouts=True)
    rec = tr.train_step(make_rollouts(0, 4, 4, version=0))
    assert rec["t_train_cv"] == 0.0  # one step: no spread yet
    assert rec["trace"]["start"] <= rec["trace"]["end"]
    # no feed here (train_step called directly): seq 0, version 0, fetch time unknown
    assert rec["trace"]["rollouts"] == [[0, 0, None]] * 16
    # the running means after steps of 1 s and 3 s: mean 0.8·1 + 0.2·3 = 1.4, mean square
    # 0.8·1 + 0.2·9 = 2.6, variance 2.6 − 1.96 = 0.64, cv = 0.8 / 1.4
    timing = StepTiming()  # the piece that keeps them, built alone
    timing.add_step(1.0)
    timing.add_step(3.0)
    assert timing.t_train_cv == pytest.approx(0.8 / 1.4)
