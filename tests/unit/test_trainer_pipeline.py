"""The learner's plumbing off its critical path (trainer/pipeline.py) and where its time goes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_recipe import make_rollouts

from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.metrics import IdleClock, read_jsonl
from trainer.pipeline import PublicationSlot, RolloutFeed
from trainer.recipe import Trainer
from trainer.sources import InProcessSource, MemoryPublisher, VersionNotNewer

torch.set_num_threads(1)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_idle_clock_window_and_breakdown() -> None:
    clock = Clock()
    idle = IdleClock(clock, window_s=10.0)
    clock.t += 2.0
    idle.add_wait(2.0, "rollouts")
    clock.t += 2.0
    idle.add_busy(2.0)
    idle.mark()
    assert idle.fraction() == pytest.approx(0.5)
    assert idle.breakdown()["rollouts"] == pytest.approx(0.5)
    # 20 s later, all busy but 1 s of publishing: the start-up wait has left the window
    for _ in range(10):
        clock.t += 2.0
        idle.add_busy(1.5)
        idle.add_wait(0.5, "publish")
        idle.mark()
    assert idle.fraction() == pytest.approx(0.25)
    parts = idle.breakdown()
    assert parts["publish"] == pytest.approx(0.25) and parts["rollouts"] == 0.0
    assert parts["other"] == pytest.approx(0.0, abs=1e-9)
    totals = idle.totals()
    assert totals["wall_s"] == pytest.approx(24.0) and totals["busy_s"] == pytest.approx(17.0)
    assert totals["idle_rollouts_s"] == 2.0 and totals["idle_publish_s"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="unknown idle cause"):
        idle.add_wait(1.0, "coffee")


class ScriptedSource:
    """Answers fetches from a script of (delay, rollouts) and records what was asked."""

    def __init__(self, script: list[tuple[float, list[Rollout]]]) -> None:
        self.script = script
        self.asked: list[tuple[int, int, int | None]] = []

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Rollout] | None:
        self.asked.append((max_items, after, min_version))
        if not self.script:
            return None
        delay, items = self.script.pop(0)
        await asyncio.sleep(delay)
        return items


def _seq(rollouts: list[Rollout], start: int) -> list[Rollout]:
    return [dataclasses.replace(r, seq=start + i) for i, r in enumerate(rollouts)]


@pytest.mark.parametrize(
    ("page", "version", "cause"),
    [
        (32, 0, "rollouts"),  # 16 of 32 asked: the coordinator's queue ran dry
        (16, 0, "fetch"),  # a full page: rollouts were there, the fetch took the time
        (16, 9, "stale"),  # a full page of rollouts too stale to train on
    ],
)
def test_a_wait_is_attributed_to_what_the_fetch_found(page: int, version: int, cause: str) -> None:
    async def scenario() -> IdleClock:
        idle = IdleClock()
        source = ScriptedSource([(0.2, _seq(make_rollouts(1, 4, 4, version=0), 1))])
        feed = RolloutFeed(
            source, after=0, page=page, capacity=2 * page, idle=idle,
            admissible=lambda r: version - r.policy_version <= 2,
        )  # fmt: skip
        feed.start()
        await feed.take(page, timeout=5.0)
        await feed.stop()
        return idle

    idle = asyncio.run(scenario())
    totals = idle.totals()
    assert totals[f"idle_{cause}_s"] >= 0.15
    assert sum(v for k, v in totals.items() if k.startswith("idle_")) == pytest.approx(
        totals[f"idle_{cause}_s"]
    )


def test_rollouts_the_source_skipped_as_stale_count_as_dropped() -> None:
    async def scenario() -> tuple[RolloutFeed, ScriptedSource]:
        page = make_rollouts(2, 2, 4, version=5)  # seqs 11..18: 1..10 were skipped as stale
        source = ScriptedSource([(0.0, _seq(page, 11))])
        feed = RolloutFeed(
            source, after=0, page=8, capacity=16, idle=IdleClock(), background=False,
            admissible=lambda r: True, min_version=lambda: 4,
        )  # fmt: skip
        got = await feed.take(8, timeout=1.0)
        assert got is not None and len(got) == 8
        return feed, source

    feed, source = asyncio.run(scenario())
    assert source.asked == [(8, 0, 4)]
    assert feed.take_dropped() == 10 and feed.cursor == 18 and feed.take_dropped() == 0


class SwallowsOneCancel:
    """A long-polling source whose call swallows the first cancellation, as ``asyncio.wait_for``
    does in Python 3.11 when the cancel races with its inner call completing: the fetch returns
    an empty page as if answered."""

    def __init__(self) -> None:
        self.swallowed = 0
        self.fetches = 0

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Rollout] | None:
        self.fetches += 1
        try:
            await asyncio.sleep(30.0)  # the coordinator's long poll
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed += 1
        return []


def test_stopping_the_feed_ends_a_fetch_that_swallowed_the_cancel() -> None:
    """The feed's stop lands although the fetch in flight swallowed the first cancel: one cancel
    left the loop long-polling again and ``stop`` waited on it for ever (a trainer at its
    ``max_steps`` that never exited)."""

    async def scenario() -> tuple[SwallowsOneCancel, float, bool]:
        source = SwallowsOneCancel()
        feed = RolloutFeed(
            source, after=0, page=4, capacity=8, idle=IdleClock(), admissible=lambda r: True
        )
        feed.start()
        await asyncio.sleep(0.05)  # the first fetch is waiting
        task = feed._task
        t0 = time.monotonic()
        await asyncio.wait_for(feed.stop(), 5.0)
        return source, time.monotonic() - t0, task is not None and task.done()

    source, took, done = asyncio.run(scenario())
    assert source.swallowed == 1 and source.fetches == 2  # the loop did poll again
    assert done and took < 2.0


@pytest.mark.parametrize("trace", [True, False])
def test_a_tracing_feed_stamps_each_admissible_rollout_on_arrival(trace: bool) -> None:
    """``trace`` is given to the feed when it is built (``trace_rollouts``), not set on it
    afterwards: it stamps the admissible rollouts it receives, by seq."""

    async def scenario() -> tuple[RolloutFeed, list[Rollout]]:
        page = _seq(make_rollouts(3, 2, 4, version=0), 1)
        source = ScriptedSource([(0.0, [*page[:4], dataclasses.replace(page[4], reward=-1.0)])])
        feed = RolloutFeed(
            source, after=0, page=8, capacity=16, idle=IdleClock(), background=False,
            admissible=lambda r: r.reward >= 0, trace=trace,
        )  # fmt: skip
        got = await feed.take(5, timeout=1.0)
        assert got is not None
        return feed, got

    before = time.time()
    feed, got = asyncio.run(scenario())
    assert [r.seq for r in got] == [1, 2, 3, 4]  # the inadmissible one is dropped
    if not trace:
        assert feed.fetched_at is None
        return
    assert feed.fetched_at is not None and sorted(feed.fetched_at) == [1, 2, 3, 4]
    assert all(before <= t <= time.time() for t in feed.fetched_at.values())


def test_a_publication_deferred_behind_one_in_flight_is_counted() -> None:
    slot = PublicationSlot()
    assert (slot.defer(), slot.defer(), slot.deferred) == (1, 2, 2)


def _trainer(tmp_path: Path, **kw: object) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=4, minibatches=1, **kw
    )  # type: ignore[arg-type]
    return Trainer.setup(cfg)


class WatchingSource(InProcessSource):
    """Records whether each fetch happened while a learner step was running."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(wait_s=0.05)
        self.trainer = trainer
        self.during_step: list[bool] = []

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Rollout] | None:
        self.during_step.append(self.trainer.training)
        return await super().fetch(max_items, after, min_version)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_batch_is_fetched_while_the_learner_trains(tmp_path: Path, overlap: bool) -> None:
    tr = _trainer(tmp_path, max_steps=4, overlap=overlap)
    source = WatchingSource(tr)
    for b in range(6):
        source.put(make_rollouts(20 + b, 4, 4, version=0))
    source.close()
    asyncio.run(tr.run(source, None))
    assert tr.step == 4
    assert any(source.during_step) is overlap


