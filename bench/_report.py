"""Shared by the bench scripts: replace one script's section of docs/benchmarks.md.

Each script owns the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``;
other sections are left alone, and the file is re-read right before writing (scripts may run
concurrently).
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def markers(section: str) -> tuple[str, str]:
    return f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"


def write_section(section: str, text: str, path: Path = DOC) -> None:
    """Replace (or append) ``section`` with ``text`` (with or without its markers)."""
    start, end = markers(section)
    body = text.strip()
    if not body.startswith(start):
        body = f"{start}\n{body}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(current):
        updated = pattern.sub(lambda _m: body, current)
    else:
        updated = current.rstrip("\n") + "\n\n" + body + "\n"
    path.write_text(updated)
