"""docs/configuration.md, generated from the typed configs: every TOML key of the coordinator, the
trainer and the node, with its type, range, default and the field's description.

    python -m swarm.shell.config_reference          print the page
    python -m swarm.shell.config_reference --write  rewrite docs/configuration.md
    python -m swarm.shell.config_reference --check  exit 1 (saying so) when the page is stale

``tests/unit/test_config_reference.py`` fails when the page and the configs differ. The configs
import neither torch nor hivemind, so neither does this module.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["DOC_PATH", "render"]

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_INTRO = """\
# Configuration reference

Every key of the three TOML files, generated from the typed configs (pydantic models with
`extra="forbid"`: an unknown key is refused at load, naming it) by
`python -m swarm.shell.config_reference --write`; `tests/unit/test_config_reference.py` fails when
this page and the code differ. The checked-in examples (`coordinator/coordinator.example.toml`,
`trainer/trainer.example.toml`, `node/node.example.toml`) show typical values; command-line flags
(`swarm ... --help`) override some keys. A key left out takes its default; "unset" means the
setting is off or derived, as its description says.
"""

#: (title, config class path, TOML file, what the file is read by, note on "none")
_FILES = (
    (
        "Coordinator",
        "coordinator.config:CoordinatorConfig",
        "coordinator.toml",
        "`swarm coordinator launch --config` (and `swarm coordinator plan`)",
        "Keys are grouped in tables (`[intake]`, `[leases]`, ...); top-level keys come first.",
    ),
    (
        "Trainer",
        "trainer.config:TrainerConfig",
        "trainer.toml",
        "`swarm trainer run --config`",
        'Flat keys. TOML has no null: the string `"none"` sets a key whose unset value means '
        'off (e.g. `target_step_kl = "none"`), as `swarm demo --trainer-set KEY=none` does.',
    ),
    (
        "Node",
        "node.config:NodeConfig",
        "node.toml",
        "`swarm node run --config`",
        "Flat keys; the flags of `swarm node run` override them.",
    ),
)


def _load(path: str) -> type[BaseModel]:
    module, _, name = path.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert isinstance(cls, type) and issubclass(cls, BaseModel)
    return cls


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _type(t: Any) -> str:
    """A TOML-minded name of an annotation."""
    origin = get_origin(t)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in get_args(t))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        inner = " or ".join(_type(a) for a in args)
        return f"{inner}, optional" if len(args) < len(get_args(t)) else inner
    if origin in (list, tuple):
        item = next(iter(get_args(t)), Any)
        return f"array of {_type(item)}"
    if origin is dict:
        _, value = get_args(t)
        return f"table of {value.__name__ if _is_model(value) else _type(value)}"
    names = {bool: "bool", int: "int", float: "float", str: "string", Path: "path (string)"}
    if t in names:
        return names[t]
    return getattr(t, "__name__", str(t))


def _range(info: FieldInfo) -> str:
    parts = []
    for m in info.metadata:
        for cls, attr, sign in (
            (at.Gt, "gt", ">"), (at.Ge, "ge", "≥"), (at.Lt, "lt", "<"), (at.Le, "le", "≤")
        ):  # fmt: skip
            if isinstance(m, cls):
                parts.append(f"{sign} {getattr(m, attr)!r}")
    return ", ".join(parts)


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str | Path):
        return f"`{json.dumps(str(value))}`"
    if isinstance(value, int | float):
        return f"`{value!r}`"
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(json.dumps(v) for v in value) + "]`"
    return f"`{value}`"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _doc_line(cls: type[BaseModel]) -> str:
    return _cell((cls.__doc__ or "").strip().split("\n\n")[0])


def _table(cls: type[BaseModel], prefix: str, sub: list[tuple[str, FieldInfo]]) -> Iterator[str]:
    """One markdown table of the plain keys of ``cls``; its sections and tables of models go to
    ``sub`` as (dotted name, field)."""
    yield "| key | type | range | default | meaning |"
    yield "|---|---|---|---|---|"
    for name, info in cls.model_fields.items():
        t = info.annotation
        if _is_model(t):
            sub.append((prefix + name, info))
            continue
        default = info.get_default(call_default_factory=True)
        if get_origin(t) is dict and _is_model(get_args(t)[1]):
            sub.append((prefix + name, info))
            keys = ", ".join(f"`{json.dumps(k)}`" for k in default)
            default_text = f"{len(default)} entries: {keys} (below)"
        else:
            default_text = _toml(default)
        row = (f"`{prefix}{name}`", _type(t), _range(info), default_text, _cell(info.description))
        yield "| " + " | ".join(row) + " |"


def _entries(dotted: str, info: FieldInfo) -> Iterator[str]:
    """A table of models (``intake.tolerances``): its entry's keys, then the defaults."""
    model = get_args(info.annotation)[1]
    default = info.get_default(call_default_factory=True)
    yield f'#### `[{dotted}."KEY"]` — {_doc_line(model)}'
    yield ""
    yield from _table(model, "", [])
    yield ""
    yield f"Default entries of `{dotted}`:"
    yield ""
    names = list(model.model_fields)
    yield "| KEY | " + " | ".join(f"`{n}`" for n in names) + " |"
    yield "|---" * (len(names) + 1) + "|"
    for key, entry in default.items():
        cells = [_toml(getattr(entry, n)).replace("unset", "—") for n in names]
        yield f"| `{json.dumps(key)}` | " + " | ".join(cells) + " |"


def _file(title: str, cls: type[BaseModel], file: str, reader: str, note: str) -> Iterator[str]:
    yield f"## {title}: `{file}`"
    yield ""
    yield f"Read by {reader}; the model is `{cls.__module__}.{cls.__name__}`. {note}"
    yield ""
    sub: list[tuple[str, FieldInfo]] = []
    yield from _table(cls, "", sub)
    yield ""
    while sub:
        dotted, info = sub.pop(0)
        if _is_model(info.annotation):
            section = info.annotation
            assert isinstance(section, type) and issubclass(section, BaseModel)
            yield f"### `[{dotted}]` — {_doc_line(section)}"
            yield ""
            nested: list[tuple[str, FieldInfo]] = []
            yield from _table(section, dotted + ".", nested)
            yield ""
            sub[:0] = nested
        else:
            yield from _entries(dotted, info)
            yield ""


def render() -> str:
    """The whole page."""
    out = [_INTRO]
    for title, path, file, reader, note in _FILES:
        out.extend(_file(title, _load(path), file, reader, note))
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--write"]:
        DOC_PATH.write_text(text)
        return 0
    if argv == ["--check"]:
        if DOC_PATH.read_text() != text:
            print(
                f"{DOC_PATH} is out of date: run python -m swarm.shell.config_reference --write",
                file=sys.stderr,
            )
            return 1
        return 0
    if argv:
        print("usage: python -m swarm.shell.config_reference [--write | --check]", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
