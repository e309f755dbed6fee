"""Adaptive cheaters against the real intake, on a fake clock (issue 34).

Each strategy is played by nodes against a real coordinator core (store, leases, intake, trust,
reputation, the calibrated in-process verifier on the embedded model): honest leases are sampled
with the ``hf`` backend as a node does; a forged lease replaces one sample of the lease with the
right answer (reward 1) carrying the honest log-probs of those tokens, so only the seeded replay
tells (the hardest forgery of finding 5). Strategies (the cheater knows the published rule and
counts its own accepted leases, so it knows its rate ``r(h)``, never whether a lease is checked):

* ``floor``      honest until its rate reaches the floor, then forges every lease;
* ``after-n``    forges, and after each refusal is honest for ``n`` leases (80) before forging
                 again (finding 3's patient cheater);
* ``prob-p``     forges each lease with probability ``p`` (0.1);
* ``sybil``      a fresh identity for every lease, always forging.

Printed per strategy: leases played, accepted, forged accepted and their share of the accepted
ones, forged leases until the ban, and the formula's expectation (:mod:`coordinator.detection`);
then the verifier's compute against a learner's at the floor rate (with and without the check's
second, bf16 forward), and the ack latency of checked against unchecked leases (the timing
side channel: docs/reliability.md "Detection power"). The clock is fake, so load
only changes the wall time (the load average is printed anyway).

Usage: ``python bench/adversary.py`` (defaults: the coordinator's intake settings,
``--leases 4000`` per strategy); ``--quick`` for a small smoke run (floor reached sooner:
``target_forged_share`` 0.2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests" / "unit"))  # the unit tests' coordinator harness

import msgspec  # noqa: E402
import torch  # noqa: E402
from coord_harness import Harness, answer, sampled  # noqa: E402

from coordinator.detection import (  # noqa: E402
    forged_leases_to_ban,
    share_forging_from,
    share_forging_with_probability,
)
from coordinator.logprobs import CalibrationSettings, InProcessLogprobVerifier  # noqa: E402
from policy.model import ModelSpec, build_model  # noqa: E402
from policy.scoring import score_logprobs  # noqa: E402
from protocol.messages import (  # noqa: E402
    Ack,
    pack_logprobs,
    pack_tokens,
    unpack_tokens,
)


@dataclass
class Tally:
    leases: int = 0
    accepted: int = 0
    forged: int = 0
    forged_accepted: int = 0
    forged_to_ban: int | None = None
    identities: int = 1


def forge(lease: Any, honest: Any, model: Any) -> Any:
    """Sample 0 of prompt 0 replaced by the right answer with its honest log-probs."""
    tokens = answer(lease, 0)
    prompt = unpack_tokens(lease.prompts[0].token_ids)
    lps = score_logprobs(model, [prompt], [tokens])[0]
    group = honest.groups[0]
    samples = list(group.samples)
    samples[0] = msgspec.structs.replace(
        samples[0], token_ids=pack_tokens(tokens), logprobs=pack_logprobs(lps), finish_reason="eos"
    )
    groups = [msgspec.structs.replace(group, samples=samples), *honest.groups[1:]]
    return msgspec.structs.replace(honest, groups=groups)


def with_verifier(h: Harness, model: Any) -> Harness:
    """``h`` re-scoring with ``model`` (calibrated on 128 samples), reopened, v1 published."""
    h.verifier = InProcessLogprobVerifier(
        lambda v: model, h.cfg.intake.tolerances, cache_size=2,
        calibration=CalibrationSettings(samples=128),
    )  # fmt: skip
    h.reopen()
    h.publish(1)
    return h


def build(tmp: Path, model: Any, args: argparse.Namespace) -> Harness:
    h = Harness(
        tmp,
        group_size=4,
        sampling={"max_new_tokens": 6},
        leases={"max_prompts_per_lease": 1, "max_active_per_node": 64, "min_deadline_s": 30.0},
        intake={
            "spot_check_fraction": args.floor,
            "new_node_check_rate": 1.0,
            "target_forged_share": args.eps,
        },
        reputation={"strikes_to_ban": 3},
    )
    return with_verifier(h, model)


async def play(name: str, model: Any, args: argparse.Namespace, rng: random.Random) -> Tally:
    with tempfile.TemporaryDirectory() as tmp:
        h = build(Path(tmp), model, args)
        t = Tally()
        node = h.node()
        honest_left = 0
        h_f = h.core.trust.leases_to_floor()
        own = 0  # accepted leases of the current identity (what the cheater counts)
        for _ in range(args.leases):
            if name == "sybil" and t.leases:
                node, own = h.node(), 0
                t.identities += 1
            if h.core.reputation.banned(node.public_key, h.clock()) is not None:
                break
            lease = h.lease(node, 1)
            sub = sampled(lease, model)
            if name == "floor":
                cheat = own >= h_f
            elif name == "after-n":
                cheat = honest_left == 0
            elif name == "prob-p":
                cheat = rng.random() < args.p
            else:
                cheat = True
            if cheat:
                sub = forge(lease, sub, model)
            got = await h.core.submit(node.public_key, sub)
            h.clock.advance(1.0)
            t.leases += 1
            t.forged += cheat
            if isinstance(got, Ack):
                t.accepted += 1
                own += 1
                t.forged_accepted += cheat
                honest_left = max(0, honest_left - (not cheat))
            elif cheat:
                honest_left = args.n
                own = 0  # a strike restarts the clean history
            if h.core.reputation.banned(node.public_key, h.clock()) is not None:
                t.forged_to_ban = t.forged
                if name != "sybil":
                    break
        return t


def learner_s_per_token(model: Any, seqs: int = 64, length: int = 16) -> float:
    """A GRPO step's compute per token on this model: forward + backward of π_θ and a forward
    of π_prox (what the learner spends per consumed token)."""
    ids = torch.randint(3, 26, (seqs, length))
    m = build_model(ModelSpec(), seed=1)
    t0 = time.process_time()
    for _ in range(5):
        with torch.no_grad():
            m(input_ids=ids)
        out = m(input_ids=ids).logits.float().log_softmax(-1).mean()
        out.backward()
    return (time.process_time() - t0) / (5 * seqs * length)


def verifier_s_per_token(model: Any, seqs: int = 64, length: int = 16, *, local: bool) -> float:
    """What re-scoring a checked lease costs per token: one batched fp32 forward and the seeded
    replay, and with ``local`` the check's second forward in bf16 whose spread sizes the replay's
    slack (what the calibrated verifier runs)."""
    import copy

    from policy.draw import sample_uniforms
    from policy.scoring import audit_samples

    prompts = [[1, 4, 5, 6, 3]] * seqs
    comps = [torch.randint(3, 26, (length,)).tolist() for _ in range(seqs)]
    uniforms = [sample_uniforms(i, length) for i in range(seqs)]
    kw: dict[str, Any] = {}
    if local:
        kw = {"alt_model": copy.deepcopy(model).to(torch.bfloat16), "local_slack": 1.0}
    audit_samples(model, prompts, comps, uniforms=uniforms, **kw)  # warm-up
    t0 = time.process_time()
    for _ in range(5):
        audit_samples(model, prompts, comps, uniforms=uniforms, **kw)
    return (time.process_time() - t0) / (5 * seqs * (length + 5))


async def ack_latency(
    model: Any, leases: int
) -> tuple[list[float], list[float], list[float]]:
    """Wall seconds of ``SubmissionDesk.receive`` (the ack a node is sent, as the node RPC
    answers it, without the network) for honest leases, split into (checked, unchecked), and
    the wall seconds of each checked lease's re-score after its ack (``SubmissionDesk.settle``,
    run before the next lease, untimed by the ack): one node at a check rate of 0.5 against the
    calibrated verifier, leases of 2 prompts x 8 samples x 8 tokens; the calibration runs on a
    warm-up lease first."""
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(
            Path(tmp),
            group_size=8,
            sampling={"max_new_tokens": 8},
            leases={"max_prompts_per_lease": 2, "max_active_per_node": 64},
            intake={"spot_check_fraction": 0.5, "new_node_check_rate": 0.5},
        )
        with_verifier(h, model)
        node = h.node()
        await h.core.submit(node.public_key, sampled(h.lease(node, 2), model))
        checked: list[float] = []
        unchecked: list[float] = []
        settled: list[float] = []
        for _ in range(leases):
            lease = h.lease(node, 2)
            sub = sampled(lease, model)
            rate = h.core.trust.rate(node.public_key)
            is_checked = h.core.intake.spot_checked(lease.lease_id, rate)
            t0 = time.perf_counter()
            got, held = await h.core.desk.receive(node.public_key, sub)
            took = time.perf_counter() - t0
            if not isinstance(got, Ack):
                raise RuntimeError(f"an honest lease was refused: {got}")
            if (held is not None) != is_checked:
                raise RuntimeError(f"lease {lease.lease_id}: held {held}, drawn {is_checked}")
            (checked if is_checked else unchecked).append(took)
            if held is not None:
                t0 = time.perf_counter()
                done = await h.core.desk.settle(held)
                settled.append(time.perf_counter() - t0)
                if not isinstance(done, Ack):
                    raise RuntimeError(f"an honest lease failed its check: {done}")
            h.clock.advance(1.0)
        return checked, unchecked, settled


def separable(checked: list[float], unchecked: list[float]) -> float:
    """Accuracy of the best threshold on latency telling checked from unchecked leases (0.5:
    no information at equal counts; 1.0: the latency says it every time)."""
    both = sorted(checked + unchecked)
    best = 0.0
    for t in both:
        right = sum(x > t for x in checked) + sum(x <= t for x in unchecked)
        best = max(best, right / len(both))
    return best


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=4000, help="leases per strategy at most")
    ap.add_argument("--floor", type=float, default=0.05, help="intake.spot_check_fraction")
    ap.add_argument("--eps", type=float, default=0.01, help="intake.target_forged_share")
    ap.add_argument("--n", type=int, default=80, help="after-n: honest leases after a refusal")
    ap.add_argument("--p", type=float, default=0.1, help="prob-p: forging probability")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default="floor,after-n,prob-p,sybil")
    ap.add_argument("--quick", action="store_true", help="smoke run: eps 0.2, 300 leases")
    ap.add_argument(
        "--latency", type=int, default=200, help="honest leases timed for the ack latency (0: skip)"
    )
    args = ap.parse_args()
    if args.quick:
        args.eps, args.leases = 0.2, min(args.leases, 300)
    torch.set_num_threads(1)
    model = build_model(ModelSpec(), seed=0).eval()
    print(f"load average {os.getloadavg()[0]:.2f} (fake clock: load changes wall time only)")
    from coordinator.config import IntakeSection
    from coordinator.store import Store
    from coordinator.trust import Trust  # the schedule the core uses, for the formulas

    with tempfile.TemporaryDirectory() as tmp:
        intake = IntakeSection(spot_check_fraction=args.floor, target_forged_share=args.eps)
        trust = Trust(Store(Path(tmp) / "s.sqlite"), intake)
        expected = {
            "floor": share_forging_from(trust.rate_after, trust.leases_to_floor()),
            "after-n": share_forging_from(trust.rate_after, args.n),
            "prob-p": share_forging_with_probability(trust.rate_after, args.p),
            "sybil": 1.0 - trust.rate_after(0),
        }
    print("| strategy | leases | accepted | forged accepted | forged share (formula) | "
          "forged leases to ban | identities | wall s |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    rng = random.Random(args.seed)
    for name in [s for s in args.strategies.split(",") if s]:
        t0 = time.monotonic()
        t = await play(name, model, args, rng)
        share = t.forged_accepted / t.accepted if t.accepted else 0.0
        ban = "-" if t.forged_to_ban is None else str(t.forged_to_ban)
        print(f"| {name} | {t.leases} | {t.accepted} | {t.forged_accepted} | {share:.3%} "
              f"({expected[name]:.3%}) | {ban} | {t.identities} | "
              f"{time.monotonic() - t0:.0f} |", flush=True)  # fmt: skip
    bound = forged_leases_to_ban(args.floor, 3)
    print(f"bound: banned within {forged_leases_to_ban(args.floor, 1)} forged leases (gross, "
          f"ban at once) / {bound} (subtle, 3 strikes) with probability >= 99%")  # fmt: skip
    if args.latency:
        import statistics

        checked, unchecked, settled = await ack_latency(model, args.latency)
        runs = (("c", checked), ("u", unchecked), ("s", settled))
        ms = {k: statistics.median(v) * 1e3 for k, v in runs if v}
        print(f"ack latency (SubmissionDesk.receive, the node RPC's answer, wall): checked "
              f"{len(checked)} leases median {ms.get('c', float('nan')):.1f} ms, unchecked "
              f"{len(unchecked)} median {ms.get('u', float('nan')):.1f} ms; a latency threshold "
              f"tells them apart in {separable(checked, unchecked):.1%} of leases (best "
              f"threshold; 50% at equal counts is chance); the re-score after the ack: median "
              f"{ms.get('s', float('nan')):.1f} ms")  # fmt: skip
    lrn = learner_s_per_token(model)
    v1 = verifier_s_per_token(model, local=False)
    v2 = verifier_s_per_token(model, local=True)
    print(f"learner {lrn * 1e6:.2f} us/token (fwd+bwd+fwd); verifier {v1 * 1e6:.2f} us/token "
          f"with the fp32 forward alone, {v2 * 1e6:.2f} us/token with the check's bf16 forward "
          f"(local replay slack): verification at the floor {args.floor:g} = "
          f"{args.floor * v1 / lrn:.2%} / {args.floor * v2 / lrn:.2%} of the learner's compute "
          "(bf16 on a CPU without bf16 units is several times slower than fp32; on a GPU "
          "verifier it is not)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
