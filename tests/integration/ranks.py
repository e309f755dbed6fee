"""One rank of a 2-process gloo job on 127.0.0.1 (the torchrun code path: env:// rendezvous),
as the sharded-trainer tests start them with ``torch.multiprocessing.spawn``.

A rank ends the way ``swarm trainer run --nproc N`` ends its ranks (``trainer.main``): after a
clean :func:`~trainer.distributed.shutdown_distributed`, :func:`swarm.signals.exit_now` skips the
interpreter's teardown. That teardown is not safe for a process that used a process group: a
thread still inside torch when the interpreter finalizes (a gloo worker dropping the last
reference to a collective's tensors takes the GIL) is unwound by CPython and aborts the process
("terminate called without an active exception", SIGABRT), after all its work was done and
saved. ``test_rank_exit.py`` shows the hazard and that this ending avoids it. A rank that fails
raises as usual (``spawn`` reports its traceback), with the process group left without a
barrier. ``faulthandler`` prints every thread's Python stack should a rank still abort.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from swarm.signals import exit_now
from trainer.distributed import DistContext, init_distributed, shutdown_distributed


@contextmanager
def rank_process(
    rank: int, port: int, backend: str = "gloo", world: int = 2
) -> Iterator[DistContext]:
    """Join the job as ``rank`` (``MASTER_PORT`` ``port``), yield its context, then leave the
    group and end the process with exit status 0; an exception leaves the group uncleanly and
    propagates."""
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    )  # fmt: skip
    ctx = init_distributed(backend)
    ok = False
    try:
        yield ctx
        ok = True
    finally:
        shutdown_distributed(clean=ok)
    exit_now(0)
