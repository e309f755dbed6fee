"""The sampling contract's tensor side: the processed distribution and the seeded draw.

* :func:`processed_logprobs` -- the one definition of "the exact sampling distribution": fp32
  temperature, then top-k, then top-p on the raw logits. The node samples from it, the
  coordinator re-scores with it, the trainer weights with it (μ, π_prox and π_θ are all
  log-probs of this processed distribution at the lease's settings).
* :func:`sample_uniforms`    -- the seeded uniforms of one sample (``u[t]`` for token ``t``).
* :func:`inverse_cdf`        -- token ``t`` is the inverse-CDF draw at ``u[t]`` of the processed
  distribution (rank order = token id order).

Pure functions of (logits, settings, seed): every backend that draws with them produces the same
tokens for the same logits, and the coordinator can replay a node's draws.
"""

from __future__ import annotations

import torch

__all__ = ["inverse_cdf", "processed_logprobs", "sample_uniforms"]


def processed_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Log-probs ``[..., V]`` (fp32) of the sampling distribution for raw ``logits [..., V]``.

    Tokens removed by top-k / top-p get ``-inf``. Semantics match transformers' and vLLM's
    warpers: temperature first, top-k keeps logits >= the k-th largest, top-p keeps a token when
    the probability mass of the higher-ranked tokens is < ``top_p`` (rank: logit descending, ties
    by token id ascending; the most likely token is always kept).
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_uniforms(seed: int, steps: int) -> torch.Tensor:
    """The ``steps`` uniforms of a sample seeded ``seed``: token ``t`` is the inverse-CDF draw at
    ``u[t]`` of the sampling distribution (the ``hf`` backend samples with these; the
    coordinator replays them in its spot check)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.rand(steps, generator=gen)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token index per row drawn from ``probs [B, V]`` (unnormalised ok) with uniforms ``u [B]``.

    ``searchsorted(cdf, v, right=True)`` with ``v < cdf[-1]`` strictly can only return an index
    whose probability is > 0 (a zero-probability token repeats the previous cdf value)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    v = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).squeeze(1).clamp_max(probs.shape[1] - 1)
