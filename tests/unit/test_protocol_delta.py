"""protocol.delta: the RSDELTA1 format (test vector of docs/protocol.md §8.5), exact round trips,
and refusal of every malformed or inconsistent delta with a reason code (never a crash)."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.delta import (
    GAPS,
    LayoutChanged,
    apply_delta,
    encode_delta,
    read_records,
    tensor_digest,
    tensor_infos,
)
from protocol.errors import DeltaError, ReasonCode
from protocol.manifest import build_manifest, part_indices, part_size
from protocol.messages import DeltaInfo, TensorInfo

HEAD = struct.Struct(">IBQQI")


def safetensors(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A safetensors file from (dtype, shape, raw little-endian data), in the given order."""
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data, off = data + raw, off + len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


# --- the test vector of docs/protocol.md §8.5 ---------------------------------------------------
A0 = (0x3C00 + np.arange(256)).astype("<u2")  # "a": BF16 [4, 64], element i = 0x3c00 + i
A1 = A0.copy()
A1[5] ^= 0x0001
A1[100] ^= 0x0003
A1[255] ^= 0x8000
B = np.array([1.0, 2.0, 3.0], "<f4")  # "b": F32 [3], unchanged
C0 = np.arange(16, dtype="<u1")  # "c": U8 [16], elements 0..11 get + 100
C1 = C0.copy()
C1[:12] += 100


def vector_files(a: np.ndarray, c: np.ndarray) -> dict[str, bytes]:
    return {
        "model.safetensors": safetensors(
            {
                "a": ("BF16", [4, 64], a.tobytes()),
                "b": ("F32", [3], B.tobytes()),
                "c": ("U8", [16], c.tobytes()),
            }
        )
    }


BASE, NEW = vector_files(A0, C0), vector_files(A1, C1)
VECTOR_DIGESTS = {  # sha256 tensor digests of the new version
    "a": "c3a3abcea8ae5be4be98ae7feffc06e79e55d9b052e3982e82f1a5fea0801f28",
    "b": "a2381a2e32cfc8bf2341b01b268f50cdab695aa857975cfa671679ada86a3a21",
    "c": "529a0dc293336fbd485a608bb3229d492f18f079a7c0925074ea60ce57e7469f",
}
VECTOR_DELTA = bytes.fromhex(
    "525344454c544131000000020000000001000000000000000300000000000000120000001b28b52ffd20129100"
    "00055e9a0000000000000000000103000000800000000202000000000000000c000000000000000e0000001728"
    "b52ffd200e710000ff0f646464646c6c6c6c64646464"
)
VECTOR_RAW = {  # decompressed record bodies: positions || values
    0: "055e9a000000000000000000010300000080",  # gaps 5, 94, 154 as u32 planes; XORs as u16 planes
    2: "ff0f646464646c6c6c6c64646464",  # bitmap of elements 0..11; 12 XOR bytes
}


def test_vector_digests_and_apply() -> None:
    tensors = tensor_infos(NEW, "sha256")
    assert {t.name: t.hash.hex() for t in tensors} == VECTOR_DIGESTS
    assert [(t.name, t.dtype, t.shape) for t in tensors] == [
        ("a", "BF16", [4, 64]),
        ("b", "F32", [3]),
        ("c", "U8", [16]),
    ]
    out, changed = apply_delta(BASE, VECTOR_DELTA, tensors, "sha256")
    assert changed == ["a", "c"]
    assert bytes(out["model.safetensors"]) == NEW["model.safetensors"]


def test_vector_records_decode_to_the_documented_payloads() -> None:
    tensors = tensor_infos(NEW, "sha256")
    pos, bodies = 12, {}
    while pos < len(VECTOR_DELTA):
        index, _enc, _count, _raw_len, body_len = HEAD.unpack_from(VECTOR_DELTA, pos)
        pos += HEAD.size
        bodies[index] = (
            zstandard.ZstdDecompressor().decompress(VECTOR_DELTA[pos : pos + body_len]).hex()
        )
        pos += body_len
    assert bodies == VECTOR_RAW
    records = read_records(VECTOR_DELTA, tensors)
    assert [r.positions.tolist() for r in records] == [[5, 100, 255], list(range(12))]
    assert records[0].values.tolist() == [0x0001, 0x0003, 0x8000]


