"""Per-node capacity figures (coordinator/throughput.py) and how the coordinator plans with them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from coord_harness import Harness, submission

from coordinator.throughput import ThroughputBook
from protocol.messages import Ack, Timings

KEY = b"k" * 32


def test_generation_rate_overhead_and_load_per_switch() -> None:
    book = ThroughputBook(alpha=0.5)
    # 64 samples in 0.5 s of generation; the coordinator saw 0.7 s from issue to receipt, the
    # node claims 0.1 s of round trips: the unexplained 0.2 s counts as overhead instead.
    fig = book.record(KEY, samples=64, version=1, generate_s=0.5, load_s=0.0, overhead_s=0.1,
                      observed_s=0.7)  # fmt: skip
    assert fig is not None
    assert (fig.gen_rate, fig.lease_s, fig.load_s) == (128.0, 0.5, None)
    assert fig.overhead_s == pytest.approx(0.2)
    # the first load is the start-up download, not a version switch; the next switch is
    fig = book.record(KEY, samples=64, version=2, generate_s=0.5, load_s=0.4, overhead_s=0.3,
                      observed_s=1.0)  # fmt: skip
    assert fig is not None and fig.load_s == pytest.approx(0.4)
    assert fig.overhead_s == pytest.approx(0.25)  # (0.2 + 0.3) / 2
    # a lease on the version it holds does not dilute the per-switch load
    fig = book.record(KEY, samples=64, version=2, generate_s=0.5, load_s=0.0, overhead_s=0.3,
                      observed_s=0.6)  # fmt: skip
    assert fig is not None and fig.load_s == pytest.approx(0.4) and fig.leases == 3
    # a switch whose load the prefetch hid: the mean goes down
    fig = book.record(KEY, samples=64, version=3, generate_s=0.5, load_s=0.0, overhead_s=0.3,
                      observed_s=0.6)  # fmt: skip
    assert fig is not None and fig.load_s == pytest.approx(0.2)


def test_a_node_claiming_a_faster_generation_gains_nothing() -> None:
    """The rule uses samples / (g + o): time hidden from generate_s reappears as overhead."""
    honest, liar = ThroughputBook(), ThroughputBook()
    h = honest.record(KEY, samples=64, version=1, generate_s=0.8, load_s=0.0, overhead_s=0.1,
                      observed_s=0.9)  # fmt: skip
    lie = liar.record(KEY, samples=64, version=1, generate_s=0.01, load_s=0.0, overhead_s=0.0,
                      observed_s=0.9)  # fmt: skip
    assert h is not None and lie is not None and lie.gen_rate == 6400.0
    assert 64 / (lie.lease_s + lie.overhead_s) == pytest.approx(64 / (h.lease_s + h.overhead_s))
    # claims beyond what the coordinator observed are cut to it
    big = ThroughputBook().record(KEY, samples=8, version=1, generate_s=50.0, load_s=50.0,
                                  overhead_s=0.0, observed_s=2.0)  # fmt: skip
    assert big is not None and (big.lease_s, big.overhead_s) == (2.0, 0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_unusable_generation_times_measure_nothing(bad: float) -> None:
    book = ThroughputBook()
    assert book.record(KEY, samples=8, version=1, generate_s=bad, load_s=0.0, overhead_s=0.0,
                       observed_s=0.0) is None  # fmt: skip
    assert book.get(KEY) is None


def test_the_coordinator_plans_with_measured_figures(tmp_path: Path) -> None:
    """Accepted submissions feed the book; the plan uses generation rate, round trips and
    version loads; /status says what it predicts."""
    h = Harness(tmp_path, capacity={"batch_rollouts": 100, "t_train_s": 2.0})
    h.publish(1)
    node = h.node()
    lease = h.lease(node, max_prompts=3)  # 3 prompts × G = 2: 6 samples
    h.clock.advance(2.0)
    sub = msgspec.structs.replace(
        submission(lease),
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0, overhead_s=0.5),
    )
    assert isinstance(asyncio.run(h.core.submit(node.public_key, sub)), Ack)
    fig = h.core.throughput.get(node.public_key)
    assert fig is not None and fig.gen_rate == 6.0 and fig.overhead_s == pytest.approx(1.0)
    plan = h.core.replan()
    # μ = 6/s over 1 s of generation per 2 s cycle -> 3 rollouts/s, all within S = 2 (a lease
    # cycle of 2 s against (S + 1)·T − T_train = 4 s); the learner needs 100 per 2 s step:
    # × reliability (1 + 1)/(1 + 0 + 2) = 2/3 after one completed lease: 2 rollouts/s, a step
    # every 100/2 s instead of 2 s
    assert plan.available == pytest.approx(2.0)
    assert plan.pool_idle == pytest.approx(1 - 2.0 / 50)
    status = h.core.status()
    assert status["plan_predicted_idle_frac"] == pytest.approx(0.96)
    assert status["plan_batch_rollouts"] == 100 and status["plan_t_train_s"] == 2.0


def test_generation_rate_is_a_ratio_of_means() -> None:
    """μ_i = samples per lease / generation seconds per lease (both running means): with
    generation times that vary, a running mean of each lease's own rate overstates it (here
    (640 + 213.3)/2 = 426.7 against 64 / 0.2 = 320), and the rule's μ_i·g_i would exceed the
    samples a lease really carries."""
    book = ThroughputBook(alpha=0.5)
    book.record(KEY, samples=64, version=1, generate_s=0.1, load_s=0.0, overhead_s=0.0,
                observed_s=0.1)  # fmt: skip
    fig = book.record(KEY, samples=64, version=1, generate_s=0.3, load_s=0.0, overhead_s=0.0,
                      observed_s=0.3)  # fmt: skip
    assert fig is not None
    assert fig.lease_s == pytest.approx(0.2)
    assert fig.gen_rate == pytest.approx(320.0)
    assert fig.gen_rate * fig.lease_s == pytest.approx(64.0)
