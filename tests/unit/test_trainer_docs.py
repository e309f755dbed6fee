"""docs/trainer.md's knob table says what ``TrainerConfig()`` holds: every documented default is
the field's default (issue 36: the table gave ``target_step_kl`` 0.02 where the config has None)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from trainer.config import TrainerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def _knob_rows() -> list[tuple[list[str], str]]:
    """(field names, default cell) of each row of the table under "## Knobs"."""
    text = DOC.read_text()
    section = text[text.index("## Knobs") :]
    section = section[: section.index("\n#", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return rows


def _parse(cell: str) -> Any:
    """A documented default: ``None → what it means`` is None; true/false; a number; a word."""
    word = cell.split("→")[0].strip().strip("`").strip('"')
    if word == "None":
        return None
    if word in ("true", "false"):
        return word == "true"
    try:
        return float(word)
    except ValueError:
        return word


def _same(documented: Any, actual: Any) -> bool:
    if documented is None or isinstance(documented, bool):
        return documented is actual
    if isinstance(documented, float):
        ok = isinstance(actual, int | float) and not isinstance(actual, bool)
        return ok and math.isclose(documented, float(actual), rel_tol=1e-12)
    return documented == str(actual)


def test_the_knob_table_parses() -> None:
    rows = _knob_rows()
    assert len(rows) > 40  # the table is there and read whole
    assert (["target_step_kl"], "None") in rows


@pytest.mark.parametrize(("names", "cell"), _knob_rows(), ids=lambda v: str(v))
def test_each_documented_default_is_trainer_configs(names: list[str], cell: str) -> None:
    fields = TrainerConfig.model_fields
    parts = [p.strip() for p in cell.split(",")]
    values = parts if len(parts) == len(names) else [cell] * len(names)
    defaults = TrainerConfig()
    for name, value in zip(names, values, strict=True):
        if "*" in name:  # `warn_*`: the bounds, documented under "Stability monitors"
            continue
        assert name in fields, f"docs/trainer.md documents {name}, which TrainerConfig lacks"
        documented, actual = _parse(value), getattr(defaults, name)
        assert _same(documented, actual), f"{name}: docs/trainer.md says {value}, config {actual!r}"
