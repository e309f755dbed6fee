"""How a rank of the sharded-trainer tests ends (``ranks.rank_process``): after its work, with a
thread still inside torch, it exits with status 0. Ending through the interpreter's teardown
instead (what the tests did until the stop-41 CI failure) aborts such a process: CPython unwinds
a thread that takes the GIL during finalization, and torch's C++ frames turn that into
``std::terminate`` (SIGABRT, "terminate called without an active exception"). In the sharded
tests that thread is one of gloo's, releasing a collective's tensors; here it is a Python thread
looping on small matrix products, which reacquires the GIL every few milliseconds and so is
caught by the finalization window nearly every time (25 of 25 plain exits aborted here)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.multiprocessing as mp
from ranks import rank_process
from test_trainer_fsdp import _free_port

pytestmark = [pytest.mark.timeout(120)]


def _spin() -> None:
    a = torch.randn(256, 256)
    while True:
        a = torch.tanh(a @ a)


def _worker(rank: int, port: int) -> None:
    with rank_process(rank, port) as ctx:
        ctx.barrier()
        threading.Thread(target=_spin, name="still-in-torch", daemon=True).start()
        ctx.barrier()


def test_a_rank_ends_cleanly_with_a_thread_inside_torch() -> None:
    # Each rank's exit status is checked by spawn: SIGABRT raises ProcessExitedException.
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)
