"""``arith``: procedural one- and two-digit arithmetic problems, answers in ``\\boxed{}``.

Sized for a small instruct model on CPU: each problem is one addition or subtraction of two
numbers in 1..``max_operand`` (never a negative result), followed by "Put the final answer in
\\boxed{}.". Two styles:

* ``arith``       -- the bare question, "What is 7 + 15?" (SmolLM2-135M-Instruct answers about a
  third of them right from the start at T = 0.7, in ~20 tokens: most GRPO groups hold both right
  and wrong answers, which is what the learner needs);
* ``arith-words`` -- the same sums told as a short story from a few templates ("Sam has 7 apples.
  Sam gets 15 more apples. ..."): harder for a 135M model (under a tenth right at the start).

The reward is :class:`~coordinator.datasets.MathReward` (math-verify on the coordinator; optional
format share). ``arith:N`` / ``arith-words:N`` set ``max_operand`` (default 20).

**Held-out split** (the held-out evaluation, :mod:`policy.evaluation`): a problem is its sum,
``(a, op, b)`` (``a + b`` and ``b + a`` are one sum); one sum in :data:`HELDOUT_EVERY` is held out
by a hash of the sum (:func:`~coordinator.datasets.held_out`), the same for every seed.
:meth:`ArithmeticTask.problem` never gives a held-out sum (a draw that lands on one is drawn
again), so a held-out problem is a sum the learner never trains on, told in any story;
:meth:`ArithmeticTask.heldout` lists them.
"""

from __future__ import annotations

import random

from coordinator.datasets import EqualFn, MathReward, held_out, math_equal
from coordinator.problems import Problem

__all__ = ["ArithmeticTask"]

_NAMES = ("Sam", "Mia", "Tom", "Ana", "Leo", "Zoe", "Ben", "Ivy")
_THINGS = ("apples", "marbles", "stickers", "books", "coins", "cookies", "pencils", "shells")
_ADD = (
    "{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?",
    "There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in all?",
    "{n} collected {a} {t} on Monday and {b} {t} on Tuesday. How many {t} did {n} collect?",
)
_SUB = (
    "{n} has {a} {t}. {n} gives away {b} {t}. How many {t} does {n} have left?",
    "There are {a} {t} in a jar. {n} takes {b} of them. How many {t} are left in the jar?",
    "{n} had {a} {t} and lost {b} of them. How many {t} does {n} have now?",
)
INSTRUCTION = "Put the final answer in \\boxed{}."
#: one sum in this many is held out of training (119 of the 420 sums with operands to 20)
HELDOUT_EVERY = 4


class ArithmeticTask:
    """Arithmetic word problems (see the module docstring); deterministic from (seed, index)."""

    def __init__(
        self,
        seed: int = 0,
        *,
        max_operand: int = 20,
        words: bool = False,
        format_reward: float = 0.0,
        timeout_s: float = 5.0,
        equal_fn: EqualFn = math_equal,
    ) -> None:
        if not 2 <= max_operand <= 99:
            raise ValueError(f"arith: max_operand must be in 2..99, got {max_operand}")
        self.seed = seed
        self.max_operand = max_operand
        self.words = words
        base = "arith-words" if words else "arith"
        self.name = base if max_operand == 20 else f"{base}:{max_operand}"
        self.scorer = MathReward(
            format_reward=format_reward, timeout_s=timeout_s, equal_fn=equal_fn
        )

    def problem(self, index: int) -> Problem:
        """The ``index``-th training problem (never a held-out sum)."""
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        while True:
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
            add = rng.random() < 0.5
            template = rng.randrange(3)
            if not add:
                a, b = max(a, b), min(a, b)
            if not self._held_out(a, "+" if add else "-", b):
                break
        return self._problem(f"{self.name}:{index:08d}", a, add, b, name, thing, template)

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems, one per held-out sum (the same for every seed);
        ValueError when the split has fewer than ``n`` sums."""
        sums = [
            (a, op, b)
            for a in range(1, self.max_operand + 1)
            for b in range(1, self.max_operand + 1)
            for op in "+-"
            if (a <= b if op == "+" else a >= b) and self._held_out(a, op, b)
        ]
        if n > len(sums):
            raise ValueError(
                f"{self.name} holds out {len(sums)} problems, fewer than the {n} asked; lower "
                "eval_prompts or raise the operand bound (arith-words:N)"
            )
        random.Random(f"{self.name}:heldout").shuffle(sums)
        out = []
        for k, (a, op, b) in enumerate(sums[:n]):
            rng = random.Random(f"{self.name}:heldout:{a}{op}{b}")
            name, thing, template = rng.choice(_NAMES), rng.choice(_THINGS), rng.randrange(3)
            if op == "+" and rng.random() < 0.5:
                a, b = b, a
            out.append(
                self._problem(
                    f"{self.name}:heldout:{k:04d}", a, op == "+", b, name, thing, template
                )
            )
        return out

    def _held_out(self, a: int, op: str, b: int) -> bool:
        if op == "+":  # a + b and b + a are one problem: on one side of the split
            a, b = min(a, b), max(a, b)
        return held_out(f"arith/{a}{op}{b}", HELDOUT_EVERY)

    def _problem(
        self, prompt_id: str, a: int, add: bool, b: int, name: str, thing: str, template: int
    ) -> Problem:
        templates, answer, op = (_ADD, a + b, "+") if add else (_SUB, a - b, "-")
        story = templates[template].format(n=name, t=thing, a=a, b=b)
        text = story if self.words else f"What is {a} {op} {b}?"
        return Problem(prompt_id=prompt_id, prompt=f"{text}\n{INSTRUCTION}", answer=str(answer))

    def reward(self, problem: Problem, completion: str, finished: bool) -> float:
        return self.scorer.reward(problem.answer, completion, finished)

    def exact(self, problem: Problem, completion: str, finished: bool) -> bool:
        return self.scorer.correct(problem.answer, completion)

    def close(self) -> None:
        self.scorer.close()
