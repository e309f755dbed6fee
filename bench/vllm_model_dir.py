"""Write a local HF model directory for the GPU swarm check (no hub access on the GPU host).

A random Qwen2 (``policy.model.scaled_config``: hidden 512, 8 layers, the embedded character
vocabulary) plus a character-level fast tokenizer over the same symbols (``tokenizers`` WordLevel,
EOS ``<eos>``, a minimal chat template), so ``swarm demo --model-dir DIR`` can run an hf node
and a vLLM node on the same weights. Usage: ``python bench/vllm_model_dir.py DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policy.model import CharTokenizer, scaled_config  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


def write(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    chars = CharTokenizer()
    vocab = {s: i for i, s in enumerate(chars.symbols)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    cfg = scaled_config(hidden_size=512, layers=8, heads=8, max_positions=512)
    model = AutoModelForCausalLM.from_config(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/vllm_model_dir.py DIR")
    write(Path(sys.argv[1]))
