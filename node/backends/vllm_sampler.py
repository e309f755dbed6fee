"""The swarm's sampling rule inside vLLM: a logits processor that draws with ``draw_tokens``.

vLLM samples with its own RNG; the coordinator replays ``policy.draw.draw_tokens`` at the
sample's seeded uniforms (docs/protocol.md §11), so vLLM's own draws would be refused. The
processor here takes the draw away from vLLM: for every logits row of a request it owns (its
``SamplingParams.extra_args`` carry :data:`EXTRA_KEY`), at generated position ``t``, it

1. draws ``token, logp = draw_tokens(row, uniform_at(sample seed, t), T, top_p, top_k)`` on the
   row's raw fp32 logits, exactly as the hf backend does;
2. records ``(t, token, logp)`` under the request's tag in :data:`DRAWS` (worker process);
3. overwrites the row with a one-hot (0 at ``token``, -inf elsewhere), so whatever vLLM's sampler
   does next (its request settings are plain: T=1, top_p=1, top_k off) it emits ``token``.

The backend reads the behaviour log-probs back with :func:`drain` (through ``collective_rpc`` on
the worker extension) after ``LLM.generate``; vLLM's own log-probs are not requested.

:class:`SeededDrawState` is the engine-independent core (unit-tested on CPU against the hf
backend's draws); :class:`SeededInverseCDFProcessor` adapts it to vLLM's Model Runner V2 logits
processor interface (``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``, vLLM 0.33),
where ``apply`` sees a batch of rows, ``ctx.expanded_idx_mapping`` (row -> request slot) and
``ctx.pos`` (position of the row's input token: the row predicts position ``pos + 1``, i.e.
generated index ``t = pos + 1 - prompt_len``). Rows with ``t < 0`` (a chunk of a prefill that
samples nothing) are left alone. Speculative decoding is not supported (one row per request).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policy.draw import draw_tokens, uniform_at

__all__ = [
    "DRAWS",
    "EXTRA_KEY",
    "FQCN",
    "RequestDraw",
    "SeededDrawState",
    "drain",
    "extra_args",
]

#: key of the ``SamplingParams.extra_args`` entry that turns the processor on for a request.
EXTRA_KEY = "rollout_swarm_draw"
#: the processor's fully qualified class name, for ``LLM(logits_processors=[FQCN])``.
FQCN = "node.backends.vllm_sampler:SeededInverseCDFProcessor"


@dataclass(frozen=True)
class RequestDraw:
    """What the processor needs of one request (from its ``extra_args[EXTRA_KEY]``)."""

    tag: str
    seed: int
    prompt_len: int
    temperature: float
    top_p: float
    top_k: int

    @classmethod
    def parse(cls, raw: Any) -> RequestDraw:
        if not isinstance(raw, Mapping):
            kind = type(raw).__name__
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] must be a mapping, got {kind}")
        try:
            out = cls(
                tag=str(raw["tag"]),
                seed=int(raw["seed"]),
                prompt_len=int(raw["prompt_len"]),
                temperature=float(raw["temperature"]),
                top_p=float(raw["top_p"]),
                top_k=int(raw["top_k"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] is malformed: {exc}") from exc
        if out.prompt_len < 1 or out.temperature <= 0 or not 0 < out.top_p <= 1 or out.top_k < 0:
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] out of range: {out}")
        return out


def extra_args(
    tag: str, seed: int, prompt_len: int, temperature: float, top_p: float, top_k: int
) -> dict[str, Any]:
    """The ``SamplingParams.extra_args`` that hand one sample's draw to the processor."""
    return {
        EXTRA_KEY: {
            "tag": tag,
            "seed": seed,
            "prompt_len": prompt_len,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
        }
    }


