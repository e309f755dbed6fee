"""Token-budgeted micro-batches: one minibatch (one optimizer update) as several forward/backward
passes whose gradients accumulate.

A rank's share of a minibatch is a padded :class:`~trainer.batch.TrainBatch` of ``N`` rows and
``P + T`` columns. :func:`plan_micro_batches` cuts it into groups of rows whose *padded* size
(rows × (longest prompt + longest completion) among those rows) stays within ``token_budget``;
each part is trimmed to its own widths, so short sequences do not pay for the longest one.
Rows are taken longest first (little padding per part); a row longer than the budget gets a part
of its own. The loss of every part is normalised by the token count of the whole (global)
minibatch, so the accumulated gradient equals the one-pass gradient (up to float rounding).

Trimming keeps the layout of :func:`~trainer.batch.build_batch` (prompt left-padded, completion
right-padded): the last ``P_part`` prompt columns and the first ``T_part`` completion columns,
positions unchanged (they only count real tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.batch import TrainBatch


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``rows`` of a minibatch, trimmed to their own padded widths."""

    #: ``[n]`` int64 row indices into the minibatch (ascending).
    rows: Tensor
    #: the rows as a batch of their own (``prompt_len`` and completion width of these rows).
    batch: TrainBatch

    @property
    def width(self) -> int:
        """Completion columns kept (``T_part``): the part's values go to ``[:, :width]``."""
        return int(self.batch.completion_ids.shape[1])

    def take(self, tensor: Tensor) -> Tensor:
        """The part's rows and completion columns of a minibatch-shaped ``[N, T]`` tensor."""
        return tensor[self.rows][:, : self.width]


def plan_micro_batches(batch: TrainBatch, token_budget: int | None) -> list[MicroBatch]:
    """Split ``batch`` into micro-batches of at most ``token_budget`` padded tokens each (see the
    module docstring); ``None`` keeps it whole (one part, untrimmed)."""
    n = batch.size
    if token_budget is None or n == 0:
        return [MicroBatch(rows=torch.arange(n), batch=batch)] if n else []
    p_len = batch.prompt_len
    prompt = batch.attention_mask[:, :p_len].sum(dim=1).tolist()
    completion = batch.completion_mask.sum(dim=1).long().tolist()
    order = sorted(range(n), key=lambda i: (-(prompt[i] + completion[i]), i))
    parts: list[list[int]] = []
    max_p = max_t = 0
    for i in order:
        p, t = max(max_p, prompt[i]), max(max_t, completion[i])
        if parts and (len(parts[-1]) + 1) * (p + t) <= token_budget:
            parts[-1].append(i)
            max_p, max_t = p, t
        else:
            parts.append([i])
            max_p, max_t = prompt[i], completion[i]
    return [_take_rows(batch, sorted(part)) for part in parts]


def _take_rows(batch: TrainBatch, rows: list[int]) -> MicroBatch:
    idx = torch.tensor(rows, dtype=torch.long)
    p_len = batch.prompt_len
    p_part = max(1, int(batch.attention_mask[idx, :p_len].sum(dim=1).max()))
    t_part = int(batch.completion_mask[idx].sum(dim=1).max())
    cols = slice(p_len - p_part, p_len + t_part)
    on = batch.input_ids.device
    dev_idx = idx.to(on)
    part = TrainBatch(
        input_ids=batch.input_ids[dev_idx, cols],
        attention_mask=batch.attention_mask[dev_idx, cols],
        position_ids=batch.position_ids[dev_idx, cols],
        completion_ids=batch.completion_ids[dev_idx, :t_part],
        completion_mask=batch.completion_mask[dev_idx, :t_part],
        behaviour_logprobs=batch.behaviour_logprobs[dev_idx, :t_part],
        advantages=batch.advantages[dev_idx],
        staleness=batch.staleness[dev_idx],
        rewards=batch.rewards[dev_idx],
        prompt_len=p_part,
    )
    return MicroBatch(rows=dev_idx, batch=part)
