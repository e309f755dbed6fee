"""The status document on the wire (``rswarm/status``): whatever the trainer reports, the
coordinator's answer must still decode at every client (StatusResponse's bounded shape)."""

from __future__ import annotations

from protocol.codec import decode, encode
from protocol.limits import MAX_NAME_LEN, MAX_STATUS_KEYS
from protocol.messages import StatusResponse


def test_a_status_with_too_many_or_too_long_keys_still_decodes() -> None:
    from coordinator.status import wire_status

    doc: dict[str, object] = {"latest_version": 3, "versions_held": [1, 2, 3]}
    # what build_status appends from a trainer's report: "trainer_" + a name of up to 256 chars
    doc |= {f"trainer_{i:03d}" + "k" * 250: i for i in range(300)}
    doc["node_states"] = {f"ed25519:{i}" + "n" * 300: "active" for i in range(300)}
    wire = wire_status(doc)
    back = decode(encode(StatusResponse(status=wire)), StatusResponse).status
    assert len(back) == MAX_STATUS_KEYS and all(len(k) <= MAX_NAME_LEN for k in back)
    assert back["latest_version"] == 3 and back["versions_held"] == [1, 2, 3]  # kept: added first
    assert "node_states" not in back  # added last, dropped with the overflow


def test_nested_maps_are_cut_to_the_limits() -> None:
    from coordinator.status import wire_status

    wire = wire_status({"node_states": {"n" * 300 + str(i): "gone" for i in range(300)}})
    back = decode(encode(StatusResponse(status=wire)), StatusResponse).status
    states = back["node_states"]
    assert isinstance(states, dict) and len(states) <= MAX_STATUS_KEYS
    assert all(len(k) <= MAX_NAME_LEN for k in states)
