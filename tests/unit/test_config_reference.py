"""docs/configuration.md is the configs' key reference (issue 36, item 15): generated from the
pydantic models by ``python -m swarm.shell.config_reference --write``; it must equal what the code
renders now, name every key of every model, and every key of the checked-in example files."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from coordinator.config import CoordinatorConfig
from node.config import NodeConfig
from swarm.shell.config_reference import DOC_PATH, render
from trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_is_what_the_configs_render() -> None:
    assert DOC_PATH == ROOT / "docs" / "configuration.md"
    assert DOC_PATH.read_text() == render(), (
        "docs/configuration.md is out of date: run .venv/bin/python -m "
        "swarm.shell.config_reference --write"
    )


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        t = info.annotation
        if isinstance(t, type) and issubclass(t, BaseModel):
            out |= _keys(t, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def _documented() -> set[str]:
    return set(re.findall(r"^\| `([a-z0-9_.]+)` \|", DOC_PATH.read_text(), re.M))


def test_every_key_of_every_config_has_a_row() -> None:
    documented = _documented()
    for model in (CoordinatorConfig, TrainerConfig, NodeConfig):
        missing = _keys(model) - documented
        assert not missing, f"{model.__name__}: no row for {sorted(missing)}"
    assert "intake.spot_check_fraction" in documented and "lr" in documented


def _flat(data: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        if isinstance(value, dict) and key != "tolerances":
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_every_key_of_the_example_files_is_documented() -> None:
    documented = _documented()
    for example in ("coordinator/coordinator.example.toml", "trainer/trainer.example.toml",
                    "node/node.example.toml"):  # fmt: skip
        keys = _flat(tomllib.loads((ROOT / example).read_text()))
        assert keys and not keys - documented, f"{example}: {sorted(keys - documented)}"


def test_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    """``--check`` (what a contributor runs after changing a config) tells a stale page apart."""
    ok = subprocess.run(
        [sys.executable, "-m", "swarm.shell.config_reference", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    page = render()
    stale = page.replace("| `lr` |", "| `learning_rate` |")
    assert stale != page
    from swarm.shell import config_reference

    original = config_reference.DOC_PATH
    try:
        config_reference.DOC_PATH = tmp_path / "configuration.md"
        config_reference.DOC_PATH.write_text(stale)
        assert config_reference.main(["--check"]) == 1
        config_reference.DOC_PATH.write_text(page)
        assert config_reference.main(["--check"]) == 0
    finally:
        config_reference.DOC_PATH = original
