"""Reading a TOML config file for any process (coordinator, node, trainer), with one-line errors.

Foreign errors (OS, encoding, TOML syntax) are translated here, once; each process wraps
:class:`ConfigFileError` into its own config error type.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """The config file could not be read or parsed; the message says which file and why."""


def read_toml(path: str | Path, *, example: str) -> dict[str, Any]:
    """The parsed TOML mapping of ``path``; ``example`` is the file to copy when it is missing."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigFileError(f"{p}: no such config file; copy {example}") from exc
    except IsADirectoryError as exc:
        raise ConfigFileError(f"{p}: is a directory; give the TOML config file itself") from exc
    except OSError as exc:  # permissions, I/O error, ...
        raise ConfigFileError(f"{p}: cannot read config file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{p}: not a text file (not UTF-8): is it the TOML config?") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{p}: not valid TOML: {exc}") from exc
