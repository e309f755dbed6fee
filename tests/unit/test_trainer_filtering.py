"""Informative groups only (``filter_groups``): the choice, and the learner's loop taking it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.unit.test_trainer_recipe import make_rollouts
from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.filtering import GroupFilter, left_out, uniform_rewards
from trainer.metrics import read_jsonl
from trainer.recipe import Trainer
from trainer.sources import InProcessSource

torch.set_num_threads(1)


def test_a_group_is_uniform_when_every_reward_is_the_same() -> None:
    assert (
        uniform_rewards([1.0, 1.0, 1.0]) and uniform_rewards([0.25]) and uniform_rewards([0, 0.0])
    )
    assert not uniform_rewards([1.0, 1.0, 0.0])
    assert not uniform_rewards([0.5, 0.5 + 2**-40])  # any difference gives an advantage


def test_the_filter_takes_informative_groups_in_order_and_stops_at_a_full_batch() -> None:
    pick = GroupFilter(batch_prompts=3, max_batches=4, min_groups=2)
    for gid, rewards in [("a", [1, 1]), ("b", [0, 1]), ("c", [0, 0]), ("d", [1, 0]), ("e", [0, 1])]:
        pick.offer(gid, rewards)
    assert pick.done and pick.full and pick.missing == 0 and pick.looked == 5
    assert pick.chosen() == (["b", "d", "e"], ["a", "c"])
    with pytest.raises(RuntimeError):
        pick.offer("f", [0, 1])


def test_the_filter_gives_up_after_its_budget_and_fills_with_the_newest_uniform_groups() -> None:
    pick = GroupFilter(batch_prompts=2, max_batches=3, min_groups=2)
    for i in range(5):
        pick.offer(f"u{i}", [1.0, 1.0])
        assert not pick.done
    assert pick.missing == 2
    pick.offer("u5", [1.0, 1.0])  # 6 = 3 batches' worth looked at
    assert pick.done and not pick.full
    assert pick.chosen() == (["u4", "u5"], ["u0", "u1", "u2", "u3"])
    # one informative group found: it trains, one uniform group makes up min_groups
    pick = GroupFilter(batch_prompts=2, max_batches=2, min_groups=2)
    for gid, rewards in [("u0", [0, 0]), ("i1", [0, 1]), ("u2", [0, 0]), ("u3", [1, 1])]:
        pick.offer(gid, rewards)
    assert pick.chosen() == (["i1", "u3"], ["u0", "u2"])


def test_the_filter_refuses_impossible_settings() -> None:
    with pytest.raises(ValueError, match="min_groups"):
        GroupFilter(batch_prompts=2, max_batches=1, min_groups=3)
    with pytest.raises(ValueError, match="max_batches"):
        GroupFilter(batch_prompts=2, max_batches=0, min_groups=1)


def test_filter_drop_solved_leaves_out_only_groups_at_the_full_reward() -> None:
    assert left_out([1.0, 1.0]) and left_out([0.5, 0.5]) and not left_out([0.0, 1.0])
    assert left_out([1.0, 1.0], "solved") and left_out([1, 1], "solved")
    assert not left_out([0.5, 0.5], "solved") and not left_out([0.0, 0.0], "solved")
    assert not left_out([1.0, 0.5], "solved")
    with pytest.raises(ValueError, match="filter_drop"):
        left_out([1.0], "all")
    with pytest.raises(ValueError, match="filter_drop"):
        GroupFilter(batch_prompts=2, max_batches=1, min_groups=1, drop="stuck")
    # a group stuck on one wrong answer counts with the informative ones; a solved one is left out
    pick = GroupFilter(batch_prompts=2, max_batches=2, min_groups=1, drop="solved")
    for gid, rewards in [("solved", [1, 1]), ("stuck", [0.25, 0.25]), ("mixed", [0, 1])]:
        pick.offer(gid, rewards)
    assert pick.done and pick.chosen() == (["stuck", "mixed"], ["solved"])


def _mixed_source(n_pairs: int) -> tuple[InProcessSource, list[Rollout]]:
    """Groups alternating: uniform (all rewards 0.5), informative (differing rewards)."""
    source = InProcessSource(wait_s=0.05)
    rollouts = []
    for k in range(n_pairs):
        rollouts += make_rollouts(100 + k, 1, 4, version=0, equal_rewards=True)
        informative = make_rollouts(200 + k, 1, 4, version=0)
        informative[0] = dataclasses.replace(informative[0], reward=0.0)
        informative[1] = dataclasses.replace(informative[1], reward=1.0)
        rollouts += informative
    source.put(rollouts)
    source.close()
    return source, source._items


def _run(tmp_path: Path, source: InProcessSource, **kw: object) -> list[dict[str, object]]:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=4, minibatches=2,
        trace_rollouts=True, **kw,
    )  # type: ignore[arg-type]  # fmt: skip
    trainer = Trainer.setup(cfg)
    asyncio.run(trainer.run(source, None))
    return read_jsonl(tmp_path / "run" / "metrics.jsonl")


def _trained_groups(row: dict[str, object], items: list[Rollout]) -> list[str]:
    by_seq = {r.seq: r.group_id for r in items}
    trace = row["trace"]
    assert isinstance(trace, dict)
    out: list[str] = []
    for seq, _version, _at in trace["rollouts"]:
        if by_seq[seq] not in out:
            out.append(by_seq[seq])
    return out


def test_with_filter_groups_the_learner_trains_on_informative_groups_only(tmp_path: Path) -> None:
    source, items = _mixed_source(8)
    rows = _run(tmp_path, source, max_steps=2)  # the default
    uniform = {r.group_id for r in items if r.group_id.startswith("s1")}  # seeds 100..107
    for row in rows:
        trained = _trained_groups(row, items)
        assert len(trained) == 4 and not set(trained) & uniform
        # 4 informative groups trained, the 4 uniform ones between them left out
        assert row["rollouts"] == 16 and row["dropped_uniform"] == 16
    # the reward figures cover what the step consumed (uniform groups included), so that they
    # follow the policy, not the filter; B as consumed is twice the batch
    first = [r.reward for r in items[:32]]
    assert rows[0]["reward_mean"] == pytest.approx(sum(first) / 32, abs=1e-9)
    assert rows[0]["batch_rollouts"] == 32


def test_without_filter_groups_uniform_groups_are_trained_on(tmp_path: Path) -> None:
    source, items = _mixed_source(4)
    rows = _run(tmp_path, source, filter_groups=False, max_steps=1)
    assert _trained_groups(rows[0], items) == [r.group_id for r in items[::4]][:4]
    assert rows[0]["dropped_uniform"] == 0 and rows[0]["batch_rollouts"] == 16


def test_a_solved_task_does_not_starve_a_filtering_learner(tmp_path: Path) -> None:
    """Every group uniform: after filter_max_batches batches' worth the step trains on the
    newest `minibatches` groups instead of waiting for informative ones that never come."""
    source = InProcessSource(wait_s=0.05)
    for k in range(8):
        source.put(make_rollouts(300 + k, 1, 4, version=0, equal_rewards=True))
    source.close()
    items = source._items
    rows = _run(tmp_path, source, filter_groups=True, filter_max_batches=2, max_steps=1)
    assert len(rows) == 1
    assert _trained_groups(rows[0], items) == [items[24].group_id, items[28].group_id]
    assert rows[0]["rollouts"] == 8 and rows[0]["dropped_uniform"] == 24


def test_with_filter_drop_solved_a_stuck_group_is_trained_on(tmp_path: Path) -> None:
    """The uniform groups of _mixed_source got 0.5 each (one wrong answer for all): with
    ``filter_drop = "solved"`` they are trained on in order, nothing is left out."""
    source, items = _mixed_source(4)
    rows = _run(tmp_path, source, filter_drop="solved", max_steps=1)
    assert _trained_groups(rows[0], items) == [r.group_id for r in items[::4]][:4]
    assert rows[0]["dropped_uniform"] == 0 and rows[0]["rollouts"] == 16
