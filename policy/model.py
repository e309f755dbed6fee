"""The policy model: the embedded default (tiny Qwen2 + char tokenizer) and local HF checkpoints.

Everything that turns a :class:`ModelSpec` into weights and a tokenizer lives here, so the node, the
coordinator's log-prob re-scorer and the trainer build the *same* network from the same spec.

The embedded default (DESIGN.md §10): a Qwen2-architecture causal LM built from a config with random
weights (hidden 64, 2 layers, 4 heads, about 133k parameters) and a 26-symbol character tokenizer.
Nothing is downloaded: a real checkpoint comes from a local directory (``ModelSpec(path=...)``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch/transformers are imported lazily: `swarm --help` must stay instant.
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

EMBEDDED = "embedded"


class Tokenizer(Protocol):
    """The small slice of a tokenizer that the swarm needs."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def pad_token_id(self) -> int: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def fingerprint(self) -> str: ...


class CharTokenizer:
    """Character tokenizer of the embedded default: ``<pad> <bos> <eos> > a..v`` (26 symbols).

    A prompt ``"abc"`` encodes as ``[<bos>, a, b, c, >]``; the model answers with characters then
    ``<eos>``. Unknown characters are an error, never silently dropped.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", ">")
    LETTERS = "abcdefghijklmnopqrstuv"

    def __init__(self) -> None:
        self.symbols: list[str] = [*self.SPECIALS, *self.LETTERS]
        self._index = {s: i for i, s in enumerate(self.symbols)}

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    @property
    def sep_token_id(self) -> int:
        return 3

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(
                f"character {exc.args[0]!r} is not in the embedded vocabulary"
            ) from exc

    def encode_prompt(self, text: str) -> list[int]:
        """``<bos> text >``: the separator tells the model to start answering."""
        return [self.bos_token_id, *self.encode(text), self.sep_token_id]

    def decode(self, ids: list[int]) -> str:
        """Characters of ``ids``; special tokens are dropped."""
        return "".join(self.symbols[i] for i in ids if i >= len(self.SPECIALS))

    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256("\n".join(self.symbols).encode()).hexdigest()


class HFTokenizer:
    """Adapter around a Hugging Face tokenizer loaded from a local directory."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"tokenizer in {path} has no eos_token_id; set it in tokenizer_config.json"
            )
        self._path = path

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(pad if pad is not None else self._tok.eos_token_id)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(p.name for p in self._path.iterdir() if "token" in p.name):
            digest.update(name.encode() + b"\0" + (self._path / name).read_bytes())
        return "sha256:" + digest.hexdigest()


@dataclass(frozen=True)
class ModelSpec:
    """Which policy: ``path=None`` is the embedded default, else a local HF model directory."""

    path: str | None = None
    #: dtype the weights are held in on this process ("float32", "bfloat16", "float16").
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return EMBEDDED if self.path is None else str(self.path)


def tiny_config() -> PretrainedConfig:
    """Config of the embedded default model (Qwen2 architecture, random weights)."""
    from transformers import Qwen2Config

    tok = CharTokenizer()
    return Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
    )


def scaled_config(
    *, hidden_size: int = 256, layers: int = 4, heads: int = 4, max_positions: int = 128
) -> PretrainedConfig:
    """A bigger Qwen2 config over the embedded tokenizer (benchmarks and GPU tests); intermediate
    size is 4 × hidden as usual."""
    from transformers import Qwen2Config

    base = tiny_config().to_dict()
    for key in ("layer_types", "transformers_version", "model_type", "architectures"):
        base.pop(key, None)
    base.update(
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
    )
    return Qwen2Config(**base)


def config_fingerprint(config: PretrainedConfig) -> str:
    """Stable hash of a model config (goes into checkpoint manifests)."""
    data = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        data.pop(volatile, None)
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    if spec.path is None:
        return CharTokenizer()
    return HFTokenizer(_model_dir(spec))


def load_config(spec: ModelSpec) -> PretrainedConfig:
    if spec.path is None:
        return tiny_config()
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.from_pretrained(
        str(_model_dir(spec)), local_files_only=True
    )
    return config


def build_model(spec: ModelSpec, *, seed: int = 0) -> PreTrainedModel:
    """The policy network in eval mode: random init (seeded) for the embedded default, else the
    weights from the local directory."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec.dtype)
    if spec.path is None:
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            tiny_config(), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(_model_dir(spec)), local_files_only=True, dtype=dtype
        )
    model.eval()  # type: ignore[no-untyped-call]
    return model


def load_weights(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a published state_dict into ``model`` in place; every parameter must be present."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit the model: missing={missing} unexpected={unexpected}"
        )


def _model_dir(spec: ModelSpec) -> Path:
    assert spec.path is not None
    path = Path(spec.path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a model directory (no config.json); pass a local HF model dir"
        )
    return path
