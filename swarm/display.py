"""Human-readable figures shared by ``swarm inspect``, the demo and the status document.

Pure functions, no imports beyond the wire types: short fingerprints that stay unique within a
view (like git's abbreviated hashes), hardware in one phrase, rounded numbers with units.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.identity import FINGERPRINT_PREFIX
from protocol.messages import CapabilityAdvert

__all__ = [
    "counts_line",
    "describe_hardware",
    "fmt_bytes",
    "fmt_duration",
    "fmt_number",
    "fmt_rate",
    "short_ids",
]

#: Shortest abbreviation of a fingerprint's body (base32: 5 bits a character, 30 bits here).
MIN_SHORT_ID = 6


def short_ids(fingerprints: Iterable[str], min_len: int = MIN_SHORT_ID) -> dict[str, str]:
    """``{fingerprint: shortest prefix of its body, at least min_len characters, that no other
    fingerprint of the set shares}``; the ``ed25519:`` prefix is dropped."""
    bodies = {fp: fp.removeprefix(FINGERPRINT_PREFIX) for fp in fingerprints}
    distinct = sorted(set(bodies.values()))
    need: dict[str, int] = {}
    for a, b in itertools.pairwise(distinct):  # neighbours share the longest prefix
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        need[a] = max(need.get(a, 0), common + 1)
        need[b] = max(need.get(b, 0), common + 1)
    return {fp: body[: max(min_len, need.get(body, 0))] for fp, body in bodies.items()}


def fmt_bytes(n: float | None) -> str:
    """``24 GiB``, ``512 MiB``, ``3.5 KiB`` (binary units)."""
    if n is None or not math.isfinite(n):
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if value >= 10 or unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_number(value: Any, digits: int = 3) -> str:
    """A number rounded to ``digits`` significant figures, thousands separated; ``–`` for none.

    ``0.2422889139328864`` -> ``0.242``; ``5179.2`` -> ``5,179``; ``True`` -> ``yes``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return str(value)
    if not math.isfinite(value):
        return "–"
    if isinstance(value, int) or (abs(value) >= 10 ** (digits - 1) and value == int(value)):
        return f"{int(value):,}"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def fmt_rate(value: Any, unit: str) -> str:
    """``5,179 tok/s``; ``–`` when unknown."""
    text = fmt_number(value)
    return text if text == "–" else f"{text} {unit}"


def fmt_duration(seconds: Any) -> str:
    """``42s``, ``3m05s``, ``2h10m``; ``–`` when unknown."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return "–"
    if not math.isfinite(seconds):
        return "–"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def describe_hardware(advert: CapabilityAdvert) -> str:
    """``2× NVIDIA H100 80GB HBM3 (80 GiB)`` or ``CPU 8 cores, 31 GiB``; GPUs first."""
    if advert.gpus:
        return ", ".join(f"{g.count}× {g.name} ({fmt_bytes(g.memory_bytes)})" for g in advert.gpus)
    cpu = advert.cpu
    if cpu is None:
        return "–"
    return f"CPU {cpu.cores} cores, {fmt_bytes(cpu.memory_bytes)}"


def counts_line(counts: Mapping[str, Any]) -> str:
    """``bad_signature 3 · stale_version 1`` (largest first); ``none`` when empty."""
    items = [(str(k), v) for k, v in counts.items() if isinstance(v, int | float) and v]
    if not items:
        return "none"
    items.sort(key=lambda kv: (-float(kv[1]), kv[0]))
    return " · ".join(f"{k} {fmt_number(v)}" for k, v in items)
