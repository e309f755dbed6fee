"""Held-out evaluation: how well a policy answers a fixed prompt set it is never trained on.

The protocol (docs/models.md, "Held-out evaluation"), the same at every version:

* **the set**: ``N`` prompts of the task's held-out split (disjoint from the training prompts;
  the task defines the split), rendered to token ids with the policy's own template
  (:mod:`policy.prompts`), each with its reference answer;
* **greedy accuracy**: one completion per prompt, the most likely token at every position (ties:
  the lowest token id), at most ``max_new_tokens``, ending at the first token of the stop set
  (kept); graded by the task's verifier. ``k`` of ``N`` right, with the Wilson 95% interval of a
  binomial proportion;
* **pass@1**: ``n`` samples per prompt from the processed distribution of the sampling contract
  (temperature → top-k → top-p, :func:`policy.draw.draw_tokens`), drawn with the swarm's seeded
  inverse-CDF rule at seeds derived from the prompt id (:func:`eval_seed`): every version draws
  with the same uniforms, so two versions differ by their weights only. pass@1 is the mean over
  prompts of ``c_i / n``; its interval is Wilson's at that mean with ``N`` trials, which is
  conservative: ``Var(c_i/n) = Var(p_i) + E[p_i(1−p_i)]/n ≤ p(1−p)`` (one trial per prompt is
  the worst case of the per-prompt noise plus the spread of the prompts' difficulties).

:func:`complete` is the batched KV-cache decoding loop; it takes any module whose ``forward``
accepts ``input_ids``/``attention_mask``/``position_ids`` and a cache and returns ``.logits``
(a Hugging Face causal LM, with or without adapters injected), so it evaluates whatever wrapping
the learner trains. :class:`HeldOutEvaluator` runs the protocol and returns an
:class:`EvalResult`. The grader is a callable (the task's verifier lives with the task).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policy.draw import draw_tokens, sample_uniforms
from policy.sampling import sample_seed
from policy.scoring import cache_kwarg

__all__ = [
    "Completion",
    "EvalItem",
    "EvalResult",
    "HeldOutEvaluator",
    "complete",
    "eval_seed",
    "wilson_interval",
]

#: z of a two-sided 95% normal interval
Z95 = 1.959963984540054


def wilson_interval(successes: float, trials: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / trials`` (``successes`` may be
    fractional: a mean of per-prompt rates times ``trials``); ``(0, 1)`` for no trials."""
    if trials <= 0:
        return 0.0, 1.0
    if not 0.0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, {trials}], got {successes}")
    p = successes / trials
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_seed(prompt_id: str) -> int:
    """Seed of the pass@1 samples of held-out prompt ``prompt_id`` (63-bit, the same at every
    version); sample ``j`` is drawn at :func:`policy.sampling.sample_seed` ``(seed, j)``."""
    digest = hashlib.blake2b(f"rollout-swarm/eval/{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class EvalItem:
    """One held-out prompt: its id, its rendered token ids and the reference answer."""

    prompt_id: str
    prompt_ids: tuple[int, ...]
    answer: str


@dataclass(frozen=True)
class Completion:
    """A decoded completion: its tokens (the stop token included) and whether a stop token
    ended it (False: it ran into ``max_new_tokens``)."""

    token_ids: list[int]
    finished: bool


def _base_module(model: Any) -> Any:
    """The module whose ``forward`` names the cache keyword (a peft wrapper passes it on)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _last_logits(
    model: Any, cache: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Logits ``[B, V]`` of the next token of each row (one forward through the KV cache)."""
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
        **cache,
    ).logits  # fmt: skip
    last: torch.Tensor = logits[:, -1, :]
    return last


