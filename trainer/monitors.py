"""Stability monitors: early signs that learning on stale rollouts is about to collapse.

Each learner step reports the health of its behaviour weights and of its update (ESS, mismatch
KL, clip and mask fractions, gradient norm: :meth:`~trainer.step.LearnerStep.train_step`). A single
step is noisy, so :class:`StabilityMonitor` compares the mean of the last ``window`` steps with a
threshold per figure; the thresholds are the ones ``bench/staleness.py`` found to precede a
collapse of the exact match (docs/benchmarks.md, section staleness) and live in
:class:`~trainer.config.TrainerConfig` (``warn_*``). The result is one human-readable line
(``stability_warning`` in the step record, ``trainer_stability_warning`` in ``/status``), empty
while every figure is inside its bound.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bound:
    """One monitored step figure and the side on which its rolling mean is alarming."""

    #: key in the step record, e.g. ``"mismatch_kl"``.
    figure: str
    #: the threshold; None disables this bound.
    limit: float | None
    #: True: warn when the mean is above ``limit``; False: when it is below.
    above: bool


class StabilityMonitor:
    """Rolling means of the monitored figures against their bounds."""

    def __init__(self, bounds: list[Bound], *, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.bounds = [b for b in bounds if b.limit is not None]
        self.window = window
        self._history: dict[str, deque[float]] = {
            b.figure: deque(maxlen=window) for b in self.bounds
        }
        self._alarmed: frozenset[str] = frozenset()

    def observe(self, record: Mapping[str, object]) -> str:
        """Add one step record; return the warning line ("" when every bound holds). Logs a
        WARNING when the line changes to a new alarm and an INFO line when it clears."""
        crossed: list[str] = []
        names: set[str] = set()
        for b in self.bounds:
            value = record.get(b.figure)
            hist = self._history[b.figure]
            if isinstance(value, int | float) and not isinstance(value, bool):
                hist.append(float(value))
            if len(hist) < self.window:
                continue  # too few steps for a mean that means something
            mean = sum(hist) / len(hist)
            assert b.limit is not None
            if (mean > b.limit) if b.above else (mean < b.limit):
                sign = ">" if b.above else "<"
                crossed.append(f"{b.figure} {mean:.3g} {sign} {b.limit:g}")
                names.add(b.figure)
        line = "; ".join(crossed)
        if names and not names <= self._alarmed:
            log.warning(
                "stability warning (mean of the last %d steps): %s; learning may be about to "
                "collapse: lower the staleness bound S or the learning rate",
                self.window,
                line,
            )
        elif not names and self._alarmed:
            log.info("stability warning cleared")
        self._alarmed = frozenset(names)
        return line


class GradSpikeGuard:
    """Tells the trainer to skip an update whose gradient norm (before clipping) is more than
    ``factor`` times the median of the last ``window`` updates' norms.

    One such update is typically a single off-distribution sample (a rare token of a stale
    rollout, or a lone wrong answer with a large negative advantage in a group that is otherwise
    right) whose gradient dominates the minibatch; AdamW then takes a full-size step in its
    direction. Skipping it is the remedy large pre-training runs use for loss spikes. Every norm
    enters the history (a lasting shift of the norm moves the median, so skipping stops); no
    verdict before ``warmup`` norms were seen. The norm is all-reduced, so every rank agrees.
    """

    def __init__(self, factor: float | None, *, window: int = 50, warmup: int = 20) -> None:
        self.factor = factor
        self.warmup = warmup
        self._norms: deque[float] = deque(maxlen=window)

    @property
    def history(self) -> list[float]:
        """The recent norms the median is taken over, oldest first (saved in checkpoints)."""
        return list(self._norms)

    def restore(self, norms: list[float]) -> None:
        """Continue from a saved :attr:`history` (a restarted trainer keeps its warm-up done)."""
        self._norms.clear()
        self._norms.extend(float(n) for n in norms)

    def skip(self, norm: float) -> bool:
        """Record ``norm``; True when the update that produced it should be skipped."""
        spike = (
            self.factor is not None
            and len(self._norms) >= self.warmup
            and norm > self.factor * statistics.median(self._norms)
        )
        self._norms.append(norm)
        if spike:
            log.warning(
                "skipped an update: gradient norm %.3g > %g × the recent median", norm, self.factor
            )
        return spike


def monitor_from_config(cfg: TrainerConfig) -> StabilityMonitor:
    """The monitor with the ``warn_*`` bounds of ``cfg``."""
    return StabilityMonitor(
        [
            Bound("ess_frac", cfg.warn_ess_frac_below, above=False),
            Bound("mismatch_kl", cfg.warn_mismatch_kl_above, above=True),
            Bound("out_of_support_frac", cfg.warn_out_of_support_frac_above, above=True),
            Bound("clip_frac", cfg.warn_clip_frac_above, above=True),
            Bound("mask_frac", cfg.warn_mask_frac_above, above=True),
            Bound("grad_norm", cfg.warn_grad_norm_above, above=True),
        ],
        window=cfg.warn_window,
    )
