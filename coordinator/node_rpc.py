"""The nodes' side of the coordinator service: register, heartbeat, lease, submit, release.

:class:`NodeHandlers` decodes each request, hands it to the :class:`~coordinator.core.Coordinator`
and encodes the answer. Two waits happen here, both bounded: a lease request that finds no
leasable version while one is on its way from the trainer waits for it
(:meth:`~coordinator.holding.VersionHolder.until_leasable`), and a submission whose version is
still being fetched waits for its weights (its spot check needs them). It keeps which libp2p peer
each node last called from (register, heartbeat): the service's dial-back measures that peer.

A submission is answered with :meth:`~coordinator.submissions.SubmissionDesk.receive`'s ack,
which does not wait for the lease's re-score (issue 34: its latency told a node which leases
were checked); the re-score of a lease drawn for one runs after the answer, in a task here
(:meth:`NodeHandlers.settle_later`), and the learner's fetch is woken when its rows are released.
A re-score that raises (the verifier or the weights failed; a node's fault is a verdict, not an
exception) is tried again after :data:`RESCORE_RETRY_S`; leases a restart left unchecked, or whose
every try failed, are checked at the start (:meth:`NodeHandlers.resume_checks`).
The re-scores running after their answers are bounded: with ``max_pending_checks`` of them
running, every submission's answer (drawn or not, so the wait reveals only the coordinator's
load) waits up to ``check_room_wait_s`` for one to end. Before the answer stopped waiting for the
check, a node's own wait for it held it to the verifier's pace; without the bound, a node whose
every lease is drawn (a newcomer on probation) outran the verifier and the held backlog and its
tasks grew without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from coordinator.core import Coordinator
from coordinator.errors import Rejection
from coordinator.submissions import HeldCheck
from protocol.codec import decode, encode
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import fingerprint_of
from protocol.messages import (
    Ack,
    Heartbeat,
    LeaseRequest,
    Register,
    Reject,
    ReleaseLease,
    RolloutSubmission,
    SignedEnvelope,
)

M = TypeVar("M", bound=msgspec.Struct)

log = logging.getLogger(__name__)

#: a submission waits at most this long for the coordinator to hold its version (spot checks)
SPOT_CHECK_WAIT_S = 5.0
#: a lease request that finds no leasable version while one is being fetched from the trainer
#: waits up to this long for it (instead of sending the node away for a 1 s standby)
LEASE_VERSION_WAIT_S = 2.0
#: re-scores running after their answers beyond which a submission's answer waits (module
#: docstring); a few seconds of one verifier's work on the embedded model, well under a minute
#: for a real one at the budget's pace
MAX_PENDING_CHECKS = 32
#: the longest a submission's answer waits for room among the re-scores (the node's submit call
#: times out after 60 s; the wait for the version's weights, 5 s, comes after it)
CHECK_ROOM_WAIT_S = 20.0
#: a re-score that raised (the verifier or the weights failed, not the node: a node's fault is a
#: verdict) is tried again after each of these delays, its task still counted among the pending
#: re-scores; after the last its rows stay held until the next start (``resume_checks``)
RESCORE_RETRY_S = (5.0, 30.0, 120.0)


class VersionWaits(Protocol):
    """The waits on versions being fetched (:class:`coordinator.holding.VersionHolder`)."""

    async def until_leasable(self, wait_s: float) -> None: ...

    async def wait_held(self, version: int, timeout: float) -> None: ...


class NodeHandlers:
    """The node RPCs over ``core``. ``versions`` waits for versions on their way;
    ``on_rollouts`` is told when a submission stored rollouts (the learner's fetch wakes)."""

    def __init__(
        self,
        core: Coordinator,
        *,
        versions: VersionWaits,
        on_rollouts: Callable[[], None],
        lease_wait_s: float = LEASE_VERSION_WAIT_S,
        spot_check_wait_s: float = SPOT_CHECK_WAIT_S,
        max_pending_checks: int = MAX_PENDING_CHECKS,
        check_room_wait_s: float = CHECK_ROOM_WAIT_S,
        rescore_retry_s: tuple[float, ...] = RESCORE_RETRY_S,
    ) -> None:
        self._core = core
        self._versions = versions
        self._on_rollouts = on_rollouts
        self._lease_wait_s = lease_wait_s
        self._spot_check_wait_s = spot_check_wait_s
        self._peer_ids: dict[str, str] = {}  # node fingerprint -> libp2p peer id (register, hb)
        #: re-scores running after their lease's ack (held rows: durable if they never end)
        self._checks: set[asyncio.Task[None]] = set()
        self._max_pending_checks = max_pending_checks
        self._check_room_wait_s = check_room_wait_s
        self._check_ended = asyncio.Event()
        self._rescore_retry_s = rescore_retry_s

    def peer_of(self, fingerprint: str) -> str | None:
        """The libp2p peer the node ``fingerprint`` last registered or beat from (None: never)."""
        return self._peer_ids.get(fingerprint)

    def _open(self, request: bytes, type_: type[M], *, admit: bool = True) -> tuple[bytes, M]:
        env = decode(request, SignedEnvelope)
        return self._core.open(env, type_, admit=admit)

    async def on_register(self, caller: str, request: bytes) -> bytes:
        node_key, msg = self._open(request, Register)
        if msg.advert.peer_id != caller:
            raise Rejection(ReasonCode.SCHEMA, "advert.peer_id is not the calling libp2p peer")
        ack = self._core.register(node_key, msg.advert)
        self._peer_ids[fingerprint_of(node_key)] = caller
        return encode(ack)

    async def on_heartbeat(self, caller: str, request: bytes) -> bytes:
        # admitted by the heartbeat itself, from the one read it makes (the most frequent call)
        node_key, msg = self._open(request, Heartbeat, admit=False)
        ack = self._core.heartbeat(node_key, msg)
        self._peer_ids[fingerprint_of(node_key)] = caller
        return encode(ack)

    async def on_lease(self, caller: str, request: bytes) -> bytes:
        node_key, msg = self._open(request, LeaseRequest)
        await self._versions.until_leasable(self._lease_wait_s)
        return encode(self._core.request_lease(node_key, msg))

    async def on_submit(self, caller: str, request: bytes) -> bytes:
        core = self._core
        env = decode(request, SignedEnvelope)
        try:
            node_key, msg = core.open(env, RolloutSubmission)
        except ProtocolError as exc:  # refused before the intake: still an intake rejection
            if exc.code is ReasonCode.REPLAYED:  # the same signed bytes again: same verdict
                stored = core.replayed_submission(env)
                if stored is not None:
                    return encode(stored)
            core.metrics.rejected.labels(reason=ReasonCode(exc.code).value).inc()
            raise
        await self._room_for_checks()
        arrived = core.clock()  # judged as of now: its lease waits for its check (issue 35)
        with core.budget.verifying.waiting(msg.lease_id, node_key, arrived):
            # spot checks need the weights here
            await self._versions.wait_held(msg.policy_version, self._spot_check_wait_s)
            verdict, held = await core.desk.receive(node_key, msg, arrived)
        if held is not None:  # acknowledged as any other; its re-score runs after the answer
            self.settle_later(held, msg.policy_version)
        elif not isinstance(verdict, Reject):
            self._on_rollouts()
        return encode(verdict)

    def settle_later(self, held: HeldCheck, version: int) -> None:
        """Run an acknowledged lease's re-score in a task; its rows join the feed if it passes."""
        task = asyncio.get_running_loop().create_task(self._settle(held, version))
        self._checks.add(task)
        task.add_done_callback(self._check_done)

    def _check_done(self, task: asyncio.Task[None]) -> None:
        self._checks.discard(task)
        self._check_ended.set()

    async def _room_for_checks(self) -> None:
        """Until fewer than ``max_pending_checks`` re-scores run, at most ``check_room_wait_s``
        (then answer anyway: the bound slows the intake down, it never refuses)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._check_room_wait_s
        while len(self._checks) >= self._max_pending_checks:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._check_ended.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_ended.wait(), left)

    async def _settle(self, held: HeldCheck, version: int) -> None:
        tries = 1 + len(self._rescore_retry_s)
        for attempt, delay in enumerate((0.0, *self._rescore_retry_s), start=1):
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await self._versions.wait_held(version, self._spot_check_wait_s)
                verdict = await self._core.desk.settle(held)
            except Exception as exc:  # the verifier failed (a node's fault is a verdict)
                if attempt < tries:
                    log.warning(
                        "the re-score of lease %s failed (%s: %s); trying again in %.0f s",
                        held.lease_id, type(exc).__name__, exc, self._rescore_retry_s[attempt - 1],
                    )  # fmt: skip
                    continue
                log.exception(  # its rows stay held; the next start checks the lease again
                    "the re-score of lease %s failed %d times; its rows stay held until the "
                    "coordinator's next start", held.lease_id, tries,
                )  # fmt: skip
                return
            if not isinstance(verdict, Reject):
                self._on_rollouts()
            return

    def resume_checks(self) -> int:
        """Re-score the leases a restart left acknowledged and unchecked (their rows held);
        returns how many were started."""
        pending = self._core.desk.records.held.pending()
        for lease in pending:
            self.settle_later(HeldCheck(lease.lease_id, lease.digest), lease.version)
        if pending:
            log.info("re-scoring %d leases acknowledged before the restart", len(pending))
        return len(pending)

    async def stop(self) -> None:
        """Cancel the re-scores still running (their rows stay held: checked at the next start)."""
        for task in list(self._checks):
            task.cancel()
        await asyncio.gather(*self._checks, return_exceptions=True)

    async def on_release(self, caller: str, request: bytes) -> bytes:
        node_key, msg = self._open(request, ReleaseLease)
        prompts = self._core.release(node_key, msg.lease_id, msg.epoch, msg.reason)
        return encode(Ack(ref=msg.lease_id, detail=f"{len(prompts)} prompts released"))
