"""``swarm coordinator plan`` prints the capacity rule's numbers (hand-computed, DESIGN.md §9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swarm.cli import app

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
    # κ·B/(κ·T_train − T_bcast) = 768 / 2.5 = 307.2; ×1.2 = 368.64
    assert "= 3·256 / (3·1 − 0.5) = 768 / 2.5 = 307.2 rollouts/s" in out
    assert "Σμ ≥ 368.64 rollouts/s" in out
    # t_gen = G/μ_min = 8/40 = 0.2 s; 3 + ⌈0.7/1⌉ = 4 ≤ 4
    assert "t_gen = G/μ_min = 8/40 = 0.2 s" in out
    assert "3 + ⌈(0.5 + 0.2)/1⌉ = 4 ≤ S = 4: ok" in out
    # Effective rates: 36 (40·0.9) + 120 + 120 + 48 (60·0.8) + 200 + 320 = 844.
    assert "effective Σμ = 844 rollouts/s" in out
    # Cheapest set reaching 368.64: a100 200 + l4 48 + one 4090 120 + free volunteer 36 = 404
    # at 1.20 + 0.35 + 0.40 = 1.95/h (greedy by price/rate would take both 4090s: 2.00/h).
    assert "active (4): Σμ_eff = 404 rollouts/s, cost 1.95 per hour" in out
    active = out.split("active (4)")[1].split("standby")[0]
    for node in ("a100-80g", "l4-spot", "rtx4090-a", "volunteer-3060"):
        assert node in active
    standby = out.split("standby (2)")[1].split("plan:")[0]
    assert "h100-sxm" in standby and "rtx4090-b" in standby
    assert "saves 2.9 per hour" in out  # 2.50 + 0.40


def test_config_file_and_t_train_override(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "staleness_bound = 2\ngroup_size = 4\n[capacity]\nbatch_rollouts = 100\n"
        "t_train_s = 1.0\nt_bcast_s = 0.5\nheadroom = 0.5\n",
        encoding="utf-8",
    )
    pool = write_pool(
        tmp_path,
        [
            {"id": "slow", "rollouts_per_s": 40, "price_per_hour": 0.1},
            {"id": "fast", "rollouts_per_s": 100, "price_per_hour": 1.0},
        ],
    )
    code, out, _ = plan("--config", str(cfg), "--pool", str(pool), "--t-train", "2")
    # κ = S − 1 = 1; 1·100 / (1·2 − 0.5) = 66.6667; ×1.5 = 100 -> only "fast" (100) reaches it.
    assert code == 0
    assert "κ        steps per published version   1 (publish_every unset: S − 1)" in out
    assert "= 1·100 / (1·2 − 0.5) = 100 / 1.5 = 66.6667 rollouts/s" in out
    assert "Σμ ≥ 100 rollouts/s" in out
    # t_gen = 4/40 = 0.1; 1 + ⌈0.6/2⌉ = 2 ≤ 2
    assert "1 + ⌈(0.5 + 0.1)/2⌉ = 2 ≤ S = 2: ok" in out
    assert "active (1): Σμ_eff = 100 rollouts/s, cost 1 per hour" in out


def test_infeasible_when_broadcast_fills_the_window() -> None:
    code, out, _ = plan("--pool", str(EXAMPLE_POOL), "--t-bcast", "3")
    assert code == 1
    assert "INFEASIBLE: T_bcast = 3 s ≥ κ·T_train = 3 s" in out
    assert "3 + ⌈(3 + 0.2)/1⌉ = 7 > S = 4: VIOLATED" in out
    assert "active (6)" in out and "standby (0)" in out  # everything kept active


def test_staleness_violation_exits_1(tmp_path: Path) -> None:
    pool = write_pool(tmp_path, [{"id": "tiny", "rollouts_per_s": 1, "price_per_hour": None}])
    code, out, _ = plan("--pool", str(pool), "--t-train", "100")
    # rule: 3·256/(300 − 0) = 2.56 rollouts/s > 1 -> short; t_gen = 8 s: 3 + ⌈8/100⌉ = 4 ≤ 4
    assert code == 1
    assert "= 2.56 rollouts/s" in out and "short of capacity" in out
    assert "3 + ⌈(0 + 8)/100⌉ = 4 ≤ S = 4: ok" in out
    code, out, _ = plan("--pool", str(pool), "--t-train", "1000", "--t-bcast", "2500")
    # 3·256/(3000 − 2500) = 1.536 > 1 still short; staleness 3 + ⌈2508/1000⌉ = 6 > 4
    assert code == 1 and "= 6 > S = 4: VIOLATED" in out


def test_without_pool_prints_rule_only() -> None:
    code, out, _ = plan()
    assert code == 0
    assert "= 3·256 / (3·1 − 0) = 768 / 3 = 256 rollouts/s" in out
    assert "with t_gen = 0: 3 + ⌈0/1⌉ = 3 vs S = 4: ok so far" in out
    assert "no --pool given" in out


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
