"""``fake`` backend: deterministic pseudo-samples for tests of everything around the backend.

Sample ``j`` of a request is a pure function of (prompt tokens, request seed, ``j``, loaded
version, sampling config): each step stops with probability ``stop_probability`` (emitting the
EOS token) or emits a uniformly drawn non-stop token. Log-probs are ``log(1/vocab_size)``: finite,
but they do NOT match a re-scoring by the real model, so a coordinator running the log-prob spot
check against fake nodes must disable it (or expect ``logprob_mismatch``).

No torch, no model: it loads in milliseconds. Never chosen by ``make_backend("auto")``.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from node.backends.base import (
    GenerationRequest,
    InferenceBackend,
    SampleOut,
    SamplingConfig,
)
from policy.model import CharTokenizer, ModelSpec


class FakeBackend(InferenceBackend):
    """Deterministic, model-free backend (see module docstring)."""

    name = "fake"
    #: not the swarm's rule (no model, no logits): tests only, with the spot check off
    sampling_rule = "fake"

    def __init__(
        self,
        spec: ModelSpec | None = None,
        *,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
        stop_probability: float = 0.25,
    ) -> None:
        self.spec = spec or ModelSpec()
        default_vocab, default_eos = _vocab_and_eos(self.spec)
        self.vocab_size = vocab_size if vocab_size is not None else default_vocab
        eos = eos_token_id if eos_token_id is not None else default_eos
        if not 0 <= eos < self.vocab_size:
            raise ValueError(f"eos_token_id {eos} is outside [0, {self.vocab_size})")
        self.eos_token_ids = (eos,)
        self.dtype = self.spec.dtype
        self.stop_probability = stop_probability
        self.loaded_version = None
        self.generate_calls = 0

    def load_state_dict(
        self,
        version: int,
        state_dict: Mapping[str, Any],
        changed: Collection[str] | None = None,
    ) -> None:
        self.loaded_version = version

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        self.check_requests(requests, sampling)
        self.generate_calls += 1
        stops = self.stop_set(sampling)
        allowed = [t for t in range(self.vocab_size) if t not in stops]
        if not allowed:
            raise ValueError("every token is a stop token; nothing to generate")
        logprob = -math.log(self.vocab_size)
        # ends on its EOS when the stop set has it, else on the set's smallest id (never: empty)
        eos = self.eos_token_ids[0] if self.eos_token_ids[0] in stops else min(stops, default=-1)
        out: list[list[SampleOut]] = []
        for req in requests:
            group = []
            for j in range(req.n):
                rng = random.Random(self._key(req, j, sampling))
                toks: list[int] = []
                reason: str = "length"
                for _ in range(sampling.max_new_tokens):
                    if eos >= 0 and rng.random() < self.stop_probability:
                        toks.append(eos)
                        reason = "stop"
                        break
                    toks.append(allowed[rng.randrange(len(allowed))])
                group.append(
                    SampleOut(
                        token_ids=toks,
                        logprobs=[logprob] * len(toks),
                        finish_reason="stop" if reason == "stop" else "length",
                    )
                )
            out.append(group)
        return out

    def _key(self, req: GenerationRequest, index: int, sampling: SamplingConfig) -> int:
        blob = json.dumps(
            [req.prompt_token_ids, req.seed, index, self.loaded_version, repr(sampling)]
        ).encode()
        return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "big")


def _vocab_and_eos(spec: ModelSpec) -> tuple[int, int]:
    """Vocabulary size and EOS id of ``spec`` without importing transformers."""
    if spec.path is None:
        tok = CharTokenizer()
        return tok.vocab_size, tok.eos_token_id
    cfg_path = Path(spec.path).expanduser() / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {cfg_path}: {exc}; pass a local HF model dir") from exc
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if not isinstance(cfg.get("vocab_size"), int) or not isinstance(eos, int):
        raise ValueError(f"{cfg_path} lacks an integer vocab_size / eos_token_id")
    return int(cfg["vocab_size"]), eos
