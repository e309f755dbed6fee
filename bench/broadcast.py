"""Benchmark: star vs peer-assisted checkpoint broadcast with real peers on 127.0.0.1.

Every peer (the seed and N receivers) is a separate process (``swarm.peerproc``) with the same
upload cap B (token bucket). A checkpoint of M bytes is broadcast to N = 1, 2, 4, 8 receivers,
first *star* (receivers only download from the seed and do not relay) then *peer-assisted*
(receivers relay verified chunks at once). We report the time until the last receiver holds a
verified copy and its ratio to the physical limit M/B. Process start-up is excluded (receivers
start, report READY, and only then get GO).

    python bench/broadcast.py                  # M = 64 MiB, B = 10 MiB/s, N = 1 2 4 8
    python bench/broadcast.py --cap-mib 20 --size-mib 64 --ns 1 2 4 8

Writes the table and docs/broadcast.png into docs/benchmarks.md between
``<!-- bench:broadcast:start -->`` and ``<!-- bench:broadcast:end -->`` (only that section).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import markers, write_section  # noqa: E402

MIB = 1 << 20
START, END = markers("broadcast")


async def run(args: argparse.Namespace) -> list[dict[str, float | int | str]]:
    from protocol.identity import Identity
    from protocol.manifest import build_manifest, sign_manifest
    from swarm.chunks import ChunkStore
    from swarm.peerproc import PeerProcess
    from swarm.testing import start_loopback_peer

    size, cap = int(args.size_mib * MIB), args.cap_mib * MIB
    files = {"model.safetensors": os.urandom(size)}
    coord = Identity.generate()
    tmp = Path(tempfile.mkdtemp(prefix="bench-broadcast-"))
    runs = [(mode, n) for mode in args.modes for n in args.ns]
    seed_store = ChunkStore(tmp / "seed", keep_versions=len(runs))
    now = time.time()
    for version in range(1, len(runs) + 1):  # a fresh version per run: no stale holder records
        manifest, chunks = build_manifest(
            files,
            version=version,
            parent_version=None,
            model_config_hash="00",
            tokenizer_hash="00",
            created_at=now,
            expires_at=now + 86400,
            chunk_size=int(args.chunk_kib * 1024),
        )
        seed_store.seed(sign_manifest(manifest, coord, now), manifest, chunks)
    n_chunks = len(chunks)
    del chunks
    boot_peer = await start_loopback_peer()
    boot = await boot_peer.visible_maddrs()
    common = ["--coordinator-key", coord.public_key.hex(), "--upload-rate", str(cap)]
    for maddr in boot:
        common += ["--bootstrap", maddr]
    seed = PeerProcess(["--store", str(tmp / "seed"), *common], log_path=str(tmp / "seed.log"))
    seed_id = await seed.start()
    rows: list[dict[str, float | int | str]] = []
    try:
        for version, (mode, n) in enumerate(runs, start=1):
            procs = []
            for i in range(n):
                extra = ["--no-relay"] if mode == "star" else []
                d = tmp / f"v{version}-r{i}"
                argv = ["--store", str(d), "--seed", seed_id, "--version", str(version)]
                argv.extend(common)
                argv.extend(extra)
                procs.append(PeerProcess(argv, log_path=str(tmp / f"v{version}-r{i}.log")))
            await asyncio.gather(*(p.start() for p in procs))
            await asyncio.sleep(1.0)  # let DHT routing settle after the joins
            t0 = time.time()
            for p in procs:
                p.go()
            try:
                limit = args.timeout or 2 * n * size / cap + 30
                await asyncio.wait_for(asyncio.gather(*(p.wait_done() for p in procs)), limit)
            except TimeoutError:
                stuck = [(p.peer_id[-8:], p.progress) for p in procs if p.done_at is None]
                for p in procs:
                    if p.done_at is None:
                        p.dump_tasks()
                await asyncio.sleep(2.0)
                args.keep = True  # keep the peer logs for the post-mortem
                msg = f"{mode} N={n}: timed out; stuck: {stuck}; logs: {tmp}"
                raise RuntimeError(msg) from None
            errors = [p.error for p in procs if p.error]
            if errors:
                raise RuntimeError(f"{mode} N={n}: {errors[0]}")
            t_last = max(p.done_at or 0.0 for p in procs) - t0
            ideal = size / cap
            row: dict[str, float | int | str] = {
                "mode": mode,
                "n": n,
                "t_last": t_last,
                "ratio": t_last / ideal,
            }
            from_seed = sum(int(p.stats.get("sources", {}).get(seed_id, 0)) for p in procs)  # type: ignore[union-attr]
            row["seed_copies"] = from_seed / n_chunks
            rows.append(row)
            print(
                f"{mode:5s} N={n}: last receiver after {t_last:6.2f} s"
                f" = {t_last / ideal:5.2f} x M/B"
                f"  (seed uploaded {from_seed / n_chunks:.2f} copies)",
                flush=True,
            )
            if args.verbose:
                for p in procs:
                    src = p.stats.get("sources", {})
                    assert isinstance(src, dict)
                    print(
                        f"    {p.peer_id[-6:]} done +{(p.done_at or 0) - t0:5.2f} s, "
                        f"{src.get(seed_id, 0)} chunks from the seed, {sum(src.values())} total"
                    )
            await asyncio.gather(*(p.close() for p in procs))
            for i in range(n):
                for path in (tmp / f"v{version}-r{i}").rglob("*.bin"):
                    path.unlink()
    finally:
        await seed.close()
        await boot_peer.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def write_report(rows: list[dict[str, float | int | str]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ideal = args.size_mib / args.cap_mib
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("star", "o-"), ("peer", "s-")):
        pts = [(int(r["n"]), float(r["t_last"])) for r in rows if r["mode"] == mode]
        label = "star (seed only)" if mode == "star" else "peer-assisted"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ns = sorted({int(r["n"]) for r in rows})
    ax.plot(ns, [n * ideal for n in ns], ":", color="gray", label="N·M/B (star model)")
    ax.axhline(ideal, ls="--", color="black", label="M/B (seed limit)")
    ax.set_xlabel("receivers N")
    ax.set_ylabel("time to last receiver (s)")
    ax.set_title(f"broadcast of {args.size_mib:g} MiB, every uplink {args.cap_mib:g} MiB/s")
    ax.set_xticks(ns)
    ax.legend()
    fig.tight_layout()
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    fig.savefig(docs / "broadcast.png", dpi=120)

    lines = [
        START,
        "## Checkpoint broadcast: star vs peer-assisted (`bench/broadcast.py`)",
        "",
        f"M = {args.size_mib:g} MiB checkpoint, {args.chunk_kib:g} KiB chunks, every peer's upload "
        f"capped at B = {args.cap_mib:g} MiB/s (token bucket), M/B = {ideal:.2f} s. Seed and "
        "receivers are separate processes on 127.0.0.1 (libp2p streams via p2pd); time is from GO "
        f"to the last receiver holding a verified copy. Machine: {os.cpu_count()} CPU cores.",
        "",
        "| N | star: t_last (s) | star / (M/B) | peer-assisted: t_last (s) | peer / (M/B) |",
        "|---|---|---|---|---|",
    ]
    for n in ns:
        s = next(r for r in rows if r["mode"] == "star" and r["n"] == n)
        p = next(r for r in rows if r["mode"] == "peer" and r["n"] == n)
        lines.append(
            f"| {n} | {float(s['t_last']):.2f} | {float(s['ratio']):.2f} | "
            f"{float(p['t_last']):.2f} | {float(p['ratio']):.2f} |"
        )
    lines += (
        ["", "![broadcast](broadcast.png)", "", args.note, END]
        if args.note
        else ["", "![broadcast](broadcast.png)", END]
    )
    write_section("broadcast", "\n".join(lines), docs / "benchmarks.md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=float, default=64.0, help="checkpoint size M (MiB)")
    p.add_argument("--cap-mib", type=float, default=10.0, help="upload cap B per peer (MiB/s)")
    p.add_argument("--chunk-kib", type=float, default=1024.0, help="chunk size (KiB)")
    p.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8], help="receiver counts")
    p.add_argument("--modes", nargs="+", default=["star", "peer"], choices=["star", "peer"])
    p.add_argument("--timeout", type=float, default=0.0, help="per-run timeout, s (0: 2·N·M/B+30)")
    p.add_argument("--note", default="", help="free text appended to the report section")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (stores, peer logs)")
    p.add_argument("--verbose", action="store_true", help="per-receiver figures")
    p.add_argument("--no-report", action="store_true", help="print only, leave docs/ alone")
    args = p.parse_args()
    rows = asyncio.run(run(args))
    if not args.no_report:
        write_report(rows, args)
        print("wrote docs/benchmarks.md (bench:broadcast section) and docs/broadcast.png")


if __name__ == "__main__":
    main()