@torch.inference_mode()
def complete(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    seeds: Sequence[int] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_rows: int = 32,
    should_stop: Callable[[], bool] | None = None,
) -> list[Completion]:
    """Decode one completion per prompt: greedy when ``seeds`` is None, else the seeded
    inverse-CDF draw of the processed distribution at ``seeds[i]``'s uniforms (the nodes'
    sampling rule). Batches of at most ``batch_rows`` rows, left-padded,
    ``position_ids = cumsum(mask) − 1``, one KV cache per batch; finished rows leave the batch
    once half of it is done. ``should_stop`` is asked between batches: when it says True the
    rest is not decoded (the result is then shorter than ``prompts``)."""
    from transformers import DynamicCache

    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if any(not p for p in prompts):
        raise ValueError("every prompt must have at least one token")
    device = next(model.parameters()).device
    cache_kw = cache_kwarg(_base_module(model))
    config = getattr(_base_module(model), "config", None)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    out: list[Completion] = []
    for start in range(0, len(prompts), max(1, batch_rows)):
        if should_stop is not None and should_stop():
            break
        batch = [list(p) for p in prompts[start : start + batch_rows]]
        rows = len(batch)
        width = max(len(p) for p in batch)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=config)
        uniforms = None
        if seeds is not None:
            uniforms = torch.stack(
                [sample_uniforms(s, max_new_tokens) for s in seeds[start : start + rows]]
            ).to(device)
        logits = _last_logits(model, {cache_kw: cache}, ids, mask, pos)
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
        finished = torch.zeros((rows,), dtype=torch.bool, device=device)
        live = torch.arange(rows, device=device)  # original row of each batch row
        done = torch.zeros((rows,), dtype=torch.bool, device=device)
        next_pos = mask.sum(-1)
        for t in range(max_new_tokens):
            if uniforms is None:
                tok = logits.float().argmax(-1)
            else:
                tok, _ = draw_tokens(
                    logits, uniforms.index_select(0, live)[:, t],
                    temperature=temperature, top_p=top_p, top_k=top_k,
                )  # fmt: skip
            tokens[live, t] = tok
            hit = torch.isin(tok, stops) & ~done
            if bool(hit.any()):
                lengths[live[hit]] = t + 1
                finished[live[hit]] = True
                done = done | hit
            n_done = int(done.sum())
            if t == max_new_tokens - 1 or n_done == len(live):
                break
            if n_done and 2 * n_done >= len(live):
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live, tok, mask, next_pos, done = (
                    live[keep],
                    tok[keep],
                    mask[keep],
                    next_pos[keep],
                    done[keep],
                )
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            logits = _last_logits(
                model, {cache_kw: cache}, tok.unsqueeze(1), mask, next_pos.unsqueeze(1)
            )
            next_pos = next_pos + 1
        tok_list, len_list = tokens.cpu().tolist(), lengths.cpu().tolist()
        fin_list = finished.cpu().tolist()
        out.extend(Completion(tok_list[i][: len_list[i]], bool(fin_list[i])) for i in range(rows))
    return out


