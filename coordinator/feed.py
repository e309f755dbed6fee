"""The trainer's side of the coordinator: accepted rollouts in arrival order, and its reports.

:class:`RolloutFeed` reads the stored rollouts for the learner (:meth:`RolloutFeed.fetch`) and
hands the learner's figures (step, rollout cursor, step time) to the
:class:`~coordinator.ledger.Ledger` (:meth:`RolloutFeed.learner_report`).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.ledger import Ledger
from coordinator.store import Store
from protocol.identity import fingerprint_of
from protocol.messages import AcceptedRollout, RolloutBatch


class RolloutFeed:
    """Accepted rollouts for the trainer, and the trainer's consumption reports."""

    def __init__(self, store: Store, ledger: Ledger, clock: Callable[[], float]) -> None:
        self.store = store
        self.ledger = ledger
        self.clock = clock

    def learner_report(self, step: int, cursor: int, step_time_s: float) -> None:
        """The trainer's figures with a fetch (:meth:`coordinator.ledger.Ledger.learner_report`)."""
        self.ledger.learner_report(step, cursor, step_time_s, self.clock())

    def fetch(
        self, after_seq: int, max_rollouts: int, min_policy_version: int | None = None
    ) -> RolloutBatch:
        """Accepted rollouts with ``seq > after_seq`` in arrival order (the trainer's feed); with
        ``min_policy_version``, older ones are skipped in the query (a stale backlog costs the
        learner nothing: it never travels)."""
        rows = self.store.rollouts_after(after_seq, max_rollouts, min_policy_version)
        last = rows[-1].seq if rows else after_seq
        return RolloutBatch(
            rollouts=[
                AcceptedRollout(
                    seq=r.seq,
                    lease_id=r.lease_id,
                    prompt_id=r.prompt_id,
                    sample_index=r.sample_index,
                    group_size=r.group_size,
                    prompt_token_ids=r.prompt_tokens,
                    completion_token_ids=r.completion_tokens,
                    behaviour_logprobs=r.logprobs,
                    finish_reason=r.finish_reason,  # type: ignore[arg-type]
                    policy_version=r.version,
                    reward=r.reward,
                    node_fingerprint=fingerprint_of(r.node_key),
                )
                for r in rows
            ],
            last_seq=last,
        )
