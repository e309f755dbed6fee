"""Message schemas: round trips and field-level rejections with stable reason codes."""

from __future__ import annotations

import copy
import math
import struct
import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import pytest

from protocol import PROTOCOL_VERSION
from protocol.codec import decode, encode
from protocol.errors import DecodeError, ProtocolError, ReasonCode, SchemaViolation
from protocol.examples import example_messages, rollout_submission
from protocol.messages import (
    MESSAGE_TYPES,
    Message,
    RolloutSubmission,
    Sample,
    Standby,
    logprobs_array,
    pack_logprobs,
    pack_tokens,
    tokens_array,
    unpack_logprobs,
    unpack_tokens,
)


def _raw(msg: msgspec.Struct) -> Any:
    """The message as plain msgpack builtins, ready to be tampered with."""
    return msgspec.msgpack.decode(encode(msg))


def _code(obj: Any, type_: Any = Message) -> ReasonCode:
    with pytest.raises(ProtocolError) as info:
        decode(msgspec.msgpack.encode(obj), type_)
    return info.value.code


def test_examples_cover_every_message_type() -> None:
    assert {type(m) for m in example_messages()} == set(MESSAGE_TYPES)
    assert set(MESSAGE_TYPES) == set(Message.__args__)  # type: ignore[attr-defined]


@pytest.mark.parametrize("msg", example_messages(), ids=lambda m: type(m).__name__)
def test_round_trip_every_message(msg: msgspec.Struct) -> None:
    data = encode(msg)
    assert decode(data) == msg  # via the union
    assert decode(data, type(msg)) == msg  # via the concrete type
    raw = msgspec.msgpack.decode(data)
    assert raw["type"] == type(msg).__name__
    assert raw["protocol_version"] == PROTOCOL_VERSION


def test_decoding_as_the_wrong_type_is_schema_error() -> None:
    data = encode(Standby(retry_after_s=1.0, reason=""))
    with pytest.raises(DecodeError) as info:
        decode(data, RolloutSubmission)
    assert info.value.code is ReasonCode.SCHEMA


def test_packing_round_trip_and_layout() -> None:
    tokens = [0, 1, 2**32 - 1, 151_935]
    packed = pack_tokens(tokens)
    assert packed == struct.pack("<4I", *tokens)
    assert unpack_tokens(packed) == tokens
    assert tokens_array(packed).dtype == np.dtype("<u4")
    lps = [-0.5, -1e-8, -30.0]
    packed_lp = pack_logprobs(lps)
    assert packed_lp == struct.pack("<3f", *lps)
    assert unpack_logprobs(packed_lp) == pytest.approx(lps, rel=1e-6)
    assert logprobs_array(packed_lp).dtype == np.dtype("<f4")
    assert pack_tokens([]) == b"" and pack_logprobs([]) == b""


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_pack_tokens_rejects_out_of_range(bad: list[Any]) -> None:
    with pytest.raises(SchemaViolation):
        pack_tokens(bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_pack_logprobs_rejects_non_finite(bad: float) -> None:
    with pytest.raises(SchemaViolation) as info:
        pack_logprobs([-0.1, bad])
    assert info.value.code is ReasonCode.NOT_FINITE


def test_sample_construction_checks_lengths() -> None:
    with pytest.raises(SchemaViolation):
        Sample(
            token_ids=pack_tokens([1, 2]),
            logprobs=pack_logprobs([-1.0]),
            finish_reason="eos",
            seed=0,
        )


# --- tampered wire data: each mutation maps to its documented reason code --------------------
def _sub() -> Any:
    return _raw(rollout_submission(n_samples=2, n_tokens=4))


def _set(path: str, value: Any) -> Any:
    obj = _sub()
    *parents, last = path.split(".")
    cur = obj
    for p in parents:
        cur = cur[int(p)] if p.isdigit() else cur[p]
    cur[int(last) if last.isdigit() else last] = value
    return obj


NAN_F32 = struct.pack("<f", math.nan)
INF_F32 = struct.pack("<f", math.inf)


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        (_set("extra", 1), ReasonCode.UNKNOWN_FIELD),
        (_set("groups.0.samples.0.extra", 1), ReasonCode.UNKNOWN_FIELD),
        (_set("epoch", "3"), ReasonCode.SCHEMA),
        (_set("epoch", -1), ReasonCode.OUT_OF_RANGE),
        (_set("epoch", 2**63), ReasonCode.OUT_OF_RANGE),
        (_set("dtype", "int8"), ReasonCode.SCHEMA),
        (_set("backend", "Has Space"), ReasonCode.SCHEMA),
        (_set("lease_id", "x" * 129), ReasonCode.TOO_LONG),
        (_set("lease_id", ""), ReasonCode.SCHEMA),
        (_set("groups", []), ReasonCode.SCHEMA),
        (_set("timings.generate_s", math.nan), ReasonCode.NOT_FINITE),
        (_set("timings.started_at", math.inf), ReasonCode.NOT_FINITE),
        (_set("timings.finished_at", -math.inf), ReasonCode.NOT_FINITE),
        (_set("groups.0.samples.0.logprobs", NAN_F32 * 4), ReasonCode.NOT_FINITE),
        (_set("groups.0.samples.1.logprobs", INF_F32 * 4), ReasonCode.NOT_FINITE),
        (_set("groups.0.samples.0.token_ids", b"\x01\x02\x03"), ReasonCode.MALFORMED),
        (_set("groups.0.samples.0.token_ids", b"\x01" * 8), ReasonCode.SCHEMA),
        (_set("groups.0.samples.0.token_ids", b"\x00" * (4 * 131_072 + 4)), ReasonCode.TOO_LONG),
        (_set("groups.0.samples", [_sub()["groups"][0]["samples"][0]] * 257), ReasonCode.TOO_LONG),
        (_set("protocol_version", 2), ReasonCode.UNSUPPORTED_VERSION),
        (_set("type", "RolloutSubmissionV2"), ReasonCode.SCHEMA),
    ],
)
def test_tampered_submission_rejected_with_code(obj: Any, code: ReasonCode) -> None:
    assert _code(obj) is code


