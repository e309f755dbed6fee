"""Accepted rollouts → padded tensors.

:class:`Rollout` is the record the trainer consumes (the coordinator's ``AcceptedRollout`` is mapped
into it by the rollout source). :func:`build_batch` lays a list of rollouts out as

    input_ids  [N, P+T]   left-padded prompt | right-padded completion
    completion [N, T]     completion ids, mask 1 on every token up to and including the first EOS

so that the logits predicting completion token ``t`` sit at column ``P−1+t`` and positions are
``cumsum(attention_mask) − 1`` — the same layout the nodes and the coordinator's re-scorer use,
which is what makes recomputed log-probs match the logged ones (DESIGN.md §10 pitfalls).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rollout:
    """One verified sample, as the trainer needs it."""

    #: Samples with the same ``group_id`` form one GRPO group (same prompt, same policy version).
    group_id: str
    #: Prompt token ids (no padding).
    prompt_ids: Sequence[int]
    #: Sampled token ids; includes the EOS token when the sample stopped (anything after the first
    #: EOS is ignored).
    completion_ids: Sequence[int]
    #: log μ(token) per completion token, logged by the node at sampling time; same length as
    #: ``completion_ids``.
    behaviour_logprobs: Sequence[float]
    #: Policy version v the node sampled with.
    policy_version: int
    #: Reward recomputed by the coordinator's verifier.
    reward: float
    #: Position in the coordinator's accepted-rollout stream (monotonic); the trainer saves the
    #: highest one it consumed as its resume cursor. 0 when the source has no cursor.
    seq: int = 0


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors for a list of rollouts (N sequences)."""

    #: ``[N, P+T]`` int64, prompt left-padded to P, completion right-padded to T.
    input_ids: Tensor
    #: ``[N, P+T]`` int64, 1 on real tokens.
    attention_mask: Tensor
    #: ``[N, P+T]`` int64, ``cumsum(attention_mask) − 1`` (0 on left padding).
    position_ids: Tensor
    #: ``[N, T]`` int64 completion ids (pad after the end).
    completion_ids: Tensor
    #: ``[N, T]`` float32, 1 on completion tokens up to and including the first EOS, else 0.
    completion_mask: Tensor
    #: ``[N, T]`` float32 behaviour log-probs (0 on padding).
    behaviour_logprobs: Tensor
    #: ``[N]`` float32 advantages.
    advantages: Tensor
    #: ``[N]`` int64 staleness Δ.
    staleness: Tensor
    #: ``[N]`` float32 rewards.
    rewards: Tensor
    #: padded prompt length P (completion logits are ``logits[:, P−1 : P−1+T]``).
    prompt_len: int

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device``."""
        return TrainBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            completion_ids=self.completion_ids.to(device),
            completion_mask=self.completion_mask.to(device),
            behaviour_logprobs=self.behaviour_logprobs.to(device),
            advantages=self.advantages.to(device),
            staleness=self.staleness.to(device),
            rewards=self.rewards.to(device),
            prompt_len=self.prompt_len,
        )


def completion_length(completion_ids: Sequence[int], eos_token_id: int | Collection[int]) -> int:
    """Number of trained tokens: up to and including the first stop token (``eos_token_id``: one
    id or the lease's whole stop set), else all of them."""
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    for i, tok in enumerate(completion_ids):
        if int(tok) in stops:
            return i + 1
    return len(completion_ids)


def build_batch(
    rollouts: Sequence[Rollout],
    advantages: Sequence[float],
    staleness: Sequence[int],
    *,
    pad_token_id: int,
    eos_token_id: int | Collection[int],
) -> TrainBatch:
    """Pad ``rollouts`` into a :class:`TrainBatch`; ``advantages``/``staleness`` are per rollout.

    Raises ValueError when a rollout's log-probs do not match its completion length or its prompt is
    empty (the first completion token needs a prompt token to be predicted from).
    """
    if not (len(rollouts) == len(advantages) == len(staleness)):
        raise ValueError("build_batch: rollouts, advantages and staleness must have equal length")
    for r in rollouts:
        if len(r.behaviour_logprobs) != len(r.completion_ids):
            raise ValueError(
                f"rollout in group {r.group_id!r}: {len(r.behaviour_logprobs)} log-probs for "
                f"{len(r.completion_ids)} completion tokens; the node must log one per token"
            )
        if len(r.prompt_ids) == 0:
            raise ValueError(f"rollout in group {r.group_id!r} has an empty prompt")
    n = len(rollouts)
    lengths = [completion_length(r.completion_ids, eos_token_id) for r in rollouts]
    p_len = max((len(r.prompt_ids) for r in rollouts), default=1)
    t_len = max(lengths, default=0)
    input_ids = torch.full((n, p_len + t_len), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, p_len + t_len), dtype=torch.long)
    completion = torch.full((n, t_len), pad_token_id, dtype=torch.long)
    cmask = torch.zeros((n, t_len), dtype=torch.float32)
    blogp = torch.zeros((n, t_len), dtype=torch.float32)
    for i, (r, length) in enumerate(zip(rollouts, lengths, strict=True)):
        prompt = torch.as_tensor(list(r.prompt_ids), dtype=torch.long)
        input_ids[i, p_len - len(prompt) : p_len] = prompt
        attention[i, p_len - len(prompt) : p_len] = 1
        if length:
            comp = torch.as_tensor(list(r.completion_ids[:length]), dtype=torch.long)
            input_ids[i, p_len : p_len + length] = comp
            attention[i, p_len : p_len + length] = 1
            completion[i, :length] = comp
            cmask[i, :length] = 1.0
            blogp[i, :length] = torch.as_tensor(
                [float(x) for x in r.behaviour_logprobs[:length]], dtype=torch.float32
            )
    position_ids = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        completion_ids=completion,
        completion_mask=cmask,
        behaviour_logprobs=blogp,
        advantages=torch.as_tensor(list(advantages), dtype=torch.float32),
        staleness=torch.as_tensor(list(staleness), dtype=torch.long),
        rewards=torch.as_tensor([float(r.reward) for r in rollouts], dtype=torch.float32),
        prompt_len=p_len,
    )


def group_rollouts(rollouts: Sequence[Rollout]) -> list[list[Rollout]]:
    """Rollouts grouped by ``group_id``, groups in order of first appearance."""
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    return list(groups.values())
