"""TrainerConfig: the checked-in example loads, unknown keys and contradictions fail at load."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.config import TrainerConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "trainer" / "trainer.example.toml"


def test_example_config_loads_and_matches_defaults() -> None:
    cfg = TrainerConfig.from_toml(EXAMPLE)
    assert cfg == TrainerConfig()
    assert cfg.kappa == 3
    assert cfg.eps_high == cfg.clip_eps


def test_overrides_win_over_file() -> None:
    cfg = TrainerConfig.from_toml(EXAMPLE, lr=5e-4, max_staleness=2, publish_every=None)
    assert cfg.lr == 5e-4
    assert cfg.kappa == 1  # max(1, S − 1)


def test_none_in_a_file_switches_a_setting_off(tmp_path: Path) -> None:
    """TOML has no null: "none" is how trainer.toml turns off a default-on setting."""
    path = tmp_path / "t.toml"
    path.write_text('target_step_kl = "none"\nmax_grad_norm = "None"\n')
    cfg = TrainerConfig.from_toml(path)
    assert cfg.target_step_kl is None and cfg.max_grad_norm is None
    path.write_text('lr = "none"\n')  # lr has no off: a clear error naming the field
    with pytest.raises(ValidationError, match="lr"):
        TrainerConfig.from_toml(path)


def test_swarm_trainer_run_reads_none_as_off(tmp_path: Path) -> None:
    """The CLI's own loader (trainer/main.py), not only from_toml: the demo writes
    ``target_step_kl = "none"`` for ``--trainer-set target_step_kl=none``."""
    from trainer.main import _cli_config

    path = tmp_path / "t.toml"
    path.write_text('target_step_kl = "none"\n')
    cfg = _cli_config(path, state_dir=tmp_path / "state", max_steps=None)
    assert cfg.target_step_kl is None


def test_unknown_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("learning_rate = 0.1\n")
    with pytest.raises(ValidationError, match="learning_rate"):
        TrainerConfig.from_toml(path)


def test_cross_field_rules_name_the_field() -> None:
    with pytest.raises(ValidationError, match="publish_every"):
        TrainerConfig(max_staleness=2, publish_every=3)
    with pytest.raises(ValidationError, match="minibatches"):
        TrainerConfig(batch_prompts=2, minibatches=4)
    with pytest.raises(ValidationError, match="weight_cap"):
        TrainerConfig(weight_cap=1.0)
    with pytest.raises(ValidationError, match="weight_mode"):
        TrainerConfig(weight_mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="weight_cap_low"):
        TrainerConfig(weight_cap_low=1.5)  # the band's lower end is below 1
    with pytest.raises(ValidationError, match="m2_threshold"):
        TrainerConfig(m2_threshold=0.0)
    with pytest.raises(ValidationError, match="adam_beta2"):
        TrainerConfig(adam_beta2=1.0)
    with pytest.raises(ValidationError, match="adam_beta1"):
        TrainerConfig(adam_beta1=1.0)
    with pytest.raises(ValidationError, match="warn_ess_frac_below"):
        TrainerConfig(warn_ess_frac_below=2.0)


def test_every_staleness_option_of_the_benchmark_is_a_valid_config() -> None:
    # bench/staleness.py's options are TrainerConfig overrides (each key a field)
    import sys

    sys.path.insert(0, str(EXAMPLE.parents[1] / "bench"))
    from staleness import OPTIONS

    for name, overrides in OPTIONS.items():
        assert set(overrides) <= set(TrainerConfig.model_fields), name
        assert TrainerConfig(**overrides), name


def test_every_field_is_documented() -> None:
    for name, field in TrainerConfig.model_fields.items():
        assert field.description, f"{name} has no description"


def test_stop_grace_s_defaults_to_the_documented_bound_and_may_not_exceed_it() -> None:
    # the trainer's stop bound (20 s, docs/operations.md) counts on at most 10 s of grace
    assert TrainerConfig().stop_grace_s == 10.0
    assert TrainerConfig(stop_grace_s=2.0).stop_grace_s == 2.0
    for bad in (0.0, 10.5):
        with pytest.raises(ValidationError, match="stop_grace_s"):
            TrainerConfig(stop_grace_s=bad)
