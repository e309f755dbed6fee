"""Did the coordinator's spot checks accept both a vLLM node and an hf node? (bench/vllm_gpu.sh)

Reads the verdict receipts of a finished ``swarm demo --node-backend vllm --node-backend hf``
run (``RUN/coordinator/state.sqlite``, table ``receipts``, kind ``verdict``; each names the
backend the lease was held to, ``held_to = backend/dtype``) and prints, per backend, the
verdicts, the spot-checked submissions and the passed spot checks. Exit 0 when each of
``--backends`` has at least ``--min-checked`` passed spot checks and every verdict of every
backend is ``ack``; else 1 with the refusals printed.

Usage: ``python bench/vllm_swarm_check.py RUN_DIR [--backends vllm,hf] [--min-checked 8]``.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def verdicts(db: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT body FROM receipts WHERE kind = 'verdict' ORDER BY seq")
        return [json.loads(bytes(r[0]).decode()) for r in rows]
    finally:
        conn.close()


def summarise(entries: list[dict[str, Any]], backends: list[str], min_checked: int) -> int:
    codes: dict[str, Counter[str]] = defaultdict(Counter)
    checked: Counter[str] = Counter()
    passed: Counter[str] = Counter()
    refusals: list[str] = []
    for e in entries:
        backend = str(e.get("held_to", "?")).split("/", 1)[0]
        codes[backend][e["verdict"]] += 1
        checks = e.get("checks") or {}
        checked[backend] += bool(checks.get("spot_checked"))
        passed[backend] += checks.get("passed") is True
        if e["verdict"] != "ack":
            refusals.append(f"{backend} lease {e['lease']}: {e['verdict']}: {e['detail']}")
    ok = not refusals
    for b in backends:
        print(f"{b}: verdicts {dict(codes[b])}, spot-checked {checked[b]}, passed {passed[b]}")
        if passed[b] < min_checked:
            print(f"  FAIL: fewer than {min_checked} passed spot checks for {b}")
            ok = False
    for line in refusals:
        print(f"  REFUSED {line}")
    print(f"PASS: {', '.join(backends)} accepted" if ok else "FAIL")
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--backends", default="vllm,hf")
    p.add_argument("--min-checked", type=int, default=8)
    a = p.parse_args()
    db = a.run_dir / "coordinator" / "state.sqlite"
    if not db.is_file():
        sys.exit(f"{db} does not exist: give the run directory of a finished swarm demo")
    sys.exit(summarise(verdicts(db), a.backends.split(","), a.min_checked))


if __name__ == "__main__":
    main()
