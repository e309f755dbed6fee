"""The trainer's side of the sampling contract: match the coordinator's leases or refuse to start.

The coordinator owns what every lease carries (temperature, top-p, top-k, ``max_new_tokens``, the
stop set) and reports it on ``rswarm/status``. Before the first step, :func:`adopt_contract`
compares it with the trainer's config:

* ``temperature``/``top_p``/``top_k`` left unset in the trainer config are taken from the
  coordinator; a value set to something else is refused (π_θ and π_prox would be computed from
  another distribution than the nodes' μ, and every behaviour weight would be off);
* the stop set is adopted (a completion is trained up to its first stop token);
* the longest prompt the coordinator renders plus ``max_new_tokens`` must fit the trainer's
  model positions.

Each refusal is a :class:`ContractError` whose one-line message names the setting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trainer.config import TrainerConfig

__all__ = ["ContractError", "adopt_contract"]


class ContractError(ValueError):
    """The trainer cannot train on this coordinator's samples (one line naming the setting)."""


def adopt_contract(
    config: TrainerConfig, status: Mapping[str, Any], positions: int | None
) -> tuple[TrainerConfig, tuple[int, ...]]:
    """``(config with the coordinator's sampling settings, the leases' stop set)``; raises
    :class:`ContractError`. A status without a ``sampling`` map (an older coordinator) changes
    nothing."""
    sampling = status.get("sampling")
    stops = status.get("stop_token_ids")
    stop_ids = tuple(int(t) for t in stops) if isinstance(stops, list) else ()
    if not isinstance(sampling, Mapping):
        return config, stop_ids
    update: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k"):
        theirs = sampling.get(key)
        if not isinstance(theirs, int | float) or isinstance(theirs, bool):
            continue
        mine = getattr(config, key)
        if mine is None:
            update[key] = int(theirs) if key == "top_k" else float(theirs)
        elif not math.isclose(float(mine), float(theirs), rel_tol=0.0, abs_tol=1e-9):
            raise ContractError(
                f"{key}={mine} in the trainer config, but the coordinator's leases sample with "
                f"sampling.{key}={theirs}: the trainer must weight samples with the distribution "
                f"they were drawn from; set {key} = {theirs} or leave it unset"
            )
    max_new = sampling.get("max_new_tokens")
    longest = status.get("longest_prompt_tokens")
    known = isinstance(max_new, int) and isinstance(longest, int) and positions is not None
    if known and longest + max_new > positions:  # type: ignore[operator]
        raise ContractError(
            f"model_path: the trainer's model has {positions} positions, but the coordinator's "
            f"prompts reach {longest} tokens plus sampling.max_new_tokens={max_new}; lower "
            "max_new_tokens on the coordinator or use a model with more positions"
        )
    return (config.model_copy(update=update) if update else config), stop_ids
