"""bench/intake.py's honest submissions are leased and acknowledged (it stops otherwise).

The bench used to sample each prompt once with its own seeds and reuse the groups; since leases
carry keyed seeds (check 4b) every such submission was refused ``sampling_mismatch`` and the
bench stopped at its first one. It now samples each lease at the lease's seeds as a node does.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from intake import PROMPTS, VERSION, G, make_bench

from policy.model import ModelSpec, build_model


def test_the_bench_submissions_pass_the_seed_check(tmp_path: Path) -> None:
    bench = make_bench("off", tmp_path, 0.0, build_model(ModelSpec(), seed=VERSION))
    asyncio.run(bench.run(bench.prepare(1)))  # SystemExit on a refused submission
    assert bench.core.store.rollout_count() == PROMPTS * G
    bench.core.close()


def test_a_round_of_leases_is_not_capped_per_node(tmp_path: Path) -> None:
    """A round's leases are all issued before it is timed: 100 per round at the defaults (400
    submissions in 4 rounds) over 4 nodes, beyond max_active_per_node's default of 4."""
    bench = make_bench("off", tmp_path, 0.0, build_model(ModelSpec(), seed=VERSION))
    bench.nodes = bench.nodes[:1]
    assert len(bench.lease(25)) == 25  # SystemExit on a Standby
    bench.core.close()
