"""The nodes' side of the coordinator service: register, heartbeat, lease, submit, release.

:class:`NodeHandlers` decodes each request, hands it to the :class:`~coordinator.core.Coordinator`
and encodes the answer. Two waits happen here, both bounded: a lease request that finds no
leasable version while one is on its way from the trainer waits for it
(:meth:`~coordinator.holding.VersionHolder.until_leasable`), and a submission whose version is
still being fetched waits for its weights (its spot check needs them). It keeps which libp2p peer
each node last called from (register, heartbeat): the service's dial-back measures that peer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from coordinator.core import Coordinator
from coordinator.errors import Rejection
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

#: a submission waits at most this long for the coordinator to hold its version (spot checks)
SPOT_CHECK_WAIT_S = 5.0
#: a lease request that finds no leasable version while one is being fetched from the trainer
#: waits up to this long for it (instead of sending the node away for a 1 s standby)
LEASE_VERSION_WAIT_S = 2.0


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
    ) -> None:
        self._core = core
        self._versions = versions
        self._on_rollouts = on_rollouts
        self._lease_wait_s = lease_wait_s
        self._spot_check_wait_s = spot_check_wait_s
        self._peer_ids: dict[str, str] = {}  # node fingerprint -> libp2p peer id (register, hb)

    def peer_of(self, fingerprint: str) -> str | None:
        """The libp2p peer the node ``fingerprint`` last registered or beat from (None: never)."""
        return self._peer_ids.get(fingerprint)

    def _open(self, request: bytes, type_: type[M]) -> tuple[bytes, M]:
        env = decode(request, SignedEnvelope)
        return self._core.open(env, type_)

    async def on_register(self, caller: str, request: bytes) -> bytes:
        node_key, msg = self._open(request, Register)
        if msg.advert.peer_id != caller:
            raise Rejection(ReasonCode.SCHEMA, "advert.peer_id is not the calling libp2p peer")
        ack = self._core.register(node_key, msg.advert)
        self._peer_ids[fingerprint_of(node_key)] = caller
        return encode(ack)

    async def on_heartbeat(self, caller: str, request: bytes) -> bytes:
        node_key, msg = self._open(request, Heartbeat)
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
        arrived = core.clock()  # judged as of now: its lease waits for its check (issue 35)
        with core.budget.verifying.waiting(msg.lease_id, node_key, arrived):
            # spot checks need the weights here
            await self._versions.wait_held(msg.policy_version, self._spot_check_wait_s)
            verdict = await core.submit(node_key, msg, arrived)
        if not isinstance(verdict, Reject):
            self._on_rollouts()
        return encode(verdict)

    async def on_release(self, caller: str, request: bytes) -> bytes:
        node_key, msg = self._open(request, ReleaseLease)
        prompts = self._core.release(node_key, msg.lease_id, msg.epoch, msg.reason)
        return encode(Ack(ref=msg.lease_id, detail=f"{len(prompts)} prompts released"))
