"""Benchmark: delta versions of a ≥ 100M-parameter model trained by the project's own trainer.

A Llama config the size of SmolLM2-135M (hidden 576, 30 layers, 9 heads / 3 KV heads,
intermediate 1536, vocabulary 49152, tied embeddings; random weights) unless ``--model-path``
names a real model directory, trained with :class:`trainer.recipe.Trainer` (fp32 master weights,
AdamW) on synthetic rollouts (random prompts and completions, rewards 0/1 within each group), at
each learning rate. After every step the weights are published the way the trainer publishes
them: bf16 safetensors (``cast_floats`` + ``state_dict_to_files``). For κ = 1, 2, 4 steps between
versions, each version is built as a delta against the previous published one
(:class:`swarm.publication.VersionBuilder`), and we report

* delta bytes as a fraction of the full checkpoint, and the fraction of bf16 elements changed;
* encode time (tensor digests + delta) on the trainer;
* apply time: decode, patch and verify every tensor (``protocol.delta.apply_delta``, base in
  memory), and what a node does end to end (``VersionSync._apply``: read the base from its chunk
  store, apply, verify, store the full checkpoint with every chunk hash checked), against reading
  the full checkpoint from disk (cold: evicted from the page cache with ``posix_fadvise``; warm);
* exactness: every reconstruction compared byte for byte with the published checkpoint.

The first step after the initial weights (Adam's warm start moves every weight by ~lr) is shown
on its own row. With ``--broadcast-n N`` (default 4; 0 skips it) the same version then goes out
through the loopback broadcast (``swarm.peerproc`` processes, upload cap B each, receivers that
hold the previous version): once as a keyframe (full checkpoint) and once as a delta.

    nice -n 5 python bench/delta.py                        # lr 1e-6 1e-5, 8 steps, N = 4
    python bench/delta.py --lrs 1e-6 --steps 4 --broadcast-n 0 --no-report   # quick look

Writes its section of docs/benchmarks.md (``<!-- bench:delta:start -->``) unless ``--no-report``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import write_section  # noqa: E402

MIB = 1 << 20
HASH = "blake3"  # what swarm.publication.VersionBuilder uses by default


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model_path:
        return AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def synthetic_batch(trainer: Any, rng: random.Random, step: int, vocab: int) -> list[Any]:
    """2 groups × 2 samples: random 8-token prompts, 16-token completions, rewards 0 and 1."""
    from trainer.batch import Rollout

    out = []
    for g in range(trainer.config.batch_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(8)]
        for j in range(trainer.config.group_size):
            completion = [rng.randrange(3, vocab) for _ in range(16)]
            out.append(
                Rollout(
                    group_id=f"s{step}-g{g}",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    behaviour_logprobs=[-10.8] * 16,
                    policy_version=trainer.version,
                    reward=float(j % 2),
                )
            )
    return out


def published_files(trainer: Any) -> dict[str, bytes]:
    from swarm.checkpoint_io import cast_floats, state_dict_to_files

    return state_dict_to_files(cast_floats(trainer.state_dict_for_publish(), "bfloat16"))


def read_cold_warm(files: dict[str, bytes], tmp: Path) -> tuple[float, float]:
    """Seconds to read the checkpoint from disk with an empty page cache, and again (cached)."""
    paths = []
    for name, data in files.items():
        p = tmp / name
        with open(p, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        paths.append(p)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    t0 = time.perf_counter()
    for p in paths:
        p.read_bytes()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in paths:
        p.read_bytes()
    warm = time.perf_counter() - t0
    for p in paths:
        p.unlink()
    return cold, warm


class Versions:
    """Published versions of one run: files on disk (a few at a time), signed-like manifests."""

    def __init__(self, tmp: Path) -> None:
        from swarm.publication import PublishPolicy, VersionBuilder

        self.tmp = tmp
        self.builder = VersionBuilder(
            model_config_hash="00",
            tokenizer_hash="00",
            chunk_size=4 * MIB,
            policy=PublishPolicy(max_delta_ratio=1.0),
        )
        self.keyframes: dict[int, Any] = {}  # version -> Built (keyframe of its files)

    def save(self, step: int, files: dict[str, bytes]) -> None:
        d = self.tmp / f"step-{step}"
        d.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (d / name).write_bytes(data)

    def load(self, step: int) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((self.tmp / f"step-{step}").iterdir())}

    def drop_before(self, step: int) -> None:
        for d in self.tmp.glob("step-*"):
            if int(d.name.split("-")[1]) < step:
                shutil.rmtree(d)

    def keyframe(self, step: int, files: dict[str, bytes]) -> Any:
        built = self.builder.build(
            files, version=step, parent_version=None, base=None, created_at=0.0, expires_at=1e12
        )
        return built


def measure_pair(versions: Versions, base_step: int, step: int, tmp: Path) -> dict[str, float]:
    """Delta from ``base_step`` to ``step``: sizes, encode/apply/read times, exactness."""
    from protocol.delta import apply_delta
    from protocol.manifest import part_indices
    from swarm.chunks import ChunkStore
    from swarm.deltasync import VersionSync
    from swarm.publication import Base

    base_files, files = versions.load(base_step), versions.load(step)
    base_built = versions.keyframe(base_step, base_files)
    built = versions.builder.build(
        files,
        version=step,
        parent_version=base_step,
        created_at=0.0,
        expires_at=1e12,
        base=Base(base_built.manifest, base_files, 0),
    )
    m = built.manifest
    assert built.kind == "delta", built.reason
    delta = b"".join(built.chunks[i] for i in part_indices(m, "delta"))
    # in memory: decode + patch + verify every tensor (the base buffer is the node's to patch)
    base = {k: bytearray(v) for k, v in base_files.items()}
    t0 = time.perf_counter()
    out, _ = apply_delta(
        base,
        delta,
        m.tensors or [],
        m.hash_algorithm,
        base_tensors=base_built.manifest.tensors,
        in_place=True,
    )
    apply_s = time.perf_counter() - t0
    exact = all(bytes(out[k]) == files[k] for k in files) and set(out) == set(files)
    del base, out
    # end to end on a node: base in its chunk store, delta chunks arrived, apply + store
    store = ChunkStore(tmp / "node-store", keep_versions=4)
    store.seed(_env(base_built.manifest), base_built.manifest, base_built.chunks)
    store.put_manifest(_env(m), m)
    for i in part_indices(m, "delta"):
        store.put_chunk(step, i, built.chunks[i])
    sync = VersionSync(_NoDownloader(store))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    node_files = sync._apply(m)
    node_s = time.perf_counter() - t0
    exact = exact and node_files == files
    shutil.rmtree(tmp / "node-store")
    cold, warm = read_cold_warm(files, tmp)
    return {
        "fraction": built.delta_bytes / built.full_bytes,
        "changed": built.changed_elements / built.total_elements,
        "delta_mb": built.delta_bytes / 1e6,
        "full_mb": built.full_bytes / 1e6,
        "encode_s": built.encode_s,
        "apply_s": apply_s,
        "node_s": node_s,
        "cold_s": cold,
        "warm_s": warm,
        "exact": float(exact),
    }


class _NoDownloader:
    """What VersionSync._apply needs of a downloader: the store (nothing is downloaded)."""

    def __init__(self, store: Any) -> None:
        self.store = store


def _env(manifest: Any) -> Any:
    """An unsigned stand-in envelope (the store does not check signatures; bench only)."""
    from protocol.codec import encode
    from protocol.messages import SignedEnvelope

    return SignedEnvelope(
        signer=bytes(32), nonce=bytes(16), ts=0.0, payload=encode(manifest), signature=bytes(64)
    )


def run_lr(args: argparse.Namespace, lr: float, model0: Any, tmp: Path) -> dict[str, Any]:
    from trainer.config import TrainerConfig
    from trainer.recipe import Trainer

    cfg = TrainerConfig(
        lr=lr,
        batch_prompts=2,
        group_size=2,
        minibatches=1,
        entropy_coef=0.0,
        device="cpu",
        out_dir=str(tmp / "trainer"),
        resume=False,
        checkpoint_every=10_000,
        max_staleness=5,
    )
    trainer = Trainer.setup(cfg, model=copy.deepcopy(model0))
    vocab = int(model0.config.vocab_size)
    rng = random.Random(0)
    versions = Versions(tmp / f"lr{lr:g}")
    versions.save(0, published_files(trainer))
    kappas = sorted(args.kappas)
    pairs: dict[int, list[dict[str, float]]] = {k: [] for k in kappas}
    warm_start: dict[str, float] = {}
    step_s = []
    for step in range(1, args.steps + 2):  # step 1 is the warm start, then --steps more
        t0 = time.perf_counter()
        trainer.train_step(synthetic_batch(trainer, rng, step, vocab))
        step_s.append(time.perf_counter() - t0)
        versions.save(step, published_files(trainer))
        if step == 1:
            warm_start = measure_pair(versions, 0, 1, tmp)
            print(f"lr {lr:g} warm start: {warm_start['fraction']:.2%} of full", flush=True)
        for k in kappas:
            if step > 1 and (step - 1) % k == 0:
                row = measure_pair(versions, step - k, step, tmp)
                pairs[k].append(row)
                print(
                    f"lr {lr:g} κ={k} v{step - k}→v{step}: {row['fraction']:.2%} of full, "
                    f"{row['changed']:.2%} changed, apply {row['apply_s']:.2f} s, node "
                    f"{row['node_s']:.2f} s, cold read {row['cold_s']:.2f} s",
                    flush=True,
                )
        versions.drop_before(step - max(kappas))
    if args.keep_pair is not None and lr == args.lrs[0]:
        for step in (args.steps, args.steps + 1):  # the last κ = 1 pair, for the broadcast run
            shutil.copytree(tmp / f"lr{lr:g}" / f"step-{step}", args.keep_pair / f"step-{step}")
    shutil.rmtree(versions.tmp, ignore_errors=True)
    return {"lr": lr, "warm": warm_start, "pairs": pairs, "step_s": statistics.mean(step_s)}


# --- loopback broadcast: the same version as a keyframe and as a delta --------------------------
async def broadcast(args: argparse.Namespace, pair_dir: Path, tmp: Path) -> list[dict[str, Any]]:
    from protocol.identity import Identity
    from protocol.manifest import part_size, sign_manifest
    from swarm.chunks import ChunkStore
    from swarm.peerproc import PeerProcess
    from swarm.publication import Base, PublishPolicy, VersionBuilder
    from swarm.testing import start_loopback_peer

    base_files = {p.name: p.read_bytes() for p in (pair_dir / f"step-{args.steps}").iterdir()}
    files = {p.name: p.read_bytes() for p in (pair_dir / f"step-{args.steps + 1}").iterdir()}
    coord = Identity.generate()
    builder = VersionBuilder(
        model_config_hash="00",
        tokenizer_hash="00",
        chunk_size=int(args.chunk_kib * 1024),
        policy=PublishPolicy(max_delta_ratio=1.0),
    )
    now = time.time()

    def signed(version: int, data: dict[str, bytes], base: Base | None) -> tuple[Any, Any, Any]:
        built = builder.build(
            data,
            version=version,
            parent_version=None,
            base=base,
            created_at=now,
            expires_at=now + 86400,
        )
        return sign_manifest(built.manifest, coord, now), built.manifest, built.chunks

    v1 = signed(1, base_files, None)  # what every receiver holds already
    v2 = signed(2, files, None)  # the new weights as a keyframe
    v3 = signed(3, files, Base(v1[1], base_files, 0))  # the same weights as a delta against v1
    tmp.mkdir(parents=True, exist_ok=True)
    seed_store = ChunkStore(tmp / "seed", keep_versions=3)
    for env, m, chunks in (v1, v2, v3):
        seed_store.seed(env, m, chunks)
    cap = args.cap_mib * MIB
    boot_peer = await start_loopback_peer()
    common = ["--coordinator-key", coord.public_key.hex(), "--upload-rate", str(cap)]
    for maddr in await boot_peer.visible_maddrs():
        common += ["--bootstrap", maddr]
    seed = PeerProcess(["--store", str(tmp / "seed"), *common], log_path=str(tmp / "seed.log"))
    seed_id = await seed.start()
    rows = []
    try:
        for label, version in (("full (keyframe)", 2), ("delta", 3)):
            procs = []
            for i in range(args.broadcast_n):
                d = tmp / f"{version}-r{i}"
                ChunkStore(d, keep_versions=3).seed(*v1)  # the receivers run v1
                argv = ["--store", str(d), "--seed", seed_id, "--version", str(version), *common]
                procs.append(PeerProcess(argv, log_path=str(tmp / f"{version}-r{i}.log")))
            await asyncio.gather(*(p.start() for p in procs))
            await asyncio.sleep(1.0)
            t0 = time.time()
            for p in procs:
                p.go()
            size = part_size(v2[1], "full")
            await asyncio.wait_for(
                asyncio.gather(*(p.wait_done() for p in procs)),
                4 * args.broadcast_n * size / cap + 120,
            )
            errors = [p.error for p in procs if p.error]
            if errors:
                raise RuntimeError(f"{label}: {errors[0]}")
            t_last = max(p.done_at or 0.0 for p in procs) - t0
            paths = {str(p.stats.get("path")) for p in procs}
            moved = part_size(v3[1], "delta") if version == 3 else size
            rows.append(
                {
                    "label": label,
                    "t_last": t_last,
                    "ratio": t_last / (size / cap),
                    "paths": ",".join(sorted(paths)),
                    "bytes": moved,
                }
            )
            print(
                f"broadcast {label}: N={args.broadcast_n}, last receiver after {t_last:.2f} s "
                f"({t_last / (size / cap):.2f} x M/B; path {paths})",
                flush=True,
            )
            await asyncio.gather(*(p.close() for p in procs))
    finally:
        await seed.close()
        await boot_peer.stop()
    return rows


def report(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    bcast: list[dict[str, Any]],
    n_params: int,
    load: float,
) -> str:
    model = args.model_path or (
        "Llama config of SmolLM2-135M's size (hidden 576, 30 layers, 9/3 heads, intermediate "
        "1536, vocabulary 49152, tied embeddings), random weights"
    )
    lines = [
        "## Delta versions (`bench/delta.py`)",
        "",
        f"{model}: {n_params / 1e6:.1f} M parameters, published as bf16 safetensors "
        f"({runs[0]['warm']['full_mb']:.0f} MB with the tied `lm_head.weight` written out). "
        "Trained by `trainer.recipe.Trainer` (fp32 master weights, AdamW, grad-norm clip 1.0) on "
        "synthetic rollouts (2 groups × 2 samples, 8-token prompts, 16-token completions), "
        f"{args.steps} steps after the first per learning rate; each step is one version, and κ "
        "= 1, 2, 4 take every κ-th version. Deltas: `swarm.publication.VersionBuilder` (zstd "
        f"level 1, blake3 digests). {os.cpu_count()} CPU cores shared with other jobs (load "
        f"average {load:.1f} at the end): times are indicative, ratios within a row are measured "
        "side by side.",
        "",
        "| lr | κ | deltas | delta / full (mean, max) | bf16 elements changed | encode (s) | "
        "apply (s) | node: apply + store (s) | read full, cold / warm (s) | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(lr: float, label: str, rs: list[dict[str, float]]) -> str:
        def mean(key: str) -> float:
            return statistics.mean(r[key] for r in rs)

        worst = max(r["fraction"] for r in rs)
        return (
            f"| {lr:g} | {label} | {len(rs)} | {mean('fraction'):.2%}, {worst:.2%} | "
            f"{mean('changed'):.2%} | {mean('encode_s'):.2f} | {mean('apply_s'):.2f} | "
            f"{mean('node_s'):.2f} | {mean('cold_s'):.2f} / {mean('warm_s'):.2f} | "
            f"{int(sum(r['exact'] for r in rs))}/{len(rs)} |"
        )

    for run in runs:
        lines.append(row(run["lr"], "first step", [run["warm"]]))
        for k, rs in run["pairs"].items():
            if rs:
                lines.append(row(run["lr"], str(k), rs))
    lines += [
        "",
        "*apply* = decode + patch + verify every tensor against the signed digests, base in "
        "memory (`protocol.delta.apply_delta`); *node* = what a node does once the delta chunks "
        "are in: read the base from its chunk store, apply, verify, write the full checkpoint "
        "back with every chunk hash checked (`VersionSync._apply`); *read full* = reading the "
        "full checkpoint file (cold: dropped from the page cache first). The first step moves "
        "every weight by ~lr (Adam's first update is lr·sign(g)), hence its larger delta. "
        "Targets: ≤ 5% of the full bytes at lr 1e-6, apply below the cold read.",
    ]
    if bcast:
        lines += [
            "",
            f"Loopback broadcast of one such version (lr {args.lrs[0]:g}, κ = 1) to N = "
            f"{args.broadcast_n} receivers that run the previous version (`swarm.peerproc` "
            f"processes on 127.0.0.1, every uplink capped at B = {args.cap_mib:g} MiB/s by the "
            f"in-app token bucket, {args.chunk_kib:g} KiB chunks); t_last = until the last "
            "receiver holds the verified full checkpoint:",
            "",
            "| published as | bytes to move | t_last (s) | t_last / (M_full/B) | receivers' path |",
            "|---|---|---|---|---|",
        ]
        for r in bcast:
            lines.append(
                f"| {r['label']} | {r['bytes'] / 1e6:.1f} MB | {r['t_last']:.2f} | "
                f"{r['ratio']:.3f} | {r['paths']} |"
            )
        lines += [
            "",
            "The delta run's t_last is dominated by applying and verifying on each receiver, not "
            "by the link. Real links (network namespaces, kernel-shaped egress): see the "
            "`broadcast-netns` sections (`bench/broadcast.py --suite record`).",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--kappas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=8, help="steps after the first, per lr")
    p.add_argument("--model-path", default=None, help="a local HF model directory (real weights)")
    p.add_argument("--broadcast-n", type=int, default=4, help="receivers (0: no broadcast run)")
    p.add_argument("--cap-mib", type=float, default=10.0, help="upload cap per peer, MiB/s")
    p.add_argument("--chunk-kib", type=float, default=1024.0, help="broadcast chunk size, KiB")
    p.add_argument("--no-report", action="store_true", help="print only, leave docs/ alone")
    args = p.parse_args()
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    tmp = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    args.keep_pair = tmp / "pair" if args.broadcast_n else None
    try:
        model0 = build_model(args)
        n_params = sum(p.numel() for p in model0.parameters())
        runs = [run_lr(args, lr, model0, tmp) for lr in args.lrs]
        del model0
        bcast = asyncio.run(broadcast(args, tmp / "pair", tmp / "bcast")) if args.keep_pair else []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, runs, bcast, n_params, os.getloadavg()[0])
    print(text)
    if not args.no_report:
        write_section("delta", text)
        print("wrote docs/benchmarks.md (bench:delta section)")


if __name__ == "__main__":
    main()
