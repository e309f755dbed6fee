"""A tiny *real-looking* Hugging Face model directory, built locally in a second (tests, trials).

:func:`build_tiny_chat_model` writes what a pretrained instruct model directory has, at toy size:

* a byte-level BPE tokenizer trained right here with ``tokenizers`` (a few hundred tokens), with
  ChatML special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and a ChatML chat
  template (the shape of SmolLM2's and Qwen's);
* a Llama-architecture model with random weights (hidden 32, 2 layers);
* the EOS conventions of real instruct models: the tokenizer's EOS is ``<|im_end|>``,
  ``config.json`` names it too, and ``generation_config.json`` lists *two* ids
  (``[<|im_end|>, <|endoftext|>]``): a sample may legitimately end on either.

Nothing is downloaded. Used by the tests that run the whole swarm on a real tokenizer.

:func:`rounding_twins` gives a model and "the same model on another CPU": logits ~1e-6 apart with
exact ties that the twin breaks, the case where top-k/top-p keep different token sets.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

__all__ = ["CHATML_TEMPLATE", "build_tiny_chat_model", "rounding_twins"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _corpus() -> list[str]:
    """Text the tokenizer is trained on: short word problems, digits, LaTeX answers."""
    names, things = ("Sam", "Mia", "Tom", "Ana"), ("apples", "marbles", "books", "coins")
    lines = []
    for i in range(200):
        a, b, n, t = i % 20 + 1, i % 7 + 1, names[i % 4], things[(i // 4) % 4]
        lines.append(f"{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?")
        lines.append(f"Put the final answer in \\boxed{{}}. The answer is \\boxed{{{a + b}}}.")
    lines += ["system user assistant You are a helpful assistant."] * 5
    return lines


def build_tiny_chat_model(
    path: Path,
    *,
    vocab_size: int = 400,
    hidden_size: int = 32,
    layers: int = 2,
    max_positions: int = 512,
    seed: int = 0,
) -> Path:
    """Write the tiny model directory (see the module docstring) into ``path``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(path)
    endoftext, im_end = bpe.token_to_id("<|endoftext|>"), bpe.token_to_id("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.save_pretrained(path, safe_serialization=True)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, endoftext], gen  # the list-valued convention
    return path


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
