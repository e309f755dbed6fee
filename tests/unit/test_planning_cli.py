"""``swarm coordinator plan`` prints the capacity rule's numbers (hand-computed, see
docs/capacity.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swarm.shell.cli import app

EXAMPLE_POOL = Path(__file__).resolve().parents[2] / "coordinator" / "pool.example.json"
runner = CliRunner()


def plan(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["coordinator", "plan", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def write_pool(tmp_path: Path, pool: object) -> Path:
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(pool), encoding="utf-8")
    return path


def test_example_pool_hand_computed() -> None:
    # Defaults: B=256, T_train=1 s, S=4 so κ=3, G=8, headroom 20%; T_bcast=0.5 s from the flag.
    code, out, err = plan("--pool", str(EXAMPLE_POOL), "--t-bcast", "0.5")
    assert code == 0 and err == ""
    assert "B / T_train = 256 / 1 = 256 admissible rollouts/s; with 20% headroom 307.2" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("    ")}
    # generation on a version starts after the node's load d and must start by
    # X = (S+1)·T − T_train − T_bcast − g − o = 3.5 − g − o to arrive in time; W = max(κ·T, g+o+d)
    # rtx4090: 120 · 1/(1 + 0.1) · (1 − 1.5/3) · a, a = (X − d)/(W − d) = (2.4 − 1.5)/1.5 = 0.6
    assert rows["rtx4090-a"][6:8] == ["0.60", "32.73"]
    # h100: 320 · 0.5/0.55 · (1 − 0.5/3) · (2.95 − 0.5)/2.5 = 237.6
    assert rows["h100-sxm"][6:8] == ["0.98", "237.6"]
    # volunteer: its 4 s load ends after X = 2.2 s: nothing it makes on a version arrives in time
    assert rows["volunteer-3060"][6:8] == ["0.00", "0"]
    # a100: 200 · 0.8/0.85 · (1 − 0.5/3) · (2.65 − 0.5)/2.5 = 134.9
    assert rows["a100-80g"][6:8] == ["0.86", "134.9"]
    # cheapest set reaching 307.2: h100 + both 4090s give 303.1 (short); h100 + a100 give 372.5
    # at 3.70/h
    assert "active (3): Σρ = 372.5 rollouts/s, cost 3.7 per hour" in out
    active = out.split("active (3)")[1].split("standby")[0]
    for node in ("h100-sxm", "a100-80g"):
        assert node in active
    standby = out.split("standby (3)")[1].split("predicted")[0]
    for node in ("rtx4090-a", "rtx4090-b", "l4-spot"):
        assert node in standby
    assert "saves 1.15 per hour" in out  # 0.40 + 0.40 + 0.35
    # but every 3rd step hands over to a version that must deliver its first 256 rollouts
    # within (S − κ + 1)·T_train = 2 s: the h100's arrive from T_bcast + d + g + o = 1.55 s at
    # 290.9/s, the a100's from 1.85 s at 188.2/s: 87.3 by 1.85 s, 256 by 2.202 s; so the learner
    # waits 0.202 s per 3 steps (step every 1.067 s, 6.3 %; the fluid model, step by step: 6.4 %)
    assert "predicted learner idle: 6.4% with the active set (a step every 1.069 s)" in out


def test_a_short_pool_predicts_the_learner_idle(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "staleness_bound = 2\ngroup_size = 4\n[capacity]\nbatch_rollouts = 100\n"
        "t_train_s = 1.0\nt_bcast_s = 0.0\nheadroom = 0.5\n",
        encoding="utf-8",
    )
    pool = write_pool(tmp_path, [{"id": "one", "rollouts_per_s": 100, "lease_s": 0.5}])
    code, out, _ = plan("--config", str(cfg), "--pool", str(pool), "--t-train", "0.5")
    # κ = S − 1 = 1; demand 100/0.5 = 200 (300 with headroom); a = (3·0.5 − 0.5 − 0.5)/0.5 = 1:
    # 100 rollouts/s, so a step every 100/100 = 1 s instead of 0.5 s: idle 50%
    assert code == 1
    assert "κ        steps per published version      1 (publish_every unset: S − 1)" in out
    assert "demand: B / T_train = 100 / 0.5 = 200 admissible rollouts/s" in out
    assert "predicted learner idle: 50.0% with the active set (a step every 1 s)" in out
    assert "short of capacity" in out and "idle 50%" in out


def test_broadcast_beyond_the_staleness_budget_exits_1() -> None:
    code, out, _ = plan("--t-bcast", "4")  # S·T_train = 4 s ≤ T_bcast
    assert code == 1
    assert "STALENESS: S·T_train = 4 s ≤ T_bcast = 4 s" in out
    code, out, _ = plan("--pool", str(EXAMPLE_POOL), "--t-bcast", "4")
    assert code == 1 and "active (6)" in out and "standby (0)" in out  # all kept active
    assert "short of capacity" in out


def test_without_pool_prints_the_demand_only() -> None:
    code, out, _ = plan()
    assert code == 0
    assert "demand: B / T_train = 256 / 1 = 256 admissible rollouts/s" in out
    assert "no --pool given" in out and "STALENESS" not in out


BAD_POOLS: list[tuple[str, str]] = [
    ("{not json", "not valid JSON"),
    ('{"id": "a"}', "must be a JSON list"),
    ('[{"id": "a"}]', "rollouts_per_s is required"),
    ('[{"id": "a", "rollouts_per_s": -1}]', "rollouts_per_s must be a number >= 0, got -1"),
    ('[{"id": "a", "rollouts_per_s": "fast"}]', "rollouts_per_s must be a number"),
    ('[{"id": "a", "rollouts_per_s": true}]', "rollouts_per_s must be a number"),
    ('[{"id": "a", "rollouts_per_s": 1, "reliability": 1.5}]', "reliability must be a number in"),
    ('[{"id": "a", "rollouts_per_s": 1, "price_per_hour": -2}]', "price_per_hour must be"),
    ('[{"id": "a", "rollouts_per_s": 1, "cost": 2}]', "unknown field 'cost'"),
    ('[{"rollouts_per_s": 1}]', "id must be a non-empty string"),
    ('[{"id": "a", "rollouts_per_s": 1}, {"id": "a", "rollouts_per_s": 2}]', "duplicate id"),
    ("[3]", "entry 0: must be an object"),
    ('[{"id": "a", "rollouts_per_s": 1, "load_s": -1}]', "load_s must be a number >= 0"),
    ('[{"id": "a", "rollouts_per_s": 1, "lease_s": "x"}]', "lease_s must be a number >= 0"),
]


@pytest.mark.parametrize(("text", "message"), BAD_POOLS)
def test_bad_pool_file_exits_2_with_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pool.json"
    path.write_text(text, encoding="utf-8")
    code, out, err = plan("--pool", str(path))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and str(path) in err


def test_missing_pool_file_exits_2(tmp_path: Path) -> None:
    code, _, err = plan("--pool", str(tmp_path / "nope.json"))
    assert code == 2 and "no such pool file" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--t-train", "0"], "capacity.t_train_s"),
        (["--t-bcast", "-1"], "capacity.t_bcast_s"),
        (["--t-train", "nan"], "--t-train: must be a finite number"),
    ],
)
def test_bad_override_exits_2(args: list[str], message: str) -> None:
    code, out, err = plan(*args)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_bad_config_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[capacity]\nbatch_rollout = 3\n", encoding="utf-8")
    code, _, err = plan("--config", str(cfg))
    assert code == 2 and "capacity.batch_rollout" in err and err.count("\n") == 1
    code, _, err = plan("--config", str(tmp_path))  # a directory
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
