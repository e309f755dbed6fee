"""The coordinator service's collaborators, each built alone around a harness core: the version
holder and its T_bcast estimate, the learner's handlers (publish, fetch), the node handlers' waits
and the status board (no libp2p, no HTTP socket)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from coord_harness import FakeClock, Harness
from service_parts import Downloads, board, holder, learner, nodes, published

from coordinator.errors import Rejection
from coordinator.holding import SpotCheckModels, TBcastEstimate
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.manifest import build_manifest, verify_manifest
from protocol.messages import (
    FetchRollouts,
    LoraInfo,
    Manifest,
    ManifestResponse,
    PublishVersion,
    RolloutBatch,
    SignedEnvelope,
)
from swarm.chunks import ChunkStore


def _harness(tmp_path: Path, **overrides: Any) -> tuple[Harness, set[int]]:
    """A harness whose core leases the versions in the returned set (what a holder holds)."""
    h = Harness(tmp_path, clock=FakeClock(time.time()), **overrides)
    held: set[int] = set()
    h.core.servable = held.__contains__
    return h, held


class Sink:
    """Records the publications handed to the version holder."""

    def __init__(self) -> None:
        self.held: list[tuple[int, str]] = []

    def hold(self, env: SignedEnvelope, manifest: Manifest, seeder: str) -> None:
        self.held.append((manifest.version, seeder))


# --- T_bcast ---------------------------------------------------------------------------------
def test_t_bcast_is_the_prepare_time_plus_the_running_mean_of_hold_times() -> None:
    applied: list[float] = []
    est = TBcastEstimate(apply=applied.append)
    est.prepared(0.5)
    assert applied == []  # no version held yet: nothing to say
    est.held(1.0)  # first hold: the mean is that hold
    est.held(2.0)  # then 0.7 * old + 0.3 * new = 1.3
    est.prepared(None)  # a report without the figure: prepare time 0
    # hand-computed: 0.5 + 1.0, 0.5 + 1.3, 0 + 1.3 (margins: a few float roundings of ~1)
    assert applied == pytest.approx([1.5, 1.8, 1.3], abs=1e-12)


# --- the version holder ----------------------------------------------------------------------
async def test_the_holder_fetches_a_publication_from_its_trainer_and_times_it(
    tmp_path: Path,
) -> None:
    h, held = _harness(tmp_path)
    h.publish(1)
    times: list[float] = []
    downloads = Downloads(held, delay=0.05, failures=2)  # the trainer starts seeding late
    versions = holder(h, tmp_path, downloads, on_held=times.append)
    assert h.core.lease_version() is None
    versions.hold(*published(h, 1), "trainer-peer")
    assert versions.chunks.manifest(1) is not None  # served to nodes at once
    assert versions.seeder_of(1) == "trainer-peer" and versions.fetching(1)
    await versions.wait_held(1, 5.0)
    assert not versions.fetching(1)
    assert downloads.calls == [(1, ["trainer-peer"])] * 3  # retried until served
    assert h.core.lease_version() == 1
    # three downloads of ≥ 0.05 s each, plus two back-offs (0.02 s, 0.04 s): sleeps never end early
    assert len(times) == 1 and times[0] >= 3 * 0.05 + 0.06


async def test_a_version_never_served_wakes_the_waiting_lease_requests(tmp_path: Path) -> None:
    h, held = _harness(tmp_path)
    h.publish(1)
    times: list[float] = []
    downloads = Downloads(held, failures=1 << 30)
    versions = holder(h, tmp_path, downloads, on_held=times.append, fetch_timeout_s=0.1)
    versions.hold(*published(h, 1), "trainer-peer")
    t0 = time.monotonic()
    await versions.until_leasable(5.0)  # gives up with the fetch, not at its own bound
    assert time.monotonic() - t0 < 2.0
    assert not versions.fetching(1) and times == []  # a failed fetch measures no T_bcast


async def test_after_a_restart_the_holder_resumes_the_usable_versions(tmp_path: Path) -> None:
    h, held = _harness(tmp_path, staleness_bound=2)
    for version in range(1, 5):
        h.publish(version)
    times: list[float] = []
    downloads = Downloads(held)
    versions = holder(h, tmp_path, downloads, on_held=times.append)
    versions.resume()
    for version in (2, 3, 4):
        await versions.wait_held(version, 5.0)
    # the last S + 1 versions, from whoever holds them (no seeder known after a restart)
    assert sorted(downloads.calls) == [(2, []), (3, []), (4, [])]
    assert held == {2, 3, 4} and times == []  # says nothing about T_bcast


# --- the learner's handlers ------------------------------------------------------------------
def _proposal(h: Harness, trainer: Identity, version: int, lora: LoraInfo | None = None) -> bytes:
    now = h.clock()
    manifest, _ = build_manifest(
        {"model.safetensors": b"w" * 64},
        version=version,
        parent_version=None,
        model_config_hash="ab",
        tokenizer_hash="cd",
        created_at=now,
        expires_at=now + 3600,
        chunk_size=32,
        lora=lora,
    )
    msg = PublishVersion(manifest=encode(manifest), source="test")
    return encode(seal(trainer, msg, now=now))


async def test_a_publication_is_signed_recorded_and_handed_to_the_holder(tmp_path: Path) -> None:
    h, _ = _harness(tmp_path)
    trainer, sink, announced = Identity.generate(), Sink(), []
    link = learner(h, sink, trainer=trainer, on_published=announced.append)
    answer = decode(await link.on_publish("trainer-peer", _proposal(h, trainer, 1)))
    assert isinstance(answer, ManifestResponse) and answer.manifest is not None
    assert verify_manifest(answer.manifest, h.publisher.public_key, h.clock()).version == 1
    assert h.core.store.latest_version() == 1
    assert sink.held == [(1, "trainer-peer")] and announced == [1]
    # a retry (the first answer was lost): the same signed manifest, nothing done twice
    again = decode(await link.on_publish("trainer-peer", _proposal(h, trainer, 1)))
    assert isinstance(again, ManifestResponse) and again.manifest == answer.manifest
    assert sink.held == [(1, "trainer-peer")] and announced == [1]


async def test_a_lora_version_over_another_base_is_refused_at_publication(
    tmp_path: Path,
) -> None:
    """The coordinator could not spot-check it (it skipped those checks with a warning): the
    trainer hears why, in one line, and nothing is recorded or fetched."""
    from policy.lora import base_fingerprint
    from policy.model import ModelSpec

    h, _ = _harness(tmp_path)
    trainer, sink, announced = Identity.generate(), Sink(), []
    model_dir = tmp_path / "model"  # a model directory's fingerprint hashes its files
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen2"}')
    spec = ModelSpec(path=str(model_dir))
    models = SpotCheckModels(ChunkStore(tmp_path / "chunks", keep_versions=3), spec)
    link = learner(
        h, sink, trainer=trainer, on_published=announced.append,
        check_version=models.check_lora_base,
    )  # fmt: skip
    other = LoraInfo(base_model="ab" * 32, rank=4, alpha=8.0)
    with pytest.raises(Rejection) as e:
        await link.on_publish("trainer-peer", _proposal(h, trainer, 1, lora=other))
    assert e.value.code is ReasonCode.LORA_BASE_MISSING
    assert "\n" not in str(e.value) and "model_path" in str(e.value) and "abababab" in str(e.value)
    assert h.core.store.latest_version() is None and sink.held == [] and announced == []
    # over the coordinator's own base: published
    ours = LoraInfo(base_model=base_fingerprint(spec).split(":", 1)[1], rank=4, alpha=8.0)
    answer = decode(await link.on_publish("trainer-peer", _proposal(h, trainer, 1, lora=ours)))
    assert isinstance(answer, ManifestResponse)
    assert h.core.store.latest_version() == 1 and sink.held == [(1, "trainer-peer")]


async def test_the_trainers_report_reaches_the_plan_the_status_and_t_bcast(
    tmp_path: Path,
) -> None:
    h, _ = _harness(tmp_path)
    trainer, reports, applied = Identity.generate(), [], []
    t_bcast = TBcastEstimate(apply=applied.append)
    t_bcast.held(2.0)
    link = learner(h, Sink(), trainer=trainer, t_bcast=t_bcast, on_report=reports.append)
    stats = {"step": 3, "t_train_s": 0.5, "batch_rollouts": 64, "kappa": 2,
             "publish_prepare_s": 0.25, "rollout_cursor": 0}  # fmt: skip
    fetch = FetchRollouts(
        after_seq=0, max_rollouts=8, min_policy_version=None, wait_s=0.0, trainer_stats=stats
    )
    request = encode(seal(trainer, fetch, now=h.clock()))
    answer = decode(await link.on_fetch("trainer-peer", request))
    assert isinstance(answer, RolloutBatch) and answer.rollouts == []
    assert reports == [stats]
    assert (h.core.t_train_s, h.core.batch_rollouts, h.core.kappa) == (0.5, 64, 2)
    assert applied[-1] == pytest.approx(2.25, abs=1e-12)  # 0.25 + 2.0, one rounding


async def test_a_fetch_says_what_the_learner_has_fetched_waits_for_and_trains_within(
    tmp_path: Path,
) -> None:
    """``rollouts_wanted`` and ``max_staleness`` of the trainer's report, with the fetch's
    ``after_seq``, reach the learner's figures the backlog bound reads; a report-only fetch (past
    any seq) moves no position, and a junk S is not believed."""
    h, _ = _harness(tmp_path)
    trainer = Identity.generate()
    link = learner(h, Sink(), trainer=trainer)

    async def fetch(after: int, stats: dict[str, Any]) -> None:
        msg = FetchRollouts(
            after_seq=after, max_rollouts=8, min_policy_version=None, wait_s=0.0,
            trainer_stats=stats,
        )  # fmt: skip
        answer = decode(
            await link.on_fetch("trainer-peer", encode(seal(trainer, msg, now=h.clock())))
        )
        assert isinstance(answer, RolloutBatch)

    await fetch(7, {"rollouts_wanted": 16, "max_staleness": 0})
    figures = h.core.learner
    assert (figures.fetched_after, figures.wanting_now(h.clock()), figures.max_staleness) == (
        7,
        16,
        0,
    )
    await fetch(2**62, {"rollouts_wanted": 0, "max_staleness": True})  # a report: no position
    assert (figures.fetched_after, figures.wanting_now(h.clock()), figures.max_staleness) == (
        7,
        16,
        0,
    )
    await fetch(9, {"rollouts_wanted": 0, "max_staleness": -1})
    assert (figures.fetched_after, figures.wanting_now(h.clock()), figures.max_staleness) == (
        9,
        0,
        0,
    )


# --- the node handlers' waits and the status board -------------------------------------------
async def test_a_submission_waits_for_its_version_within_its_bound(tmp_path: Path) -> None:
    h, held = _harness(tmp_path)
    h.publish(1)
    h.publish(2)
    versions = holder(h, tmp_path, Downloads(held, delay=0.2))
    versions.hold(*published(h, 1), "trainer-peer")
    t0 = time.monotonic()
    await versions.wait_held(1, 5.0)  # until held
    assert 0.15 <= time.monotonic() - t0 < 1.5 and 1 in held
    slow = holder(h, tmp_path / "slow", Downloads(held, delay=5.0))
    slow.hold(*published(h, 2), "trainer-peer")
    t0 = time.monotonic()
    await slow.wait_held(2, 0.1)  # no longer than its bound
    assert time.monotonic() - t0 < 1.0 and slow.fetching(2)
    await slow.wait_held(3, 5.0)  # nothing on its way: no wait
    slow.stop()
    assert nodes(h, versions).peer_of("nobody") is None


def test_the_status_board_shows_each_nodes_measured_reachability(tmp_path: Path) -> None:
    h, _ = _harness(tmp_path)
    public, unmeasured = h.node(), h.node()
    doc = board(h, reachability={public.fingerprint: "public"}.get).document()
    assert doc["node_reachability"] == {
        public.fingerprint: "public",
        unmeasured.fingerprint: "unknown",
    }


async def test_a_publication_is_held_from_the_trainers_seed_and_then_leased(
    tmp_path: Path,
) -> None:
    """The learner link, the version holder and a real broadcast node over an in-memory network:
    the trainer proposes v1, seeds it only after the answer (as it does), and the coordinator
    holds it, leases name it and T_bcast is measured; nothing is faked but the network."""
    from coordinator.holding import VersionHolder
    from swarm.broadcast import BroadcastNode, DownloadConfig
    from swarm.holders import MemoryHolderDirectory
    from swarm.memtransport import InMemoryNetwork

    h = Harness(tmp_path, clock=FakeClock(time.time()))
    net, directory, key = InMemoryNetwork(), MemoryHolderDirectory(), h.publisher.public_key
    fast = DownloadConfig(seed_backoff=0.01, holders_refresh=0.05)
    seed = BroadcastNode(
        net.endpoint("trainer-peer"), ChunkStore(tmp_path / "t", keep_versions=3), directory, key
    )
    chunks = ChunkStore(tmp_path / "coord", keep_versions=3)
    ours = BroadcastNode(net.endpoint("coord"), chunks, directory, key, config=fast)
    h.core.servable = chunks.is_complete  # as the service wires it
    applied: list[float] = []
    t_bcast = TBcastEstimate(apply=applied.append)
    versions = VersionHolder(
        chunks=chunks, downloader=ours, published=h.core.store, models=None,
        staleness_bound=h.cfg.staleness_bound, spot_checks=False,
        lease_version=h.core.lease_version, on_held=t_bcast.held,
    )  # fmt: skip
    trainer = Identity.generate()
    link = learner(h, versions, trainer=trainer, t_bcast=t_bcast)
    await seed.start()
    await ours.start()
    try:
        now = h.clock()
        files = {"model.safetensors": bytes(range(256)) * 64}
        manifest, parts = build_manifest(
            files, version=1, parent_version=None, model_config_hash="ab", tokenizer_hash="cd",
            created_at=now, expires_at=now + 3600, chunk_size=4096,
        )  # fmt: skip
        proposal = PublishVersion(manifest=encode(manifest), source="test")
        answer = decode(
            await link.on_publish("trainer-peer", encode(seal(trainer, proposal, now=now)))
        )
        assert isinstance(answer, ManifestResponse) and answer.manifest is not None
        assert h.core.lease_version() is None  # published, not held yet: no lease names it
        await asyncio.sleep(0.05)
        await seed.seed_version(answer.manifest, parts)  # the trainer seeds after our answer
        await versions.until_leasable(10.0)
        assert h.core.lease_version() == 1 and versions.holds(1)
        assert chunks.load_files(1) == files
        assert len(applied) == 1 and applied[0] >= 0.05  # publish -> held, seeding waited for
        assert versions.seeder_of(1) == "trainer-peer"
    finally:
        versions.stop()
        await ours.stop()
        await seed.stop()
