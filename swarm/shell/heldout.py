"""The held-out evaluation, put together: a task's held-out split, rendered and graded.

Three packages meet here, so neither role imports the other's internals: the task and its
verifier are the coordinator's (:func:`coordinator.tasks.heldout_problems`, the task's
``exact``), the protocol and decoding loop are the sampling contract's
(:mod:`policy.evaluation`, :mod:`policy.prompts`), and the trainer process runs it on its own
weights (:mod:`trainer.evaluation`). ``swarm trainer run`` hands :func:`start_evaluation` to the
trainer (:data:`trainer.main.StartEvaluation`), which calls it once set up: like the CLI, the shell
composes the roles, so the trainer imports neither the coordinator nor the shell.

The prompts are rendered the way the coordinator renders a lease's (the same
:class:`~policy.prompts.PromptRenderer`: the template the coordinator reports on ``rswarm/status``
and the system prompt the trainer is told, ``eval_system_prompt``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policy.evaluation import EvalItem, HeldOutEvaluator
from policy.model import ModelSpec, load_tokenizer
from policy.prompts import PromptRenderer, PromptTemplate

__all__ = ["build_evaluator", "start_evaluation"]


def build_evaluator(
    task_name: str,
    spec: ModelSpec,
    *,
    prompts: int,
    samples: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    template: PromptTemplate = "auto",
    system_prompt: str | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[HeldOutEvaluator, Any]:
    """``(evaluator, task)`` for the first ``prompts`` held-out problems of ``task_name``; the
    caller closes the task (its verifier runs in a worker process) when done. ValueError (one
    line) for a task without a held-out split or too few held-out problems."""
    from coordinator.tasks import heldout_problems, make_task

    task = make_task(task_name)
    try:
        problems = heldout_problems(task, prompts)
        tokenizer = load_tokenizer(spec)
        renderer = PromptRenderer(tokenizer, template=template, system_prompt=system_prompt)
        items = [
            EvalItem(p.prompt_id, tuple(renderer.render(p.prompt)), p.answer) for p in problems
        ]

        def grade(answer: str, completion: str) -> bool:
            from coordinator.problems import Problem

            return bool(task.exact(Problem("heldout", "", answer), completion, True))

        evaluator = HeldOutEvaluator(
            items,
            grade,
            tokenizer.decode,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            pad_id=tokenizer.pad_token_id,
            samples=samples,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
    except BaseException:
        close = getattr(task, "close", None)
        if callable(close):
            close()
        raise
    return evaluator, task


def start_evaluation(
    trainer: Any, status: dict[str, Any], stop_ids: Sequence[int], source: Any
) -> Any:
    """Give ``trainer``'s held-out evaluation (``eval_every``; rank 0) its evaluator, built from
    its config, the sampling contract it adopted and the coordinator's ``status`` (the prompt
    template, the leases' ``max_new_tokens``); each result goes to metrics.jsonl and into
    ``source.stats`` (reported to ``/status``). Returns the task, for the caller to close."""
    cfg = trainer.config
    found = status.get("sampling")
    sampling: dict[str, Any] = found if isinstance(found, dict) else {}
    template = sampling.get("prompt_template", "auto")
    max_new = cfg.eval_max_new_tokens or sampling.get("max_new_tokens")
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise ValueError(
            "eval_max_new_tokens: the coordinator does not report its max_new_tokens; set "
            "eval_max_new_tokens"
        )
    processing = cfg.processing
    evaluator, task = build_evaluator(
        cfg.eval_task,
        ModelSpec(path=cfg.model_path, dtype=cfg.dtype),
        prompts=cfg.eval_prompts,
        samples=cfg.eval_samples,
        max_new_tokens=max_new,
        stop_ids=sorted(set(stop_ids) | set(trainer.stop_token_ids)),
        template=template if template in ("auto", "chat", "plain") else "auto",
        system_prompt=cfg.eval_system_prompt,
        temperature=float(processing["temperature"]),
        top_p=float(processing["top_p"]),
        top_k=int(processing["top_k"]),
    )
    runner = trainer.evaluation

    def report(record: dict[str, Any]) -> None:
        # the step thread swaps source.stats too: build aside, swap in one assignment
        source.stats = {**source.stats, **runner.stats()}

    runner.on_result.append(report)
    runner.closers.append(getattr(task, "close", lambda: None))
    runner.attach(evaluator, trainer.metrics)
    return task
