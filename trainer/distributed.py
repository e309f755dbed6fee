"""The process group: rank, world size and the few collectives the recipe needs on plain data.

Launch with torchrun (``python -m torch.distributed.run``) or ``swarm trainer run --nproc N``:
every rank joins the group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), gloo on CPU and NCCL on GPUs. Rank 0 (the
leader) alone talks to the swarm: it fetches each batch, scatters each rank its share of the
groups, publishes and writes metrics; checkpoints are written by every rank (sharded). The model
side (FSDP2 sharding, gradient reduction, the gathered state dict) is :mod:`trainer.engine`.

Waiting ranks: the followers wait in :meth:`DistContext.share` while the leader waits for rollouts
or publishes, which can take longer than the process group's collective timeout (10 min under
NCCL, 30 min under gloo). The leader sends a small keep-alive object every
:data:`KEEPALIVE_S` while it waits (:meth:`DistContext.keepalive`); :meth:`DistContext.share`
on a follower skips them. A dead rank is not waited for: gloo fails the next collective at once
(the peer's sockets close), and torchrun stops the other ranks when one exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Seconds between keep-alives the leader sends while followers wait for it.
KEEPALIVE_S = 60.0


class _KeepAlive:
    """What the leader broadcasts to show it is alive while it waits (never a payload)."""


@dataclass(frozen=True)
class DistContext:
    """Rank and world size; every method is a no-op (or the identity) in a single process."""

    rank: int = 0
    world_size: int = 1
    #: device of collective buffers ("cuda:<local rank>" under NCCL, else "cpu").
    device: str = "cpu"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0 fetches, publishes and writes metrics and the checkpoint's metadata."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items`` (round robin, so shard sizes differ by at most one)."""
        return list(items[self.rank :: self.world_size])

    def share(self, obj: T) -> T:
        """Broadcast rank 0's ``obj`` to every rank (trusted, in-job traffic only); the others'
        ``obj`` is ignored. A follower skips the leader's keep-alives until the payload comes."""
        if not self.enabled:
            return obj
        while True:
            box: list[object] = [obj if self.is_leader else None]
            dist.broadcast_object_list(box, src=0, device=self._object_device)
            if self.is_leader or not isinstance(box[0], _KeepAlive):
                return box[0]  # type: ignore[return-value]

    def keepalive(self) -> None:
        """Leader only: tell followers waiting in :meth:`share` that it is still alive."""
        if self.enabled and self.is_leader:
            dist.broadcast_object_list([_KeepAlive()], src=0, device=self._object_device)

    def scatter(self, per_rank: Sequence[T] | None) -> T:
        """Rank 0's ``per_rank[r]`` to rank ``r`` (the others pass None)."""
        if not self.enabled:
            assert per_rank is not None
            return per_rank[0]
        if self.is_leader:
            assert per_rank is not None and len(per_rank) == self.world_size
        out: list[object] = [None]
        dist.scatter_object_list(
            out, list(per_rank) if self.is_leader and per_rank is not None else None, src=0
        )
        return out[0]  # type: ignore[return-value]

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks (float64)."""
        if not self.enabled:
            return [float(v) for v in values]
        buf = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return [float(v) for v in buf.cpu().tolist()]

    def max_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise maximum of ``values`` over ranks."""
        if not self.enabled or not values:
            return [int(v) for v in values]
        buf = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return [int(v) for v in buf.cpu().tolist()]

    def all_gather_objects(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable, small: in-job traffic only), in rank order."""
        if not self.enabled:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out  # type: ignore[return-value]

    def all_gather_1d(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D ``tensor`` (lengths may differ, one dtype), in rank order, on every
        rank; on this rank's collective device (a single process: ``[tensor]`` as it is)."""
        if not self.enabled:
            return [tensor]
        dev = torch.device(self.device)
        local = tensor.reshape(-1).to(dev)
        size = torch.tensor([local.numel()], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        counts = [int(s.item()) for s in sizes]
        padded = local.new_zeros(max(1, *counts))  # same shape on every rank
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded)
        return [part[:n] for part, n in zip(parts, counts, strict=True)]

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Make every rank start from rank 0's weights (and buffers) of ``module``."""
        for tensor in module.state_dict().values():
            self.broadcast_tensor(tensor)

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Overwrite ``tensor`` in place with rank 0's."""
        if self.enabled:
            dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @property
    def _object_device(self) -> torch.device | None:
        return torch.device(self.device) if self.device.startswith("cuda") else None


async def leader_wait(ctx: DistContext, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` (rank 0: rollouts, a publication); followers waiting for it in a
    collective get a keep-alive every :data:`KEEPALIVE_S`, so a long wait does not trip the
    process group's timeout."""
    if not ctx.enabled:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=KEEPALIVE_S)
            if done:
                return task.result()
            ctx.keepalive()
    finally:
        task.cancel()


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` from torchrun's environment (1 when unset)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> DistContext:
    """Join the process group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); a single process when ``WORLD_SIZE`` is unset or 1.

    ``backend``: None picks NCCL when CUDA is available, else gloo. ``timeout_s``: the collective
    timeout (None: torch's default, 10 min NCCL / 30 min gloo)."""
    world = torchrun_world_size()
    if world <= 1:
        return DistContext()
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = "cpu"
    if chosen == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(backend=chosen, **kwargs)  # type: ignore[arg-type]
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
    log.info(
        "rank %d/%d (pid %d) joined the process group (%s)",
        ctx.rank, ctx.world_size, os.getpid(), chosen,
    )  # fmt: skip
    return ctx


def shutdown_distributed(*, clean: bool = True) -> None:
    """Leave the process group (idempotent).

    ``clean``: every rank finished its work; they meet at a barrier first (a rank that tears down
    gloo while a peer still has collectives in flight makes that peer abort with SIGABRT).
    After a failure there is no barrier: the other ranks are stuck in some other collective, and
    a barrier would not match it; they fail when this process's connections close."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        dist.barrier()
        dist.destroy_process_group()
