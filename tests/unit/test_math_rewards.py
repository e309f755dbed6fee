"""Math answers from ``\\boxed{}`` as well as ``####``, the format reward, the ``arith`` task."""

from __future__ import annotations

import re

import pytest

from coordinator.arith import ArithmeticTask
from coordinator.datasets import boxed_answer, extract_answer, well_formed
from coordinator.tasks import make_task


def test_boxed_answers_are_read_first_and_braces_balance() -> None:
    assert boxed_answer(r"so \boxed{\frac{1}{2}} and finally \boxed{12}.") == "12"
    assert boxed_answer(r"\boxed{a{b}c}") == "a{b}c"
    assert boxed_answer(r"\fbox{7}") == "7"
    assert boxed_answer(r"unclosed \boxed{3") is None
    assert extract_answer(r"12 - 5 = 7, so \boxed{7}. #### 9") == "7"  # boxed wins over ####
    assert extract_answer("work... #### 1,234") == "1234"
    assert extract_answer("The answer is 25.") == "The answer is 25."  # math-verify finds it


def test_well_formed_needs_a_finished_completion_with_a_stated_answer() -> None:
    assert well_formed(r"so \boxed{7}", finished=True)
    assert not well_formed(r"so \boxed{7}", finished=False)  # cut at max_new_tokens
    assert not well_formed(r"so \boxed{ }", finished=True)
    assert well_formed("#### 7", finished=True) and not well_formed("####", finished=True)
    assert not well_formed("The answer is 7.", finished=True)


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    t = ArithmeticTask(seed=1, format_reward=0.25)
    yield t  # type: ignore[misc]
    t.close()


def test_arith_problems_are_deterministic_and_right(task: ArithmeticTask) -> None:
    for i in range(50):
        p = task.problem(i)
        assert p == ArithmeticTask(seed=1, format_reward=0.25).problem(i)
        m = re.match(
            r"What is (\d+) ([+-]) (\d+)\?\nPut the final answer in \\boxed\{\}\.$", p.prompt
        )
        assert m, p.prompt
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 1 <= a <= 20 and 1 <= b <= 20
        assert int(p.answer) == (a + b if op == "+" else a - b) >= 0
    words = make_task("arith-words:9", seed=1)
    try:
        assert "How many" in words.problem(0).prompt and words.name == "arith-words:9"
    finally:
        words.close()  # type: ignore[attr-defined]


def test_reward_is_correctness_plus_the_format_share(task: ArithmeticTask) -> None:
    p = task.problem(0)
    right, wrong = p.answer, str(int(p.answer) + 1)
    assert task.reward(p, rf"it is \boxed{{{right}}}", True) == 1.0
    assert task.reward(p, f"{right}", True) == 0.75  # correct, not well-formed
    assert task.reward(p, rf"\boxed{{{wrong}}}", True) == 0.25  # well-formed, wrong
    assert task.reward(p, f"#### {right}", False) == 0.75  # cut off: no format share
    assert task.exact(p, f"the answer is {right}", True)
    assert not task.exact(p, rf"\boxed{{{wrong}}}", True)
