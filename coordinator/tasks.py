"""Prompt sources and task verifiers: where prompts come from and how rewards are computed.

Rewards are always computed here, on the coordinator, from the completion text; a node never
supplies a reward that counts (DESIGN.md §7, check 6).

- :class:`ReverseTask`: the embedded default, a procedural task ("reverse ``abc``" → ``cba``) that
  a tiny model learns from scratch with GRPO. Dense reward = fraction of positions right, EOS
  included (pure 0/1 gives no signal from a random init: DESIGN.md §10).
- :class:`JsonlMathTask` (in :mod:`coordinator.datasets`): GSM8K-style JSONL with ``math-verify``.
- :class:`ArithmeticTask` (in :mod:`coordinator.arith`): arithmetic word problems for small instruct
  models, answers in ``\\boxed{}``, rewarded with ``math-verify``.

A task is deterministic from ``(seed, index)``, so the prompt a lease carries is the coordinator's
choice and can be re-derived on restart.

The math tasks keep a **held-out split** out of their training stream, the same for every seed
(:func:`heldout_problems`; ``arith``: one sum in five, ``jsonl:PATH``: one question in ten, both by
hash): the prompts of the held-out evaluation (:mod:`policy.evaluation`). The reversal tasks have
none (their whole space is a few hundred strings, all of which training visits).
"""

from __future__ import annotations

import random

from coordinator.problems import Problem, Task

__all__ = ["ReverseTask", "heldout_problems", "make_task"]


class ReverseTask:
    """Reverse a random string of ``length`` characters over ``alphabet``."""

    def __init__(self, length: int = 3, alphabet: str = "abcd", seed: int = 0) -> None:
        if length < 1:
            raise ValueError("reverse task: length must be at least 1")
        if len(set(alphabet)) != len(alphabet) or not alphabet.isalpha():
            raise ValueError(f"reverse task: alphabet {alphabet!r} must be distinct letters")
        self.length = length
        self.alphabet = alphabet
        self.seed = seed
        self.name = f"reverse{length}"

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"{self.name}:{self.alphabet}:{self.seed}:{index}")
        text = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Problem(prompt_id=f"{self.name}:{index:08d}", prompt=text, answer=text[::-1])

    def reward(self, problem: Problem, completion: str, finished: bool) -> float:
        target = problem.answer
        right = sum(1 for a, b in zip(completion, target, strict=False) if a == b)
        eos_right = finished and len(completion) == len(target)
        return (right + int(eos_right)) / (len(target) + 1)

    def exact(self, problem: Problem, completion: str, finished: bool) -> bool:
        return finished and completion == problem.answer


def make_task(name: str, seed: int = 0, *, format_reward: float = 0.0) -> Task:
    """Task by name: ``reverse3`` / ``reverseN`` (embedded), ``arith`` / ``arith-words`` (with
    ``:N``, the operand bound) or ``jsonl:PATH`` (math-verify); ``format_reward`` applies to the
    math tasks."""
    known = "use reverse3, reverse4, ..., arith, arith-words (:N = operands up to N), jsonl:PATH"
    if name.startswith("reverse"):
        suffix = name.removeprefix("reverse") or "3"
        if not suffix.isdigit():
            raise ValueError(f"unknown task {name!r}: {known}")
        return ReverseTask(length=int(suffix), seed=seed)
    base, _, suffix = name.partition(":")
    if base in ("arith", "arith-words"):
        from coordinator.arith import ArithmeticTask

        if not (suffix or "20").isdigit():
            raise ValueError(f"unknown task {name!r}: {known}")
        return ArithmeticTask(
            seed,
            max_operand=int(suffix or 20),
            words=base == "arith-words",
            format_reward=format_reward,
        )
    if name.startswith("jsonl:"):
        from coordinator.datasets import JsonlMathTask

        return JsonlMathTask(name.removeprefix("jsonl:"), seed=seed, format_reward=format_reward)
    raise ValueError(f"unknown task {name!r}: {known}")


def heldout_problems(task: Task, n: int) -> list[Problem]:
    """The first ``n`` problems of ``task``'s held-out split (disjoint from every problem
    ``task.problem(i)`` gives); ValueError naming the task when it has no split or too few."""
    if n < 1:
        raise ValueError(f"eval_prompts must be >= 1, got {n}")
    heldout = getattr(task, "heldout", None)
    if not callable(heldout):
        raise ValueError(
            f"task {task.name} has no held-out split; the held-out evaluation needs arith, "
            "arith-words (:N) or jsonl:PATH"
        )
    problems: list[Problem] = heldout(n)
    return problems
