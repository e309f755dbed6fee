"""Weight updates of the ``vllm`` backend: staged, streamed, then a checked prefix-cache reset.

vLLM reserves most of the GPU (``gpu_memory_utilization``) at start-up, so a new checkpoint must
never be put on the GPU whole. :func:`stream_update` does it in bounded pieces:

1. :func:`plan_chunks` groups the tensors to load (only the ``changed`` ones when the caller knows
   which differ from the loaded version) into chunks of at most ``chunk_bytes`` (a tensor larger
   than that is a chunk of its own), cast on the CPU to the engine's dtype;
2. each chunk is written as one safetensors file in a staging directory chosen by
   :func:`staging_dir` (``/dev/shm`` when it has room, else the disk; a clear error when neither
   has) and loaded by every vLLM worker through ``LLM.collective_rpc``: the worker reads the file
   tensor by tensor and hands ``model.load_weights`` a generator, so at most one tensor of the
   new checkpoint is on the GPU at any time (:func:`worker_load_file`);
3. the file is removed before the next chunk is written, so staging needs room for one chunk.

:func:`reset_prefix_cache_checked` wraps ``LLM.reset_prefix_cache``, which returns False (and
resets nothing) while KV blocks are in use: it retries with a bounded wait and raises
:class:`PrefixCacheBusy` (one line) when the cache never resets; the backend then refuses the
version (docs/backends.md).

This module imports neither vLLM nor CUDA; the tests drive it with a fake engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.backends.base import BackendError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "PrefixCacheBusy",
    "StagingError",
    "UpdateStats",
    "plan_chunks",
    "reset_prefix_cache_checked",
    "staging_candidates",
    "staging_dir",
    "staging_need",
    "stream_update",
    "worker_load_file",
]

#: default upper bound of one staged chunk (bytes): the staging room and the host-memory peak
#: of an update beyond the state dict itself.
DEFAULT_CHUNK_BYTES = 256 << 20
#: free bytes a staging directory must keep beyond the chunk (other users of /dev/shm or /tmp).
STAGING_HEADROOM = 16 << 20
#: environment variable naming the staging directory to use (first candidate when set).
STAGING_ENV = "ROLLOUT_SWARM_STAGING_DIR"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StagingError(BackendError):
    """No staging directory has room for a chunk of weights."""


class PrefixCacheBusy(BackendError):
    """``reset_prefix_cache`` kept returning False: the version is refused."""


@dataclass
class UpdateStats:
    """What one :func:`stream_update` did (logged, and printed by bench/vllm_gpu.sh)."""

    tensors: int = 0
    bytes: int = 0
    chunks: int = 0
    staging_dir: str = ""
    seconds: float = 0.0


# ---------------------------------------------------------------------------------- staging
def staging_candidates(explicit: str | os.PathLike[str] | None = None) -> list[Path]:
    """Where chunks may be staged, in order: ``explicit`` (or ``$ROLLOUT_SWARM_STAGING_DIR``)
    alone when given, else ``/dev/shm`` (RAM, fastest) then the system temp directory."""
    chosen = explicit if explicit is not None else os.environ.get(STAGING_ENV) or None
    if chosen is not None:
        return [Path(chosen).expanduser()]
    out = [Path("/dev/shm")] if os.path.isdir("/dev/shm") else []
    out.append(Path(tempfile.gettempdir()))
    return out


def staging_dir(need_bytes: int, candidates: list[Path]) -> Path:
    """The first candidate directory with ``need_bytes`` + headroom free; :class:`StagingError`
    naming every candidate's free space when none has."""
    seen: list[str] = []
    for cand in candidates:
        if not cand.is_dir() or not os.access(cand, os.W_OK):
            seen.append(f"{cand} is not a writable directory")
            continue
        free = shutil.disk_usage(cand).free
        if free >= need_bytes + STAGING_HEADROOM:
            return cand
        seen.append(f"{cand} has {_mib(free)} free")
    raise StagingError(
        f"no room to stage {_mib(need_bytes)} of weights ({'; '.join(seen)}): set "
        f"{STAGING_ENV} to a directory with room, or lower the vLLM update chunk size"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------------------------- chunking
def plan_chunks(
    state_dict: Mapping[str, Any],
    changed: Collection[str] | None,
    *,
    dtype: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``{name: CPU tensor}`` chunks of at most ``chunk_bytes`` (one tensor per chunk when
    it is bigger), tensors cast to ``dtype`` on the CPU; only the ``changed`` names when given
    (each must be in ``state_dict``). Chunks are built lazily: one chunk in memory at a time."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    target = _DTYPES.get(dtype)
    if target is None:
        raise ValueError(f"unknown engine dtype {dtype!r}; one of {sorted(_DTYPES)}")
    if changed is not None:
        missing = sorted(n for n in changed if n not in state_dict)
        if missing:
            raise ValueError(f"changed tensors missing from the checkpoint: {missing[:5]}")
        names = [n for n in state_dict if n in set(changed)]
    else:
        names = list(state_dict)
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name in names:
        t = state_dict[name].detach()
        t = (t.to("cpu", target) if t.is_floating_point() else t.to("cpu")).contiguous()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = {}, 0
        # tied weights share storage and safetensors refuses shared tensors in one file
        ptr = t.untyped_storage().data_ptr()
        if any(o.untyped_storage().data_ptr() == ptr for o in chunk.values()):
            t = t.clone()
        chunk[name] = t
        size += nbytes
    if chunk:
        yield chunk


def staging_need(
    state_dict: Mapping[str, Any],
    changed: Collection[str] | None,
    *,
    dtype: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Bytes the largest chunk of :func:`plan_chunks` can take (checked before any weight moves:
    a version that cannot be staged is refused with the old weights intact)."""
    target = _DTYPES.get(dtype, torch.float32)
    if changed is not None and (missing := sorted(n for n in changed if n not in state_dict)):
        raise ValueError(f"changed tensors missing from the checkpoint: {missing[:5]}")
    names = list(state_dict) if changed is None else list(changed)
    sizes = [
        state_dict[n].numel()
        * (target.itemsize if state_dict[n].is_floating_point() else state_dict[n].element_size())
        for n in names
    ]
    return int(min(sum(sizes), max([chunk_bytes, *sizes])))


def chunk_nbytes(chunk: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in chunk.values())


# ---------------------------------------------------------------------------------- update
def stream_update(
    state_dict: Mapping[str, Any],
    changed: Collection[str] | None,
    load_file: Callable[[str], Any],
    *,
    dtype: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    staging: list[Path] | None = None,
) -> UpdateStats:
    """Stage each chunk of :func:`plan_chunks` as a safetensors file and call
    ``load_file(path)`` (the engine's ``collective_rpc`` into :func:`worker_load_file`) on it;
    the file is deleted before the next one is written. Raises on the first failure (the
    engine may then hold a mix of versions: the caller must not report the new version)."""
    from safetensors.torch import save_file

    candidates = staging if staging is not None else staging_candidates()
    stats = UpdateStats()
    t0 = time.perf_counter()
    for chunk in plan_chunks(state_dict, changed, dtype=dtype, chunk_bytes=chunk_bytes):
        need = chunk_nbytes(chunk)
        where = staging_dir(need, candidates)
        fd, path = tempfile.mkstemp(prefix="rollout-swarm-w-", suffix=".safetensors", dir=where)
        os.close(fd)
        try:
            save_file(chunk, path)
            load_file(path)
        finally:
            os.unlink(path)
        stats.tensors += len(chunk)
        stats.bytes += need
        stats.chunks += 1
        stats.staging_dir = str(where)
    stats.seconds = time.perf_counter() - t0
    return stats


def worker_load_file(model: Any, path: str, device: str | torch.device) -> int:
    """Inside a vLLM worker: feed the tensors of one staged file to ``model.load_weights`` one
    at a time (read from the file, moved to ``device``, handed over, dropped), so the new
    weights never sit on the GPU beside the old ones beyond one tensor. Returns the count."""
    from safetensors import safe_open

    count = 0

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                count += 1
                yield name, f.get_tensor(name).to(device, non_blocking=False)

    model.load_weights(tensors())
    return count


# ---------------------------------------------------------------------------------- prefix cache
def reset_prefix_cache_checked(
    reset: Callable[[], Any],
    *,
    timeout_s: float = 10.0,
    first_wait_s: float = 0.01,
    max_wait_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Call ``reset()`` (``LLM.reset_prefix_cache``) until it returns True, waiting
    ``first_wait_s`` doubling up to ``max_wait_s`` between tries, for at most ``timeout_s``.
    Returns the number of tries; raises :class:`PrefixCacheBusy` when it never succeeded.

    vLLM's reset returns False while running requests hold KV blocks; a bool is required
    (vLLM >= 0.8): anything else is an error, since an unchecked reset is what this guards."""
    deadline = clock() + timeout_s
    wait = first_wait_s
    tries = 0
    while True:
        tries += 1
        ok = reset()
        if ok is True:
            return tries
        if not isinstance(ok, bool):
            raise PrefixCacheBusy(
                f"reset_prefix_cache returned {ok!r}, not a bool: this vLLM cannot confirm "
                "the reset; install the pinned release (rollout-swarm[vllm])"
            )
        if clock() + wait > deadline:
            raise PrefixCacheBusy(
                f"vLLM's prefix cache did not reset after {tries} tries in {timeout_s:g} s "
                "(KV blocks still in use); the version is refused and the old one kept"
            )
        sleep(wait)
        wait = min(wait * 2, max_wait_s)
