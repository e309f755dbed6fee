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
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch/transformers are imported lazily: `swarm --help` must stay instant.
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

EMBEDDED = "embedded"
#: positions of the embedded default model (its config's ``max_position_embeddings``)
EMBEDDED_MAX_POSITIONS = 64


class Tokenizer(Protocol):
    """The small slice of a tokenizer that the swarm needs."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def pad_token_id(self) -> int: ...
    @property
    def has_chat_template(self) -> bool: ...
    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def render_chat(self, messages: list[dict[str, str]]) -> list[int]: ...
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

    @property
    def has_chat_template(self) -> bool:
        return False

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        raise ValueError(
            "the embedded character tokenizer has no chat template; use the plain prompt template"
        )

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
                f"model_path {path}: the tokenizer has no EOS token, so no sample could end; set "
                '"eos_token" in its tokenizer_config.json'
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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, text: str) -> list[int]:
        """The plain template: ``text`` with the tokenizer's own special tokens (BOS, ...)."""
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """``messages`` through the tokenizer's chat template, ending with the assistant turn's
        opening (the text is rendered, then encoded without adding special tokens again)."""
        if not self.has_chat_template:
            raise ValueError(f"tokenizer in {self._path} has no chat template")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(str(text))

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
        max_position_embeddings=EMBEDDED_MAX_POSITIONS,
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


#: One model construction at a time in this process. transformers' ``from_pretrained`` is not
#: thread-safe: it builds the model under process-wide state (empty-weight initialisation, the
#: default dtype), and two loads on two threads (the coordinator preloads a new version while a
#: re-score loads another) came out with ``lm_head.weight`` left on the meta device, untied from
#: the embedding: every log-prob of that version was -inf and honest nodes were banned for
#: ``logprob_mismatch`` (transformers 5.25; tests/unit/test_model_build_threads.py).
_BUILD_LOCK = threading.Lock()


def build_model(spec: ModelSpec, *, seed: int = 0) -> PreTrainedModel:
    """The policy network in eval mode: random init (seeded) for the embedded default, else the
    weights from the local directory. Safe to call from several threads (one build at a time)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec.dtype)
    with _BUILD_LOCK:
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


def _eos_ids(value: object) -> set[int]:
    """EOS ids of a config field that may hold an int, a list of ints or nothing."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def model_stop_ids(spec: ModelSpec, tokenizer: Tokenizer | None = None) -> tuple[int, ...]:
    """The model's EOS ids, sorted: the tokenizer's EOS plus ``eos_token_id`` of ``config.json``
    and of ``generation_config.json`` (each an int or a list; instruct models often list several).

    The coordinator puts these (plus its configured extra stop tokens) in every lease; nodes and
    the intake use exactly the lease's set (docs/protocol.md, "stop set")."""
    tok = tokenizer if tokenizer is not None else load_tokenizer(spec)
    ids = {int(tok.eos_token_id)}
    if spec.path is not None:
        model_dir = _model_dir(spec)
        for name in ("config.json", "generation_config.json"):
            path = model_dir / name
            if path.is_file():
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError) as exc:
                    raise ValueError(f"model_path {model_dir}: cannot read {name}: {exc}") from exc
                if isinstance(data, dict):
                    ids |= _eos_ids(data.get("eos_token_id"))
                    text_cfg = data.get("text_config")
                    if isinstance(text_cfg, dict):
                        ids |= _eos_ids(text_cfg.get("eos_token_id"))
    # the embedded default's config names the character tokenizer's EOS (tiny_config): no more
    return tuple(sorted(ids))


def model_vocab_size(spec: ModelSpec) -> int:
    """Rows of the model's embedding (``config.vocab_size``); token ids must be below it."""
    if spec.path is None:  # no transformers import for the embedded default (swarm demo start-up)
        return CharTokenizer().vocab_size
    return int(load_config(spec).vocab_size)


def max_positions(spec: ModelSpec) -> int | None:
    """Positions the model can attend over (``max_position_embeddings``); None when unknown."""
    if spec.path is None:
        return EMBEDDED_MAX_POSITIONS
    config = load_config(spec)
    value = getattr(config, "max_position_embeddings", None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _model_dir(spec: ModelSpec) -> Path:
    assert spec.path is not None
    path = Path(spec.path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a model directory (no config.json); pass a local HF model dir"
        )
    return path