class SlowPublisher(MemoryPublisher):
    """Each publication takes ``delay`` seconds; records the learner's step at start and end."""

    def __init__(self, trainer: Trainer, delay: float) -> None:
        super().__init__()
        self.trainer = trainer
        self.delay = delay
        self.spans: list[tuple[int, int, int]] = []

    async def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        start = self.trainer.step
        await asyncio.sleep(self.delay)
        await super().publish(version, state_dict)
        self.spans.append((version, start, self.trainer.step))


@pytest.mark.parametrize("overlap", [True, False])
def test_publishing_does_not_block_the_next_step(tmp_path: Path, overlap: bool) -> None:
    tr = _trainer(tmp_path, max_steps=6, max_staleness=8, publish_every=1, overlap=overlap)
    pub = SlowPublisher(tr, delay=0.4)
    source = InProcessSource(wait_s=0.05)
    for b in range(8):
        source.put(make_rollouts(30 + b, 4, 4, version=0))
    source.close()
    asyncio.run(tr.run(source, pub))
    versions = sorted(pub.versions)
    assert versions[0] == 0 and versions == sorted(set(versions)) and tr.step == 6
    background = [s for s in pub.spans if s[0] > 0]
    steps_during = sum(end - start for _, start, end in background)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    if overlap:
        # steps ran while versions were being published; due ones waited for the slot
        assert steps_during > 0 and tr.publish_deferred > 0
        # only v0, published before the first step, kept the learner waiting
        assert 0.4 <= rows[-1]["idle_publish_s"] < 0.4 * 1.5
    else:
        assert steps_during == 0 and tr.publish_deferred == 0
        assert rows[-1]["idle_publish_s"] >= 0.4 * (len(versions) - 1)  # the last after its row
    assert json.loads((tmp_path / "run" / "published.json").read_text()) == {
        "version": max(versions)
    }


