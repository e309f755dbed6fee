"""Refuse impossible set-ups at start, with one line naming the setting, not in a loop later.

:func:`check_setup` is what the coordinator (``swarm coordinator launch``) and ``swarm demo`` run
before anything starts; the trainer runs :func:`check_positions` against the coordinator's figures
(it learns them from ``rswarm/status``). Each failure is a :class:`SetupError` whose message names
the setting to change. What is checked:

* the stop set: not empty, at most ``MAX_STOP_TOKENS`` ids (what a lease carries), every id inside
  the model's vocabulary (a tokenizer without EOS is
  refused when it is loaded, :class:`policy.model.HFTokenizer`);
* the task can be written in the model's vocabulary: the first ``sample`` prompts render (a
  character the tokenizer does not know is an error, never dropped), their ids are inside the
  model's embedding, and each reference answer encodes and decodes back to itself (a model whose
  vocabulary cannot write the answer can never earn the reward);
* the longest of those prompts plus ``max_new_tokens`` fits the model's positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policy.model import Tokenizer
from policy.prompts import PromptRenderer

__all__ = ["SetupError", "SetupReport", "check_positions", "check_setup"]

#: Setting names as the coordinator's config spells them (the demo passes its flags instead).
COORDINATOR_NAMES: Mapping[str, str] = {
    "task": "task",
    "model": "model_path",
    "max_new_tokens": "sampling.max_new_tokens",
    "stop": "sampling.stop_token_ids",
    "template": "prompt.template",
}


class SetupError(ValueError):
    """An impossible set-up; the message is one line naming the setting to change."""


class _Problem(Protocol):
    prompt_id: str
    prompt: str
    answer: str


class _Task(Protocol):
    name: str

    def problem(self, index: int) -> Any: ...


@dataclass(frozen=True)
class SetupReport:
    """What the checks measured (the coordinator reports these on ``/status``)."""

    #: longest rendered prompt among the checked ones, in tokens
    longest_prompt: int
    #: prompts checked
    checked: int
    #: the model's positions (None: the config does not say)
    positions: int | None


def check_positions(
    longest_prompt: int,
    max_new_tokens: int,
    positions: int | None,
    *,
    names: Mapping[str, str] = COORDINATOR_NAMES,
) -> None:
    """``longest_prompt + max_new_tokens`` must fit ``positions`` (None: unknown, not checked)."""
    if positions is not None and longest_prompt + max_new_tokens > positions:
        raise SetupError(
            f"{names['max_new_tokens']}={max_new_tokens} plus the longest prompt "
            f"({longest_prompt} tokens) exceeds the model's {positions} positions "
            f"(max_position_embeddings); lower {names['max_new_tokens']} to at most "
            f"{max(0, positions - longest_prompt)} or use shorter prompts"
        )


def check_setup(
    *,
    tokenizer: Tokenizer,
    renderer: PromptRenderer,
    task: _Task,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    vocab_size: int,
    positions: int | None,
    sample: int = 256,
    names: Mapping[str, str] = COORDINATOR_NAMES,
) -> SetupReport:
    """Run every check (see the module docstring); :class:`SetupError` on the first failure."""
    if not stop_token_ids:
        raise SetupError(
            f"{names['model']}: the stop set is empty (no EOS id in the tokenizer, config.json or "
            "generation_config.json), so no sample could end; set eos_token_id"
        )
    from protocol.limits import MAX_STOP_TOKENS

    if len(stop_token_ids) > MAX_STOP_TOKENS:
        raise SetupError(
            f"{names['stop']}: the stop set has {len(stop_token_ids)} ids, a lease carries at most "
            f"{MAX_STOP_TOKENS}; list fewer extra stop tokens"
        )
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise SetupError(
            f"{names['stop']}: stop token {bad[0]} is outside the model's vocabulary "
            f"[0, {vocab_size})"
        )
    count = len(task) if hasattr(task, "__len__") else sample  # type: ignore[arg-type]
    count = max(1, min(sample, count))
    longest = 0
    for index in range(count):
        problem: _Problem = task.problem(index)
        try:
            ids = renderer.render(problem.prompt)
        except ValueError as exc:
            raise SetupError(
                f"{names['task']} {task.name!r} cannot be written in the model's vocabulary: "
                f"prompt {problem.prompt_id}: {exc}; pick a model whose tokenizer covers the task "
                f"({names['model']})"
            ) from exc
        oov = next((t for t in ids if not 0 <= t < vocab_size), None)
        if oov is not None:
            raise SetupError(
                f"{names['model']}: the tokenizer gives token id {oov} for prompt "
                f"{problem.prompt_id}, outside the model's vocabulary [0, {vocab_size}); the "
                "tokenizer does not belong to this model"
            )
        _check_answer(tokenizer, problem, task.name, names)
        longest = max(longest, len(ids))
    check_positions(longest, max_new_tokens, positions, names=names)
    return SetupReport(longest_prompt=longest, checked=count, positions=positions)


def _check_answer(
    tokenizer: Tokenizer, problem: _Problem, task: str, names: Mapping[str, str]
) -> None:
    """The reference answer must be writable: it encodes and decodes back to itself."""
    answer = problem.answer
    try:
        back = tokenizer.decode(tokenizer.encode(answer))
    except ValueError as exc:
        raise SetupError(
            f"{names['task']} {task!r}: the model's vocabulary cannot write the answer "
            f"{answer!r} of {problem.prompt_id} ({exc}); pick another model ({names['model']})"
        ) from exc
    if "".join(back.split()) != "".join(answer.split()):
        raise SetupError(
            f"{names['task']} {task!r}: the model's vocabulary cannot write the answer "
            f"{answer!r} of {problem.prompt_id} (it comes back as {back!r}); pick another model "
            f"({names['model']})"
        )


@dataclass(frozen=True)
class PolicySetup:
    """The policy side of a coordinator, checked: tokenizer, prompt renderer, stop set."""

    tokenizer: Tokenizer
    renderer: PromptRenderer
    #: the lease's stop set: the model's EOS ids plus the configured extra stop tokens
    stop_token_ids: tuple[int, ...]
    report: SetupReport


def prepare(
    spec: Any,
    *,
    task: _Task,
    max_new_tokens: int,
    extra_stop_ids: Sequence[int] = (),
    template: Any = "auto",
    system_prompt: str | None = None,
    names: Mapping[str, str] = COORDINATOR_NAMES,
    sample: int = 256,
) -> PolicySetup:
    """Load the tokenizer of ``spec`` (a :class:`policy.model.ModelSpec`), build the renderer and
    the stop set, and run :func:`check_setup`; every failure is one :class:`SetupError` line."""
    from policy.model import load_tokenizer, max_positions, model_stop_ids, model_vocab_size

    try:
        tokenizer = load_tokenizer(spec)
        stops = tuple(sorted(set(model_stop_ids(spec, tokenizer)) | set(extra_stop_ids)))
        vocab_size = model_vocab_size(spec)
        positions = max_positions(spec)
    except (OSError, ValueError) as exc:
        message = str(exc)
        if not message.startswith(names["model"]):
            message = f"{names['model']} {spec.name!r}: {message}"
        raise SetupError(message) from exc
    try:
        renderer = PromptRenderer(tokenizer, template=template, system_prompt=system_prompt)
    except ValueError as exc:
        raise SetupError(f"{names['template']}: {exc}") from exc
    report = check_setup(
        tokenizer=tokenizer,
        renderer=renderer,
        task=task,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        vocab_size=vocab_size,
        positions=positions,
        sample=sample,
        names=names,
    )
    return PolicySetup(tokenizer, renderer, stops, report)
