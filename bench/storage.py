"""Database growth at the 10,000-node rate, with and without pruning consumed rollouts.

Not a test (``tests/unit/test_coord_retention.py`` runs :func:`grow` at a toy scale). A real
:class:`~coordinator.store.Store` on a file (WAL, as the coordinator runs it) receives accepted
rollouts at ``--rate`` per simulated second, ``--tokens`` completion tokens each (token ids and
log-probs: 8 bytes a token, what a 2,048-token rollout stores), in one transaction per simulated
second; the learner consumes everything accepted ``--lag`` seconds earlier (its cursor, as the
``consumed`` receipts record it); :class:`~coordinator.retention.Retention` runs on every
simulated tick with a ``--retention`` window. The clock is simulated, so an hour of traffic takes
the time SQLite needs to write it, not an hour; what is measured is the file's size (database +
WAL) every ``--report`` simulated seconds, and the write rate this disk sustains.

    python bench/storage.py                                 # 512 rollouts/s, 2,048 tokens, 20 min
    python bench/storage.py --rate 512 --minutes 60 --retention 600
    python bench/storage.py --no-prune                      # the same traffic, nothing deleted
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator.records import RolloutRow  # noqa: E402
from coordinator.retention import Retention  # noqa: E402
from coordinator.store import Store  # noqa: E402


def db_bytes(path: Path) -> int:
    """The database file plus its WAL."""
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def grow(
    path: Path,
    *,
    rate: int,
    tokens: int,
    seconds: int,
    retention_s: float | None,
    lag_s: float = 30.0,
    report_s: int = 60,
) -> list[tuple[int, int, int]]:
    """Write ``rate`` rollouts a simulated second for ``seconds``; every ``report_s`` seconds
    record (simulated second, database bytes, rows stored). ``retention_s`` None: no pruning."""
    now = [1_800_000_000.0]
    store = Store(path)
    retention = (
        Retention(store, lambda: now[0], retention_s=retention_s, interval_s=1.0, batch=10 * rate)
        if retention_s is not None
        else None
    )
    blob_tokens = b"\x01\x00\x00\x00" * tokens
    blob_lps = b"\x00\x00\x80\xbf" * tokens
    seq_at: list[int] = []  # highest seq at the end of each simulated second
    out = []
    for t in range(seconds):
        rows = [
            RolloutRow(
                f"L{t}-{i // 8}",
                t * rate + i,
                i % 8,
                b"k" * 32,
                1,
                f"p{t}-{i // 8}",
                b"\x02\x00\x00\x00" * 64,
                blob_tokens,
                blob_lps,
                "eos",
                1.0,
                True,
                now[0],
                8,
            )
            for i in range(rate)
        ]
        store.insert_rollouts(rows)
        seq_at.append(store.max_rollout_seq())
        consumed = t - int(lag_s)
        if consumed >= 0:
            store.set_meta("learner_cursor", str(seq_at[consumed]))
        if retention is not None:
            retention.tick()
        now[0] += 1.0
        if (t + 1) % report_s == 0:
            stored = int(store.query("SELECT COUNT(*) FROM rollouts")[0][0])
            out.append((t + 1, db_bytes(path), stored))
    store.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=512, help="rollouts accepted per second")
    ap.add_argument("--tokens", type=int, default=2048, help="completion tokens per rollout")
    ap.add_argument("--minutes", type=float, default=20.0, help="simulated minutes of traffic")
    ap.add_argument("--retention", type=float, default=300.0, help="audit window (seconds)")
    ap.add_argument("--lag", type=float, default=30.0, help="learner lag behind intake (s)")
    ap.add_argument("--report", type=int, default=60, help="report every this many sim seconds")
    ap.add_argument("--no-prune", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-storage-") as tmp:
        path = Path(tmp) / "state.sqlite"
        t0, c0 = time.perf_counter(), time.process_time()
        rows = grow(
            path, rate=args.rate, tokens=args.tokens, seconds=int(args.minutes * 60),
            retention_s=None if args.no_prune else args.retention, lag_s=args.lag,
            report_s=args.report,
        )  # fmt: skip
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"{args.rate} rollouts/s x {args.tokens} tokens, "
        + ("no pruning" if args.no_prune else f"retention {args.retention:g} s")
        + f"; {wall:.0f} s wall, {cpu:.0f} s CPU, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| simulated minute | database + WAL (MB) | rows stored | "
        "MB per simulated hour since the last row |"
    )
    print("|---:|---:|---:|---:|")
    prev: tuple[int, int, int] | None = None
    for t, size, stored in rows:
        slope = "" if prev is None else f"{(size - prev[1]) / 1e6 * 3600 / (t - prev[0]):,.0f}"
        print(f"| {t / 60:g} | {size / 1e6:,.1f} | {stored:,} | {slope} |")
        prev = (t, size, stored)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
