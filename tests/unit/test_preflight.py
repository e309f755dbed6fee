"""Impossible set-ups are refused at start with one line naming the setting (policy/preflight.py).

Before: a model with 256 positions and long prompts had every node fail and release hundreds of
leases while ``swarm demo`` printed ``step -``; a task the tokenizer could not write, or a tokenizer
without EOS, failed only once leases were issued. Now ``swarm coordinator launch``, ``swarm
trainer run`` and ``swarm demo`` refuse such set-ups before anything starts.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from policy.testing import build_tiny_chat_model
from swarm.shell import cli
from trainer.config import TrainerConfig
from trainer.contract import ContractError, adopt_contract

KEY = "ed25519:t7zy4sqvttem4rnbowlxlyiss2gwzxrfog4wrcldgyk5uymcbbva"
PEER = "QmTdjMKHewEygMGmbkfgBCMPuH6o21STxBs4Tq6ZvkReMb"


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat model with only 64 positions (a chat-rendered arith prompt is ~50 tokens)."""
    return build_tiny_chat_model(tmp_path_factory.mktemp("short") / "m", max_positions=64)


@pytest.fixture(scope="module")
def no_eos_model(short_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("noeos") / "m"
    shutil.copytree(short_model, out)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.pop("eos_token", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return out


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[object]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "install_fork_signal_reset", lambda: None)

    def run(*argv: str) -> tuple[object, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli.main(list(argv))
        out, err = capsys.readouterr()
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert "Traceback" not in out + err and len(errors) == 1, out + err
        return info.value.code, errors[0]

    yield run


def _coordinator_cfg(tmp_path: Path, model: Path | None, task: str, max_new: int) -> Path:
    model_line = f'model_path = "{model}"\n' if model else ""
    path = tmp_path / "coordinator.toml"
    path.write_text(f'task = "{task}"\n{model_line}\n[sampling]\nmax_new_tokens = {max_new}\n')
    return path


def test_coordinator_refuses_prompts_beyond_the_positions(
    tmp_path: Path, short_model: Path, run_cli: object
) -> None:
    cfg = _coordinator_cfg(tmp_path, short_model, "arith", 32)
    code, line = run_cli("coordinator", "launch", "--config", str(cfg))  # type: ignore[operator]
    assert code == 2
    assert "sampling.max_new_tokens=32" in line and "64 positions" in line
    assert "lower sampling.max_new_tokens to at most" in line


def test_coordinator_refuses_a_tokenizer_without_eos(
    tmp_path: Path, no_eos_model: Path, run_cli: object
) -> None:
    cfg = _coordinator_cfg(tmp_path, no_eos_model, "arith", 4)
    code, line = run_cli("coordinator", "launch", "--config", str(cfg))  # type: ignore[operator]
    assert code == 2 and "model_path" in line and "no EOS token" in line


def test_coordinator_refuses_a_task_the_vocabulary_cannot_write(
    tmp_path: Path, run_cli: object
) -> None:
    cfg = _coordinator_cfg(tmp_path, None, "arith", 4)  # the embedded 26-symbol model
    code, line = run_cli("coordinator", "launch", "--config", str(cfg))  # type: ignore[operator]
    assert code == 2
    assert "task 'arith' cannot be written in the model's vocabulary" in line
    assert "model_path" in line


def test_demo_refuses_before_starting_anything(
    tmp_path: Path, short_model: Path, run_cli: object
) -> None:
    run_dir = tmp_path / "run"
    code, line = run_cli(  # type: ignore[operator]
        "demo", "--model-dir", str(short_model), "--max-new-tokens", "40", "--run-dir", str(run_dir)
    )
    assert code == 2 and "--max-new-tokens=40" in line and "64 positions" in line
    code, line = run_cli("demo", "--task", "arith", "--run-dir", str(run_dir))  # type: ignore[operator]
    assert code == 2 and "--task 'arith' cannot be written" in line
    assert not run_dir.exists()  # nothing was started


def test_trainer_refuses_a_tokenizer_without_eos(
    tmp_path: Path, no_eos_model: Path, run_cli: object
) -> None:
    cfg = tmp_path / "trainer.toml"
    cfg.write_text(f'model_path = "{no_eos_model}"\n')
    code, line = run_cli(  # type: ignore[operator]
        "trainer", "run", "--config", str(cfg), "--coordinator", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}",
        "--coordinator-key", KEY, "--state-dir", str(tmp_path / "t"),
    )  # fmt: skip
    assert code == 2 and "no EOS token" in line


def test_trainer_adopts_or_refuses_the_coordinators_sampling() -> None:
    status = {
        "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 16},
        "stop_token_ids": [0, 2],
        "longest_prompt_tokens": 40,
    }
    cfg, stops = adopt_contract(TrainerConfig(), status, positions=64)
    assert cfg.processing == {"temperature": 0.7, "top_p": 0.9, "top_k": 0}
    assert stops == (0, 2)
    same, _ = adopt_contract(TrainerConfig(temperature=0.7), status, positions=64)
    assert same.temperature == 0.7
    with pytest.raises(ContractError, match=r"^temperature=1\.0 in the trainer config.*0\.7"):
        adopt_contract(TrainerConfig(temperature=1.0), status, positions=64)
    with pytest.raises(ContractError, match="64 positions"):
        adopt_contract(TrainerConfig(), {**status, "longest_prompt_tokens": 50}, positions=64)
    # an older coordinator without the contract on /status: nothing changes
    assert adopt_contract(TrainerConfig(), {}, positions=64) == (TrainerConfig(), ())


def test_stop_set_must_fit_a_lease_and_the_vocabulary() -> None:
    from coordinator.tasks import ReverseTask
    from policy.model import CharTokenizer
    from policy.preflight import SetupError, check_setup
    from policy.prompts import PromptRenderer

    tok = CharTokenizer()
    common = {
        "tokenizer": tok, "renderer": PromptRenderer(tok), "task": ReverseTask(),
        "max_new_tokens": 4, "vocab_size": 26, "positions": 64,
    }  # fmt: skip
    report = check_setup(stop_token_ids=(2,), **common)  # type: ignore[arg-type]
    assert report.longest_prompt == 5 and report.positions == 64
    with pytest.raises(SetupError, match=r"^sampling\.stop_token_ids: stop token 26 is outside"):
        check_setup(stop_token_ids=(2, 26), **common)  # type: ignore[arg-type]
    with pytest.raises(SetupError, match="at most 64"):
        check_setup(stop_token_ids=tuple(range(65)), **common)  # type: ignore[arg-type]
    with pytest.raises(SetupError, match="stop set is empty"):
        check_setup(stop_token_ids=(), **common)  # type: ignore[arg-type]