def test_encoder_reproduces_the_vector_payloads() -> None:
    """Compressed bytes may differ between zstd versions; the records they hold may not."""
    tensors = tensor_infos(NEW, "sha256")
    enc = encode_delta(BASE, NEW, tensors)
    assert enc.changed == ["a", "c"] and enc.changed_elements == 15
    mine = read_records(enc.data, tensors)
    ref = read_records(VECTOR_DELTA, tensors)
    assert [(r.tensor, r.positions.tolist(), r.values.tolist()) for r in mine] == [
        (r.tensor, r.positions.tolist(), r.values.tolist()) for r in ref
    ]
    assert enc.data[16] == GAPS and enc.data[:16] == VECTOR_DELTA[:16]  # record 0 uses gaps


def test_tensor_digest_covers_dtype_and_shape() -> None:
    data = b"\x00" * 8
    d = tensor_digest("sha256", "F32", [2], data)
    assert d != tensor_digest("sha256", "I32", [2], data)
    assert d != tensor_digest("sha256", "F32", [1, 2], data)
    assert d != tensor_digest("blake3", "F32", [2], data)


# --- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0.0005, 0.02, 0.3, 1.0])
def test_round_trip_is_bit_exact(density: float) -> None:
    rng = np.random.default_rng(1)
    w0 = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    f0 = rng.standard_normal(700).astype("<f4")
    w1, f1 = w0.copy(), f0.copy()
    hit = rng.random(w0.size) < density
    w1[hit] ^= rng.integers(1, 2**16, int(hit.sum()), dtype=np.uint16)
    f1[: int(700 * density)] += 1.0

    def files(w: np.ndarray, f: np.ndarray) -> dict[str, bytes]:
        return {
            "m-1.safetensors": safetensors({"w": ("BF16", [50, 100], w.tobytes())}),
            "m-2.safetensors": safetensors({"f": ("F32", [700], f.tobytes())}),
        }

    base, new = files(w0, f0), files(w1, f1)
    tensors = tensor_infos(new, "blake3")
    enc = encode_delta(base, new, tensors)
    out, _ = apply_delta(
        base, enc.data, tensors, "blake3", base_tensors=tensor_infos(base, "blake3")
    )
    assert {k: bytes(v) for k, v in out.items()} == new
    if density <= 0.02:
        assert len(enc.data) < 0.25 * sum(map(len, new.values()))


def test_identical_versions_give_an_empty_delta() -> None:
    tensors = tensor_infos(BASE, "sha256")
    enc = encode_delta(BASE, BASE, tensors)
    assert enc.data == b"RSDELTA1\x00\x00\x00\x00" and enc.changed == []


def test_layout_change_is_not_a_delta() -> None:
    other = {"model.safetensors": safetensors({"a": ("BF16", [256], A1.tobytes())})}
    with pytest.raises(LayoutChanged):
        encode_delta(BASE, other, tensor_infos(other, "sha256"))
    with pytest.raises(LayoutChanged):
        encode_delta(BASE, {"x.safetensors": NEW["model.safetensors"]}, tensor_infos(NEW, "sha256"))


# --- refusals -----------------------------------------------------------------------------------
TENSORS = tensor_infos(NEW, "sha256")


def refused(delta: bytes, code: ReasonCode = ReasonCode.DELTA_INVALID, **kw: object) -> str:
    with pytest.raises(DeltaError) as info:
        apply_delta(BASE, delta, kw.get("tensors", TENSORS), "sha256")  # type: ignore[arg-type]
    assert info.value.code is code
    return info.value.detail


def record(index: int, enc: int, count: int, raw: bytes, *, declared: int | None = None) -> bytes:
    body = zstandard.ZstdCompressor(level=1).compress(raw)
    return (
        HEAD.pack(index, enc, count, len(raw) if declared is None else declared, len(body)) + body
    )


def delta_of(*records: bytes, n: int | None = None) -> bytes:
    return b"RSDELTA1" + struct.pack(">I", len(records) if n is None else n) + b"".join(records)


