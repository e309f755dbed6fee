"""LoRA versions on the wire (docs/protocol.md §8.6): the test vector printed there, the kind of a
version, and the manifest rules a LoRA version must keep."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import torch

from protocol.codec import decode, encode
from protocol.errors import ManifestError, ProtocolError, ReasonCode, error_for
from protocol.manifest import build_manifest, version_kind
from protocol.messages import DeltaInfo, LoraInfo, Manifest, TensorInfo
from swarm.checkpoint_io import state_dict_to_files

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
W0 = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
A = [[1.0, 0.0, -1.0]]
B = [[0.5], [2.0]]


def _vector_block() -> str:
    found = re.search(r"<!-- vectors:lora .*?```\n(.*?)```", DOC, re.S)
    assert found, "docs/protocol.md §8.6 lost its LoRA test vector"
    return "".join(found.group(1).split())


def test_lora_info_encodes_as_the_vector_in_protocol_md() -> None:
    info = LoraInfo(base_model="ab" * 32, rank=8, alpha=16.0)
    assert msgspec.msgpack.encode(info).hex() == _vector_block()
    assert msgspec.msgpack.decode(bytes.fromhex(_vector_block()), type=LoraInfo) == info


def test_the_merge_vector_of_protocol_md_both_ways() -> None:
    from policy.lora import AdapterSet, merged_copy

    text = " ".join(DOC.split("<!-- vectors:lora")[1].split("```")[0].split())
    assert "merged `W = [[2, 2, 2], [8, 5, 2]]`" in text and "`y = [2, 8]`" in text
    base = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    with torch.no_grad():
        base[0].weight.copy_(torch.tensor(W0))
    adapter = {"0.lora_A.weight": torch.tensor(A), "0.lora_B.weight": torch.tensor(B)}
    merged = merged_copy(base, adapter, rank=1, alpha=2.0)
    assert merged[0].weight.tolist() == [[2.0, 2.0, 2.0], [8.0, 5.0, 2.0]]
    x = torch.tensor([[1.0, 0.0, 0.0]])
    for mode in ("merged", "unmerged"):
        held = AdapterSet(base, keep=1, mode=mode)  # type: ignore[arg-type]
        held.add(1, adapter, rank=1, alpha=2.0)
        held.activate(1)
        with torch.no_grad():
            assert base(x).tolist() == [[2.0, 8.0]], mode
        held.activate(None)
        assert base[0].weight.tolist() == W0


def _manifest(**kw: object) -> Manifest:
    files = state_dict_to_files({"m.lora_A.weight": torch.ones(1, 3)})
    tensors = [TensorInfo(name="m.lora_A.weight", dtype="F32", shape=[1, 3], hash=bytes(32))]
    manifest, _ = build_manifest(
        files,
        version=3,
        parent_version=2,
        model_config_hash="ab",
        tokenizer_hash="cd",
        created_at=1.0,
        expires_at=2.0,
        tensors=tensors,
        **kw,  # type: ignore[arg-type]
    )
    return manifest


def test_a_manifest_says_which_kind_of_version_it_is() -> None:
    lora = _manifest(lora=LoraInfo(base_model="ab" * 32, rank=1, alpha=2.0))
    assert version_kind(lora) == "lora"
    assert decode(encode(lora), Manifest) == lora
    assert version_kind(_manifest()) == "full"


def test_a_lora_version_cannot_be_a_delta() -> None:
    with pytest.raises(ManifestError, match="LoRA version cannot also be a delta"):
        _manifest(
            lora=LoraInfo(base_model="ab" * 32, rank=1, alpha=2.0),
            delta=DeltaInfo(base_version=2, base_root_hash=bytes(32), files=["z.rsd"]),
        )


@pytest.mark.parametrize(
    "bad", [{"rank": 0}, {"alpha": 0.0}, {"alpha": -1.0}, {"base_model": "XY"}]
)
def test_lora_info_out_of_range_is_refused(bad: dict[str, object]) -> None:
    fields = {"base_model": "ab" * 32, "rank": 8, "alpha": 16.0, **bad}
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(fields), LoraInfo)


def test_lora_base_missing_is_a_manifest_error() -> None:
    exc = error_for("lora_base_missing", "v3 needs base ab…")
    assert isinstance(exc, ManifestError) and exc.code is ReasonCode.LORA_BASE_MISSING
    assert "| `lora_base_missing` |" in DOC
