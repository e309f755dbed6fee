"""The sharded trainer with LoRA (FSDP2 over 2 gloo processes on 127.0.0.1, the torchrun code
path) against the single process: the adapters train to the same values, the frozen base stays
bit for bit, the published adapter is gathered whole on rank 0, and a sharded LoRA checkpoint
resumes in one process (2 → 1) and continues like the uninterrupted run.

Batches, configs and tolerances are those of ``test_trainer_fsdp.py`` (see its docstring)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from ranks import rank_process
from test_trainer_fsdp import ADAM_TOL, _config, _free_port, _run

from policy.lora import AdapterState
from trainer.checkpoints import CHECKPOINT_DIR
from trainer.distributed import DistContext
from trainer.recipe import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2}


class Capture:
    """Keeps what rank 0 publishes (the adapter states)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    async def publish(self, version: int, state_dict: Any) -> None:
        assert isinstance(state_dict, AdapterState)
        torch.save(
            {"tensors": dict(state_dict), "base": state_dict.base_model, "rank": state_dict.rank},
            self.root / f"v{version}.pt",
        )


def _worker(rank: int, port: int, out: str) -> None:
    root = Path(out)
    with rank_process(rank, port) as ctx:
        cfg = _config(
            root / "a", "cpu", micro_batch_tokens=20, activation_checkpointing=True, **LORA
        )
        trainer = Trainer.setup(cfg, dist=ctx)
        _run(trainer, rank, Capture(root) if rank == 0 else None)
        assert (trainer.step, trainer.published_version) == (2, 2)
        # only the adapters are trainable, on every rank; the optimizer holds them alone
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert names and all(".lora_" in n for n in names)
        state = trainer.state_dict_for_publish()  # a collective
        base = {
            n: p.to_local().detach().cpu()
            for n, p in trainer.model.named_parameters()
            if not p.requires_grad
        }
        torch.save({"state": dict(state), "base": base}, root / f"r{rank}.pt")


def test_two_ranks_train_the_same_adapters_as_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(2))
    assert r1["state"] == {}  # gathered on rank 0 only

    single = Trainer.setup(_config(tmp_path / "single", "cpu", **LORA), dist=DistContext())
    initial = single.state_dict_for_publish()
    _run(single, 0)
    ref = single.state_dict_for_publish()
    got = r0["state"]
    assert set(got) == set(ref) and len(ref) == 2 * 7 * 2
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, **ADAM_TOL, msg=lambda m, k=k: f"{k}: {m}")
    assert sum(not torch.equal(ref[k], initial[k]) for k in ref) > 5  # the adapters trained
    # the frozen base on the ranks is the single process's, bit for bit (rank 0's shard first)
    frozen = {n: p.detach() for n, p in single.model.named_parameters() if not p.requires_grad}
    for name, param in frozen.items():
        whole = torch.cat([r0["base"][name], r1["base"][name]])
        assert torch.equal(whole, param), name
    published = torch.load(tmp_path / "v2.pt", weights_only=False)
    assert published["rank"] == 4 and published["base"] == ref.base_model  # type: ignore[attr-defined]
    assert all(torch.equal(published["tensors"][k], got[k]) for k in got)

    # the sharded step-1 checkpoint resumes in one process and continues like the ranks
    src = tmp_path / "a" / CHECKPOINT_DIR / "step-00000001"
    shutil.copytree(src, tmp_path / "d" / CHECKPOINT_DIR / src.name)
    resumed = Trainer.setup(_config(tmp_path / "d", "cpu", **LORA), dist=DistContext())
    assert resumed.step == 1 and resumed.optimizer.state
    _run(resumed, 0)
    for k, v in resumed.state_dict_for_publish().items():
        torch.testing.assert_close(v, got[k], **ADAM_TOL, msg=lambda m, k=k: f"{k}: {m}")