def test_truncated_delta_is_refused_wherever_it_is_cut() -> None:
    for cut in range(len(VECTOR_DELTA)):
        refused(VECTOR_DELTA[:cut])


def test_oversized_delta_is_refused() -> None:
    assert "after the last record" in refused(VECTOR_DELTA + b"\x00")
    assert "records for 3 tensors" in refused(delta_of(n=4))


def test_malformed_records_are_refused() -> None:
    gaps_a = bytes.fromhex(VECTOR_RAW[0])
    assert "magic" in refused(b"RSDELTA2" + VECTOR_DELTA[8:])
    assert "out of order" in refused(
        delta_of(record(2, 2, 12, bytes.fromhex(VECTOR_RAW[2])), record(0, 1, 3, gaps_a))
    )
    assert "out of order" in refused(delta_of(record(3, 1, 3, gaps_a)))
    assert "changed elements" in refused(delta_of(record(0, 1, 0, b"")))
    assert "changed elements" in refused(delta_of(record(1, 1, 4, b"\x00" * 32)))
    assert "unknown position encoding" in refused(delta_of(record(0, 7, 3, gaps_a)))
    assert "expected 18" in refused(delta_of(record(0, 1, 3, gaps_a + b"\x00")))
    assert "declares" in refused(delta_of(record(0, 1, 3, gaps_a[:-1], declared=18)))
    assert "bits set past" in refused(delta_of(record(1, 2, 1, b"\x10" + b"\x01\x00\x00\x00")))
    assert "bitmap marks" in refused(delta_of(record(2, 2, 11, b"\xff\x0f" + b"\x01" * 11)))
    assert "gap beyond" in refused(delta_of(record(0, 1, 1, struct.pack("<I", 256) + b"\x01\x00")))
    assert "beyond 256 elements" in refused(
        delta_of(record(0, 1, 2, bytes([200, 100, 0, 0, 0, 0, 0, 0]) + b"\x01\x01\x00\x00"))
    )
    zero = bytes.fromhex("055e9a000000000000000000010000000000")
    assert "does not change" in refused(delta_of(record(0, 1, 3, zero)))


def test_zstd_frame_must_be_exact() -> None:
    raw = bytes.fromhex(VECTOR_RAW[0])
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    rec = HEAD.pack(0, 1, 3, len(raw), len(no_size)) + no_size
    assert "declares" in refused(delta_of(rec))
    body = zstandard.ZstdCompressor().compress(raw) + b"junk"
    assert "trailing" in refused(delta_of(HEAD.pack(0, 1, 3, len(raw), len(body)) + body))
    body = zstandard.ZstdCompressor().compress(raw)
    broken = body[:1] + bytes([body[1] ^ 0xFF]) + body[2:]  # not a zstd frame any more
    refused(delta_of(HEAD.pack(0, 1, 3, len(raw), len(broken)) + broken))


def test_reconstruction_must_match_the_signed_digests() -> None:
    wrong = [TENSORS[0], TENSORS[1], TensorInfo(name="c", dtype="U8", shape=[16], hash=bytes(32))]
    assert "tensor c: reconstruction" in refused(
        VECTOR_DELTA, ReasonCode.DELTA_MISMATCH, tensors=wrong
    )
    # a delta that leaves out a change the digests require
    partial = delta_of(record(0, 1, 3, bytes.fromhex(VECTOR_RAW[0])))
    assert "tensor c" in refused(partial, ReasonCode.DELTA_MISMATCH)


def test_base_with_another_layout_is_refused() -> None:
    shaped = [TensorInfo(name="a", dtype="BF16", shape=[256], hash=TENSORS[0].hash), *TENSORS[1:]]
    assert "base is BF16 [4, 64]" in refused(
        VECTOR_DELTA, ReasonCode.DELTA_MISMATCH, tensors=shaped
    )
    assert "the base holds 3" in refused(
        VECTOR_DELTA, ReasonCode.DELTA_MISMATCH, tensors=TENSORS[:2]
    )


