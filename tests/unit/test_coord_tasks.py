"""Task verifiers: the embedded reverse task and GSM8K-style JSONL with math-verify."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.datasets import JsonlMathTask, extract_answer
from coordinator.tasks import ReverseTask, make_task


def test_reverse_task_rewards() -> None:
    task = ReverseTask(length=3, seed=0)
    p = task.problem(7)
    assert p == task.problem(7) and p.answer == p.prompt[::-1]
    assert task.reward(p, p.answer, True) == 1.0 and task.exact(p, p.answer, True)
    assert task.reward(p, p.answer, False) == pytest.approx(0.75)  # no EOS: 3 of 4
    assert not task.exact(p, p.answer, False)
    wrong = "".join("a" if c != "a" else "b" for c in p.answer)
    assert task.reward(p, wrong, True) == pytest.approx(0.25)  # only EOS right
    assert task.reward(p, p.answer[:2], True) == pytest.approx(0.5)  # 2 right, EOS too early
    assert make_task("reverse4").problem(0).prompt.__len__() == 4
    with pytest.raises(ValueError):
        make_task("nope")


def slow_equal(gold: str, pred: str) -> bool:
    """Stands in for a sympy expression that never finishes."""
    if pred == "hang":
        time.sleep(60)
    return gold == pred


@pytest.fixture
def gsm8k(tmp_path: Path) -> Path:
    path = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 39 more. How many?", "answer": "3+39=42\n#### 42"},
        {"question": "Half of 1,000?", "answer": "1000/2 = 500\n#### 500"},
        {"question": "A third of 1.5?", "answer": "#### 0.5"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def math_task(gsm8k: Path) -> Iterator[JsonlMathTask]:
    task = JsonlMathTask(gsm8k, seed=1, timeout_s=10.0)
    yield task
    task.close()


def test_extract_answer() -> None:
    assert extract_answer("so 3+39=42\n#### 42") == "42"
    assert extract_answer("#### 1,234 ") == "1234"
    assert extract_answer(" 17 ") == "17"


def test_math_verify_rewards(math_task: JsonlMathTask) -> None:
    by_answer = {math_task.problem(i).answer: math_task.problem(i) for i in range(3)}
    assert set(by_answer) == {"42", "500", "0.5"}
    assert math_task.reward(by_answer["42"], "3 + 39 = 42\n#### 42", True) == 1.0
    assert math_task.reward(by_answer["42"], "#### 41", True) == 0.0
    assert math_task.reward(by_answer["500"], "#### 500.0", True) == 1.0
    assert math_task.reward(by_answer["0.5"], "#### 1/2", True) == 1.0
    assert math_task.reward(by_answer["0.5"], "", True) == 0.0
    # order: deterministic per seed, each pass over the file is a permutation
    assert {math_task.problem(i).answer for i in range(3, 6)} == {"42", "500", "0.5"}
    assert math_task.problem(4).prompt_id.endswith("00000004")


def test_math_verify_timeout_is_hard(gsm8k: Path) -> None:
    task = JsonlMathTask(gsm8k, timeout_s=0.5, equal_fn=slow_equal)
    try:
        p = task.problem(0)
        assert task.reward(p, f"#### {p.answer}", True) == 1.0  # worker up and answering
        start = time.monotonic()
        assert task.reward(p, "#### hang", True) == 0.0
        assert time.monotonic() - start < 5.0  # not 60 s: the worker was killed
        assert task.worker.timeouts == 1
        assert task.reward(p, f"#### {p.answer}", True) == 1.0  # a fresh worker took over
    finally:
        task.close()


def test_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"q": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        JsonlMathTask(path)
