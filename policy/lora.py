"""LoRA policy versions: the adapter format, its base model, and applying adapters over one base.

A LoRA version (docs/protocol.md §8.6) is a low-rank adapter over a *base model* that every role
holds: the trainer trains the adapter (with ``peft``), the coordinator signs and seeds it like any
version, nodes and the coordinator's spot check apply it over the base they loaded once.

* **Adapter tensors** (the version's safetensors file :data:`ADAPTER_FILE`): for every adapted
  linear module ``M`` of the base (its name in the HF model, e.g.
  ``model.layers.0.self_attn.q_proj``) two tensors, ``M.lora_A.weight`` ``[r, in]`` and
  ``M.lora_B.weight`` ``[out, r]``. The module computes ``y = x W^T (+ b) + s · (x A^T) B^T`` with
  ``s = alpha / r`` (``Manifest.lora``: rank ``r`` and ``alpha``); dropout is 0.
* **Base fingerprint** (:func:`base_fingerprint`): a model directory's
  :func:`policy.importer.model_fingerprint` (what ``swarm model import`` prints), or for the
  embedded default, ``sha256`` over its config fingerprint and its seeded initial weights. A
  receiver whose base has another fingerprint refuses the version (``lora_base_missing``).
* :class:`AdapterState` — the trainer's published state: the adapter tensors plus what the
  manifest must say (base fingerprint, rank, alpha); a publisher builds a LoRA version from it.
* :class:`AdapterSet` — a loaded base model plus up to ``keep`` adapters held in memory, one of
  them active; switching is :meth:`AdapterSet.activate`, never a reload of the base. Two ways of
  applying the active adapter (``mode``): ``"merged"`` writes ``W0 + s·B·A`` into each adapted
  weight (recomputed from a kept copy of ``W0``, so a switch is bit-stable: the same adapter
  always gives the same bits), ``"unmerged"`` leaves the base weights alone and adds
  ``s·(x A^T) B^T`` to each adapted module's output in a forward hook (peft's own order of
  operations). docs/models.md has the measured comparison.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from policy.model import ModelSpec

__all__ = [
    "ADAPTER_FILE",
    "AdapterSet",
    "AdapterState",
    "ApplyMode",
    "LoraError",
    "adapter_modules",
    "adapter_state",
    "base_fingerprint",
    "check_adapter",
    "inject_lora",
    "merged_copy",
]

ADAPTER_FILE = "adapter.safetensors"
ApplyMode = Literal["merged", "unmerged"]
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
#: peft's parameter names: ``M.lora_A.<adapter name>.weight``
_PEFT = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.[^.]+\.weight$")


class LoraError(ValueError):
    """An adapter does not fit the base model (one line: which tensor, what to do)."""


class AdapterState(dict[str, "torch.Tensor"]):
    """Adapter tensors (canonical names, see the module docstring) and what their version's
    manifest says about them: the base model's fingerprint, the rank and alpha."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], *, base_model: str, rank: int, alpha: float
    ) -> None:
        super().__init__(tensors)
        self.base_model = base_model
        self.rank = rank
        self.alpha = alpha


def inject_lora(
    model: torch.nn.Module, *, rank: int, alpha: float, target_modules: list[str]
) -> None:
    """Add LoRA adapters to ``model`` in place with ``peft`` (dropout 0, no bias) and freeze
    every other parameter: only the adapters train. ``lora_B`` starts at zero, so the model's
    outputs are the base's until the first update."""
    from peft import LoraConfig, inject_adapter_in_model

    targets: str | list[str] = (
        "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # typed int; peft divides it by r as a float
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
    )
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise LoraError(f"lora_target_modules {target_modules}: {exc}".splitlines()[0]) from exc
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)