def test_unchanged_tensor_accepted_by_base_digest_only_when_equal() -> None:
    base_tensors = tensor_infos(BASE, "sha256")
    out, _ = apply_delta(BASE, VECTOR_DELTA, TENSORS, "sha256", base_tensors=base_tensors)
    assert bytes(out["model.safetensors"]) == NEW["model.safetensors"]
    # a base digest that differs from the version's for an untouched tensor: hashed, refused
    lying = [
        TensorInfo(name="b", dtype="F32", shape=[3], hash=bytes(32)) if t.name == "b" else t
        for t in TENSORS
    ]
    with pytest.raises(DeltaError, match="tensor b"):
        apply_delta(BASE, VECTOR_DELTA, lying, "sha256", base_tensors=base_tensors)


def test_in_place_patches_the_callers_buffers() -> None:
    base = {k: bytearray(v) for k, v in BASE.items()}
    out, _ = apply_delta(base, VECTOR_DELTA, TENSORS, "sha256", in_place=True)
    assert out["model.safetensors"] is base["model.safetensors"]
    assert bytes(base["model.safetensors"]) == NEW["model.safetensors"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_deltas_never_crash_and_never_load_wrong_bytes(data: st.DataObject) -> None:
    delta = bytearray(VECTOR_DELTA)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(delta) - 1))
        delta[i] = data.draw(st.integers(0, 255))
    try:
        out, _ = apply_delta(BASE, bytes(delta), TENSORS, "sha256")
    except DeltaError:
        return
    assert bytes(out["model.safetensors"]) == NEW["model.safetensors"]


# --- manifests ----------------------------------------------------------------------------------
def test_manifest_parts_and_rules() -> None:
    files = {**NEW, "delta.rsd": VECTOR_DELTA}
    kw = {
        "version": 2,
        "parent_version": 1,
        "model_config_hash": "00",
        "tokenizer_hash": "00",
        "created_at": 1.0,
        "expires_at": 2.0,
        "chunk_size": 64,
        "tensors": TENSORS,
    }
    info = DeltaInfo(base_version=1, base_root_hash=bytes(32), files=["delta.rsd"])
    m, chunks = build_manifest(files, delta=info, **kw)  # type: ignore[arg-type]
    assert part_size(m, "delta") == len(VECTOR_DELTA)
    assert part_size(m, "full") == len(NEW["model.safetensors"])
    assert sorted(part_indices(m, "full") + part_indices(m, "delta")) == list(range(len(chunks)))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"delta": info, "tensors": None}, "must list its tensors"),
        (
            {"delta": DeltaInfo(base_version=2, base_root_hash=bytes(32), files=["delta.rsd"])},
            "not older",
        ),
        (
            {"delta": DeltaInfo(base_version=1, base_root_hash=bytes(32), files=["nope.rsd"])},
            "has no chunks",
        ),
        (
            {
                "delta": DeltaInfo(
                    base_version=1,
                    base_root_hash=bytes(32),
                    files=["model.safetensors", "delta.rsd"],
                )
            },
            "ascending",
        ),
        ({"tensors": TENSORS[::-1]}, "strictly ascending by name"),
    ]
    for change, message in bad:
        with pytest.raises(Exception, match=message):
            build_manifest(files, **{**kw, **change})
    with pytest.raises(Exception, match="no full checkpoint files"):
        build_manifest({"delta.rsd": VECTOR_DELTA}, delta=info, **kw)  # type: ignore[arg-type]


def test_vector_printed_in_the_protocol_doc_is_this_one() -> None:
    """docs/protocol.md §8.5 prints the vector for implementers; it must be the one tested."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    section = doc[doc.index("### 8.5 Delta versions") :]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    digests = dict(line.split() for line in blocks[1].strip().splitlines())
    assert digests == VECTOR_DIGESTS
    hex_parts = [re.split(r"\s{2,}", line.strip())[0] for line in blocks[2].strip().splitlines()]
    assert bytes.fromhex("".join(hex_parts).replace(" ", "")) == VECTOR_DELTA


def test_delta_code_imports_without_the_ml_stack() -> None:
    import subprocess
    import sys

    code = (
        "import sys, protocol.delta, protocol.safetensors_layout, swarm.publication\n"
        "bad = [m for m in ('torch', 'hivemind', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
