"""A stop that lands while rank 0 asks the coordinator for its newest version (right after the
set-up, e.g. the launcher SIGKILLed as a resume ends): one process leaves as before; a sharded
job must not leave its other ranks waiting in the loop's first collective
(``test_trainer_sharded_cli`` saw them outlive their launcher)."""

from __future__ import annotations

import asyncio

import pytest

from trainer.network import _latest_version, _Stopped


class _SlowCoordinator:
    """A publisher whose status request answers only after ``answer_after_s`` (never: None)."""

    def __init__(self, answer_after_s: float | None) -> None:
        self.answer_after_s = answer_after_s
        self.stopped = False
        self.asked = 0

    async def latest_version(self) -> int | None:
        self.asked += 1
        if self.answer_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.answer_after_s or 0.0)
        return 7

    def stop(self) -> None:
        self.stopped = True


async def _stop_soon(stop: asyncio.Event) -> None:
    await asyncio.sleep(0.05)
    stop.set()


async def test_a_stop_during_the_request_hands_a_sharded_job_back_to_end_with_its_ranks() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().create_task(_stop_soon(stop))
    answered, latest = await asyncio.wait_for(
        _latest_version(_SlowCoordinator(None), stop, sharded=True), 5.0
    )
    assert (answered, latest) == (False, None)


async def test_a_stop_during_the_request_ends_one_process_as_before() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().create_task(_stop_soon(stop))
    with pytest.raises(_Stopped):
        await asyncio.wait_for(_latest_version(_SlowCoordinator(None), stop, sharded=False), 5.0)


async def test_stopped_before_the_request_asks_once_and_takes_the_answer() -> None:
    stop = asyncio.Event()
    stop.set()
    coordinator = _SlowCoordinator(0.01)
    for sharded in (False, True):
        assert await _latest_version(coordinator, stop, sharded=sharded) == (True, 7)
    assert coordinator.stopped and coordinator.asked == 2


async def test_no_answer_after_a_stop_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainer.network.REPORT_TIMEOUT_S", 0.1)
    stop = asyncio.Event()
    stop.set()
    assert await _latest_version(_SlowCoordinator(None), stop, sharded=True) == (False, None)
    with pytest.raises(_Stopped):
        await _latest_version(_SlowCoordinator(None), stop, sharded=False)


async def test_the_stop_grace_is_the_configs() -> None:
    """``stop_grace_s`` (trainer config) is the grace a step still running at the stop gets,
    then it is abandoned: here 0.3 s, not the default 10 s (an outer limit of 5 s)."""
    from trainer.config import TrainerConfig
    from trainer.network import StepAbandoned, _within_grace

    grace_s = TrainerConfig(stop_grace_s=0.3).stop_grace_s
    stop = asyncio.Event()
    step = asyncio.ensure_future(asyncio.Event().wait())  # a step that never ends
    asyncio.get_running_loop().create_task(_stop_soon(stop))
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(StepAbandoned, match=r"within 0\.3 s of the stop"):
        await asyncio.wait_for(_within_grace(step, stop, "the step", grace_s=grace_s), 5.0)
    took = asyncio.get_running_loop().time() - t0
    assert 0.3 <= took < 4.0, took  # the grace was given, and it was not the default's 10 s
    step.cancel()


async def test_a_loop_cut_short_ends_even_when_it_swallows_the_first_cancel() -> None:
    """After the grace, the loop's task (in a publication's network wait) is cancelled until it
    ends: a wait that swallowed the first cancel (Python 3.11's ``wait_for`` race in the
    transport) and waited again hung the trainer's exit with a single ``cancel(); await``."""
    from trainer.network import CUT_SHORT_S, _cut_short

    cancels = 0

    async def publication() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise  # the first cancel is swallowed, the second ends it

    run = asyncio.create_task(publication())
    await asyncio.sleep(0)
    # not wait_for: its own timeout's cancel would reach `run` through the awaiting helper
    cut = asyncio.create_task(_cut_short(run))
    done, _ = await asyncio.wait([cut], timeout=CUT_SHORT_S + 2.0)
    assert cut in done, "the loop's task was not ended"
    assert run.cancelled() and cancels == 2
