"""Misbehaving node modes for ``swarm demo --byzantine K`` (and tests of the verification).

Selected by ``NodeConfig.misbehave`` (empty by default: an honest node never loads this module).
Each mode rewrites an honest :class:`~protocol.messages.RolloutSubmission` just before it is
signed; the coordinator must catch every one of them (DESIGN.md §7):

================  ==============================================================  =================
mode              what the node does                                              caught by
================  ==============================================================  =================
forge_logprobs    replaces every behaviour log-prob by a random finite value      spot check
                  in [-6, -0.01) (cheap "generation" without the model)           (logprob_mismatch)
inflate_reward    replaces each completion by the correct answer computed          spot check: the
                  locally (reverse task), keeping the real sample's log-probs     log-probs do not
                  (a reward-hacking attempt)                                       fit the tokens
wrong_version     claims a policy version other than the lease's                  version checks /
                  (v - 1, or v + 1 for v = 0)                                      spot check
oov_tokens        puts a token id ``vocab_size`` (out of vocabulary) in every     token_out_of_vocab
                  sample
greedy            decodes greedily (top-k 1) instead of sampling, then reports    spot check:
                  the honest log-probs of the lease's sampling distribution       sampling_mismatch
                  (``hf`` backend only; :func:`greedy_generate`)                  (seeded replay,
                                                                                  z-statistic)
================  ==============================================================  =================

``greedy`` acts at generation time (the worker calls :func:`greedy_generate` instead of the
backend's ``generate``); the others rewrite the finished submission (:func:`misbehave`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from node.backends.base import GenerationRequest, SampleOut, SamplingConfig
from node.config import MISBEHAVIOURS
from policy.model import Tokenizer
from protocol.messages import (
    GroupResult,
    Lease,
    RolloutSubmission,
    Sample,
    pack_logprobs,
    pack_tokens,
    unpack_logprobs,
    unpack_tokens,
)

__all__ = ["MISBEHAVIOURS", "greedy_generate", "local_answer", "misbehave", "report_logprobs_of"]


def local_answer(prompt_ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """The correct completion of the embedded reverse task: reversed prompt text, then EOS."""
    text = tokenizer.decode(list(prompt_ids))  # special tokens (<bos>, '>') are dropped
    wrapper = set(tokenizer.encode_prompt(""))  # what encode_prompt adds around the text
    body = [t for t in tokenizer.encode_prompt(text[::-1]) if t not in wrapper]
    return [*body, tokenizer.eos_token_id]


def misbehave(
    modes: Sequence[str],
    sub: RolloutSubmission,
    lease: Lease,
    *,
    vocab_size: int,
    tokenizer: Tokenizer | None,
    rng: random.Random,
) -> RolloutSubmission:
    """Apply ``modes`` (in the order of :data:`MISBEHAVIOURS`) to an honest submission."""
    unknown = set(modes) - set(MISBEHAVIOURS)
    if unknown:
        raise ValueError(f"unknown misbehaviour {sorted(unknown)}; use {', '.join(MISBEHAVIOURS)}")
    prompts = {p.prompt_id: unpack_tokens(p.token_ids) for p in lease.prompts}
    groups = list(sub.groups)
    if "inflate_reward" in modes:
        if tokenizer is None:
            raise ValueError("inflate_reward needs the tokenizer of the embedded model")
        groups = [_inflate(g, prompts[g.prompt_id], tokenizer) for g in groups]
    if "forge_logprobs" in modes:
        groups = [_map_samples(g, lambda s: _forge(s, rng)) for g in groups]
    if "oov_tokens" in modes:
        groups = [_map_samples(g, lambda s: _oov(s, vocab_size, rng)) for g in groups]
    version = sub.policy_version
    if "wrong_version" in modes:
        version = version - 1 if version > 0 else version + 1
    return msgspec.structs.replace(sub, groups=groups, policy_version=version)


def greedy_generate(
    backend: Any, requests: list[GenerationRequest], sampling: SamplingConfig
) -> list[list[SampleOut]]:
    """Decode ``requests`` greedily but report each token's log-prob under ``sampling`` (what a
    careful cheat saving on sampling would send): the log-prob check alone cannot tell."""
    model = getattr(backend, "model", None)
    if model is None:
        raise ValueError("the greedy misbehaviour needs the hf backend (a model to re-score with)")
    outs: list[list[SampleOut]] = backend.generate(requests, dataclasses.replace(sampling, top_k=1))
    report_logprobs_of(model, requests, outs, sampling, pad_id=getattr(backend, "pad_token_id", 0))
    return outs


def report_logprobs_of(
    model: Any,
    requests: list[GenerationRequest],
    outs: list[list[SampleOut]],
    sampling: SamplingConfig,
    *,
    pad_id: int = 0,
) -> None:
    """Overwrite the log-probs of ``outs`` (however they were drawn) with those of ``model``'s
    ``sampling`` distribution: the honest-looking log-probs a cheat would report."""
    from policy.scoring import score_logprobs

    for req, group in zip(requests, outs, strict=True):
        comps = [o.token_ids for o in group]
        lps = score_logprobs(
            model,
            [req.prompt_token_ids] * len(comps),
            comps,
            sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            pad_id=pad_id,
        )
        for out, lp in zip(group, lps, strict=True):
            out.logprobs[:] = lp


def _map_samples(group: GroupResult, fn: Callable[[Sample], Sample]) -> GroupResult:
    return msgspec.structs.replace(group, samples=[fn(s) for s in group.samples])


def _inflate(group: GroupResult, prompt: list[int], tokenizer: Tokenizer) -> GroupResult:
    answer = local_answer(prompt, tokenizer)

    def fake(sample: Sample) -> Sample:
        real = unpack_logprobs(sample.logprobs) or [-1.0]
        lps = (real * (len(answer) // len(real) + 1))[: len(answer)]
        return msgspec.structs.replace(
            sample,
            token_ids=pack_tokens(answer),
            logprobs=pack_logprobs(lps),
            finish_reason="eos",
        )

    return _map_samples(group, fake)


def _forge(sample: Sample, rng: random.Random) -> Sample:
    n = len(unpack_tokens(sample.token_ids))
    return msgspec.structs.replace(
        sample, logprobs=pack_logprobs([rng.uniform(-6.0, -0.01) for _ in range(n)])
    )


def _oov(sample: Sample, vocab_size: int, rng: random.Random) -> Sample:
    toks = unpack_tokens(sample.token_ids)
    if not toks:
        return sample
    i = rng.randrange(len(toks))
    toks[i] = vocab_size
    return msgspec.structs.replace(sample, token_ids=pack_tokens(toks))