@dataclass(frozen=True)
class EvalResult:
    """One held-out evaluation of one version (see the module docstring for the protocol)."""

    version: int
    #: learner steps done when the weights were taken (None: not known)
    step: int | None
    prompts: int
    greedy_correct: int
    greedy_acc: float
    greedy_lo: float
    greedy_hi: float
    #: samples per prompt of pass@1 (0: not measured; pass@1 fields are then None)
    samples: int
    pass1: float | None
    pass1_lo: float | None
    pass1_hi: float | None
    #: the processed distribution pass@1 sampled from
    temperature: float
    #: wall seconds of the evaluation (decoding and grading)
    eval_s: float
    #: completion tokens decoded (greedy and sampled)
    tokens: int
    #: greedy completions that ended at a stop token (not at max_new_tokens)
    greedy_finished_frac: float

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl line of this evaluation (``"record": "eval"``)."""
        return {
            "record": "eval", "version": self.version, "step": self.step,
            "eval_prompts": self.prompts, "eval_samples": self.samples,
            "eval_greedy_correct": self.greedy_correct, "eval_greedy_acc": self.greedy_acc,
            "eval_greedy_lo": self.greedy_lo, "eval_greedy_hi": self.greedy_hi,
            "eval_pass1": self.pass1, "eval_pass1_lo": self.pass1_lo,
            "eval_pass1_hi": self.pass1_hi, "eval_temperature": self.temperature,
            "eval_s": round(self.eval_s, 3), "eval_tokens": self.tokens,
            "eval_greedy_finished_frac": self.greedy_finished_frac,
        }  # fmt: skip


class EvalInterrupted(RuntimeError):
    """The evaluation was asked to stop before it finished (its result would be partial)."""


class HeldOutEvaluator:
    """Scores a model on a fixed held-out set (see the module docstring).

    ``grade(answer, completion_text)`` says whether a completion is right (the task's
    verifier); ``decode`` turns completion token ids into text (the policy's tokenizer)."""

    def __init__(
        self,
        items: Sequence[EvalItem],
        grade: Callable[[str, str], bool],
        decode: Callable[[list[int]], str],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        pad_id: int,
        samples: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        batch_rows: int = 32,
    ) -> None:
        if not items:
            raise ValueError("the held-out set is empty")
        if len({it.prompt_id for it in items}) != len(items):
            raise ValueError("held-out prompt ids must be unique")
        if samples < 0:
            raise ValueError(f"eval samples must be >= 0, got {samples}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not stop_ids:
            raise ValueError("the stop set is empty: no completion could end")
        self.items = list(items)
        self.grade = grade
        self.decode = decode
        self.max_new_tokens = max_new_tokens
        self.stop_ids = tuple(stop_ids)
        self.pad_id = pad_id
        self.samples = samples
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.batch_rows = batch_rows

    def evaluate(
        self,
        model: Any,
        version: int,
        *,
        step: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> EvalResult:
        """Greedy accuracy and pass@1 of ``model`` (see the module docstring); raises
        :class:`EvalInterrupted` when ``should_stop`` ends it early."""
        t0 = time.monotonic()
        prompts = [it.prompt_ids for it in self.items]
        common = {
            "max_new_tokens": self.max_new_tokens, "stop_ids": self.stop_ids,
            "pad_id": self.pad_id, "batch_rows": self.batch_rows, "should_stop": should_stop,
        }  # fmt: skip
        greedy = complete(model, prompts, **common)  # type: ignore[arg-type]
        if len(greedy) < len(prompts):
            raise EvalInterrupted(f"evaluation of v{version} stopped")
        right = [self._right(it, c) for it, c in zip(self.items, greedy, strict=True)]
        tokens = sum(len(c.token_ids) for c in greedy)
        n = len(self.items)
        k = sum(right)
        lo, hi = wilson_interval(k, n)
        pass1 = p_lo = p_hi = None
        if self.samples:
            rows = [it.prompt_ids for it in self.items for _ in range(self.samples)]
            seeds = [
                sample_seed(eval_seed(it.prompt_id), j)
                for it in self.items
                for j in range(self.samples)
            ]
            sampled = complete(
                model, rows, seeds=seeds, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, **common,  # type: ignore[arg-type]
            )  # fmt: skip
            if len(sampled) < len(rows):
                raise EvalInterrupted(f"evaluation of v{version} stopped")
            tokens += sum(len(c.token_ids) for c in sampled)
            rates = []
            for i, it in enumerate(self.items):
                group = sampled[i * self.samples : (i + 1) * self.samples]
                rates.append(sum(self._right(it, c) for c in group) / self.samples)
            pass1 = sum(rates) / n
            p_lo, p_hi = wilson_interval(pass1 * n, n)
        return EvalResult(
            version=version, step=step, prompts=n, greedy_correct=k, greedy_acc=k / n,
            greedy_lo=lo, greedy_hi=hi, samples=self.samples, pass1=pass1, pass1_lo=p_lo,
            pass1_hi=p_hi, temperature=self.temperature, eval_s=time.monotonic() - t0,
            tokens=tokens,
            greedy_finished_frac=sum(c.finished for c in greedy) / n,
        )  # fmt: skip

    def _right(self, item: EvalItem, completion: Completion) -> bool:
        return bool(self.grade(item.answer, self.decode(completion.token_ids)))
