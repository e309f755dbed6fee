"""Rollouts → padded tensors (trainer/batch.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.batch import Rollout, build_batch, completion_length, group_rollouts

EOS, PAD = 2, 0


def _r(prompt: list[int], comp: list[int], gid: str = "g", version: int = 0) -> Rollout:
    return Rollout(
        group_id=gid,
        prompt_ids=prompt,
        completion_ids=comp,
        behaviour_logprobs=[-0.1 * (i + 1) for i in range(len(comp))],
        policy_version=version,
        reward=0.5,
    )


def test_completion_mask_includes_eos_and_nothing_after() -> None:
    rs = [_r([1, 5, 3], [7, 8, EOS, 9, 9]), _r([1, 5, 6, 7, 3], [4, 5, 6]), _r([1, 3], [EOS])]
    b = build_batch(rs, [1.0, -1.0, 0.0], [0, 1, 2], pad_token_id=PAD, eos_token_id=EOS)
    assert b.prompt_len == 5 and b.completion_ids.shape == (3, 3)
    assert b.completion_mask.tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0]]
    assert b.completion_ids.tolist() == [[7, 8, EOS], [4, 5, 6], [EOS, PAD, PAD]]
    assert b.behaviour_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.behaviour_logprobs[2].tolist() == pytest.approx([-0.1, 0.0, 0.0])
    # left-padded prompt, right-padded completion, positions count real tokens only
    assert b.input_ids[0].tolist() == [PAD, PAD, 1, 5, 3, 7, 8, EOS]
    assert b.attention_mask[2].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert b.position_ids[0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    assert b.position_ids[2][3:6].tolist() == [0, 1, 2]
    assert b.advantages.tolist() == [1.0, -1.0, 0.0]
    assert b.staleness.tolist() == [0, 1, 2]
    assert b.rewards.dtype == torch.float32


def test_completion_length() -> None:
    assert completion_length([5, EOS, EOS], EOS) == 2
    assert completion_length([5, 6], EOS) == 2
    assert completion_length([], EOS) == 0


def test_logprob_count_must_match() -> None:
    bad = Rollout("g7", [1, 3], [4, 5], [-0.1], 0, 0.0)
    with pytest.raises(ValueError, match="g7"):
        build_batch([bad], [0.0], [0], pad_token_id=PAD, eos_token_id=EOS)


def test_group_rollouts_keeps_first_appearance_order() -> None:
    rs = [_r([1], [2], "b"), _r([1], [2], "a"), _r([1], [2], "b")]
    assert [[r.group_id for r in g] for g in group_rollouts(rs)] == [["b", "b"], ["a"]]
