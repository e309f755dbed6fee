"""Coordinator config: the example file loads and documents every option; rules name the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import coordinator
from coordinator.config import CoordinatorConfig, load_config, parse_config
from coordinator.errors import ConfigError

EXAMPLE = Path(coordinator.__file__).parent / "coordinator.example.toml"


def test_example_loads_and_matches_defaults() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg == CoordinatorConfig()
    assert cfg.kappa == cfg.staleness_bound - 1


def _fields(model: type, prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        assert field.description, f"{prefix}{name} has no description"
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            out |= _fields(sub, f"{prefix}{name}.")
        else:
            out.add(name)
    return out


def test_example_documents_every_option() -> None:
    text = EXAMPLE.read_text()
    for name in _fields(CoordinatorConfig):
        if name == "tolerances":
            continue  # a table of tables, shown by its entries
        assert re.search(rf"^#?\s*{name} = ", text, re.M), f"{name} missing from the example"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"staleness_bound": 4, "publish_every": 4}, "publish_every"),
        ({"reputation": {"ban_base_s": 100, "ban_max_s": 10}}, "ban_max_s"),
        ({"leases": {"min_deadline_s": 1.0}}, "min_deadline_s"),
        ({"group_size": 0}, "group_size"),
        ({"bogus": 1}, "bogus"),
        (
            {"intake": {"tolerances": {"float32": {"metric": "max_abs", "threshold": 1}}}},
            "tolerances",
        ),
    ],
)
def test_bad_values_fail_naming_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_config(data)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
