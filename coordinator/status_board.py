"""The status the coordinator serves: the ``/status`` document, its history, ``rswarm/status``.

:class:`StatusBoard` builds the document (:func:`coordinator.status.build_status` plus the
service's own figures: versions loaded for spot checks, each node's measured reachability, the
longest prompt), refreshes it on the upkeep's tick (:meth:`StatusBoard.refresh`, which also
records a history row), shows a new version at once (:meth:`StatusBoard.show_published`) and
answers ``rswarm/status`` with the document's wire form. :func:`node_pages_on` hands the HTTP
threads' ``/api/nodes`` requests to the event loop that owns the coordinator's state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from coordinator.core import Coordinator
from coordinator.dissemination import HolderCensus
from coordinator.history import StatusHistory
from coordinator.http import PAGE_TIMEOUT_S, NodePages
from coordinator.status import build_status, node_page, wire_status
from protocol.codec import decode, encode
from protocol.messages import StatusRequest, StatusResponse
from swarm.broadcast import BroadcastNode


class StatusBoard:
    """The coordinator's status document and where it is served.

    ``core`` and ``broadcast`` give the figures, ``census`` who holds which recent version (the
    trainer's last report comes in through :meth:`trainer_report`), ``loaded_versions`` the
    versions ready for spot checks, ``reachability`` a node's measured reachability by
    fingerprint (None: not measured), ``longest_prompt`` the longest rendered prompt in tokens
    (None: not checked); each served document goes to ``serve`` (the HTTP server's
    ``set_status``) and each tick's to ``history``."""

    def __init__(
        self,
        core: Coordinator,
        *,
        fingerprint: str,
        peer_id: str,
        history: StatusHistory,
        serve: Callable[[dict[str, Any]], None],
        loaded_versions: Callable[[], list[int]],
        reachability: Callable[[str], str | None],
        broadcast: BroadcastNode | None = None,
        census: HolderCensus | None = None,
        longest_prompt: int | None = None,
        started_at: float | None = None,
    ) -> None:
        self._core = core
        self._fingerprint = fingerprint
        self._peer_id = peer_id
        self._history = history
        self._serve = serve
        #: the trainer's last report (figures riding on its fetches)
        self.trainer_stats: dict[str, Any] = {}
        self._loaded_versions = loaded_versions
        self._reachability = reachability
        self._broadcast = broadcast
        self._census = census
        self._longest_prompt = longest_prompt
        self._started_at = time.time() if started_at is None else started_at
        #: the document last served (its figures are refreshed on the tick only)
        self._doc: dict[str, Any] | None = None
        self._seq = 0  # the served document's serial (``status_seq``)

    def document(self) -> dict[str, Any]:
        """The ``/status`` document (also served over ``rswarm/status``)."""
        status = build_status(
            self._core,
            fingerprint=self._fingerprint,
            peer_id=self._peer_id,
            started_at=self._started_at,
            trainer_stats=self.trainer_stats,
            broadcast=self._broadcast,
            census=self._census,
        )
        status["versions_loaded"] = self._loaded_versions()  # ready for log-prob spot checks
        status["node_reachability"] = self.node_reachability(status.get("node_states") or {})
        if self._longest_prompt is not None:  # the trainer checks its positions against these
            status["longest_prompt_tokens"] = self._longest_prompt
        return status

    def trainer_report(self, stats: dict[str, Any]) -> None:
        """The trainer's report that rode on its last fetch: shown on /status, drawn over time."""
        self.trainer_stats = stats
        self._history.record_trainer(stats)

    def node_reachability(self, nodes: dict[str, Any]) -> dict[str, str]:
        """``{fingerprint: "public" | "private" | "unknown"}``, as measured by this coordinator's
        dial-back of each node (not as the node claims)."""
        return {fp: self._reachability(fp) or "unknown" for fp in nodes}

    def refresh(self) -> None:
        """The tick: serve a fresh document and record it in the history."""
        status = self.document()
        self._publish(status)
        census = self._census
        self._history.record_tick(status, census.counts if census and census.taken_at else None)

    def show_published(self, version: int) -> None:
        """A new version shows on /status at once (``policy_version``), before the next tick.
        Only that field: the rest of the document, the capacity figures with it, stays on the
        tick's clock (see :class:`coordinator.upkeep.Upkeep`)."""
        if self._doc is None:
            return
        doc = dict(self._doc)  # a new mapping: the tick's history holds the old one
        current = doc.get("policy_version")
        doc["policy_version"] = version if current is None else max(int(current), version)
        self._publish(doc)

    def _publish(self, doc: dict[str, Any]) -> None:
        """Serve ``doc`` on ``/status`` under the next ``status_seq``: a tick's document and a
        publication's copy of it share their ``uptime_s``, so only the serial tells a reader (the
        dashboard, a test comparing the page with ``/status``) which one it holds."""
        self._seq += 1
        doc["status_seq"] = self._seq
        self._doc = doc
        self._serve(doc)

    async def on_status(self, caller: str, request: bytes) -> bytes:
        """``rswarm/status`` (unsigned): the document without the operator-only fields."""
        decode(request, StatusRequest)
        return encode(StatusResponse(status=wire_status(self.document())))


def node_pages_on(
    loop: asyncio.AbstractEventLoop, core: Coordinator, census: HolderCensus | None
) -> NodePages:
    """``/api/nodes`` for the HTTP threads: the page is built on ``loop`` (which owns the
    coordinator's state), the thread waits ``PAGE_TIMEOUT_S`` at most."""

    async def build(offset: int, limit: int) -> dict[str, Any]:
        return node_page(core, offset, limit, census)

    def page(offset: int, limit: int) -> dict[str, Any]:
        done = asyncio.run_coroutine_threadsafe(build(offset, limit), loop)
        try:
            return done.result(timeout=PAGE_TIMEOUT_S)
        except concurrent.futures.TimeoutError as exc:
            done.cancel()
            raise TimeoutError("node page") from exc

    return page
