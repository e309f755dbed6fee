"""``swarm demo`` and the held-out evaluation: the pretrained profile turns it on (with LoRA),
the live view and the summary show it, ``--eval-target`` stops the run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from rich.console import Console

from coordinator.config import CoordinatorConfig
from node.config import NodeConfig
from policy.testing import build_tiny_chat_model
from swarm.shell.demo import Demo
from swarm.shell.demo_options import DemoOptions, parse_trainer_settings
from swarm.shell.demo_report import LiveView, heldout_line, heldout_summary
from trainer.config import TrainerConfig

STATUS = {
    "trainer_eval_version": 10,
    "trainer_eval_greedy_acc": 0.62,
    "trainer_eval_greedy_lo": 0.52,
    "trainer_eval_greedy_hi": 0.71,
    "trainer_eval_pass1": 0.55,
    "trainer_eval_prompts": 100,
    "trainer_eval_s": 41.0,
    "trainer_eval_base_version": 0,
    "trainer_eval_base_greedy_acc": 0.41,
    "trainer_eval_base_pass1": 0.33,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


def _trainer_toml(demo: Demo) -> dict[str, object]:
    demo.run_dir.mkdir(parents=True, exist_ok=True)
    demo._write_configs("ed25519:" + "0" * 64)
    return tomllib.loads((demo.run_dir / "trainer.toml").read_text())


def test_the_pretrained_profile_evaluates_and_trains_lora(tmp_path: Path, model_dir: Path) -> None:
    opts = DemoOptions(model_dir=model_dir, run_dir=tmp_path / "run", live=False)
    cfg = _trainer_toml(Demo(opts))
    assert cfg["eval_every"] == 5 and cfg["eval_task"] == "arith"
    assert cfg["eval_system_prompt"] == opts.system_prompt  # rendered like the leases
    assert (cfg["lora_rank"], cfg["lora_alpha"], cfg["lr"]) == (8, 32.0, 2e-4)
    assert cfg["batch_prompts"] * cfg["group_size"] == 32  # type: ignore[operator]
    TrainerConfig.model_validate(cfg)  # the trainer would start on it
    # full fine-tuning for a comparison: --trainer-set wins over the profile
    full = DemoOptions(
        model_dir=model_dir, run_dir=tmp_path / "full", live=False,
        trainer_overrides=parse_trainer_settings(["lora_rank=0", "lr=2e-5"]),
    )  # fmt: skip
    cfg = _trainer_toml(Demo(full))
    assert (cfg["lora_rank"], cfg["lr"], cfg["eval_every"]) == (0, 2e-5, 5)
    with pytest.raises(ValueError, match="eval_task: the demo sets it"):
        parse_trainer_settings(["eval_task=arith"])


def test_the_embedded_profile_has_no_evaluation(tmp_path: Path) -> None:
    cfg = _trainer_toml(Demo(DemoOptions(run_dir=tmp_path / "run", live=False)))
    assert "eval_every" not in cfg and "lora_rank" not in cfg
    with pytest.raises(ValueError, match="--eval-target needs the held-out evaluation"):
        DemoOptions(run_dir=tmp_path / "x", eval_target=0.5)


def test_eval_target_stops_on_a_trained_version_only(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--eval-target must be in"):
        DemoOptions(model_dir=model_dir, run_dir=tmp_path / "bad", eval_target=1.5)
    demo = Demo(DemoOptions(model_dir=model_dir, run_dir=tmp_path / "run", eval_target=0.6))
    demo.status = {**STATUS, "trainer_eval_version": 0, "trainer_eval_greedy_acc": 0.7}
    assert demo.done_reason() is None  # the base model scoring high is not learning
    demo.status = {**STATUS, "trainer_eval_greedy_acc": 0.59}
    assert demo.done_reason() is None
    demo.status = dict(STATUS)
    assert demo.done_reason() == "held-out accuracy reached 0.60"
    assert demo.reached_at is not None


def test_live_view_and_summary_show_the_held_out_score(tmp_path: Path) -> None:
    line = heldout_line(STATUS)
    assert "v10 greedy 0.620 [0.52, 0.71] pass@1 0.550" in line and "base v0 greedy 0.410" in line
    assert heldout_line({}) == "-"
    demo = Demo(DemoOptions(nodes=1, run_dir=tmp_path / "run", live=False))
    demo.curve = [
        {"t": 5.0, "step": 1, "exact": 0.1, "eval_version": 0, "eval_greedy_acc": 0.41},
        {"t": 9.0, "step": 2, "exact": 0.1, "eval_version": 0, "eval_greedy_acc": 0.41},
        {"t": 20.0, "step": 10, "exact": 0.2, "eval_version": 10, "eval_greedy_acc": 0.62},
    ]
    demo.status = dict(STATUS)
    console = Console(width=200, record=True)
    console.print(LiveView(demo, enabled=False)._render())
    shown = console.export_text()
    assert "held-out" in shown and "0.62 [0.52, 0.71] v10" in shown
    text = heldout_summary(STATUS, demo.curve)
    assert "base (v0) 0.410" in text and "latest (v10) 0.620 [95% CI 0.520, 0.710] (+0.210)" in text
    assert "best 0.620 at v10" in text
    assert heldout_summary({}, []) == ""


def test_staleness_0_is_on_policy_learning(tmp_path: Path, model_dir: Path) -> None:
    """S = 0 for the benchmark: the learner trains on its current version only; the
    coordinator keeps its smallest bound, 1."""
    demo = Demo(DemoOptions(model_dir=model_dir, run_dir=tmp_path / "run", staleness=0))
    assert _trainer_toml(demo)["max_staleness"] == 0
    coordinator = tomllib.loads((demo.run_dir / "coordinator.toml").read_text())
    assert coordinator["staleness_bound"] == 1
    with pytest.raises(ValueError, match="--staleness must be between 0 and 16"):
        DemoOptions(run_dir=tmp_path / "x", staleness=-1)


def test_the_demos_cpu_verifier_keeps_the_global_replay_slack(tmp_path: Path) -> None:
    """The demo runs every process on one CPU, where the replay's second, bf16 forward costs
    ~6x an fp32 one: its coordinator turns ``intake.calibration_local`` off (a valid config)."""
    demo = Demo(DemoOptions(run_dir=tmp_path / "run", live=False))
    _trainer_toml(demo)  # writes both configs
    text = (demo.run_dir / "coordinator.toml").read_text()
    assert tomllib.loads(text)["intake"]["calibration_local"] is False
    cfg = CoordinatorConfig.model_validate(tomllib.loads(text))
    assert cfg.intake.calibration_local is False and CoordinatorConfig().intake.calibration_local


def test_a_real_models_demo_calibrates_the_precision_its_nodes_run_in(
    tmp_path: Path, model_dir: Path
) -> None:
    """A real model's calibration with the defaults (256 samples in fp32, bf16 and fp16) takes
    about an hour on a CPU coordinator, every check of v0 waiting for it (a SmolLM2 demo made
    no learner step in 8 minutes): the demo's nodes compute in fp32, so the demo accepts and
    calibrates fp32 alone, on 32 samples. The embedded model keeps the defaults (cheap)."""
    real = Demo(DemoOptions(model_dir=model_dir, run_dir=tmp_path / "real", live=False))
    _trainer_toml(real)
    cfg = CoordinatorConfig.model_validate(
        tomllib.loads((real.run_dir / "coordinator.toml").read_text())
    )
    assert cfg.intake.accepted_dtypes == ["float32"] and cfg.intake.calibration_samples == 32
    assert NodeConfig().dtype == "float32"  # what the demo's nodes run in (no dtype is set)
    embedded = Demo(DemoOptions(run_dir=tmp_path / "embedded", live=False))
    _trainer_toml(embedded)
    cfg = CoordinatorConfig.model_validate(
        tomllib.loads((embedded.run_dir / "coordinator.toml").read_text())
    )
    assert cfg.intake.accepted_dtypes == CoordinatorConfig().intake.accepted_dtypes
    assert cfg.intake.calibration_samples == CoordinatorConfig().intake.calibration_samples


def test_trainer_set_can_change_the_evaluation() -> None:
    """``--trainer-set eval_every=1`` is checked with the task the demo names (a benchmark's
    quick check scores every version)."""
    assert parse_trainer_settings(["eval_every=1", "eval_prompts=20"]) == {
        "eval_every": 1, "eval_prompts": 20,
    }  # fmt: skip
    with pytest.raises(ValueError, match="eval_prompts"):
        parse_trainer_settings(["eval_prompts=0"])


def test_a_task_without_enough_held_out_problems_is_refused_at_start(
    tmp_path: Path, model_dir: Path
) -> None:
    with pytest.raises(ValueError, match=r"--task arith:5: arith:5 holds out \d+ problems"):
        DemoOptions(model_dir=model_dir, run_dir=tmp_path / "a", task="arith:5")
    # fewer prompts, or no evaluation, and it starts
    DemoOptions(
        model_dir=model_dir, run_dir=tmp_path / "b", task="arith:5",
        trainer_overrides=parse_trainer_settings(["eval_prompts=3"]),
    )  # fmt: skip
    DemoOptions(
        model_dir=model_dir, run_dir=tmp_path / "c", task="arith:5",
        trainer_overrides=parse_trainer_settings(["eval_every=none"]),
    )  # fmt: skip
