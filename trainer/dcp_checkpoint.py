"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): weights and AdamW state.

A checkpoint written by a sharded trainer (:class:`~trainer.engine.FSDPEngine`) holds, beside
``state.json``, the directory :data:`SHARDED_DIR`: one ``__<rank>_0.distcp`` file per rank (its
shards of the parameters and of the optimizer's moments) and DCP's ``.metadata`` (written by
rank 0: which slice of which tensor is where). Every rank writes its own file, so with several
machines ``out_dir`` must be one shared filesystem.

Loading reshards: DCP reads each rank's slices from whichever files hold them, so a checkpoint
written by W ranks resumes on W' ranks, and in a single process (the model and optimizer are then
plain tensors). The other way, a single-process checkpoint (``model.safetensors`` and
``optimizer.pt``, see :meth:`trainer.resume.CheckpointStore.save_checkpoint`) resumes on
several ranks with :func:`load_full_checkpoint`: every rank reads the full tensors and keeps
its slice.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: the DCP directory inside a checkpoint directory.
SHARDED_DIR = "sharded"


class CheckpointFormatError(RuntimeError):
    """A checkpoint directory is incomplete or not one this trainer wrote."""


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the weights and the optimizer state to ``path`` (a
    collective: all ranks call it with the same ``path``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_sd, optim_sd = get_state_dict(model, optimizer)
    save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a :func:`save_sharded` checkpoint into ``model`` and ``optimizer``, whatever the
    number of ranks that wrote it (a collective when the model is sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    if not (path / ".metadata").is_file():
        raise CheckpointFormatError(
            f"{path} has no .metadata: not a complete sharded checkpoint (with several "
            "machines, out_dir must be a filesystem they all share)"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    single = not torch.distributed.is_initialized()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state, checkpoint_id=str(path), no_dist=single)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def load_full_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
) -> None:
    """Load full (unsharded) state into a sharded ``model``/``optimizer``: the single-process
    checkpoint format. ``optimizer_state`` is ``torch.optim.Optimizer.state_dict()`` of a
    single-process trainer (parameters numbered in ``model.parameters()`` order)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    full: dict[str, Any] = dict(model_state)
    aliases: dict[int, list[str]] = {}  # tied weights: the file holds one name of several
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        held = [n for n in names if n in full]
        for name in names:
            if name not in full and held:
                full[name] = full[held[0]]
    set_model_state_dict(model, full, options=options)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    by_name = _optimizer_state_by_name(optimizer_state, names)
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def _optimizer_state_by_name(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter number → keyed by parameter name (FQN)."""
    groups = state["param_groups"]
    numbers = [i for g in groups for i in g["params"]]
    if sorted(numbers) != list(range(len(names))):
        raise CheckpointFormatError(
            f"the checkpoint's optimizer has {len(numbers)} parameters, this model "
            f"{len(names)}: it was written for another model"
        )
    return {
        "state": {names[int(i)]: dict(s) for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }
