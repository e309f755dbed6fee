"""Verification scaled out: re-score throughput of the coordinator alone against verifier processes.

For each setting, one after the other on a quiet machine, a fresh ``swarm coordinator launch``
subprocess (every lease re-scored: spot-check and newcomer rates 1; activation and admission
off), a trainer that publishes v1 and one honest test node in this process:

* ``in-process``: no ``verification.verifier_keys``; the coordinator re-scores on its own thread
  (as before verifier processes existed);
* ``N process(es)``: ``verification.local_verifier = false`` and N ``swarm coordinator verifier``
  subprocesses with listed keys; every re-score is a job one of them takes (``rswarm/vtake``)
  and answers (``rswarm/vdone``).

The node samples ``--leases`` leases of ``--prompts`` prompts x G = ``--group`` samples of up to
``--tokens`` tokens with the ``hf`` backend (untimed, before the clock starts); after a warm-up
lease per verifier (each one's first job calibrates v1's tolerance: 256 honest samples per
accepted precision, once per version and verifier), they are submitted ``--concurrency`` at a
time and the clock stops when every row is in the trainer's feed (a lease drawn for the re-score
is acknowledged at once and its rows released by the verdict). Figures: leases and re-scored
tokens per second of wall time, the coordinator's CPU (its Python process, its ``p2pd`` apart)
and the verifiers' CPU per lease, and the wall time against the in-process setting (a ratio in
one run). Every process sets ``OMP_NUM_THREADS=1``: one core each at most.

Usage: python bench/verifiers.py [--leases 40] [--prompts 4] [--group 8] [--tokens 32]
       [--processes 1 2] [--concurrency 8] [--no-write]
Writes its section of docs/benchmarks.md (between the bench:verifiers markers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from _cpu import tree_cpu  # noqa: E402
from _report import write_section  # noqa: E402
from swarm_harness import (  # noqa: E402
    CoordinatorProc,
    Proc,
    TestNode,
    Trainer,
    coordinator_toml,
    honest_submission,
    launch_coordinator,
    lease_keys,
    until,
)

from protocol.identity import Identity  # noqa: E402
from protocol.messages import Ack, Lease, RolloutSubmission  # noqa: E402

SECTION = "verifiers"


@dataclass
class Run:
    setting: str
    processes: int
    leases: int
    samples: int
    tokens: int  # prompt + completion tokens re-scored (what V counts)
    wall_s: float
    coord_cpu_s: float
    coord_p2pd_s: float
    verifier_cpu_s: float
    v_status: float | None  # V on the coordinator's /status at the end (re-scored tokens/s)


def _tokens(sub: RolloutSubmission, lease: Lease) -> int:
    prompts = {p.prompt_id: len(p.token_ids) // 4 for p in lease.prompts}
    return sum(prompts[g.prompt_id] + len(s.token_ids) // 4 for g in sub.groups for s in g.samples)


async def measure(args: argparse.Namespace, processes: int) -> Run:
    tmp = Path(tempfile.mkdtemp(prefix="verifiers-"))
    trainer_id = Identity.generate()
    keys = []
    for i in range(processes):
        (tmp / f"verifier-{i}").mkdir()
        keys.append(Identity.load_or_create(tmp / f"verifier-{i}" / "verifier.key").fingerprint)
    verification: dict[str, object] = {"admission": False}
    if processes:
        verification |= {"verifier_keys": keys, "local_verifier": False}
    config = coordinator_toml(
        tmp, trainer_id,
        top={"group_size": args.group},
        sampling={"max_new_tokens": args.tokens},
        intake={"spot_check_fraction": 1.0, "new_node_check_rate": 1.0},
        leases={"min_deadline_s": 3600.0, "max_prompts_per_lease": args.prompts,
                "max_active_per_node": 100_000},
        verification=verification,
    )  # fmt: skip
    coord = await launch_coordinator(tmp, config)
    trainer = Trainer(coord, trainer_id, tmp)
    verifiers: list[Proc] = []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifiers-generate")
    try:
        await trainer.start()
        await trainer.publish(1)
        for i in range(processes):
            verifiers.append(Proc(
                ["coordinator", "verifier", "--coordinator", coord.maddr, "--coordinator-key",
                 coord.fingerprint, "--config", str(config), "--state-dir",
                 str(tmp / f"verifier-{i}")],
                tmp / f"verifier-{i}.log",
            ))  # fmt: skip
        node = TestNode(trainer.transport, coord.peer_id)
        await node.register()
        loop = asyncio.get_running_loop()
        warm = max(1, processes)
        work: list[tuple[Lease, RolloutSubmission]] = []
        for _ in range(warm + args.leases):
            lease = await node.lease(args.prompts)
            work.append((lease, await loop.run_in_executor(pool, honest_submission, lease)))

        async def settle(batch: list[tuple[Lease, RolloutSubmission]]) -> None:
            sem = asyncio.Semaphore(args.concurrency)

            async def one(sub: RolloutSubmission) -> None:
                async with sem:
                    verdict = await node.submit(sub)
                    if not isinstance(verdict, Ack):
                        raise SystemExit(f"an honest submission was answered {verdict}")

            await asyncio.gather(*(one(sub) for _, sub in batch))
            want = set().union(*(lease_keys(lease) for lease, _ in batch))
            seen: set[tuple[str, str, int]] = set()
            cursor = 0
            deadline = time.monotonic() + args.timeout
            while not want <= seen:
                rows = await trainer.fetch(cursor)
                seen |= {(r.lease_id, r.prompt_id, r.sample_index) for r in rows}
                cursor = max([cursor, *(r.seq for r in rows)])
                if time.monotonic() > deadline:
                    raise SystemExit(f"{len(want - seen)} rows not released in {args.timeout} s")
                if not rows:
                    await asyncio.sleep(0.1)

        # warm-up: one lease per verifier (each calibrates v1 on its first job), all of it
        # settled before the clock starts
        await settle(work[:warm])
        if processes:
            await until(
                lambda: all(": pass (" in v.text() for v in verifiers),
                "every verifier to have answered a job", args.timeout,
            )  # fmt: skip
        timed = work[warm:]
        pid = coord.proc.popen.pid
        c0 = tree_cpu(pid)
        v0 = [tree_cpu(v.popen.pid)["python"] for v in verifiers]
        t0 = time.monotonic()
        await settle(timed)
        wall = time.monotonic() - t0
        c1 = tree_cpu(pid)
        v1 = [tree_cpu(v.popen.pid)["python"] for v in verifiers]
        await asyncio.sleep(1.5)  # the status document is rebuilt every second
        return Run(
            setting="in-process"
            if not processes
            else f"{processes} process" + ("es" if processes > 1 else ""),
            processes=processes,
            leases=len(timed),
            samples=sum(len(g.samples) for _, s in timed for g in s.groups),
            tokens=sum(_tokens(s, lease) for lease, s in timed),
            wall_s=wall,
            coord_cpu_s=c1["python"] - c0["python"],
            coord_p2pd_s=c1["p2pd"] - c0["p2pd"],
            verifier_cpu_s=sum(b - a for a, b in zip(v0, v1, strict=True)),
            v_status=_v(coord),
        )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for v in verifiers:
            v.stop()
        try:
            await trainer.stop()
        finally:
            coord.proc.stop()


def _v(coord: CoordinatorProc) -> float | None:
    """V on the coordinator's HTTP /status (operator only)."""
    import json
    import urllib.request

    state = coord.state
    url = json.loads((state / "coordinator.json").read_text())["http_url"]
    with urllib.request.urlopen(url + "/status", timeout=5) as resp:
        value = json.loads(resp.read()).get("verify_tokens_per_s")
    return float(value) if value is not None else None


def git_rev() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True
        ).strip()
    return "?"


def report(runs: list[Run], args: argparse.Namespace, load: tuple[float, ...]) -> str:
    base = runs[0]
    lines = [
        f"<!-- bench:{SECTION}:start -->",
        "## Verification scaled out: verifier processes (`bench/verifiers.py`)",
        "",
        f"A `swarm coordinator launch` subprocess re-scoring every lease (rates 1), one honest "
        f"test node; {base.leases} timed leases of {args.prompts} prompts x {args.group} "
        f"samples of <= {args.tokens} tokens on the embedded model, submitted {args.concurrency} "
        "at a time after one warm-up lease per verifier (each verifier's first job calibrates "
        "v1), the clock stopped when every row was in the trainer's feed. Every process "
        f"`OMP_NUM_THREADS=1`. {os.cpu_count()} CPUs shared by everything (coordinator, its "
        f"`p2pd` and DHT process, the verifiers, the node and trainer), load average "
        f"{load[0]:.2f} / {load[1]:.2f} before the runs, Python {platform.python_version()}, "
        f"commit {git_rev()}.",
        "",
        "| setting | wall s | leases/s | re-scored tokens/s | wall vs in-process | "
        "coordinator CPU ms / lease | its p2pd ms / lease | verifiers CPU ms / lease | "
        "V on /status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        v = f"{r.v_status:,.0f}" if r.v_status is not None else "-"
        lines.append(
            f"| {r.setting} | {r.wall_s:.1f} | {r.leases / r.wall_s:.2f} | "
            f"{r.tokens / r.wall_s:,.0f} | {r.wall_s / base.wall_s:.2f} | "
            f"{1000 * r.coord_cpu_s / r.leases:.0f} | {1000 * r.coord_p2pd_s / r.leases:.0f} | "
            f"{1000 * r.verifier_cpu_s / r.leases:.0f} | {v} |"
        )
    procs = " ".join(str(p) for p in args.processes)
    lines += [
        "",
        f"Command: `python bench/verifiers.py --leases {args.leases} --prompts {args.prompts} "
        f"--group {args.group} --tokens {args.tokens} --processes {procs} "
        f"--concurrency {args.concurrency}`",
        f"<!-- bench:{SECTION}:end -->",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=40, help="timed leases per setting")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per lease")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--tokens", type=int, default=32, help="max_new_tokens")
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2], help="verifier processes to try"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="submissions in flight")
    parser.add_argument("--timeout", type=float, default=600.0, help="per wait, seconds")
    parser.add_argument("--no-write", action="store_true", help="do not update benchmarks.md")
    args = parser.parse_args()
    if min(args.leases, args.prompts, args.group, args.tokens, args.concurrency) < 1 or any(
        p < 1 for p in args.processes
    ):
        raise SystemExit("error: --leases, --prompts, --group, --tokens, --concurrency and "
                         "--processes must be >= 1")  # fmt: skip
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}", flush=True)
    runs = []
    for n in [0, *args.processes]:
        run = asyncio.run(measure(args, n))
        print(
            f"{run.setting}: {run.leases} leases in {run.wall_s:.1f} s, coordinator "
            f"{run.coord_cpu_s:.1f} CPU-s, verifiers {run.verifier_cpu_s:.1f} CPU-s, "
            f"V {run.v_status}", flush=True,
        )  # fmt: skip
        runs.append(run)
    text = report(runs, args, load)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
