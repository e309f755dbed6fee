"""Prompt rendering: a task's question text -> the prompt token ids a lease carries.

Two templates (``PromptTemplate``):

* ``"chat"``  -- the tokenizer's own chat template (``apply_chat_template``): an optional system
  message, the question as the user message, and the opening of the assistant turn
  (``add_generation_prompt``). What instruct models were trained on.
* ``"plain"`` -- the question as is, with the tokenizer's usual special tokens (``<bos> text >``
  for the embedded character tokenizer). For base models and the embedded model.
* ``"auto"``  -- ``"chat"`` when the tokenizer has a chat template, else ``"plain"``.

The coordinator renders every prompt (a node never sees the question text, only token ids), so
the rendering is one place; the trainer trains on the token ids the lease carried.
"""

from __future__ import annotations

from typing import Literal

from policy.model import Tokenizer

__all__ = ["PromptRenderer", "PromptTemplate", "resolve_template"]

PromptTemplate = Literal["auto", "chat", "plain"]


def resolve_template(template: PromptTemplate, tokenizer: Tokenizer) -> Literal["chat", "plain"]:
    """The template in effect; ``"chat"`` with a tokenizer that has none is a ValueError."""
    if template == "auto":
        return "chat" if tokenizer.has_chat_template else "plain"
    if template == "chat" and not tokenizer.has_chat_template:
        raise ValueError(
            'prompt.template = "chat" but the model\'s tokenizer has no chat template; use '
            '"plain" (base models, the embedded model) or a model with a chat template'
        )
    return template


class PromptRenderer:
    """Renders question texts with one template and system prompt (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        template: PromptTemplate = "auto",
        system_prompt: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = resolve_template(template, tokenizer)
        if system_prompt is not None and self.template == "plain":
            raise ValueError(
                "prompt.system_prompt needs the chat template; the plain template has no system "
                "message (unset system_prompt or use a model with a chat template)"
            )
        self.system_prompt = system_prompt

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat messages of a question (system message first when configured)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*out, {"role": "user", "content": text}]

    def render(self, text: str) -> list[int]:
        """Prompt token ids of ``text`` (ValueError when the vocabulary cannot write it)."""
        if self.template == "chat":
            return self.tokenizer.render_chat(self.messages(text))
        return self.tokenizer.encode_prompt(text)
