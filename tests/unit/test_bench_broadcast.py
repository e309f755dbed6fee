"""bench/broadcast.py's own arithmetic: where the time went (phases of the per-chunk timelines),
the issue37 report, and the CPU-budget check; no processes, no namespaces."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # first: bench/protocol.py must not shadow the protocol package

import broadcast as bench  # noqa: E402


def test_phases_of_two_receivers() -> None:
    seed = "S"
    a = [(0.5, 0, seed), (1.0, 1, seed), (2.0, 2, "B"), (3.0, 3, "B")]
    b = [(0.7, 2, seed), (1.5, 3, seed), (2.5, 0, "A"), (4.0, 1, "A")]
    ph = bench.phases([a, b], seed, n_chunks=4)
    assert ph["first"] == pytest.approx((0.5 + 0.7) / 2)  # median first chunk
    assert ph["spread"] == pytest.approx(1.5)  # chunk 3 reached the swarm last, at 1.5 s
    assert ph["p2p"] == pytest.approx((2.0 + 2.5) / 2)  # median first chunk from a peer
    assert ph["copies95"] == pytest.approx(4.0) and ph["last"] == pytest.approx(4.0)
    # a chunk no receiver got: "every chunk in the swarm" is undefined, not a wrong number
    assert math.isnan(bench.phases([a], seed, n_chunks=5)["spread"])
    assert bench.phases([[], []], seed, n_chunks=4) == {}


def test_phases_take_the_median_of_each_start_up_mark() -> None:
    seed = "S"
    tl = [[(0.9, 0, seed)], [(1.1, 1, seed)], [(1.3, 0, seed)]]
    marks = [
        {"start": 0.1, "lookup": 0.6, "request": 0.4, "byte": 0.7},
        {"start": 0.2, "lookup": 0.5, "request": 0.5, "byte": 0.9},
        {"start": 0.3, "request": 0.6},  # its first lookup never answered, no byte yet
    ]
    ph = bench.phases(tl, seed, n_chunks=2, marks=marks)
    assert ph["m_start"] == pytest.approx(0.2) and ph["m_request"] == pytest.approx(0.5)
    assert ph["m_lookup"] == pytest.approx(0.55)  # of the two that have one
    assert ph["m_byte"] == pytest.approx(0.8)
    assert "m_start" not in bench.phases(tl, seed, n_chunks=2)  # no marks, no medians


def test_issue37_report_lists_each_link_with_timeouts_cpu_and_phases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written: dict[str, str] = {}
    monkeypatch.setattr(bench, "write_section", lambda name, text: written.update({name: text}))
    command = "python bench/broadcast.py --suite issue37"
    args = argparse.Namespace(
        size_mib=16.0, cap_mib=1.0, chunk_kib=256.0, repeats=1, command=command, note=""
    )
    results: list[Any] = []
    for link, ratio, timeouts in ((bench.Link(), 1.3, 0), (bench.Link(window=False), 1.7, 41)):
        r = bench.Result(link, "peer", 8, ratio * 16, ratio, 1.1)
        r.dht_timeouts = timeouts
        r.cpu_per_gib = {"total": 6.0}
        r.phases = {"first": 0.4, "spread": 17.0, "p2p": 1.2, "copies95": 19.0, "last": 20.8}
        results.append(r)
    bench.report_issue37(args, results)
    text = written["broadcast-issue37-1mibs"]
    assert "| tc tbf | 1.30 | 1.10 | 0 | 6.0 |" in text
    assert "| tc tbf — unpaced chunks | 1.70 | 1.10 | 41 | 6.0 |" in text
    assert "| tc tbf | 0.40 | 17.00 | 1.20 | 19.00 | 20.80 |" in text


def test_cpu_budgets_over_the_machine_are_refused() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "broadcast.py"), "--net", "netns", "--ns", "64",
         "--cpu-per-peer", "1", "--no-report"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--cpu-per-peer" in out.stderr and ("cores" in out.stderr or "unavailable" in out.stderr)
