"""Writing the small documents other processes poll for (``coordinator.json``, ``node.json``, ...).

A reader that waits for such a file to exist and then parses it must never see it half written:
:func:`atomic_write_text` writes a temporary file in the same folder and renames it into place
(``os.replace`` is atomic on POSIX and Windows within one file system), so the path holds either
the previous document or the whole new one. A write that fails leaves the previous one and no
temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text"]


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` (UTF-8) in one rename."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
