"""The sampling contract's tensor side: the processed distribution and the seeded draw.

* :func:`processed_logprobs` -- the one definition of "the exact sampling distribution": fp32
  temperature, then top-k, then top-p on the raw logits. The node samples from it, the
  coordinator re-scores with it, the trainer weights with it (μ, π_prox and π_θ are all
  log-probs of this processed distribution at the lease's settings).
* :func:`sample_uniforms`    -- the seeded uniforms of one sample (``u[t]`` for token ``t``): the
  SplitMix64 stream of the sample seed, 24 bits each (:func:`uniform_at` is the scalar form).
* :func:`inverse_cdf`        -- token ``t`` is the inverse-CDF draw at ``u[t]`` of the processed
  distribution (cumulative in token-id order).
* :func:`draw_tokens`        -- the sampling rule of every backend: ``(logits, settings, u) →
  (token, log-prob)``; a backend calls it once per generated position with the uniforms of each
  row's sample at that position.

Pure functions of (logits, settings, seed): every backend that draws with them produces the same
tokens for the same logits, and the coordinator replays a node's draws whatever its backend.
docs/protocol.md §11 defines the uniforms and the draw with test vectors.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "SAMPLING_RULE",
    "draw_tokens",
    "inverse_cdf",
    "processed_logprobs",
    "sample_uniforms",
    "splitmix64",
    "uniform_at",
]

_MASK64 = (1 << 64) - 1
#: SplitMix64's increment (2^64 / golden ratio) and its two multipliers.
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
#: Bits kept of each 64-bit output: a uniform is a multiple of 2^-24, exact in float32.
UNIFORM_BITS = 24
#: Name of the sampling rule defined here (docs/protocol.md §11): a backend that draws every token
#: with :func:`draw_tokens` at the uniforms of :func:`sample_uniforms` declares it.
SAMPLING_RULE = "inverse-cdf/splitmix64-24/v1"


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


def splitmix64(state: int) -> int:
    """SplitMix64's output for the state *after* its increment (a bijective 64-bit mix)."""
    z = state & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def uniform_at(seed: int, t: int) -> float:
    """``u[t]`` of the sample seeded ``seed``: the ``(t+1)``-th output of SplitMix64 started at
    ``seed``, top 24 bits, divided by 2^24 (a value in [0, 1 − 2^-24], exact in float32)."""
    z = splitmix64((seed + (t + 1) * _GAMMA) & _MASK64)
    return (z >> (64 - UNIFORM_BITS)) / float(1 << UNIFORM_BITS)


def sample_uniforms(seed: int, steps: int) -> torch.Tensor:
    """The ``steps`` uniforms ``u[0..steps)`` (float32) of a sample seeded ``seed``: token ``t``
    is the inverse-CDF draw at ``u[t]`` of the sampling distribution. Equal to
    ``[uniform_at(seed, t) for t in range(steps)]`` (vectorised, wrapping uint64 arithmetic)."""
    with np.errstate(over="ignore"):
        t = np.arange(1, steps + 1, dtype=np.uint64)
        z = np.uint64(seed & _MASK64) + t * np.uint64(_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
        z = z ^ (z >> np.uint64(31))
    top = (z >> np.uint64(64 - UNIFORM_BITS)).astype(np.float32)
    return torch.from_numpy(top * np.float32(1.0 / (1 << UNIFORM_BITS)))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token index per row drawn from ``probs [B, V]`` (unnormalised ok) with uniforms ``u [B]``:
    the smallest ``k`` with ``cdf[k] > u · cdf[V−1]`` (``cdf`` = running sum in token-id order).

    ``searchsorted(cdf, v, right=True)`` with ``v < cdf[-1]`` strictly can only return an index
    whose probability is > 0 (a zero-probability token repeats the previous cdf value)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    v = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).squeeze(1).clamp_max(probs.shape[1] - 1)


def draw_tokens(
    logits: torch.Tensor,
    u: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling rule of every backend, for one generated position of ``B`` rows.

    ``logits [B, V]`` are the raw logits of each row's next token and ``u [B]`` the uniform of
    each row's sample at this position (``sample_uniforms(sample seed, ·)[t]``). Returns the drawn
    tokens ``[B]`` (int64) and their log-probs ``[B]`` (fp32) under the processed distribution:
    what the node records as the behaviour log-prob and what the coordinator replays."""
    logp = processed_logprobs(logits, temperature, top_p, top_k)
    tok = inverse_cdf(logp.exp(), u.to(logp.device, torch.float32))
    return tok, logp.gather(1, tok.unsqueeze(1)).squeeze(1)