def adapter_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter tensors among ``named`` (peft's parameter names) under their canonical names
    (``M.lora_A.default.weight`` -> ``M.lora_A.weight``), as detached CPU tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        m = _PEFT.match(name)
        if m is not None:
            out[f"{m['module']}.lora_{m['which']}.weight"] = tensor.detach().to("cpu")
    return out


def adapter_modules(tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, tuple[Any, Any]]:
    """``{module name: (A [r, in], B [out, r])}`` of an adapter; LoraError unless every tensor
    is named ``M.lora_A.weight`` / ``M.lora_B.weight``, comes in pairs and has rank ``rank``."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name)
        if m is None:
            raise LoraError(f"adapter tensor {name!r} is not M.lora_A.weight or M.lora_B.weight")
        pairs.setdefault(m["module"], {})[m["which"]] = tensor
    out: dict[str, tuple[Any, Any]] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter module {module!r} lacks lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(
                f"adapter module {module!r}: A {list(a.shape)} and B {list(b.shape)} are not "
                f"[{rank}, in] and [out, {rank}]"
            )
        out[module] = (a, b)
    if not out:
        raise LoraError("the adapter has no tensors")
    return out


def base_fingerprint(spec: ModelSpec, *, seed: int = 0) -> str:
    """``sha256:<hex>`` naming the base weights of ``spec``: a model directory's
    :func:`policy.importer.model_fingerprint`; the embedded default's config fingerprint and its
    initial weights at ``seed`` (fp32, tensors in name order: name, shape, bytes)."""
    from pathlib import Path

    if spec.path is not None:
        from policy.importer import model_fingerprint
        from policy.model import _model_dir

        return model_fingerprint(Path(_model_dir(spec)))
    import torch

    from policy.model import ModelSpec, build_model, config_fingerprint, tiny_config

    model = build_model(ModelSpec(dtype="float32"), seed=seed)
    digest = hashlib.sha256(b"rollout-swarm/embedded-base/v1\x00")
    digest.update(config_fingerprint(tiny_config()).encode() + b"\x00")
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            t = tensor.detach().to("cpu", torch.float32).contiguous()
            digest.update(name.encode() + b"\x00" + repr(tuple(t.shape)).encode() + b"\x00")
            digest.update(t.numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def _linear_modules(model: torch.nn.Module, names: Iterable[str]) -> dict[str, Any]:
    import torch

    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for name in names:
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            what = "no such module" if module is None else type(module).__name__
            raise LoraError(f"adapter module {name!r} is not a linear layer of the base ({what})")
        out[name] = module
    return out


def _check_shapes(linear: Any, name: str, a: Any, b: Any) -> None:
    out_features, in_features = linear.weight.shape
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise LoraError(
            f"adapter module {name!r}: A {list(a.shape)}, B {list(b.shape)} do not fit its "
            f"weight [{out_features}, {in_features}]"
        )


def check_adapter(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], rank: int
) -> dict[str, tuple[Any, Any]]:
    """The adapter's ``{module: (A, B)}`` when it fits ``model`` (every module a linear layer of
    it, shapes ``[rank, in]`` and ``[out, rank]``); LoraError naming the first misfit."""
    pairs = adapter_modules(tensors, rank)
    for name, linear in _linear_modules(model, pairs).items():
        _check_shapes(linear, name, *pairs[name])
    return pairs


def merged_copy(
    base: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float
) -> torch.nn.Module:
    """A copy of ``base`` with the adapter merged into its weights (``W0 + s·B·A``, computed in
    fp32): what the coordinator's spot check scores with (the node's ``"merged"`` result)."""
    import torch

    model = copy.deepcopy(base)
    pairs = adapter_modules(tensors, rank)
    scale = alpha / rank
    with torch.no_grad():
        for name, linear in _linear_modules(model, pairs).items():
            a, b = pairs[name]
            _check_shapes(linear, name, a, b)
            linear.weight.copy_(_merged(linear.weight, a, b, scale))
    return model


def _merged(w0: Any, a: Any, b: Any, scale: float) -> Any:
    import torch

    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
    return (w0.to(torch.float32) + delta.to(w0.device)).to(w0.dtype)


@dataclass
class _Adapter:
    pairs: dict[str, tuple[Any, Any]]
    scale: float


class AdapterSet:
    """A base model and up to ``keep`` adapters held in memory, one active (module docstring).

    ``activate(None)`` restores the base. Not thread-safe: one caller switches and generates."""

    def __init__(self, model: torch.nn.Module, *, keep: int, mode: ApplyMode = "merged") -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        if mode not in ("merged", "unmerged"):
            raise ValueError(f"unknown LoRA apply mode {mode!r}; use merged or unmerged")
        self.model = model
        self.keep = keep
        self.mode: ApplyMode = mode
        self.active: int | None = None
        #: activations that changed the applied adapter (a switch, not a reload of the base)
        self.switches = 0
        self._adapters: OrderedDict[int, _Adapter] = OrderedDict()
        self._base: dict[str, Any] = {}  # merged: W0 of each adapted module, as loaded
        self._hooks: dict[str, Any] = {}  # unmerged: the forward hook of each adapted module

    def versions(self) -> list[int]:
        """Versions whose adapter is held, ascending."""
        return sorted(self._adapters)

    def __contains__(self, version: object) -> bool:
        return version in self._adapters

    def add(
        self, version: int, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float
    ) -> None:
        """Hold ``version``'s adapter (checked against the base; LoraError if it does not fit);
        the oldest held adapter other than the active one goes when more than ``keep`` are."""
        import torch

        pairs = check_adapter(self.model, tensors, rank)
        device = next(self.model.parameters()).device
        moved: dict[str, tuple[Any, Any]] = {}
        for name, linear in _linear_modules(self.model, pairs).items():
            a, b = pairs[name]
            dtype = torch.float32 if self.mode == "merged" else linear.weight.dtype
            moved[name] = (a.to(device, dtype), b.to(device, dtype))
        self._adapters[version] = _Adapter(moved, alpha / rank)
        while len(self._adapters) > self.keep:
            old = next(v for v in self._adapters if v != self.active)
            del self._adapters[old]

    def activate(self, version: int | None) -> None:
        """Apply ``version``'s held adapter (None: the bare base) in place of the active one."""
        if version == self.active:
            return
        if version is not None and version not in self._adapters:
            raise KeyError(f"adapter v{version} is not held (held: {self.versions()})")
        import torch

        adapter = None if version is None else self._adapters[version]
        with torch.no_grad():
            if self.mode == "merged":
                self._apply_merged(adapter)
            else:
                self._apply_unmerged(adapter)
        self.active = version
        self.switches += 1

    def _apply_merged(self, adapter: _Adapter | None) -> None:
        modules = dict(self.model.named_modules())
        wanted = set(adapter.pairs) if adapter is not None else set()
        for name in list(self._base):  # modules the previous adapter touched: back to W0
            if name not in wanted:
                modules[name].weight.copy_(self._base.pop(name))
        if adapter is None:
            return
        for name, (a, b) in adapter.pairs.items():
            weight = modules[name].weight
            if name not in self._base:
                self._base[name] = weight.detach().clone()
            weight.copy_(_merged(self._base[name], a, b, adapter.scale))

    def _apply_unmerged(self, adapter: _Adapter | None) -> None:
        import torch.nn.functional as F

        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        if adapter is None:
            return
        modules = dict(self.model.named_modules())
        scale = adapter.scale
        for name, (a, b) in adapter.pairs.items():

            def hook(_m: Any, args: Any, out: Any, a: Any = a, b: Any = b) -> Any:
                # peft's order: result + lora_B(lora_A(x)) * scaling
                return out + F.linear(F.linear(args[0], a), b) * scale

            self._hooks[name] = modules[name].register_forward_hook(hook)
