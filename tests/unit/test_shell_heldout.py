"""The held-out evaluation the shell hands to the trainer (``swarm trainer run`` passes
:func:`swarm.shell.heldout.start_evaluation` as :data:`trainer.main.StartEvaluation`): built
from a set-up trainer's config and the coordinator's status, it scores the task's held-out split
and reports to the trainer's source, without the trainer importing the coordinator."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy.model import ModelSpec, load_tokenizer
from policy.testing import build_tiny_chat_model
from protocol.identity import Identity
from swarm.memtransport import InMemoryNetwork
from swarm.shell.heldout import start_evaluation
from trainer.config import TrainerConfig
from trainer.metrics import read_evals
from trainer.recipe import Trainer
from trainer.swarm_client import CoordinatorSource


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


def _trainer(tmp_path: Path, model: Path) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), model_path=str(model), eval_every=2, eval_task="arith",
        eval_prompts=3, eval_samples=1,
    )  # fmt: skip
    return Trainer.setup(cfg)


def _source() -> CoordinatorSource:
    """The trainer's source of rollouts; its ``stats`` go to the coordinator's /status."""
    return CoordinatorSource(InMemoryNetwork().endpoint("trainer"), "coord", Identity.generate())


def test_the_trainer_scores_the_held_out_split_it_is_handed(
    tmp_path: Path, model_dir: Path
) -> None:
    tr = _trainer(tmp_path, model_dir)
    runner = tr.evaluation
    assert runner is not None
    eos = load_tokenizer(ModelSpec(path=tr.config.model_path)).eos_token_id
    source = _source()
    status = {"sampling": {"prompt_template": "auto", "max_new_tokens": 3}}
    task = start_evaluation(tr, status, [eos], source)
    try:
        assert runner.evaluator is not None and len(runner.evaluator.items) == 3
        assert task.close in runner.closers  # the grader's worker process ends with the runner
        runner.after_step(tr.model, tr.engine, 0, 0, start=True)  # v0, the base model
        assert runner.wait_idle(60)
        (record,) = read_evals(tmp_path / "run" / "metrics.jsonl")
        assert record["version"] == 0 and record["eval_prompts"] == 3
        # what the trainer reports on the coordinator's /status (source.stats)
        assert source.stats["eval_version"] == 0
        assert 0.0 <= source.stats["eval_greedy_acc"] <= 1.0
    finally:
        runner.close()


def test_without_the_leases_max_new_tokens_it_says_what_to_set(
    tmp_path: Path, model_dir: Path
) -> None:
    tr = _trainer(tmp_path, model_dir)
    with pytest.raises(ValueError, match="set eval_max_new_tokens"):
        start_evaluation(tr, {"sampling": {}}, [0], _source())
