"""Builders of the coordinator service's collaborators around a :mod:`coord_harness` core: the
pieces the service composes in its ``start``, built alone (no libp2p, no HTTP socket)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from coord_harness import Harness

from coordinator.holding import TBcastEstimate, VersionHolder
from coordinator.learner_link import LearnerLink, VersionSink
from coordinator.node_rpc import NodeHandlers
from coordinator.status_board import StatusBoard
from protocol.codec import decode
from protocol.identity import Identity
from protocol.messages import Manifest, SignedEnvelope
from swarm.chunks import ChunkStore


class Downloads:
    """A downloader standing in for the broadcast node's network side: each download of a version
    takes ``delay`` seconds, fails ``failures`` times first, then marks the version ``held`` (the
    set the harness core's ``servable`` reads)."""

    def __init__(self, held: set[int], *, delay: float = 0.0, failures: int = 0) -> None:
        self.held = held
        self.delay = delay
        self.failures = failures
        self.calls: list[tuple[int | None, list[str]]] = []

    async def download(self, version: int | None, seeds: Sequence[str]) -> Any:
        self.calls.append((version, list(seeds)))
        await asyncio.sleep(self.delay)
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("the seed does not serve it yet")
        assert version is not None
        self.held.add(version)
        return {}


def holder(
    h: Harness,
    tmp_path: Path,
    downloads: Downloads,
    *,
    on_held: Callable[[float], None] | None = None,
    fetch_timeout_s: float = 60.0,
) -> VersionHolder:
    """A version holder over the harness's store and a chunk store in ``tmp_path``; new leases
    name what the harness core names (its ``servable`` should read ``downloads.held``)."""
    return VersionHolder(
        chunks=ChunkStore(tmp_path / "chunks", keep_versions=h.cfg.staleness_bound + 1),
        downloader=downloads,
        published=h.core.store,
        models=None,
        staleness_bound=h.cfg.staleness_bound,
        spot_checks=False,
        lease_version=h.core.lease_version,
        on_held=on_held or (lambda seconds: None),
        fetch_timeout_s=fetch_timeout_s,
    )


def published(h: Harness, version: int) -> tuple[SignedEnvelope, Manifest]:
    """The signed manifest of a version the harness published."""
    raw = h.core.store.get_version(version)
    assert raw is not None, version
    env = decode(raw, SignedEnvelope)
    return env, decode(env.payload, Manifest)


def nodes(
    h: Harness, versions: VersionHolder, on_rollouts: Callable[[], None] = lambda: None
) -> NodeHandlers:
    return NodeHandlers(h.core, versions=versions, on_rollouts=on_rollouts)


def board(
    h: Harness,
    serve: Callable[[dict[str, Any]], None] = lambda doc: None,
    reachability: Callable[[str], str | None] = lambda fingerprint: None,
) -> StatusBoard:
    """The status board over the harness core; ``reachability``: what the dial-back measured."""
    from coordinator.history import StatusHistory

    return StatusBoard(
        h.core,
        fingerprint="coord-fp",
        peer_id="coord",
        history=StatusHistory(),
        serve=serve,
        loaded_versions=list,
        reachability=reachability,
    )


def learner(
    h: Harness,
    sink: VersionSink,
    *,
    trainer: Identity | None = None,
    t_bcast: TBcastEstimate | None = None,
    on_report: Callable[[dict[str, Any]], None] = lambda stats: None,
    on_published: Callable[[int], None] = lambda version: None,
    check_version: Any = None,
) -> LearnerLink:
    """The learner's handlers over the harness core, signing with the harness's publisher key
    (the key the core verifies manifests with); ``trainer`` the one key allowed to call."""
    return LearnerLink(
        h.core,
        signer=h.publisher,
        trainer_fingerprint=trainer.fingerprint if trainer is not None else None,
        holder=sink,
        t_bcast=t_bcast or TBcastEstimate(apply=lambda seconds: None),
        rollouts_stored=asyncio.Event(),
        on_report=on_report,
        on_published=on_published,
        check_version=check_version,
        clock=h.clock,
    )
