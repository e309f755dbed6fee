"""The learner's parts, built from its config: what :meth:`trainer.recipe.Trainer.setup` hands
the :class:`~trainer.recipe.Trainer`.

:func:`build_parts`, top to bottom: rank 0's config and the leases' stop set for every rank (it
may have adopted the coordinator's sampling contract); the engine; the model (LoRA adapters
before sharding, then the engine's wrapping onto this rank's device), with the held-out
evaluation's replica taken before the wrapping; the tokenizer's ids; the metrics writer (rank
0); the optimizer over the wrapped model's trainable parameters (``make_optimizer``, AdamW by
default: :func:`adamw`). Nothing here knows the Trainer: the recipe composes what comes out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import TrainerConfig
from trainer.distributed import DistContext
from trainer.engine import Engine, make_engine
from trainer.evaluation import EvalRunner, make_replica
from trainer.metrics import MetricsWriter

#: Builds the optimizer over the (wrapped) model's trainable parameters.
OptimizerFactory = Callable[[Sequence[torch.nn.Parameter]], torch.optim.Optimizer]


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (with LoRA: the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def adamw(config: TrainerConfig, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The default optimizer: AdamW with the config's lr, weight decay and betas."""
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
    )


@dataclass(frozen=True)
class TrainerParts:
    """Everything :func:`build_parts` made, for the Trainer's constructor."""

    #: rank 0's config (every rank trains with it)
    config: TrainerConfig
    #: the model as the engine prepared it (sharded over the ranks under FSDP2)
    model: torch.nn.Module
    engine: Engine
    dist: DistContext
    optimizer: torch.optim.Optimizer
    pad_token_id: int
    eos_token_id: int
    #: the model's stop tokens and rank 0's lease stop set (a completion is trained up to its
    #: first stop token)
    stop_token_ids: frozenset[int]
    #: rank 0's metrics.jsonl writer (None on the other ranks)
    metrics: MetricsWriter | None
    #: the held-out evaluation (``eval_every``), None when off
    evaluation: EvalRunner | None
    #: the base model's fingerprint a LoRA version names (rank 0 with ``lora_rank``)
    lora_base: str | None


def build_parts(
    config: TrainerConfig,
    *,
    dist: DistContext | None = None,
    model: torch.nn.Module | None = None,
    make_optimizer: OptimizerFactory | None = None,
    lease_stop_ids: Collection[int] = (),
) -> TrainerParts:
    """The model, engine, optimizer, token ids, metrics writer and held-out evaluation of
    ``config`` (see the module docstring). A collective under several ranks: every rank calls it,
    and rank 0's ``config`` and ``lease_stop_ids`` hold on all of them."""
    from policy.model import ModelSpec, build_model, load_tokenizer, model_stop_ids

    dist = dist or DistContext()
    # Rank 0's config and stop set for every rank: it may have adopted the sampling contract.
    config, lease_stops = dist.share((config, frozenset(lease_stop_ids)))
    spec = ModelSpec(path=config.model_path, dtype=config.dtype)
    engine = make_engine(config, dist)
    if model is None:
        # LoRA over the embedded default: its weights at seed 0, the base every node and the
        # coordinator build (`seed` still draws the adapters and the minibatch order)
        model = build_model(spec, seed=0 if config.lora_rank else config.seed)
    if config.lora_rank:  # before sharding: FSDP2 wraps the adapted layers
        inject_lora(model, config)
    device = resolve_device(config.device, dist)
    # the held-out evaluation's copy of the model as built (rank 0; trainer/evaluation.py)
    replica = make_replica(model) if config.eval_every and dist.is_leader else None
    model = engine.prepare(model, device)
    tok = load_tokenizer(spec)
    writer = None
    if dist.is_leader:
        writer = MetricsWriter(
            Path(config.out_dir) / "metrics.jsonl", max_staleness=config.max_staleness
        )
    params = trainable(model)
    optimizer = make_optimizer(params) if make_optimizer is not None else adamw(config, params)
    evaluation = None
    if config.eval_every:
        replica = replica.to(device) if replica is not None else None
        evaluation = EvalRunner(config, dist, replica, threads=config.eval_threads)
    lora_base = None
    if config.lora_rank and dist.is_leader:  # hashed once here, not in the first publication
        from policy.lora import base_fingerprint

        lora_base = base_fingerprint(spec)
    return TrainerParts(
        config=config,
        model=model,
        engine=engine,
        dist=dist,
        optimizer=optimizer,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        stop_token_ids=frozenset(model_stop_ids(spec, tok)) | lease_stops,
        metrics=writer,
        evaluation=evaluation,
        lora_base=lora_base,
    )


def has_lora(model: torch.nn.Module) -> bool:
    """The model already carries LoRA adapters."""
    return any(".lora_A." in name for name, _ in model.named_parameters())


def inject_lora(model: torch.nn.Module, config: TrainerConfig) -> None:
    """peft adapters on ``model`` (policy/lora.py), initialised from ``config.seed``: every rank
    draws the same ``lora_A`` (FSDP2 broadcasts rank 0's anyway)."""
    from policy.lora import inject_lora as inject

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        inject(
            model,
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            target_modules=list(config.lora_target_modules),
        )


def resolve_device(name: str, dist: DistContext) -> torch.device:
    """``device`` of the config: ``auto`` is this rank's GPU under NCCL, the CPU under gloo, else
    CUDA when there is one."""
    if name != "auto":
        return torch.device(name)
    if dist.enabled:  # this rank's GPU under NCCL; the CPU under gloo
        return torch.device(dist.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
