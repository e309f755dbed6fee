"""bench/staleness.py's bookkeeping: which runs exist at S = 0, collapses, ratios in the table."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _staleness_report import tables
from staleness import build_specs, collapse_of


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(tasks=["reverse3"], S=[0, 4], seeds=[0], max_steps=None, post_steps=None,
                eval_every=10, s0_all=False, target=0.9, lag="fixed")  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_s0_runs_once_for_weight_options_and_per_option_otherwise() -> None:
    specs = build_specs(_args(options=["tis", "mis", "rollback", "lr-3e-4"]), {})
    at0 = sorted(s.option for s in specs if s.staleness == 0)
    assert at0 == ["lr-3e-4", "rollback", "tis"]  # mis trains exactly as tis at S = 0
    assert sorted(s.option for s in specs if s.staleness == 4) == [
        "lr-3e-4", "mis", "rollback", "tis",
    ]  # fmt: skip


def test_collapse_is_a_fall_of_more_than_03_after_07() -> None:
    assert collapse_of([10, 20, 30], [0.5, 0.75, 0.5]) is None  # fell 0.25
    got = collapse_of([10, 20, 30, 40], [0.72, 0.9, 0.8, 0.55])
    assert got == {"peak_step": 20, "peak": 0.9, "trough_step": 40, "trough": 0.55}
    assert collapse_of([10, 20], [0.65, 0.2]) is None  # never reached 0.7


def _run(option: str, s: int, steps: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    return {
        "spec": {"task": "reverse3", "staleness": s, "option": option, "overrides": overrides,
                 "seed": 0, "target": 0.9},
        "steps_to_target": steps, "final_exact": 0.9, "final_reward": 0.95, "collapse": None,
        "monitors": {},
    }  # fmt: skip


def test_ratios_use_the_options_own_s0_when_it_trains_differently() -> None:
    tis = {"weight_mode": "truncate"}
    slow = {"weight_mode": "truncate", "lr": 3e-4}
    results = [
        _run("tis", 0, 100, tis), _run("tis", 4, 150, tis),
        _run("mis", 4, 120, {"weight_mode": "mask"}),
        _run("slow", 0, 200, slow), _run("slow", 4, 240, slow),
    ]  # fmt: skip
    rows = {line.split(" | ")[0]: line for line in tables(results, ["tis", "mis", "slow"])}
    assert "100 (1.00×) [1] | 150 (1.50×) [1]" in rows["| tis"]
    assert "100 (1.00×) [1] | 120 (1.20×) [1]" in rows["| mis"]  # S = 0 of the weight options
    assert "200 (1.00×) [1] | 240 (1.20×) [1]" in rows["| slow"]  # its own S = 0, not tis's


def test_no_ratio_against_an_s0_median_that_missed_the_target() -> None:
    """reverse4 at S = 0 missed in 1 of 2 seeds (median ✗): S = 4's 740 steps read "0.00×"."""
    tis = {"weight_mode": "truncate"}
    results = [_run("tis", 0, None, tis), _run("tis", 0, None, tis), _run("tis", 4, 740, tis)]
    rows = {line.split(" | ")[0]: line for line in tables(results, ["tis"])}
    assert "| 740 [1] |" in rows["| tis"] + " |"
    assert "×)" not in rows["| tis"]


def test_filter_groups_keeps_informative_groups_and_samples_more() -> None:
    """DAPO-style filtering: groups with one reward for all samples are dropped and more prompts
    sampled until the batch is full; the newest uniform groups fill up to one per minibatch at
    worst, after max_batches batches' worth."""
    from staleness import _informative

    def rows_for(indices: list[int]) -> list[tuple[Any, ...]]:  # even prompts informative
        return [(i, None, None, float(s % 2) if i % 2 == 0 else 1.0, False)
                for i in indices for s in range(2)]  # fmt: skip

    calls = []

    def more(idx: list[int], k: int) -> list[tuple[Any, ...]]:
        calls.append(k)
        return rows_for(idx)

    idx, rows, used = _informative([0, 1, 2, 3], rows_for([0, 1, 2, 3]), 4, 2, 4, more,
                                   max_batches=4, min_groups=2)  # fmt: skip
    assert idx == [0, 2, 4, 6] and used == 4 and calls == [1]
    assert [r[0] for r in rows] == [0, 0, 2, 2, 4, 4, 6, 6]
    calls.clear()

    def solved(indices: list[int], k: int = 0) -> list[tuple[Any, ...]]:
        return [(j, None, None, 1.0, True) for j in indices for _ in range(2)]

    idx, rows, used = _informative([0, 1, 2, 3], solved([0, 1, 2, 3]), 4, 2, 4, solved,
                                   max_batches=3, min_groups=2)  # fmt: skip
    # prompts 0..3 given, 4..11 sampled (two more batches), the two newest fill the batch
    assert used == 4 * 2 and idx == [10, 11] and [r[0] for r in rows] == [10, 10, 11, 11]


def test_separation_is_the_chance_that_a_step_before_a_collapse_reads_worse() -> None:
    from _staleness_report import separation

    # 2 x 3 pairs: 3 (>1, >2, tie 3 = 0.5) and 4 (> all three): 2.5 + 3 = 5.5 of 6
    assert separation([3.0, 4.0], [1.0, 2.0, 3.0], high_bad=True) == pytest.approx(5.5 / 6)
    # the same figure where low is bad: 3 is below none and ties one, 4 below none
    assert separation([3.0, 4.0], [1.0, 2.0, 3.0], high_bad=False) == pytest.approx(0.5 / 6)
    assert separation([1.0, 1.0], [1.0], high_bad=True) == 0.5  # no signal
    assert math.isnan(separation([], [1.0], high_bad=True))


def test_the_monitor_table_reports_a_figure_that_separates() -> None:
    """A synthetic run whose grad norm is 10 near its collapse and 1 everywhere else, beside a
    healthy one at 1: the AUC column reads 1.00 for grad_norm, and ess_frac (flat) 0.50."""
    from _staleness_report import monitor_analysis

    n = 60
    spike = [1.0] * 15 + [10.0] * 40 + [1.0] * 5  # high over the whole window before step 50
    flat = [0.9] * n

    def run(collapse: dict[str, Any] | None, grad: list[float]) -> dict[str, Any]:
        return {
            "spec": {"staleness": 4}, "collapse": collapse,
            "curve_steps": [10, 20, 30, 40, 50, 60], "curve_exact": [0.1, 0.75, 0.8, 0.9, 0.9, 0.9],
            "monitors": {"grad_norm": grad, "ess_frac": flat},
        }  # fmt: skip

    results = [
        run({"peak_step": 40, "peak": 0.9, "trough_step": 50, "trough": 0.2}, spike),
        run(None, [1.0] * n),
    ]
    rows = {line.split(" | ")[0]: line for line in monitor_analysis(results, {})}
    assert rows["| grad_norm"].endswith("| 1.00 |")
    assert rows["| ess_frac"].endswith("| 0.50 |")
