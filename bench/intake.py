"""Intake throughput: verified rollouts per second through the coordinator's whole intake path.

In process, no sockets, but every byte goes the real way: the node side seals the submission
(``encode(seal(...))``, untimed); the timed coordinator side is ``decode`` of the envelope ->
:meth:`Coordinator.open` (Ed25519, replay window, known node) -> :meth:`Coordinator.submit`
(lease/epoch, group completeness, version, token/length/termination checks, reward recomputed by
the task verifier, the log-prob spot check when the lease is drawn, SQLite commit with
``synchronous=FULL``, verdict stored).

Submissions are realistic: leases of 8 prompts x 8 samples (G = 8, max 8 new tokens) of the
embedded reverse3 task, sampled by the ``hf`` backend on the policy weights at the lease's seeds
(the node's own :func:`node.rollouts.lease_requests` and :func:`node.rollouts.build_submission`),
so log-probs are honest and the seed and spot checks pass (every submission must be
acknowledged). Sampling is node-side work, done before the timed part.

Two coordinators (own temp SQLite files) run interleaved rounds: spot check off (fraction 0) and
at the default fraction (0.1 of leases, up to 8 samples re-scored in fp32 at the claimed version).

Usage: python bench/intake.py [--submissions 400] [--rounds 4] [--no-write]
Writes its section of docs/benchmarks.md (between the bench:intake markers).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _report import write_section

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.logprobs import InProcessLogprobVerifier
from coordinator.store import Store
from coordinator.tasks import make_task
from node.backends.hf import HFBackend
from node.rollouts import build_submission, lease_requests, to_sampling_config
from policy.model import CharTokenizer, ModelSpec, build_model
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import (
    Ack,
    CapabilityAdvert,
    CpuInfo,
    Lease,
    LeaseRequest,
    RolloutSubmission,
    SignedEnvelope,
    Timings,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "intake"
PROMPTS, G, MAX_NEW = 8, 8, 8
VERSION = 1
TOK = CharTokenizer()


def config(
    db: Path, fraction: float, *, prompts: int = PROMPTS, g: int = G, max_new: int = MAX_NEW
) -> CoordinatorConfig:
    return CoordinatorConfig.model_validate(
        {
            "db_path": str(db),
            "group_size": g,
            "sampling": {"max_new_tokens": max_new},
            # a round's leases are all issued before it is timed: no per-node cap on them
            "leases": {
                "max_prompts_per_lease": prompts,
                "target_lease_s": 1000.0,
                "max_active_per_node": 1_000_000,
            },
            # a fixed check rate (the adaptive one is measured in the demo), no reward audits
            "intake": {"spot_check_fraction": fraction, "new_node_check_rate": fraction},
            "reward_audit": {"fraction": 0.0},
            "capacity": {"activation": False},
        }
    )


def advert(ident: Identity) -> CapabilityAdvert:
    return CapabilityAdvert(
        peer_id="bench",
        node_key=ident.public_key,
        gpus=[],
        cpu=CpuInfo(cores=1, memory_bytes=1 << 30),
        backend="hf",
        dtype="float32",
        tokens_per_s=1000.0,
        rollouts_per_s=10.0,
        price_per_hour=None,
        policy_version=VERSION,
        reachability="unknown",
        software_version="bench",
        expires_at=time.time() + 3600,
    )


@dataclass
class Bench:
    """One coordinator core with a temp database and the node identities that feed it."""

    name: str
    core: Coordinator
    verifier: InProcessLogprobVerifier
    nodes: list[Identity]
    backend: HFBackend
    latencies: list[float] = field(default_factory=list)
    submissions: int = 0
    rollouts: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    rescored: int = 0
    rescored_latencies: list[float] = field(default_factory=list)
    #: prompts per lease (the config's max_prompts_per_lease)
    prompts: int = PROMPTS
    _turn: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]

    def prepare(self, n: int) -> list[bytes]:
        """``n`` freshly leased, sealed submissions (node-side work, not timed)."""
        return [
            encode(seal(node, self.submission(lease), now=time.time()))
            for node, lease in self.lease(n)
        ]

    def lease(self, n: int) -> list[tuple[Identity, Lease]]:
        """``n`` leases, round-robin over the nodes (all held until the round is timed)."""
        out = []
        for _ in range(n):
            node = self.nodes[next(self._turn) % len(self.nodes)]
            lease = self.core.request_lease(
                node.public_key,
                LeaseRequest(peer_id="bench", policy_version=VERSION, max_prompts=self.prompts),
            )
            if not isinstance(lease, Lease) or len(lease.prompts) != self.prompts:
                raise SystemExit(f"{self.name}: no lease of {self.prompts} prompts: {lease}")
            out.append((node, lease))
        return out

    def submission(self, lease: Lease) -> RolloutSubmission:
        """The honest submission of ``lease``, sampled at its seeds as a node would."""
        requests = lease_requests(lease)
        outs = self.backend.generate(requests, to_sampling_config(lease))
        return build_submission(
            lease,
            requests,
            outs,
            set(self.backend.eos_token_ids),
            backend="hf",
            dtype="float32",
            timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
        )

    async def run(self, batch: list[bytes]) -> None:
        """The coordinator side of each submission, timed one by one."""
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for raw in batch:
            t = time.perf_counter()
            env = decode(raw, SignedEnvelope)
            node_key, sub = self.core.open(env, RolloutSubmission)
            verdict = await self.core.submit(node_key, sub)
            elapsed = time.perf_counter() - t
            self.latencies.append(elapsed)
            if not isinstance(verdict, Ack):
                raise SystemExit(f"{self.name}: honest submission refused: {verdict}")
            self.rollouts += sum(len(g.samples) for g in sub.groups)
            if self.core.intake.spot_checked(sub.lease_id, self.core.trust.rate(node_key)):
                self.rescored += 1
                self.rescored_latencies.append(elapsed)
        self.submissions += len(batch)
        self.wall_s += time.perf_counter() - wall0
        self.cpu_s += time.process_time() - cpu0


def make_bench(
    name: str, tmp: Path, fraction: float, model: Any, *, prompts: int = PROMPTS, g: int = G,
    max_new: int = MAX_NEW,
) -> Bench:  # fmt: skip
    """A coordinator core on a temp database (leases of ``prompts`` prompts x ``g`` samples of
    at most ``max_new`` tokens) and the node identities that feed it."""
    cfg = config(tmp / f"{name}.sqlite", fraction, prompts=prompts, g=g, max_new=max_new)
    publisher = Identity.generate()
    verifier = InProcessLogprobVerifier(
        lambda version: model, cfg.intake.tolerances, cache_size=cfg.staleness_bound + 1
    )
    core = Coordinator(
        cfg,
        store=Store(cfg.db_path),
        task=make_task(cfg.task, seed=cfg.task_seed),
        tokenizer=TOK,
        verifier=verifier,
        publisher_key=publisher.public_key,
    )
    now = time.time()
    manifest, _ = build_manifest(
        {"model.safetensors": b"w" * 64},
        version=VERSION,
        parent_version=None,
        model_config_hash="00",
        tokenizer_hash="00",
        created_at=now,
        expires_at=now + 86400,
        chunk_size=64,
    )
    core.publish_version(sign_manifest(manifest, publisher, now))
    nodes = [Identity.generate() for _ in range(4)]
    for node in nodes:
        core.register(node.public_key, advert(node))
    backend = HFBackend(model=model, device="cpu")
    return Bench(name, core, verifier, nodes, backend, prompts=prompts)


def render(benches: list[Bench], fractions: dict[str, float]) -> str:
    lines = [
        f"<!-- bench:{SECTION}:start -->",
        "## Rollout intake (`bench/intake.py`)",
        "",
        "Coordinator core in process, temp SQLite file on ext4 (WAL, `synchronous=FULL`), one "
        f"process, torch 1 thread, torch {torch.__version__}, Python {platform.python_version()}. "
        f"A submission = one lease of {PROMPTS} prompts x {G} samples (<= {MAX_NEW} new tokens) "
        "of the embedded model with honest `hf` log-probs. Timed: envelope decode, signature + "
        "replay + node check, lease/group/version/token/termination checks, reward "
        "recomputation, the log-prob spot check when the lease is drawn, SQLite commit of the "
        "rows and the verdict. Wall-clock rates over interleaved rounds; load average at the "
        f"end {os.getloadavg()[0]:.1f} on {os.cpu_count()} shared CPUs (noisy).",
        "",
        "| spot check | submissions | leases re-scored | submissions/s | rollouts/s | "
        "p50 ms | p95 ms | p50 ms of a re-scored lease | rollouts per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in benches:
        lat = sorted(b.latencies)
        p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
        rescored = (
            f"{statistics.median(b.rescored_latencies) * 1e3:.1f}" if b.rescored_latencies else "-"
        )
        lines.append(
            f"| fraction {fractions[b.name]:g} | {b.submissions} | {b.rescored} | "
            f"{b.submissions / b.wall_s:,.1f} | {b.rollouts / b.wall_s:,.0f} | "
            f"{statistics.median(lat) * 1e3:.1f} | {p95 * 1e3:.1f} | {rescored} | "
            f"{b.rollouts / b.cpu_s:,.0f} |"
        )
    lines.append(f"<!-- bench:{SECTION}:end -->")
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> str:
    model = build_model(ModelSpec(), seed=VERSION)
    fractions = {"off": 0.0, "default": CoordinatorConfig().intake.spot_check_fraction}
    with tempfile.TemporaryDirectory() as tmp:
        benches = [make_bench(n, Path(tmp), f, model) for n, f in fractions.items()]
        # Warm up: SQLite pages, the thread pool, and the verifier's model cache.
        for b in benches:
            await b.run(b.prepare(2))
            b.latencies.clear()
            b.submissions = b.rollouts = 0
            b.wall_s = b.cpu_s = 0.0
            b.rescored = 0
            b.rescored_latencies.clear()
        await benches[1].verifier.check(VERSION, [[1, 4, 5, 6, 3]], [[2]], [[-1.0]])
        per_round = max(1, args.submissions // args.rounds)
        for _ in range(args.rounds):
            for b in benches:
                await b.run(b.prepare(per_round))
        for b in benches:
            stored = b.core.store.rollout_count()
            assert stored == b.rollouts + 2 * PROMPTS * G, (stored, b.rollouts)
            b.core.close()
        return render(benches, fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=400, help="per spot-check setting")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--no-write", action="store_true", help="do not update benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = asyncio.run(amain(args))
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"\nwrote {DOC} (bench:{SECTION} section)")


if __name__ == "__main__":
    main()
