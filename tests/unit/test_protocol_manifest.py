"""Checkpoint manifests: split -> sign -> verify -> reassemble, bit-exact; corruption named."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import (
    AuthError,
    ChunkHashMismatch,
    ManifestError,
    ProtocolError,
    ReasonCode,
)
from protocol.identity import Identity
from protocol.limits import Limits
from protocol.manifest import (
    build_manifest,
    build_manifest_from_dir,
    check_manifest,
    reassemble,
    root_hash,
    sign_manifest,
    verify_chunk,
    verify_manifest,
)
from protocol.messages import Manifest, SignedEnvelope

T0 = 1_700_000_000.0
FILES = {
    "b.safetensors": os.urandom(10_000),
    "a.safetensors": os.urandom(4096 * 3),  # exact multiple of the chunk size
    "c.json": b"{}",
}
COORD = Identity.generate()


def _build(files: dict[str, bytes] = FILES, **kw: Any) -> tuple[Manifest, list[bytes]]:
    args: dict[str, Any] = dict(
        version=5,
        parent_version=4,
        model_config_hash="aa" * 32,
        tokenizer_hash="bb" * 32,
        created_at=T0,
        expires_at=T0 + 3600,
        chunk_size=4096,
    )
    args.update(kw)
    return build_manifest(files, **args)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_split_sign_verify_reassemble(algorithm: Any) -> None:
    manifest, chunks = _build(hash=algorithm)
    assert [c.file for c in manifest.chunks] == ["a.safetensors"] * 3 + ["b.safetensors"] * 3 + [
        "c.json"
    ]
    assert [c.size for c in manifest.chunks][3:] == [4096, 4096, 1808, 2]
    assert manifest.total_size == sum(len(v) for v in FILES.values())
    env = decode(encode(sign_manifest(manifest, COORD, now=T0)), SignedEnvelope)
    verified = verify_manifest(env, COORD.public_key, now=T0 + 10)
    assert verified == manifest
    for i, chunk in enumerate(chunks):
        verify_chunk(verified, i, chunk)
    assert reassemble(verified, chunks) == FILES
    assert reassemble(verified, dict(enumerate(chunks))) == FILES


def test_corrupted_chunk_is_detected_and_named() -> None:
    manifest, chunks = _build()
    bad = bytearray(chunks[4])
    bad[100] ^= 0x01
    with pytest.raises(ChunkHashMismatch) as info:
        verify_chunk(manifest, 4, bytes(bad))
    err = info.value
    assert err.code is ReasonCode.CHUNK_HASH_MISMATCH
    assert (err.index, err.file) == (4, "b.safetensors")
    assert "chunk 4" in str(err) and "b.safetensors" in str(err)
    with pytest.raises(ChunkHashMismatch, match="chunk 4"):
        reassemble(manifest, [*chunks[:4], bytes(bad), *chunks[5:]])
    with pytest.raises(ChunkHashMismatch, match="bytes, expected"):
        verify_chunk(manifest, 6, chunks[6] + b"x")
    with pytest.raises(ManifestError, match="missing"):
        reassemble(manifest, chunks[:-1])
    with pytest.raises(ManifestError, match="no chunk 99"):
        verify_chunk(manifest, 99, b"")


def test_flipping_any_byte_of_a_signed_manifest_fails() -> None:
    manifest, _ = _build({"m.safetensors": os.urandom(5000)})
    data = encode(sign_manifest(manifest, COORD, now=T0))
    for i in range(len(data)):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        with pytest.raises(ProtocolError):
            verify_manifest(decode(bytes(tampered), SignedEnvelope), COORD.public_key, now=T0)


def test_manifest_signed_by_another_key_is_refused() -> None:
    manifest, _ = _build()
    env = sign_manifest(manifest, Identity.generate(), now=T0)
    with pytest.raises(AuthError) as info:
        verify_manifest(env, COORD.public_key, now=T0)
    assert info.value.code is ReasonCode.BAD_SIGNATURE


def _resigned(manifest: Manifest, **changes: Any) -> SignedEnvelope:
    """A validly *signed* but internally inconsistent manifest (coordinator bug / old key)."""
    return seal(COORD, msgspec.structs.replace(manifest, **changes), now=T0)


def test_inconsistent_or_expired_manifests_are_invalid() -> None:
    manifest, _ = _build()
    c = manifest.chunks
    cases = [
        {"root_hash": bytes(32)},
        {"total_size": manifest.total_size + 1},
        {"chunks": [c[1], c[0], *c[2:]]},
        {"chunks": c[:1] + c[2:]},  # a hole in a file
        {"chunks": [msgspec.structs.replace(c[0], size=100), *c[1:]]},
        {"chunks": []},
        {"parent_version": 5},
        {"expires_at": T0 - 1},
    ]
    for change in cases:
        with pytest.raises(ManifestError) as info:
            verify_manifest(_resigned(manifest, **change), COORD.public_key, now=T0)
        assert info.value.code is ReasonCode.MANIFEST_INVALID, change
    with pytest.raises(ManifestError, match="expired"):
        verify_manifest(sign_manifest(manifest, COORD, now=T0), COORD.public_key, now=T0 + 3601)


def test_manifest_limits() -> None:
    manifest, _ = _build()
    with pytest.raises(ManifestError, match="chunks"):
        check_manifest(manifest, now=T0, limits=Limits(max_chunks=3))
    with pytest.raises(ManifestError, match="total_size"):
        check_manifest(manifest, now=T0, limits=Limits(max_total_size=1000))
    with pytest.raises(ManifestError, match="chunk_size"):
        check_manifest(manifest, now=T0, limits=Limits(chunk_size=1024))
    with pytest.raises(ValueError, match="chunk_size"):
        _build(chunk_size=Limits().chunk_size + 1)


def test_root_hash_depends_on_order_and_algorithm() -> None:
    manifest, _ = _build()
    chunks = list(manifest.chunks)
    assert root_hash("sha256", chunks) != root_hash("blake3", chunks)
    assert root_hash("sha256", chunks) != root_hash("sha256", chunks[::-1])


def test_build_from_dir(tmp_path: Path) -> None:
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    manifest, chunks = build_manifest_from_dir(
        tmp_path,
        version=1,
        parent_version=None,
        model_config_hash="",
        tokenizer_hash="",
        created_at=T0,
        expires_at=T0 + 60,
        chunk_size=4096,
    )
    assert {c.file for c in manifest.chunks} == {"a.safetensors", "b.safetensors"}
    assert reassemble(manifest, chunks) == {k: v for k, v in FILES.items() if k != "c.json"}


@pytest.mark.slow
def test_tiny_qwen2_state_dict_survives_bit_exactly() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from swarm.checkpoint_io import files_to_state_dict, state_dict_to_files

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()

    files = state_dict_to_files(sd)
    manifest, chunks = build_manifest(
        files,
        version=1,
        parent_version=None,
        model_config_hash="00",
        tokenizer_hash="00",
        created_at=T0,
        expires_at=T0 + 60,
        chunk_size=16 * 1024,
    )
    assert len(chunks) > 3
    env = decode(encode(sign_manifest(manifest, COORD, now=T0)), SignedEnvelope)
    verified = verify_manifest(env, COORD.public_key, now=T0)
    # chunks arrive out of order from different peers
    received = {i: chunks[i] for i in reversed(range(len(chunks)))}
    restored = files_to_state_dict(reassemble(verified, received))

    assert restored.keys() == sd.keys()
    for name, tensor in sd.items():
        assert restored[name].dtype == tensor.dtype and restored[name].shape == tensor.shape
        assert torch.equal(restored[name].view(torch.uint8), tensor.contiguous().view(torch.uint8))
    fresh = transformers.Qwen2ForCausalLM(config)
    fresh.load_state_dict(restored)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)

    sharded = state_dict_to_files(sd, shard_bytes=20_000)
    assert len(sharded) > 1
    assert all(torch.equal(files_to_state_dict(sharded)[k], sd[k]) for k in sd)
