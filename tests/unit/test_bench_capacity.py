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
