"""torch state_dict <-> safetensors file bytes (the payload of a checkpoint manifest).

The protocol layer only knows bytes; this module is the torch side. Tensors that share storage
(tied weights such as ``lm_head.weight`` / ``model.embed_tokens.weight``) make
``safetensors.torch.save`` fail, so every tensor after the first one on a given storage is cloned:
both names are written, and ``load_state_dict`` restores the tie on a model that declares it.
Never ``torch.load`` bytes from a peer: safetensors holds raw data, dtype and shape only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = ["cast_floats", "files_to_state_dict", "state_dict_to_files"]

DEFAULT_FILE = "model.safetensors"


def _untie(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors with no two sharing storage (shared ones cloned)."""
    seen: set[tuple[int, str]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu")
        storage = (t.untyped_storage().data_ptr(), str(t.device))
        if storage in seen or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        out[name] = t
    return out


def cast_floats(state_dict: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors converted to ``dtype`` ("bfloat16", "float16", "float32"; round to
    nearest even), other tensors as they are. Tensors that shared storage still do afterwards
    (tied weights stay tied), so :func:`state_dict_to_files` writes them as before."""
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise ValueError(f"publish dtype {dtype!r} is not a floating-point torch dtype")
    out: dict[str, torch.Tensor] = {}
    converted: dict[tuple[object, ...], torch.Tensor] = {}
    for name, t in state_dict.items():
        if not t.is_floating_point() or t.dtype == target:
            out[name] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), str(t.device), tuple(t.shape))
        if key not in converted:
            converted[key] = t.detach().to(target)
        out[name] = converted[key]
    return out


def state_dict_to_files(
    state_dict: Mapping[str, torch.Tensor], *, shard_bytes: int | None = None
) -> dict[str, bytes]:
    """Serialise a state_dict as safetensors bytes: ``{"model.safetensors": ...}``.

    With ``shard_bytes``, tensors are packed in name order into files of about that size named
    ``model-00001-of-0000N.safetensors`` (a tensor larger than ``shard_bytes`` gets its own file).
    Output is deterministic for a given state_dict.
    """
    tensors = _untie(state_dict)
    if shard_bytes is None:
        return {DEFAULT_FILE: st_save(tensors, metadata={"format": "pt"})}
    if shard_bytes <= 0:
        raise ValueError("shard_bytes must be positive")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    n = len(shards)
    return {
        f"model-{i + 1:05d}-of-{n:05d}.safetensors": st_save(shard, metadata={"format": "pt"})
        for i, shard in enumerate(shards)
    }


def files_to_state_dict(files: Mapping[str, bytes | bytearray]) -> dict[str, torch.Tensor]:
    """Load safetensors bytes (one or more files) into one state_dict; duplicate names fail.

    A ``bytearray`` (a checkpoint rebuilt from a delta) is not copied: its tensors are views
    of it (``torch.frombuffer``), so the caller must not change it while they are in use."""
    out: dict[str, torch.Tensor] = {}
    for file_name in sorted(files):
        data = files[file_name]
        loaded = _views(file_name, data) if isinstance(data, bytearray) else st_load(data)
        for name, tensor in loaded.items():
            if name in out:
                raise ValueError(f"tensor {name!r} appears in more than one file ({file_name})")
            out[name] = tensor
    return out


_TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
    "F64": torch.float64, "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip


def _views(file_name: str, data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of ``data`` (little-endian hosts)."""
    from protocol.safetensors_layout import parse_layout

    out: dict[str, torch.Tensor] = {}
    for span in parse_layout(file_name, data):
        dtype = _TORCH_DTYPES[span.dtype]
        if span.numel == 0:
            out[span.name] = torch.empty(span.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(data, dtype=dtype, count=span.numel, offset=span.start)
        out[span.name] = flat.reshape(span.shape)
    return out
