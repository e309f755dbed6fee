"""Test helpers of the sampling contract (unit and integration tests use them; no test framework).

* :func:`rounding_twins` -- a model and "the same model on another CPU": logits ~1e-6 apart with
  exact ties that the twin breaks, the case where top-k/top-p keep different token sets.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["rounding_twins"]


def rounding_twins(tied: tuple[int, ...] = tuple(range(8, 14))) -> tuple[Any, Any]:
    """``(reference, other_cpu)``: the embedded model with the embedding rows of ``tied`` made
    equal (so their logits tie exactly at every position, as happens by accident on real
    vocabularies), and a copy whose tied rows differ by a relative 1e-6 — logits within ~1e-6
    of the reference, the size of another CPU's rounding, yet enough to break every tie. Where
    a tie straddles the top-k cut or the top-p mass, the two keep different token sets."""
    import torch

    from policy.model import ModelSpec, build_model

    ref: Any = build_model(ModelSpec(), seed=0)
    with torch.no_grad():
        emb = ref.get_input_embeddings().weight
        for t in tied[1:]:
            emb[t] = emb[tied[0]]
    other: Any = copy.deepcopy(ref)
    with torch.no_grad():
        emb2 = other.get_input_embeddings().weight
        for i, t in enumerate(tied):
            emb2[t] *= 1.0 + 1e-6 * (i + 1)
    return ref, other
