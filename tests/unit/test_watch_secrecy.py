"""Nothing a node can read tells it when it is watched (issue 34, finding 4 and the epoch seed).

* the unsigned ``rswarm/status`` answer carries no per-node check rate, trust level, clean-check
  count, suspect mark or audit flag (the operator's HTTP ``/status`` still does);
* a lease's sampling seed is keyed with the coordinator's secret, not its (sequential, public)
  fencing epoch: a node cannot compute the seeds of its next lease, and two coordinators with
  different secrets give different seeds to the same lease id.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from coord_harness import FakeClock, Harness, submission
from service_parts import board

from coordinator.config import LeaseSection
from coordinator.leases import SEED_LABEL, LeaseManager
from coordinator.node_view import OPERATOR_ONLY_FIELDS
from coordinator.status import build_status, wire_status
from coordinator.store import Store
from protocol.codec import decode, encode
from protocol.messages import Ack, StatusRequest, StatusResponse


def _harness(tmp_path: Path) -> Harness:
    h = Harness(tmp_path, FakeClock())
    h.publish(1)
    return h


async def test_the_p2p_status_answer_hides_how_closely_nodes_are_watched(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    node = h.node()
    got = await h.core.submit(node.public_key, submission(h.lease(node, max_prompts=1)))
    assert isinstance(got, Ack), got
    h.core.trust.flag(node.public_key, "test flag", h.clock())  # a suspect, and flagged
    full = build_status(
        h.core, fingerprint="c", peer_id="p", started_at=0.0, trainer_stats={}, broadcast=None
    )
    # the operator's document (HTTP /status) has every field
    assert set(full) >= OPERATOR_ONLY_FIELDS
    assert full["node_suspect"][node.fingerprint] is True
    assert full["nodes_flagged"] == [node.fingerprint]
    # the document any peer reads over rswarm/status has none of them
    assert not OPERATOR_ONLY_FIELDS & set(wire_status(full))
    status = board(h)  # the service's own document: the same fields and the same flags
    assert set(status.document()) >= OPERATOR_ONLY_FIELDS
    answer = decode(await status.on_status("peer", encode(StatusRequest())), StatusResponse)
    assert not OPERATOR_ONLY_FIELDS & set(answer.status)
    assert node.fingerprint in answer.status["node_states"]  # the rest is still served


def test_lease_seeds_are_keyed_not_the_epoch(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    node = h.node()
    leases = [h.lease(node, max_prompts=1) for _ in range(3)]
    for lease in leases:
        assert lease.sampling.seed != lease.epoch
        secret = h.store.secret()
        mac = hmac.new(secret, SEED_LABEL + lease.lease_id.encode(), hashlib.sha256).digest()
        assert lease.sampling.seed == int.from_bytes(mac[:8], "big") >> 1
        assert 0 <= lease.sampling.seed < 2**63
    assert len({lease.sampling.seed for lease in leases}) == 3
    # another coordinator (another secret) gives the same lease id another seed
    other = Harness(tmp_path / "other", FakeClock())
    assert other.store.secret() != h.store.secret()
    assert other.core.leases.seed_of(leases[0].lease_id) != leases[0].sampling.seed


async def test_a_submission_with_epoch_seeds_is_refused(tmp_path: Path) -> None:
    """The intake checks the keyed seeds: a node that derived its seeds from the epoch (the
    old rule, or a guess) is refused; one that used the lease's seed is accepted."""
    import msgspec

    from coordinator.intake import expected_seed
    from protocol.errors import ReasonCode
    from protocol.messages import Reject

    h = _harness(tmp_path)
    node = h.node()
    lease = h.lease(node, max_prompts=1)
    honest = submission(lease)
    group = honest.groups[0]
    epoch_seeded = msgspec.structs.replace(
        honest,
        groups=[
            msgspec.structs.replace(
                group,
                samples=[
                    msgspec.structs.replace(s, seed=expected_seed(lease.epoch, 0, j))
                    for j, s in enumerate(group.samples)
                ],
            )
        ],
    )
    got = await h.core.submit(node.public_key, epoch_seeded)
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH, got
    assert isinstance(await h.core.submit(node.public_key, submission(h.lease(node, 1))), Ack)


def test_the_lease_seed_vector_of_the_protocol_document(tmp_path: Path) -> None:
    """docs/protocol.md §11.1: secret = 32 zero bytes, lease id L00000001-abcdef."""
    store = Store(tmp_path / "s.sqlite")
    store.set_meta("spot_check_secret", bytes(32).hex())  # the secret the leases are keyed with
    leases = LeaseManager(store, LeaseSection(), clock=lambda: 0.0, group_size=2, max_new_tokens=4)
    assert leases.seed_of("L00000001-abcdef") == 6616389715132945780
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    assert "`L00000001-abcdef` → `6616389715132945780`" in doc
