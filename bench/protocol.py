"""Protocol throughput: encode+sign and verify+decode of a signed rollout submission, one core.

Message: RolloutSubmission of 8 samples x 256 tokens (packed uint32 tokens + float32 log-probs)
in a SignedEnvelope, framed. Verify+decode is what the coordinator does per submission: decode the
envelope, payload-size check, clock check, Ed25519 verify, replay guard, strict payload decode
(including the numpy finiteness check of every log-prob).

Usage: python bench/protocol.py [--seconds 2] [--no-write]
Writes its section of docs/benchmarks.md (between the bench:protocol markers).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import write_section

from protocol.codec import decode, encode, frame
from protocol.envelope import ReplayGuard, open_envelope, seal, verify_envelope
from protocol.examples import rollout_submission
from protocol.identity import Identity
from protocol.messages import RolloutSubmission, SignedEnvelope

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- bench:protocol:start -->", "<!-- bench:protocol:end -->"
NOW = 1_700_000_000.0


def _rate(fn: Callable[[int], None], n: int, seconds: float) -> float:
    """Calls per CPU-second of ``fn(i)``, best of rounds filling ``seconds`` of wall time.

    CPU time (not wall time) so that other processes on a shared machine do not count against us.
    """
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t = time.process_time()
        for i in range(n):
            fn(i)
        best = max(best, n / max(time.process_time() - t, 1e-9))
        if time.perf_counter() > deadline:
            return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--no-write", action="store_true", help="do not update benchmarks.md")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core

    ident = Identity.generate()
    sub = rollout_submission(n_samples=8, n_tokens=256)
    n = 2000
    frames = [frame(encode(seal(ident, sub, now=NOW))) for _ in range(n)]
    size = len(frames[0])
    envs = [decode(f[4:], SignedEnvelope) for f in frames]
    guards = [ReplayGuard()]

    def encode_sign(_: int) -> None:
        frame(encode(seal(ident, sub, now=NOW)))

    def verify_decode(i: int) -> None:
        if i == 0:
            guards[0] = ReplayGuard()  # fresh guard per round: every nonce is new
        env = decode(frames[i][4:], SignedEnvelope)
        open_envelope(env, RolloutSubmission, now=NOW, replay=guards[0])

    def verify_only(i: int) -> None:
        verify_envelope(envs[i])

    def decode_only(i: int) -> None:
        decode(envs[i].payload, RolloutSubmission)

    rows = [
        ("encode + sign + frame", _rate(encode_sign, n, args.seconds)),
        ("verify + decode (full receive path)", _rate(verify_decode, n, args.seconds)),
        ("  of which Ed25519 verify only", _rate(verify_only, n, args.seconds)),
        ("  of which payload decode only", _rate(decode_only, n, args.seconds)),
    ]
    lines = [
        "## Protocol codec and signatures",
        "",
        f"`python bench/protocol.py` on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, pinned to one core, rates per CPU-second (best "
        "of several rounds). Message: signed "
        f"RolloutSubmission, 8 samples x 256 tokens with log-probs, {size} bytes per frame.",
        "",
        "| operation | messages/s | MB/s |",
        "|---|---:|---:|",
        *[f"| {name} | {rate:,.0f} | {rate * size / 1e6:,.1f} |" for name, rate in rows],
        "",
        "Target: verify + decode >= 5,000 messages/s on one core.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("protocol", text)
        print(f"\nwrote {DOC}")


if __name__ == "__main__":
    main()
