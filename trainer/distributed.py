"""Data-parallel scale-out over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Launch with ``torchrun --nproc_per_node=N python -m ...``: every rank holds the same weights and
optimizer state; rank 0 fetches each batch of rollouts and shares it; every rank computes the same
advantages and minibatch partition, then takes its shard of each minibatch's **groups**
(``groups[rank::world]``); gradients are **summed** with one all-reduce per optimizer update; every
rank applies the same update; rank 0 alone publishes, checkpoints and writes metrics.

Why an explicit all-reduce rather than wrapping the model in ``DistributedDataParallel``: the loss
is normalised by the *global* token count of the minibatch (so sharding does not change it), which
DDP's gradient *averaging* would divide again by the world size; and a rank whose shard is empty
(fewer groups than ranks) must still take part in the collective, which DDP only allows with a
dummy forward.
One flattened all-reduce per update is what DDP does too, minus the overlap with backward (fine for
the embedded model; see docs/trainer.md for the large-model note).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Rank and world size; methods are no-ops in a single process."""

    rank: int = 0
    world_size: int = 1
    #: device of collective buffers ("cuda:<local rank>" under NCCL, else "cpu").
    device: str = "cpu"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0 fetches, publishes, checkpoints and writes metrics."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items`` (round robin, so shard sizes differ by at most one)."""
        return list(items[self.rank :: self.world_size])

    def share(self, obj: T | None) -> T:
        """Broadcast rank 0's ``obj`` to every rank (trusted, in-job traffic only)."""
        if not self.enabled:
            assert obj is not None
            return obj
        box: list[object] = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks (float64)."""
        if not self.enabled:
            return [float(v) for v in values]
        buf = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return [float(v) for v in buf.cpu().tolist()]

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """All-reduce (sum) the gradients of ``params`` in one flattened buffer; a missing gradient
        counts as zero (and is materialised) so that every rank sends the same layout."""
        if not self.enabled:
            return
        plist = [p for p in params if p.requires_grad]
        for p in plist:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in plist if p.grad is not None])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in plist:
            assert p.grad is not None
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Make every rank start from rank 0's weights."""
        if not self.enabled:
            return
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed(backend: str | None = None) -> DistContext:
    """Join the process group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); a single process when ``WORLD_SIZE`` is unset or 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = "cpu"
    if chosen == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        dist.init_process_group(backend=chosen)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def shutdown_distributed() -> None:
    """Leave the process group (idempotent). All ranks meet at a barrier first: a rank that tears
    down gloo while a peer still has collectives in flight makes that peer abort (SIGABRT,
    "terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
