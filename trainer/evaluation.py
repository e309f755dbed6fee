"""The held-out evaluation in the trainer process: when, on which weights, and where it goes.

The learner holds each version's weights first, so the held-out score of version ``v`` is taken
here (:mod:`policy.evaluation` defines the protocol), at version 0 (the base model; at start, the
version the run starts from) and every ``eval_every`` versions after.

Off the critical path: at a due step boundary the learner only copies its weights (the trainable
parameters; under FSDP2 the gathered full state dict, a collective every rank joins, like a
publication); a worker thread loads them into a *replica* of the model (a copy taken before the
engine wrapped it for training, so it has the same modules and adapters, whatever they are) and
decodes there while the learner goes on with the next steps. Only rank 0 holds a replica and a
worker. When an evaluation is still running as the next one falls due, the newer weights wait in
a one-deep slot (an older waiting one is dropped and counted in ``eval_skipped``). Its cost is
visible: ``eval_s`` in the record, the seconds spent copying in ``eval_snapshot_s``.

Results go to ``metrics.jsonl`` (a line with ``"record": "eval"``), to callbacks (the process
reports them to the coordinator's ``/status`` with the learner's figures) and to :meth:`stats`.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from policy.evaluation import EvalResult, HeldOutEvaluator
    from trainer.config import TrainerConfig
    from trainer.distributed import DistContext
    from trainer.engine import Engine
    from trainer.metrics import MetricsWriter

log = logging.getLogger(__name__)

#: points of the held-out curve reported on /status (older ones are thinned, never the first)
CURVE_POINTS = 200


def make_replica(model: torch.nn.Module) -> torch.nn.Module:
    """An evaluation copy of ``model`` as built (before the engine prepares it), frozen."""
    replica = copy.deepcopy(model)
    replica.requires_grad_(False)
    replica.eval()
    return replica


class EvalRunner:
    """Takes the weights at due versions and evaluates them in a worker thread (rank 0).

    Every rank calls :meth:`after_step` at the same step boundaries (a sharded snapshot is a
    collective); rank 0 alone evaluates, once :meth:`attach` gave it the evaluator."""

    def __init__(
        self,
        config: TrainerConfig,
        dist: DistContext,
        replica: torch.nn.Module | None,
        *,
        threads: int = 1,
    ) -> None:
        if config.eval_every is None:
            raise ValueError("EvalRunner needs eval_every")
        self.every = config.eval_every
        self.dist = dist
        self.replica = replica if dist.is_leader else None
        self.threads = max(1, threads)
        self.evaluator: HeldOutEvaluator | None = None
        self.metrics: MetricsWriter | None = None
        #: called with each result's record, on the worker thread
        self.on_result: list[Callable[[dict[str, Any]], None]] = []
        #: called by :meth:`close` once the worker is done (e.g. the grader's process)
        self.closers: list[Callable[[], object]] = []
        self.results: list[EvalResult] = []
        self.skipped = 0
        self.snapshot_s = 0.0
        self._last_version: int | None = None
        self._cond = threading.Condition()
        #: (version, step, weights, Unix time they were taken) waiting for the worker
        self._pending: tuple[int, int, dict[str, torch.Tensor], float] | None = None
        self._busy = False
        self._closing = False
        self._thread: threading.Thread | None = None

    def attach(self, evaluator: HeldOutEvaluator, metrics: MetricsWriter | None) -> None:
        """Rank 0: what to evaluate with and where records go; starts the worker."""
        if self.replica is None:
            raise ValueError("only rank 0 evaluates (it holds the replica)")
        self.evaluator = evaluator
        self.metrics = metrics
        self._thread = threading.Thread(target=self._work, name="heldout-eval", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the learner's side
    def due(self, version: int, *, start: bool = False) -> bool:
        """Whether ``version`` is evaluated: the version a run starts from, then every
        ``eval_every``-th; never twice."""
        if version == self._last_version:
            return False
        return start or version % self.every == 0

    def after_step(
        self,
        model: torch.nn.Module,
        engine: Engine,
        version: int,
        step: int,
        *,
        start: bool = False,
    ) -> None:
        """At a step boundary (every rank): copy the weights if ``version`` is due and hand them
        to the worker. Only the trainable parameters are copied (the rest of the replica is the
        model as built and never changes); sharded, the gathered full state dict."""
        if not self.due(version, start=start):
            return
        self._last_version = version
        t0 = time.monotonic()
        if engine.sharded:
            state = engine.full_state_dict(model)  # a collective: every rank is here
        elif self.replica is not None:
            state = {
                name: p.detach().to("cpu", copy=True)
                for name, p in model.named_parameters()
                if p.requires_grad
            }
        else:
            state = {}
        taken_at = time.time()
        self.snapshot_s += time.monotonic() - t0
        if self.replica is None or self.evaluator is None:
            return
        with self._cond:
            if self._pending is not None:
                self.skipped += 1
                log.warning(
                    "held-out evaluation of v%d dropped: the one before is still running and "
                    "v%d is newer (raise eval_every)", self._pending[0], version,
                )  # fmt: skip
            self._pending = (version, step, state, taken_at)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                assert self._pending is not None
                version, step, state, taken_at = self._pending
                self._pending = None
                self._busy = True
            try:
                self._evaluate(version, step, state, taken_at)
            except Exception:  # an evaluation failure must not stop the learner
                log.exception("held-out evaluation of v%d failed", version)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _evaluate(
        self, version: int, step: int, state: dict[str, torch.Tensor], taken_at: float
    ) -> None:
        from policy.evaluation import EvalInterrupted

        assert self.replica is not None and self.evaluator is not None
        _load_into(self.replica, state)
        del state
        try:
            result = self.evaluator.evaluate(
                self.replica, version, step=step, should_stop=lambda: self._closing
            )
        except EvalInterrupted:
            return
        self.results.append(result)
        record = result.record()
        record["eval_skipped"] = self.skipped
        record["eval_snapshot_s"] = round(self.snapshot_s, 3)
        # Unix times: when the weights were taken (the version's place in wall time) and scored
        record["taken_at"] = round(taken_at, 3)
        record["finished_at"] = round(time.time(), 3)
        log.info(
            "held-out v%d: greedy %.3f [%.3f, %.3f] pass@1 %s (%d prompts, %.1f s)",
            version, result.greedy_acc, result.greedy_lo, result.greedy_hi,
            "-" if result.pass1 is None else f"{result.pass1:.3f}", result.prompts,
            result.eval_s,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.write_eval(record)
        for callback in self.on_result:
            callback(record)

    # ------------------------------------------------------------------ reading and stopping
    def stats(self) -> dict[str, Any]:
        """The latest result and the curve, as learner figures for ``/status`` (``eval_*``;
        lists hold at most :data:`CURVE_POINTS` points)."""
        results = list(self.results)
        if not results:
            return {}
        last, base = results[-1], results[0]
        curve = _thin(results, CURVE_POINTS)
        return {
            "eval_version": last.version,
            "eval_step": last.step,
            "eval_prompts": last.prompts,
            "eval_samples": last.samples,
            "eval_greedy_acc": last.greedy_acc,
            "eval_greedy_lo": last.greedy_lo,
            "eval_greedy_hi": last.greedy_hi,
            "eval_pass1": last.pass1,
            "eval_pass1_lo": last.pass1_lo,
            "eval_pass1_hi": last.pass1_hi,
            "eval_s": round(last.eval_s, 2),
            "eval_skipped": self.skipped,
            "eval_base_version": base.version,
            "eval_base_greedy_acc": base.greedy_acc,
            "eval_base_pass1": base.pass1,
            "eval_curve_version": [r.version for r in curve],
            "eval_curve_greedy": [round(r.greedy_acc, 4) for r in curve],
            "eval_curve_greedy_lo": [round(r.greedy_lo, 4) for r in curve],
            "eval_curve_greedy_hi": [round(r.greedy_hi, 4) for r in curve],
            "eval_curve_pass1": [None if r.pass1 is None else round(r.pass1, 4) for r in curve],
        }

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is pending or running (tests, a final report); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: an evaluation in progress ends at its next batch, unrecorded."""
        with self._cond:
            self._closing = True
            self._pending = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for closer in self.closers:
            closer()
        self.closers = []


def _load_into(replica: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the replica's parameters and buffers (names must all exist there)."""
    targets: dict[str, torch.Tensor] = dict(replica.named_parameters(remove_duplicate=False))
    targets |= dict(replica.named_buffers(remove_duplicate=False))
    unknown = [k for k in state if k not in targets]
    if unknown:
        raise ValueError(f"weights do not fit the evaluation replica: {sorted(unknown)[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            targets[name].copy_(tensor)


def _thin(results: list[EvalResult], limit: int) -> list[EvalResult]:
    """At most ``limit`` results: the first, the newest half in full, every second older one."""
    out = list(results)
    while len(out) > limit:
        half = len(out) // 2
        out = out[:half:2] + out[half:]
    return out
