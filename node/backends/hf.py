"""``hf`` backend: transformers on CPU or GPU with a batched KV-cache sampling loop.

Why not ``model.generate``: we need the log-prob of every sampled token under the exact
(processed) sampling distribution, per-sample random streams that do not depend on the batch,
and termination bookkeeping; a hand-written loop does all three with no extra forward work and
no logits processors to keep in sync (DESIGN §10: generate's top_k=50 default, output_scores vs
raw logits).

Loop: requests are left-padded and prefilled once per prompt (not once per sample); the cache is
then expanded to the ``n`` samples of each request. Every step draws each row's token with
:func:`policy.draw.draw_tokens` (the swarm's sampling rule: fp32 processed distribution of the
last logits, inverse-CDF at the sample's uniform for this position, from
:func:`policy.draw.sample_uniforms` of its :func:`~policy.sampling.sample_seed`), records its
log-prob, and feeds it back with ``position_ids = cumsum(mask) - 1``. A sample ends at the first
stop/EOS token (kept) or at ``max_new_tokens``; the loop ends when every row has. Finished rows
are dropped from the batch when at least half of the live rows are done, so long tails do not pay
for finished samples.

LoRA versions (docs/protocol.md §8.6): the base model is loaded once; each adapter is held in a
:class:`policy.lora.AdapterSet` (up to S + 1 of them) and a lease switches to its version's
adapter without reloading the base (``lora_mode``: ``"merged"`` into the weights, recomputed from
a kept copy of the base weights, or ``"unmerged"`` forward hooks; docs/models.md compares them).

Threads: torch's process-wide thread setting is respected, never changed here.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from node.backends.base import (
    GenerationRequest,
    InferenceBackend,
    SampleOut,
    SamplingConfig,
    sample_seed,
)
from policy.draw import SAMPLING_RULE, draw_tokens, sample_uniforms
from policy.lora import AdapterSet, ApplyMode, check_adapter
from policy.model import ModelSpec, build_model, load_weights
from policy.scoring import cache_kwarg

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """Device for ``device``: "auto" is cuda if available else cpu; others go to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    """EOS ids from the model config and its generation config (either may hold a list)."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


class HFBackend(InferenceBackend):
    """transformers model + batched KV-cache sampling (see module docstring)."""

    name = "hf"
    sampling_rule = SAMPLING_RULE

    def __init__(
        self,
        spec: ModelSpec | None = None,
        *,
        device: str = "auto",
        model: PreTrainedModel | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_rows: int = 1024,
        pad_token_id: int | None = None,
        lora_mode: ApplyMode = "merged",
        lora_base: str | None = None,
    ) -> None:
        """``model`` (optional) replaces ``build_model(spec)`` (tests, benchmarks);
        ``eos_token_ids`` overrides the model's EOS ids (``()`` = only ``stop_token_ids`` stop,
        for benchmarks); ``max_batch_rows`` bounds the samples decoded in one batch;
        ``lora_mode`` how adapters are applied; ``lora_base`` the base fingerprint of ``model``
        (default: :func:`policy.lora.base_fingerprint` of ``spec``, computed when first asked)."""
        self.spec = spec or ModelSpec()
        self.device = resolve_device(device)
        if model is None:
            model = build_model(self.spec)
        # transformers types .to() oddly (a decorated method); the model moves in place
        self.model: Any = cast(Any, model).to(self.device).eval()
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_token_ids = (
            tuple(eos_token_ids) if eos_token_ids is not None else model_eos_ids(self.model)
        )
        pad = pad_token_id if pad_token_id is not None else self.model.config.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.max_batch_rows = max(1, max_batch_rows)
        self.loaded_version = None
        self._cache_kw = cache_kwarg(self.model)
        self.lora_mode: ApplyMode = lora_mode
        self._lora_base = lora_base
        #: the adapters held over the base (None: no LoRA version loaded yet)
        self.adapters: AdapterSet | None = None
        #: the weights are the base model's as built (no full version loaded over them)
        self._base_intact = True
        #: times the base model was built again (a LoRA version after a full one)
        self.base_reloads = 0

    # ------------------------------------------------------------------ weights
    def load_state_dict(
        self,
        version: int,
        state_dict: Mapping[str, Any],
        changed: Collection[str] | None = None,
    ) -> None:
        if self.adapters is not None:  # a full version after LoRA ones: the weights are its own
            self.adapters.activate(None)
            self.adapters = None
            changed = None
        with torch.no_grad():
            if changed is None or self.loaded_version is None:
                load_weights(self.model, dict(state_dict))
            else:
                self._update(state_dict, changed)
        self._base_intact = False
        self.loaded_version = version

    # ------------------------------------------------------------------ LoRA
    def base_fingerprint(self) -> str | None:
        if self._lora_base is None:
            from policy.lora import base_fingerprint

            self._lora_base = base_fingerprint(self.spec)
        return self._lora_base

    def holds_adapter(self, version: int) -> bool:
        return self.adapters is not None and version in self.adapters

    def load_adapter(
        self, version: int, tensors: Mapping[str, Any], *, rank: int, alpha: float, keep: int
    ) -> None:
        check_adapter(self.model, tensors, rank)  # a misfit changes nothing (LoraError)
        if not self._base_intact:  # full versions were loaded over the base: build it again
            log.warning("LoRA v%d after full versions: building the base model again", version)
            self.loaded_version = None  # the weights are in flux until the adapter is active
            with torch.no_grad():
                load_weights(self.model, build_model(self.spec).state_dict())
            self._base_intact = True
            self.base_reloads += 1
        if self.adapters is None:
            self.adapters = AdapterSet(self.model, keep=keep, mode=self.lora_mode)
        self.adapters.keep = max(1, keep)
        self.adapters.add(version, tensors, rank=rank, alpha=alpha)
        self.activate_adapter(version)

    def activate_adapter(self, version: int) -> None:
        if self.adapters is None or version not in self.adapters:
            raise KeyError(f"LoRA v{version} is not held by this backend")
        self.adapters.activate(version)
        self.loaded_version = version

    def _update(self, state_dict: Mapping[str, Any], changed: Collection[str]) -> None:
        """Copy only the ``changed`` tensors into the model's parameters and buffers."""
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets |= dict(self.model.named_buffers(remove_duplicate=False))
        if unknown := [n for n in changed if n not in targets or n not in state_dict]:
            raise ValueError(f"checkpoint does not fit the model: unexpected={sorted(unknown)}")
        for name in changed:
            targets[name].copy_(state_dict[name])

    # ------------------------------------------------------------------ sampling
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        self.check_requests(requests, sampling)
        if self.max_positions:
            longest = max((len(r.prompt_token_ids) for r in requests), default=0)
            if longest + sampling.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} "
                    f"exceeds the model's {self.max_positions} positions; lower max_new_tokens"
                )
        out: list[list[SampleOut]] = []
        chunk: list[GenerationRequest] = []
        rows = 0
        for req in requests:
            if chunk and rows + req.n > self.max_batch_rows:
                out.extend(self._generate_chunk(chunk, sampling))
                chunk, rows = [], 0
            chunk.append(req)
            rows += req.n
        if chunk:
            out.extend(self._generate_chunk(chunk, sampling))
        return out

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        ).logits
        last: torch.Tensor = logits[:, -1, :]
        return last

    @torch.inference_mode()
    def _generate_chunk(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        from transformers import DynamicCache

        dev = self.device
        steps = sampling.max_new_tokens
        # ---- prefill once per prompt (left padded), then expand to n rows per request
        width = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, req in enumerate(requests):
            ids[i, width - len(req.prompt_token_ids) :] = torch.tensor(req.prompt_token_ids)
            mask[i, width - len(req.prompt_token_ids) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, pos, cache)

        counts = torch.tensor([r.n for r in requests])
        expand = torch.repeat_interleave(torch.arange(len(requests)), counts).to(dev)
        if len(expand) != len(requests) or bool((counts != 1).any()):
            cache.batch_select_indices(expand)
            logits = logits.index_select(0, expand)
            mask = mask.index_select(0, expand)
        n_rows = int(counts.sum())

        # ---- per-sample uniforms: independent of batch composition and of n
        uniforms = torch.empty((n_rows, steps), dtype=torch.float32)
        row = 0
        for req in requests:
            for j in range(req.n):
                uniforms[row] = sample_uniforms(sample_seed(req.seed, j), steps)
                row += 1
        uniforms = uniforms.to(dev)

        stop_ids = torch.tensor(sorted(self.stop_set(sampling)), dtype=torch.long, device=dev)
        tokens = torch.full((n_rows, steps), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((n_rows, steps), dtype=torch.float32, device=dev)
        lengths = torch.full((n_rows,), steps, dtype=torch.long, device=dev)
        stopped = torch.zeros((n_rows,), dtype=torch.bool, device=dev)

        live = torch.arange(n_rows, device=dev)  # original row of each batch row
        next_pos = mask.sum(-1)  # position of the next token of each batch row
        done = torch.zeros((n_rows,), dtype=torch.bool, device=dev)  # per batch row
        for t in range(steps):
            tok, tok_logp = draw_tokens(
                logits,
                uniforms.index_select(0, live)[:, t],
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
            )
            tokens[live, t] = tok
            logps[live, t] = tok_logp
            hit = torch.isin(tok, stop_ids) & ~done
            if bool(hit.any()):
                rows_hit = live[hit]
                lengths[rows_hit] = t + 1
                stopped[rows_hit] = True
                done = done | hit
            if t == steps - 1:
                break
            n_done = int(done.sum())
            if n_done == len(live):
                break
            if n_done and 2 * n_done >= len(live):  # drop finished rows from the batch
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live, tok, mask, next_pos = live[keep], tok[keep], mask[keep], next_pos[keep]
                done = done[keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            logits = self._forward(tok.unsqueeze(1), mask, next_pos.unsqueeze(1), cache)
            next_pos = next_pos + 1

        tok_list = tokens.cpu().tolist()
        lp_list = logps.cpu().tolist()
        len_list = lengths.cpu().tolist()
        stop_list = stopped.cpu().tolist()
        out: list[list[SampleOut]] = []
        row = 0
        for req in requests:
            group = []
            for _ in range(req.n):
                n = len_list[row]
                group.append(
                    SampleOut(
                        token_ids=tok_list[row][:n],
                        logprobs=lp_list[row][:n],
                        finish_reason="stop" if stop_list[row] else "length",
                    )
                )
                row += 1
            out.append(group)
        return out