def test_a_background_publication_refused_as_not_newer_is_renumbered(tmp_path: Path) -> None:
    """The swarm already holds v7 (a trainer killed after publishing it): the background
    publication of v1 is refused; at the next step boundary the learner adopts the floor and
    publishes its current weights as a newer version."""
    tr = _trainer(tmp_path, max_steps=3, max_staleness=8, publish_every=1)
    pub = MemoryPublisher()
    tr.published_version = 0  # as if v0 was published before a restart
    pub.versions[7] = {}
    source = InProcessSource(wait_s=0.05)
    for b in range(4):
        source.put(make_rollouts(40 + b, 4, 4, version=0))
    source.close()
    asyncio.run(tr.run(source, pub))
    assert max(pub.versions) > 7 and tr.published_version == max(pub.versions)
    assert tr.version >= tr.published_version


def test_publication_slot_collects_and_reraises() -> None:
    async def scenario() -> None:
        slot = PublicationSlot()

        async def fail() -> None:
            raise VersionNotNewer(3, 5)

        slot.start(3, fail())
        assert slot.busy and slot.collect() is None  # still running
        second = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already in flight"):
            slot.start(4, second)
        await second
        with pytest.raises(VersionNotNewer):
            await slot.wait()
        assert not slot.busy and slot.last_s is not None

    asyncio.run(scenario())


def test_an_uncollected_failed_publication_is_not_reported_as_never_retrieved() -> None:
    """A run cut short after the stop grace never collects its slot; the publication's failure
    (e.g. PublicationStopped) must not surface as asyncio's "Task exception was never retrieved"
    traceback when the task is freed, and collect() still re-raises it while the slot is kept."""
    import gc

    unhandled: list[dict[str, Any]] = []

    async def failing() -> None:
        raise RuntimeError("stopping: publication abandoned")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        kept = PublicationSlot()
        kept.start(1, failing())
        await kept.wait_done()
        with pytest.raises(RuntimeError, match="abandoned"):
            kept.collect()
        dropped = PublicationSlot()
        dropped.start(2, failing())
        await dropped.wait_done()
        del dropped  # the slot goes without anyone collecting it
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert unhandled == []


def test_a_learner_blocked_on_an_empty_feed_says_how_many_rollouts_it_waits_for() -> None:
    """``on_wanting`` (the coordinator's source sends it with every fetch as rollouts_wanted):
    the rollouts the learner waits for while it is blocked on an empty feed, 0 once it has some;
    a take that finds rollouts buffered blocks on nothing and says nothing."""
    seen: list[int] = []

    async def scenario() -> None:
        page1 = _seq(make_rollouts(1, 4, 4, version=0), 1)
        page2 = _seq(make_rollouts(1, 4, 4, version=0), len(page1) + 1)
        source = ScriptedSource([(0.3, page1), (0.2, page2)])
        feed = RolloutFeed(
            source, after=0, page=8, capacity=16, idle=IdleClock(), admissible=lambda r: True,
            on_wanting=seen.append,
        )  # fmt: skip
        feed.start()
        first = await feed.take(8, timeout=5.0)  # blocked until page 1 lands (0.3 s)
        assert first is not None and [r.seq for r in first] == [r.seq for r in page1]
        assert seen == [8, 0]
        await asyncio.sleep(0.4)  # page 2 is buffered by then
        second = await feed.take(4, timeout=5.0)
        assert second is not None and [r.seq for r in second] == [r.seq for r in page2]
        assert seen == [8, 0]  # not blocked: nothing said
        await feed.stop()

    asyncio.run(scenario())
