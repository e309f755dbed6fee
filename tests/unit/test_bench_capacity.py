"""bench/capacity.py bookkeeping: repeated grid runs are kept apart, compared on their means."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import capacity


def _run(nodes: int, s: int, rep: int, predicted: float, measured: float) -> dict[str, Any]:
    return {"nodes": nodes, "staleness": s, "overlap": True, "epochs": 1, "pair": False,
            "rep": rep, "idle": measured, "predicted": predicted}  # fmt: skip


def test_repeats_are_stored_apart_and_judged_on_their_means(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(capacity, "_predicted", lambda w: w["predicted"])
    ws = [
        _run(1, 4, 0, 0.14, 0.24), _run(1, 4, 1, 0.14, 0.18),  # means 14 / 21: 7 pp off
        _run(3, 2, 0, 0.40, 0.46), _run(3, 2, 1, 0.44, 0.42),  # means 42 / 44: 2 pp off
        _run(2, 1, 0, 0.50, 0.50),  # run once: not in the repeat table
    ]  # fmt: skip
    runs = {capacity._key(w): w for w in ws}
    assert len(runs) == 5  # a repetition does not overwrite the first run
    assert [w["rep"] for w in capacity.grid_rows(runs)] == [0, 0, 0]  # main table: rep 0
    table = capacity.repeat_table(runs)
    rows = [line for line in table if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 2
    assert rows[0].startswith("| 3 | 2 |") and rows[0].endswith("| 42.0 | 44.0 | -2.0 | 4.0 |")
    assert rows[1].startswith("| 1 | 4 |") and rows[1].endswith("| 14.0 | 21.0 | -7.0 | 6.0 |")
    assert table[-1].startswith("On the means of the runs: 1 of 2 points within 5")
    assert "largest gap 7.0 pp" in table[-1]


def test_a_nodes_window_rate_is_a_ratio_of_means() -> None:
    """μ over the window = mean samples per lease / mean lease time, as the coordinator keeps
    it: two status samples (μ, g) = (100/s, 1 s) and (50/s, 2 s) deliver 100 samples per lease
    in 1.5 s on average, 66.7/s, not the 75/s of the mean μ."""
    from _demo_window import mean_figures

    series = [
        {"node_gen_rollouts_per_s": {"n": 100.0}, "node_lease_s": {"n": 1.0}},
        {"node_gen_rollouts_per_s": {"n": 50.0}, "node_lease_s": {"n": 2.0}},
        {"node_gen_rollouts_per_s": {}, "node_lease_s": {}},  # not measured yet
    ]
    figs = mean_figures(series)["nodes"]["n"]
    assert figs["node_gen_rollouts_per_s"] == pytest.approx(100.0 / 1.5)
    assert figs["node_lease_s"] == pytest.approx(1.5)
