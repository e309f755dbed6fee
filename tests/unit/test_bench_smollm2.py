"""bench/smollm2.py's bookkeeping: the kept runs of record (docs/smollm2-runs.jsonl), the report
that names each run's commit, and the S = 2 vs S = 0 step ratio; no model, no processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # first: bench/protocol.py must not shadow the protocol package

import smollm2 as bench  # noqa: E402


def run(seed: int, s: int, curve: list[tuple[int, float]], **kw: Any) -> dict[str, Any]:
    points = [
        {"version": step, "step": step, "t": 60.0 * i, "greedy": acc, "lo": 0.0, "hi": 1.0}
        for i, (step, acc) in enumerate(curve)
    ]  # fmt: skip
    r: dict[str, Any] = {
        "seed": seed, "staleness": s, "mode": "lora", "minutes": 30.0, "learner_steps": 40,
        "step_time_s_median": 25.0, "step_time_s_max": 90.0, "batch_samples": 32, "base": 0.4,
        "final": points[-1]["greedy"], "gain": points[-1]["greedy"] - 0.4, "rollouts_per_s": 4.0,
        "adapter_bytes": 1000, "delta_bytes_median": None, "full_bytes": None, "load": [1.0, 1.2],
        "commit": "abc1234", "date": "2026-12-05", "curve": points, "rollouts_accepted": 4000,
        "trained": 1280, "dropped_stale": 100, "dropped_uniform": 200,
    }  # fmt: skip
    r.update(kw)
    return r


def test_records_round_trip_replace_the_same_run_and_keep_the_others(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    bench.keep_records([run(0, 2, [(0, 0.4), (20, 0.6)]), run(0, 0, [(0, 0.4), (10, 0.5)])], path)
    bench.keep_records([run(0, 2, [(0, 0.4), (30, 0.7)], commit="def5678")], path)
    kept = bench.read_records(path)
    assert sorted(kept) == [(0, 0, "lora", 30.0), (0, 2, "lora", 30.0)]
    again = kept[(0, 2, "lora", 30.0)]
    assert again["commit"] == "def5678" and again["final"] == pytest.approx(0.7)
    assert len(path.read_text().splitlines()) == 2


def test_a_line_that_is_not_a_run_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps({"seed": 0}) + "\n")
    with pytest.raises(SystemExit, match=r"runs.jsonl:1 is not a run record"):
        bench.read_records(path)


def test_report_names_each_runs_commit_use_of_rollouts_and_the_step_ratio() -> None:
    s2 = run(0, 2, [(0, 0.4), (10, 0.5), (25, 0.62), (40, 0.7)], commit="aaa1111")
    s0 = run(0, 0, [(0, 0.4), (10, 0.55), (20, 0.6)], commit="bbb2222")
    text = bench.render([s2, s0], None, 30.0, "--runs 0:2:lora 0:0:lora")
    assert "| aaa1111, 2026-12-05 |" in text and "| bbb2222, 2026-12-05 |" in text
    assert "| 1,280 / 4,000 (32.0%; 100, 200) |" in text
    # a run kept before these figures were read reports none rather than a wrong one
    assert bench.used({"rollouts_accepted": 4000}) == "-"
    # S = 0 ended at 0.6 after 20 steps; S = 2 first scored >= 0.6 at step 25: 1.25
    assert "lora seed 0: 1.25" in text


def test_the_kept_runs_of_record_parse() -> None:
    """docs/smollm2-runs.jsonl, where present, is what --from-runs reads: every line a run."""
    for key, r in bench.read_records().items():
        assert key == bench.record_key(r)
        assert r["curve"] and r["curve"][0]["version"] == 0, key


def test_figures_count_what_the_learner_did_with_the_accepted_rollouts(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    ev = {"record": "eval", "version": 0, "step": 0, "taken_at": 100.0, "eval_greedy_acc": 0.4,
          "eval_greedy_lo": 0.3, "eval_greedy_hi": 0.5}  # fmt: skip
    steps = [
        {"step_time_s": 20.0, "admitted": 32, "dropped_stale": 8, "dropped_uniform": 16},
        {"step_time_s": 30.0, "admitted": 24, "dropped_stale": 0, "dropped_uniform": 8},
    ]
    lines = [ev, *steps, {**ev, "version": 2, "step": 2, "taken_at": 160.0, "eval_greedy_acc": 0.5}]
    (tmp_path / "trainer" / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines)
    )
    f = bench.figures(tmp_path, wall=60.0)
    assert (f["trained"], f["dropped_stale"], f["dropped_uniform"]) == (56, 8, 24)
    assert f["learner_steps"] == 2 and f["step_time_s_median"] == pytest.approx(25.0)
    assert f["base"] == pytest.approx(0.4) and f["gain"] == pytest.approx(0.1)
    assert [c["t"] for c in f["curve"]] == [0.0, 60.0]


def test_one_seed_gets_no_interval_and_each_run_its_wall_per_step() -> None:
    """A mean over one seed has no spread: the summary says so instead of printing [x, x]; each
    run shows its wall seconds per learner step and the share the learner waited for rollouts."""
    s0 = run(0, 0, [(0, 0.4), (20, 0.75)], wall_s=1800, learner_idle_frac=0.489)
    s2a = run(0, 2, [(0, 0.4), (20, 0.7)], wall_s=1800, learner_steps=45)
    s2b = run(1, 2, [(0, 0.4), (20, 0.8)], wall_s=1800, learner_steps=45)
    text = bench.render([s0, s2a, s2b], None, 30.0, "--runs 0:0:lora 0:2:lora 1:2:lora")
    assert "| lora | 0 | 1 | +0.350 (one seed) | True |" in text
    # two seeds: mean +0.35, half-width t(1) 12.706 x 0.0707 / sqrt(2) = 0.635
    assert "| lora | 2 | 2 | +0.350 [-0.285, +0.985] | True |" in text
    assert "| 45.0 (49%) |" in text  # 1800 s / 40 steps, waiting 48.9% of it
    assert "| 40.0 |" in text  # a run kept without the idle share: wall per step alone


def test_figures_read_the_learners_waiting_share(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    lines = [
        {"kind": "step", "step": i, "step_time_s": 20.0, "admitted": 32,
         "idle_rollouts_frac": frac}
        for i, frac in ((1, 0.9), (2, 0.5))
    ]  # fmt: skip
    (tmp_path / "trainer" / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines)
    )
    got = bench.figures(tmp_path, 100.0)
    assert got["learner_steps"] == 2
    assert got["learner_idle_frac"] == pytest.approx(0.5)  # the last record's running share


def test_a_run_records_the_commit_its_processes_loaded_not_the_one_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree may change during a 30-minute run (the next commit, an edit): the record names
    the commit at the run's start, the code the demo's processes imported."""
    heads = iter(["aaa1111", "bbb2222+dirty"])
    monkeypatch.setattr(bench, "commit", lambda: next(heads))

    def demo(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        run_dir = Path(argv[argv.index("--run-dir") + 1])
        (run_dir / "trainer").mkdir(parents=True)
        ev = {"record": "eval", "version": 0, "step": 0, "taken_at": 1.0, "eval_greedy_acc": 0.4,
              "eval_greedy_lo": 0.3, "eval_greedy_hi": 0.5}  # fmt: skip
        (run_dir / "trainer" / "metrics.jsonl").write_text(json.dumps(ev) + "\n")
        bench.commit()  # the tree moves on while the demo runs
        return subprocess.CompletedProcess(argv, 1, "", "")

    monkeypatch.setattr(bench.subprocess, "run", demo)
    r = bench.run_one("smollm2", 1, 2, "lora", 0.1, tmp_path / "run", [])
    assert r["commit"] == "aaa1111"


def test_lora_is_set_against_full_fine_tuning_paired_by_seed() -> None:
    """The report pairs each LoRA run with the full run of the same seed and S: the final-score
    difference with its interval over seeds, and the step time ratio; unpaired runs are left out."""
    lo0 = run(0, 0, [(0, 0.4), (20, 0.78)], step_time_s_median=22.0)
    lo1 = run(1, 0, [(0, 0.4), (20, 0.74)], step_time_s_median=26.0)
    fu0 = run(0, 0, [(0, 0.4), (20, 0.69)], mode="full", step_time_s_median=33.0)
    fu1 = run(1, 0, [(0, 0.4), (20, 0.70)], mode="full", step_time_s_median=39.0)
    alone = run(2, 2, [(0, 0.4), (20, 0.9)])  # no full run at seed 2, S = 2: not a pair
    line = bench.lora_vs_full([lo0, lo1, fu0, fu1, alone])
    # differences +0.09, +0.04: mean +0.065, half-width 12.706 x 0.0354 / sqrt(2) = 0.318
    assert "S = 0, 2 seeds: final score LoRA - full +0.065 [-0.253, +0.383]" in line
    assert "LoRA / full 0.67x" in line and "S = 2" not in line
    assert bench.lora_vs_full([lo0, alone]) == ""
    assert line in bench.render([lo0, lo1, fu0, fu1], None, 30.0, "--runs 0:0:lora")


def test_the_commit_is_dirty_only_when_the_code_the_processes_import_changed(
    tmp_path: Path,
) -> None:
    """A run started while the kept records (docs/) or this script (bench/) had uncommitted
    edits measured the committed code: ``+dirty`` says the packages themselves differ."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for path in ("swarm/x.py", "docs/runs.jsonl", "bench/smollm2.py"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("a\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    clean = bench.commit(tmp_path)
    assert len(clean) >= 7 and not clean.endswith("+dirty")
    (tmp_path / "docs" / "runs.jsonl").write_text("b\n")
    (tmp_path / "bench" / "smollm2.py").write_text("b\n")
    assert bench.commit(tmp_path) == clean
    (tmp_path / "swarm" / "x.py").write_text("b\n")
    assert bench.commit(tmp_path) == clean + "+dirty"
