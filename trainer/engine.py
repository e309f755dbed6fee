"""Where the policy runs: one process (:class:`LocalEngine`) or FSDP2 over the process group
(:class:`FSDPEngine`), plus the memory levers both share.

:func:`make_engine` picks one from the world size. The recipe talks to the model through the
engine for everything that differs between the two:

* :meth:`Engine.prepare` — move to the device; optional activation checkpointing (each decoder
  layer's activations are recomputed in backward); under FSDP2 every rank starts from rank 0's
  weights, then ``fully_shard`` wraps each decoder layer and the root: parameters, gradients and
  AdamW's moments are sharded over the ranks (dim 0, ``torch.chunk`` layout), each layer's full
  weights exist only while it runs.
* gradient reduction is the engine's: FSDP2 reduce-scatters each layer's gradients during
  backward. The recipe's loss is already normalised by the *global* token count of the
  minibatch, so the gradients are **summed** over ranks (``set_gradient_divide_factor(1.0)``),
  never averaged, and with sum-only collectives (gloo has no pre-multiplied sum).
* :meth:`Engine.clip_grad_norm` — the global norm (an all-reduce of the shards' norms).
* :meth:`Engine.full_state_dict` — the weights to publish: gathered layer by layer onto rank 0's
  CPU (the other ranks get ``{}``); a collective, so every rank calls it.
* :meth:`Engine.pad_pass` — FSDP2 all-gathers in every forward and reduce-scatters in every
  backward, so all ranks must run the same number of passes. A rank with fewer micro-batches
  than another (a smaller shard, shorter sequences) runs one-token passes that contribute zero.
* :meth:`Engine.autocast` — ``torch.autocast`` in bf16 when ``autocast = "bf16"``: matmuls in
  bf16, weights, gradients and optimizer state stay in the config's ``dtype``, log-probs are
  computed in fp32 (``trainer.loss.token_logprobs`` upcasts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from trainer.distributed import DistContext


class Engine:
    """One process: the model as it is (the behaviour of the trainer before FSDP2)."""

    #: parameters are sharded over ranks (checkpoints are written by every rank).
    sharded = False

    def __init__(
        self, dist: DistContext, *, autocast: str = "off", activation_checkpointing: bool = False
    ) -> None:
        self.dist = dist
        self.autocast_dtype = torch.bfloat16 if autocast == "bf16" else None
        self.activation_checkpointing = activation_checkpointing
        self.device = torch.device("cpu")
        #: passes run only to keep the ranks' collectives in step (:meth:`pad_pass`).
        self.pad_passes = 0

    def prepare(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Move ``model`` to ``device`` and apply the memory levers; returns the model to train."""
        self.device = device
        model.to(device)
        if self.activation_checkpointing:
            apply_activation_checkpointing(decoder_layers(model))
        return model

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's precision context (bf16 autocast or nothing)."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            yield

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients to a global norm of ``max_norm``; returns the norm before."""
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """Detached CPU copies of the current weights (every key, tied ones included)."""
        return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}

    def trainable_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """Detached CPU copies of the trainable parameters only (LoRA: the adapters), by name.
        Sharded, a collective: rank 0 gets them gathered, the others ``{}``."""
        return {
            name: p.detach().to("cpu").clone()
            for name, p in model.named_parameters()
            if p.requires_grad
        }

    def pad_pass(self, model: nn.Module, *, backward: bool) -> None:
        """A forward (and backward) that changes nothing; only needed when sharded."""


class FSDPEngine(Engine):
    """PyTorch FSDP2 (``fully_shard``) over every rank of the process group."""

    sharded = True

    def prepare(self, model: nn.Module, device: torch.device) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import DTensor

        self.device = device
        layers = decoder_layers(model)
        if self.activation_checkpointing:
            apply_activation_checkpointing(layers)
        mesh = init_device_mesh(device.type, (self.dist.world_size,))
        # Layer by layer: onto the device, rank 0's values everywhere (whatever each rank built),
        # then sharded, so a device never holds more than its shards and one whole layer.
        for layer in layers:
            layer.to(device)
            self.dist.broadcast_parameters(layer)
            fully_shard(layer, mesh=mesh)
        model.to(device)  # the rest: embeddings, final norm, head, buffers
        for tensor in model.state_dict().values():
            if not isinstance(tensor, DTensor):
                self.dist.broadcast_tensor(tensor)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        if isinstance(norm, DTensor):  # the shards' partial norms → the global one
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Tensor] = get_model_state_dict(model, options=options)  # type: ignore[assignment]
        return state

    def trainable_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        out: dict[str, Tensor] = {}
        for name, p in model.named_parameters():  # the same order on every rank
            if not p.requires_grad:
                continue
            full = p.full_tensor() if isinstance(p, DTensor) else p  # an all-gather
            if self.dist.is_leader:
                out[name] = full.detach().to("cpu").clone()
        return out

    def pad_pass(self, model: nn.Module, *, backward: bool) -> None:
        self.pad_passes += 1
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward), self.autocast():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if backward:
            (out.logits.float().sum() * 0.0).backward()


def make_engine(config: Any, dist: DistContext) -> Engine:
    """:class:`FSDPEngine` when the process group has more than one rank, else :class:`Engine`."""
    cls = FSDPEngine if dist.enabled else Engine
    return cls(
        dist,
        autocast=config.autocast,
        activation_checkpointing=config.activation_checkpointing,
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (the classes it lists in
    ``_no_split_modules``, e.g. ``Qwen2DecoderLayer``): the unit of sharding and of recompute."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} (it names none in "
            "_no_split_modules); the sharded trainer needs a Hugging Face causal LM"
        )
    return layers


def apply_activation_checkpointing(layers: list[nn.Module]) -> None:
    """Run each layer under ``torch.utils.checkpoint`` (non-reentrant) when gradients are on:
    its activations are recomputed in backward instead of kept. Applied inside the FSDP2 unit
    (before ``fully_shard``), so the recompute runs while the layer's weights are gathered.
    Module names and state-dict keys do not change (the forward is wrapped, not the module)."""
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        inner: Callable[..., Any] = layer.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            # No RNG state to replay: the policy runs in eval mode (no dropout).
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=False,
                              **kwargs)  # fmt: skip

        layer.forward = forward
