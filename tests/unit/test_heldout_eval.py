"""The held-out evaluation: the split, the decoding loop, the scoring, the trainer's runner."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from test_trainer_recipe import make_rollouts

from coordinator.arith import ArithmeticTask
from coordinator.datasets import JsonlMathTask
from coordinator.tasks import heldout_problems, make_task
from policy.evaluation import (
    EvalItem,
    HeldOutEvaluator,
    complete,
    eval_seed,
    wilson_interval,
)
from policy.model import CharTokenizer, ModelSpec, build_model
from policy.sampling import SamplingConfig, sample_seed
from trainer.config import TrainerConfig
from trainer.metrics import read_evals, read_steps
from trainer.recipe import Trainer
from trainer.sources import InProcessSource, MemoryPublisher

torch.set_num_threads(1)
EOS = 2


# --- statistics -----------------------------------------------------------------------------------
def test_wilson_interval_matches_hand_computed_values() -> None:
    # Wilson 95% (z = 1.96): 5/10 -> [0.2366, 0.7634]; 0/10 -> [0, 0.2775]; 10/10 -> [0.7225, 1]
    # (Newcombe 1998, table I; 4-digit values, hence the 1e-4 margin)
    for k, n, lo, hi in ((5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0)):
        got = wilson_interval(k, n)
        assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4)
    # 81/263 (Newcombe's example 1): [0.2553, 0.3662]
    lo, hi = wilson_interval(81, 263)
    assert lo == pytest.approx(0.2553, abs=1e-4) and hi == pytest.approx(0.3662, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


# --- the held-out split ---------------------------------------------------------------------------
_SUM = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def _sum_of(task: ArithmeticTask, prompt: str) -> tuple[int, str, int]:
    """(a, op, b) of an ``arith`` prompt (the bare style states it)."""
    m = _SUM.match(prompt)
    assert m, prompt
    return int(m[1]), m[2], int(m[3])


@pytest.mark.parametrize("bound", [20, 50])
def test_arith_held_out_sums_never_appear_in_training(bound: int) -> None:
    """Disjointness: no training problem of any seed is a held-out sum, in any story."""
    task = ArithmeticTask(max_operand=bound)
    held = {_sum_of(task, p.prompt) for p in task.heldout(100)}
    assert len(held) == 100  # one problem per held-out sum
    for seed in (0, 1, 7):
        train = ArithmeticTask(seed, max_operand=bound)
        seen = {_sum_of(train, train.problem(i).prompt) for i in range(4000)}
        assert not seen & held
        assert len(seen) > 0.5 * (bound * bound)  # training still covers most sums
    # the same set for every seed and in the word style (same sums, told as stories)
    assert [p.answer for p in ArithmeticTask(5, max_operand=bound).heldout(100)] == [
        p.answer for p in task.heldout(100)
    ]
    words = ArithmeticTask(max_operand=bound, words=True)
    stories = words.heldout(100)
    assert all("How many" in p.prompt for p in stories)
    assert len({p.prompt_id for p in stories}) == 100


def test_word_problems_in_training_avoid_held_out_sums() -> None:
    words = ArithmeticTask(3, words=True)
    held = {(p.prompt.split("\n")[0], p.answer) for p in words.heldout(100)}
    numbers = {(tuple(sorted(map(int, re.findall(r"\d+", text)))), answer) for text, answer in held}
    for i in range(3000):
        p = words.problem(i)
        key = (tuple(sorted(map(int, re.findall(r"\d+", p.prompt.split("\n")[0])))), p.answer)
        # the two operands and the answer fix the sum (a + b and a - b differ for b >= 1)
        assert key not in numbers, p.prompt


def test_jsonl_held_out_rows_are_split_by_question(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(300)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = JsonlMathTask(path, seed=3)
    try:
        held = task.heldout(10)
        held_q = {p.prompt for p in held}
        train_q = {task.problem(i).prompt for i in range(3 * len(task))}
        assert not held_q & train_q
        assert len(task) + len(task._heldout) == 300
        assert 15 <= len(task._heldout) <= 45  # one in ten, by hash
        # the split follows the question, not the row order or the seed
        path2 = tmp_path / "shuffled.jsonl"
        path2.write_text("\n".join(json.dumps(r) for r in reversed(rows)) + "\n")
        other = JsonlMathTask(path2, seed=9)
        assert {p.prompt for p in other.heldout(len(task._heldout))} == {
            p.prompt for p in task.heldout(len(task._heldout))
        }
        other.close()
        with pytest.raises(ValueError, match=r"holds out .* fewer than the 1000 asked"):
            task.heldout(1000)
    finally:
        task.close()


def test_tasks_without_a_split_or_too_few_say_so() -> None:
    with pytest.raises(ValueError, match="reverse3 has no held-out split"):
        heldout_problems(make_task("reverse3"), 10)
    small = ArithmeticTask(max_operand=5)
    with pytest.raises(ValueError, match=r"arith:5 holds out .* lower eval_prompts"):
        small.heldout(100)
    with pytest.raises(ValueError, match="eval_prompts must be >= 1"):
        heldout_problems(small, 0)


# --- the decoding loop ----------------------------------------------------------------------------
def _prompts() -> list[list[int]]:
    tok = CharTokenizer()
    return [tok.encode_prompt(s) for s in ("abc", "dcba", "a", "bbbbbb", "cab", "ddd", "ab")]


def _greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """One prompt, no padding, no cache: the full forward at every position."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            if tok == EOS:
                break
            ids.append(tok)
    return out


def test_greedy_decoding_equals_a_plain_loop_whatever_the_batch() -> None:
    model = build_model(ModelSpec(), seed=3)
    prompts = _prompts()
    want = [_greedy_reference(model, p, 12) for p in prompts]
    for rows in (1, 3, 32):  # left padding and rows leaving the batch must not change a token
        got = complete(model, prompts, max_new_tokens=12, stop_ids=[EOS], pad_id=0, batch_rows=rows)
        assert [c.token_ids for c in got] == want
        assert [c.finished for c in got] == [t[-1] == EOS for t in want]


def test_sampled_decoding_is_the_nodes_seeded_draw() -> None:
    """pass@1 samples are drawn exactly as a node's hf backend draws a lease's samples."""
    from node.backends.base import GenerationRequest
    from node.backends.hf import HFBackend

    model = build_model(ModelSpec(), seed=4)
    prompts = _prompts()
    seeds = [11 + i for i in range(len(prompts))]
    got = complete(
        model, prompts, max_new_tokens=10, stop_ids=[EOS], pad_id=0,
        seeds=[sample_seed(s, 0) for s in seeds], temperature=0.7, top_k=8, batch_rows=4,
    )  # fmt: skip
    backend = HFBackend(ModelSpec(), model=model, device="cpu")
    sampling = SamplingConfig(temperature=0.7, top_k=8, max_new_tokens=10, stop_token_ids=(EOS,))
    node = backend.generate(
        [
            GenerationRequest(prompt_token_ids=p, n=1, seed=s)
            for p, s in zip(prompts, seeds, strict=True)
        ],
        sampling,
    )
    assert [c.token_ids for c in got] == [g[0].token_ids for g in node]


def test_a_stop_request_ends_decoding_between_batches() -> None:
    model = build_model(ModelSpec(), seed=3)
    calls = iter([False, True])
    got = complete(
        model, _prompts(), max_new_tokens=4, stop_ids=[EOS], pad_id=0, batch_rows=3,
        should_stop=lambda: next(calls),
    )  # fmt: skip
    assert len(got) == 3


# --- scoring --------------------------------------------------------------------------------------
def _items(answers: list[str]) -> list[EvalItem]:
    return [
        EvalItem(f"p{i}", tuple(p), a)
        for i, (p, a) in enumerate(zip(_prompts(), answers, strict=False))
    ]


def test_greedy_accuracy_and_pass_at_1_count_what_the_grader_says() -> None:
    model = build_model(ModelSpec(), seed=3)
    tok = CharTokenizer()
    greedy = complete(model, _prompts(), max_new_tokens=6, stop_ids=[EOS], pad_id=0)
    texts = [tok.decode(c.token_ids) for c in greedy]
    # answers: the greedy completion for the first 3 prompts, something else for the other 4
    answers = texts[:3] + ["zz"] * 4
    ev = HeldOutEvaluator(
        _items(answers), lambda a, c: a == c, tok.decode, max_new_tokens=6, stop_ids=[EOS],
        pad_id=0, samples=3, temperature=1.0,
    )  # fmt: skip
    r = ev.evaluate(model, 5, step=4)
    assert (r.greedy_correct, r.prompts, r.version, r.step) == (3, 7, 5, 4)
    assert (r.greedy_lo, r.greedy_hi) == wilson_interval(3, 7)
    # pass@1 from the seeded draws: recompute them by hand
    rates = []
    for item in ev.items:
        seeds = [sample_seed(eval_seed(item.prompt_id), j) for j in range(3)]
        drawn = complete(
            model, [item.prompt_ids] * 3, max_new_tokens=6, stop_ids=[EOS], pad_id=0, seeds=seeds
        )
        rates.append(sum(tok.decode(c.token_ids) == item.answer for c in drawn) / 3)
    assert r.pass1 == pytest.approx(sum(rates) / 7, abs=1e-12)  # same arithmetic, same order
    assert (r.pass1_lo, r.pass1_hi) == wilson_interval(r.pass1 * 7, 7)
    rec = r.record()
    assert rec["record"] == "eval" and rec["eval_greedy_correct"] == 3
    # the same weights give the same result (fixed set, greedy, fixed seeds)
    again = ev.evaluate(model, 5, step=4)
    assert (again.greedy_correct, again.pass1) == (r.greedy_correct, r.pass1)


def test_evaluator_refuses_what_cannot_be_scored() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="empty"):
        HeldOutEvaluator([], str.__eq__, tok.decode, max_new_tokens=4, stop_ids=[EOS], pad_id=0)
    twice = _items(["a", "b"])[:1] * 2
    with pytest.raises(ValueError, match="unique"):
        HeldOutEvaluator(twice, str.__eq__, tok.decode, max_new_tokens=4, stop_ids=[EOS], pad_id=0)
    with pytest.raises(ValueError, match="stop set"):
        HeldOutEvaluator(_items(["a"]), str.__eq__, tok.decode, max_new_tokens=4, stop_ids=[],
                         pad_id=0)  # fmt: skip


# --- in the trainer -------------------------------------------------------------------------------
def _evaluator(samples: int = 2) -> HeldOutEvaluator:
    tok = CharTokenizer()
    return HeldOutEvaluator(
        _items(["cba", "abcd", "a", "bbbbbb", "bac", "ddd", "ba"]),
        lambda a, c: c[:1] == a[:1],  # a grader a random model gets partly right
        tok.decode, max_new_tokens=6, stop_ids=[EOS], pad_id=0, samples=samples,
    )  # fmt: skip


def _run_with_eval(tmp_path: Path, model: torch.nn.Module | None = None) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=4, minibatches=2,
        eval_every=2, eval_task="arith", lr=5e-3, max_steps=5,
    )  # fmt: skip
    tr = Trainer.setup(cfg, model=model)
    assert tr.evaluation is not None
    tr.evaluation.attach(_evaluator(), tr.metrics)
    source = InProcessSource(wait_s=0.05)
    for step in range(5):
        source.put(make_rollouts(20 + step, 4, 4, version=step))
    asyncio.run(tr.run(source, MemoryPublisher()))
    assert tr.evaluation.wait_idle(120)
    return tr


def test_trainer_scores_the_base_and_every_eval_every_versions(tmp_path: Path) -> None:
    tr = _run_with_eval(tmp_path)
    assert tr.evaluation is not None
    try:
        evals = read_evals(tmp_path / "run" / "metrics.jsonl")
        steps = read_steps(tmp_path / "run" / "metrics.jsonl")
        assert len(steps) == 5 and all("record" not in s for s in steps)
        # v0 (the base) and every 2nd version; none dropped at this pace
        assert [e["version"] for e in evals] == [0, 2, 4]
        assert all(e["eval_prompts"] == 7 and e["eval_samples"] == 2 for e in evals)
        # where each version sits in wall time: when its weights were taken, when it was scored
        assert all(e["taken_at"] <= e["finished_at"] for e in evals)
        assert [e["taken_at"] for e in evals] == sorted(e["taken_at"] for e in evals)
        # the last evaluation scored the trained weights: score the model itself, compare
        direct = _evaluator().evaluate(tr.model, 5)
        replica = tr.evaluation.replica
        assert replica is not None
        tr.evaluation.after_step(tr.model, tr.engine, 6, 6)  # v6: due, the same weights as v5
        assert tr.evaluation.wait_idle(120)
        last = tr.evaluation.results[-1]
        assert last.version == 6
        assert (last.greedy_correct, last.pass1) == (direct.greedy_correct, direct.pass1)
        for name, p in tr.model.named_parameters():
            assert torch.equal(p, dict(replica.named_parameters())[name]), name
        stats = tr.evaluation.stats()
        assert stats["eval_base_version"] == 0 and stats["eval_version"] == 6
        assert stats["eval_curve_version"] == [0, 2, 4, 6]
        assert stats["eval_greedy_lo"] <= stats["eval_greedy_acc"] <= stats["eval_greedy_hi"]
    finally:
        tr.evaluation.close()


def test_the_replica_follows_adapters_injected_before_training(tmp_path: Path) -> None:
    """Whatever wraps the model (here peft LoRA layers injected in place): the evaluation
    copies what trains (the adapters) into a replica with the same modules."""
    peft = pytest.importorskip("peft")
    model = build_model(ModelSpec(), seed=0)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = peft.inject_adapter_in_model(cfg, model)
    tr = _run_with_eval(tmp_path, model=model)
    assert tr.evaluation is not None and tr.evaluation.replica is not None
    try:
        lora = {n: p for n, p in tr.model.named_parameters() if "lora_B" in n}
        assert lora and any(bool(p.abs().sum() > 0) for p in lora.values())  # it trained
        tr.evaluation.after_step(tr.model, tr.engine, 6, 6)
        assert tr.evaluation.wait_idle(120)
        replica = dict(tr.evaluation.replica.named_parameters())
        for name, p in lora.items():
            assert torch.equal(p, replica[name]), name
        direct = _evaluator().evaluate(tr.model, 6)
        last = tr.evaluation.results[-1]
        assert (last.greedy_correct, last.pass1) == (direct.greedy_correct, direct.pass1)
    finally:
        tr.evaluation.close()


def test_eval_every_needs_a_task() -> None:
    with pytest.raises(ValueError, match="eval_every is set but eval_task is not"):
        TrainerConfig(eval_every=5)
