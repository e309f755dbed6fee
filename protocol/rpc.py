"""RPC methods between nodes, trainer and coordinator (libp2p stream names and their messages).

Each method is one libp2p stream (see :mod:`swarm.transport` for the framing). The request is
an encoded :class:`~protocol.messages.SignedEnvelope` whose payload is the request message, signed
by the caller's Ed25519 key (node key, or the trainer's publisher key); ``rswarm/status`` is
unsigned.
Responses are plain encoded messages: the coordinator is authenticated by its libp2p peer ID, which
the caller dialled from the multiaddr it was given, and checkpoints by the pinned manifest key.

=================  ==========================  =====================================  =========
method             request payload             response                               caller
=================  ==========================  =====================================  =========
rswarm/register    Register                    RegisterAck | Reject                   node
rswarm/heartbeat   Heartbeat                   HeartbeatAck | Reject                  node
rswarm/lease       LeaseRequest                Lease | Standby | Reject               node
rswarm/submit      RolloutSubmission           Ack | Reject                           node
rswarm/release     ReleaseLease                Ack | Reject                           node
rswarm/publish     PublishVersion              ManifestResponse | Reject              trainer
rswarm/fetch       FetchRollouts               RolloutBatch | Reject                  trainer
rswarm/status      StatusRequest (unsigned)    StatusResponse                         anyone
rswarm/vtake       VerifyTake                  VerifyJob | Standby | Reject           verifier
rswarm/vdone       VerifyVerdict               Ack | Reject                           verifier
=================  ==========================  =====================================  =========

A verifier is a re-scoring process the operator runs (``swarm coordinator verifier``), signing
with a key the coordinator's ``verification.verifier_keys`` lists.

Checkpoint manifests and chunks use the methods of :mod:`swarm.broadcast` (served by every holder).
"""

from __future__ import annotations

from typing import Final

REGISTER: Final = "rswarm/register"
HEARTBEAT: Final = "rswarm/heartbeat"
LEASE: Final = "rswarm/lease"
SUBMIT: Final = "rswarm/submit"
RELEASE: Final = "rswarm/release"
PUBLISH: Final = "rswarm/publish"
FETCH: Final = "rswarm/fetch"
STATUS: Final = "rswarm/status"
VERIFY_TAKE: Final = "rswarm/vtake"
VERIFY_DONE: Final = "rswarm/vdone"

#: Seconds a caller waits for each method before giving up (every network wait has a timeout).
DEFAULT_TIMEOUTS: Final[dict[str, float]] = {
    REGISTER: 15.0,
    HEARTBEAT: 10.0,
    LEASE: 15.0,
    SUBMIT: 60.0,
    RELEASE: 10.0,
    PUBLISH: 60.0,
    FETCH: 60.0,
    STATUS: 10.0,
    VERIFY_TAKE: 10.0,  # plus the long-poll wait
    VERIFY_DONE: 10.0,
}