def test_future_version_with_new_fields_is_unsupported_version_not_unknown_field() -> None:
    obj = _set("protocol_version", 2)
    obj["new_in_v2"] = {"x": 1}
    assert _code(obj) is ReasonCode.UNSUPPORTED_VERSION


def test_constructing_a_foreign_version_fails() -> None:
    with pytest.raises(SchemaViolation) as info:
        Standby(retry_after_s=1.0, reason="", protocol_version=7)
    assert info.value.code is ReasonCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ({"a": {"b": {"c": 1}}}, ReasonCode.SCHEMA),  # nesting deeper than 2
        ({"a": math.nan}, ReasonCode.NOT_FINITE),
        ({"a": [math.inf]}, ReasonCode.NOT_FINITE),
        ({str(i): i for i in range(257)}, ReasonCode.TOO_LONG),
        ({1: 2}, ReasonCode.SCHEMA),  # map keys must be strings
    ],
)
def test_status_payload_is_bounded(status: Any, code: ReasonCode) -> None:
    assert _code({"type": "StatusResponse", "status": status}) is code


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        ({"type": "Standby", "retry_after_s": -1.0, "reason": ""}, ReasonCode.OUT_OF_RANGE),
        ({"type": "Standby", "retry_after_s": 1e9, "reason": ""}, ReasonCode.OUT_OF_RANGE),
        (
            {
                "type": "FetchRollouts",
                "after_seq": 0,
                "max_rollouts": 0,
                "min_policy_version": None,
                "wait_s": 0.0,
            },
            ReasonCode.OUT_OF_RANGE,
        ),
    ],
)
def test_numeric_ranges(obj: Any, code: ReasonCode) -> None:
    assert _code(obj) is code


def test_sampling_params_ranges() -> None:
    lease = copy.deepcopy(_raw(next(m for m in example_messages() if type(m).__name__ == "Lease")))
    lease["sampling"]["top_p"] = 0.0
    assert _code(lease) is ReasonCode.OUT_OF_RANGE
    lease["sampling"]["top_p"] = math.nan
    assert _code(lease) is ReasonCode.NOT_FINITE
    lease["sampling"]["top_p"] = 1.0
    lease["sampling"]["temperature"] = -0.1
    assert _code(lease) is ReasonCode.OUT_OF_RANGE


def test_protocol_imports_without_the_ml_stack() -> None:
    code = (
        "import sys, protocol.codec, protocol.envelope, protocol.manifest, protocol.examples\n"
        "bad = [m for m in ('torch', 'hivemind', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