class _Draws:
    """Per-tag drawn ``(t -> (token, logp))`` of this process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tag: dict[str, dict[int, tuple[int, float]]] = {}

    def record(self, tag: str, t: int, token: int, logp: float) -> None:
        with self._lock:
            self._by_tag.setdefault(tag, {})[t] = (token, logp)

    def drain(self, tags: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
        """Pop the draws of ``tags``, each as a list in position order (missing tags: [])."""
        with self._lock:
            out: dict[str, list[tuple[int, float]]] = {}
            for tag in tags:
                got = self._by_tag.pop(tag, {})
                out[tag] = [got[t] for t in sorted(got)]
            return out


#: the draws recorded in this process (a vLLM worker, or the test process).
DRAWS = _Draws()


def drain(tags: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """Pop the recorded draws of ``tags`` (called inside the worker via ``collective_rpc``)."""
    return DRAWS.drain(tags)


class SeededDrawState:
    """Per-slot draw settings plus the batch step; independent of vLLM."""

    def __init__(self, draws: _Draws = DRAWS) -> None:
        self.slots: dict[int, RequestDraw] = {}
        self.draws = draws

    def add(self, slot: int, raw_extra: Mapping[str, Any] | None) -> bool:
        """Own ``slot`` when its extra_args name a draw (True); else release it (False)."""
        raw = (raw_extra or {}).get(EXTRA_KEY)
        if raw is None:
            self.slots.pop(slot, None)
            return False
        self.slots[slot] = RequestDraw.parse(raw)
        return True

    def apply(
        self, logits: torch.Tensor, row_slots: Sequence[int], row_pos: Sequence[int]
    ) -> torch.Tensor:
        """Draw and force every owned row of ``logits [R, V]`` in place (see module docstring);
        ``row_slots[r]`` / ``row_pos[r]`` are row ``r``'s request slot and input position."""
        groups: dict[tuple[float, float, int], list[tuple[int, RequestDraw, int]]] = {}
        for r, (slot, pos) in enumerate(zip(row_slots, row_pos, strict=True)):
            req = self.slots.get(int(slot))
            if req is None:
                continue
            t = int(pos) + 1 - req.prompt_len
            if t < 0:
                continue
            groups.setdefault((req.temperature, req.top_p, req.top_k), []).append((r, req, t))
        for (temperature, top_p, top_k), rows in groups.items():
            idx = torch.tensor([r for r, _, _ in rows], device=logits.device)
            u = torch.tensor([uniform_at(req.seed, t) for _, req, t in rows], dtype=torch.float32)
            tok, logp = draw_tokens(
                logits.index_select(0, idx), u, temperature=temperature, top_p=top_p, top_k=top_k
            )
            forced = torch.full_like(logits.index_select(0, idx), float("-inf"))
            forced.scatter_(1, tok.unsqueeze(1), 0.0)
            logits.index_copy_(0, idx, forced)
            for (_, req, t), k, lp in zip(rows, tok.tolist(), logp.tolist(), strict=True):
                self.draws.record(req.tag, t, int(k), float(lp))
        return logits


try:  # the vLLM adapter exists only where vLLM (0.33's Model Runner V2) is installed
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as _VLLMLogitsProcessor,
    )
except ImportError:  # pragma: no cover - exercised on the GPU host only
    _VLLMLogitsProcessor = None

if _VLLMLogitsProcessor is not None:  # pragma: no cover - needs vLLM

    class SeededInverseCDFProcessor(_VLLMLogitsProcessor):  # type: ignore[misc]
        """vLLM MRV2 logits processor running :class:`SeededDrawState` (module docstring)."""

        def __init__(self, vllm_config: Any, req_states: Any) -> None:
            super().__init__(vllm_config, req_states)
            self.state = SeededDrawState()

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            raw = (getattr(sampling_params, "extra_args", None) or {}).get(EXTRA_KEY)
            if raw is not None:
                RequestDraw.parse(raw)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            return self.state.add(req_idx, getattr(sampling_params, "extra_args", None))

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            if not self.state.slots:
                return logits
            slots = ctx.expanded_idx_mapping.tolist()
            if not any(s in self.state.slots for s in slots):
                return logits
            return self.state.apply(logits, slots, ctx.pos.tolist())
