"""Byzantine nodes against a real coordinator (DESIGN.md §7): every cheat is refused with its
reason code, strikes ban the cheat, honest nodes keep being served throughout, and after a cheat's
first detection nothing more of it is accepted into the trainer's feed.

One ``swarm coordinator launch`` process on 127.0.0.1 with spot checks on a third of the leases
(so the log-prob and sampling cheats are only caught when checked — until their first strike,
after which every lease of theirs is checked in full). Honest nodes sample with the ``hf``
backend on the published weights; each cheat starts from an honest submission and changes what a
cheater would change, keeping everything else honest (e.g. greedy decoding reports the honest
log-probs of the lease's distribution, so only the sampling audit can tell).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
import pytest_asyncio
from swarm_harness import (
    CoordinatorProc,
    TestNode,
    Trainer,
    _backend,
    coordinator_toml,
    honest_submission,
    launch_coordinator,
)

from coordinator.tasks import Problem, ReverseTask
from node.byzantine import misbehave
from node.client import Rejected
from node.rollouts import build_submission, lease_requests, to_sampling_config
from policy.model import CharTokenizer
from protocol import rpc
from protocol.codec import decode
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import (
    Ack,
    GroupResult,
    Lease,
    LeaseRequest,
    Reject,
    RolloutSubmission,
    Standby,
    Timings,
    unpack_tokens,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TOK = CharTokenizer()
TASK = ReverseTask()
SPOT_FRACTION = 0.34
STRIKES_TO_BAN = 3
MAX_ROUNDS = 40  # a sampled-only cheat escapes 40 unchecked leases with p = 0.66^40 ≈ 6e-8


# --- the cheats ---------------------------------------------------------------------------------
def _timings() -> Timings:
    now = time.time()
    return Timings(started_at=now, finished_at=now, generate_s=0.01)


def _sample_with(
    lease: Lease,
    model_version: int,
    *,
    top_k: int | None = None,
    seed_offset: int = 0,
    n: int | None = None,
    rescore: bool = True,
) -> RolloutSubmission:
    """Sample ``lease`` on the weights of ``model_version`` (optionally greedy, from other
    seeds, more samples per prompt). With ``rescore`` the log-probs reported are the honest ones
    of the lease's distribution at the lease's version; the seeds named are always the lease's."""
    from node.backends.base import SampleOut
    from node.byzantine import report_logprobs_of

    backend = _backend(model_version)
    requests = lease_requests(lease)
    drawn = [dataclasses.replace(r, seed=r.seed + seed_offset, n=n or r.n) for r in requests]
    honest = to_sampling_config(lease)
    sampling = honest if top_k is None else dataclasses.replace(honest, top_k=top_k)
    outs = backend.generate(drawn, sampling)
    if rescore:
        report_logprobs_of(_backend(lease.policy_version).model, drawn, outs, honest)
    if n is not None:  # cherry-pick: keep the G draws with the highest reward
        for i, (prompt, group) in enumerate(zip(lease.prompts, outs, strict=True)):
            problem = TASK.problem(int(prompt.prompt_id.rsplit(":", 1)[1]))

            def reward(o: SampleOut, problem: Problem = problem) -> float:
                return TASK.reward(problem, TOK.decode(o.token_ids), o.finish_reason == "stop")

            outs[i] = sorted(group, key=reward, reverse=True)[: lease.group_size]
    eos = set(backend.eos_token_ids)
    return build_submission(
        lease, requests, outs, eos, backend="hf", dtype="float32", timings=_timings()
    )


def _byz(mode: str) -> Callable[[Lease], RolloutSubmission]:
    def cheat(lease: Lease) -> RolloutSubmission:
        return misbehave(
            [mode],
            honest_submission(lease),
            lease,
            vocab_size=TOK.vocab_size,
            tokenizer=TOK,
            rng=random.Random(lease.epoch),
        )

    return cheat


def _groups(
    lease: Lease, fn: Callable[[list[GroupResult]], list[GroupResult]]
) -> RolloutSubmission:
    sub = honest_submission(lease)
    return msgspec.structs.replace(sub, groups=fn(list(sub.groups)))


def _version(delta: int) -> Callable[[Lease], RolloutSubmission]:
    def cheat(lease: Lease) -> RolloutSubmission:
        return msgspec.structs.replace(
            honest_submission(lease), policy_version=lease.policy_version + delta
        )

    return cheat


def _self_chosen(lease: Lease) -> RolloutSubmission:
    """Answers prompts of its own choosing under the lease's prompt ids' places."""

    def swap(groups: list[GroupResult]) -> list[GroupResult]:
        return [
            msgspec.structs.replace(g, prompt_id=f"{TASK.name}:{90_000_000 + i:08d}")
            for i, g in enumerate(groups)
        ]

    return _groups(lease, swap)


@dataclass
class Cheat:
    name: str
    make: Callable[[Lease], RolloutSubmission] | None  # None: the copy/replay cheats below
    codes: frozenset[ReasonCode]
    #: refused by a check every submission gets (else only by a spot check, until struck)
    always: bool
    node: TestNode | None = None
    attempts: int = 0
    accepted_before_detection: int = 0
    detected_at: int | None = None
    detected_seq: int | None = None
    banned_at: int | None = None
    verdicts: list[str] = field(default_factory=list)


def cheats() -> list[Cheat]:
    lm, sm = ReasonCode.LOGPROB_MISMATCH, ReasonCode.SAMPLING_MISMATCH
    ig = ReasonCode.INCOMPLETE_GROUP
    return [
        Cheat("fabricated log-probs", _byz("forge_logprobs"), frozenset({lm}), False),
        Cheat(
            "a different model",
            lambda x: _sample_with(x, x.policy_version + 1000, rescore=False),
            frozenset({lm}),
            False,
        ),
        Cheat(
            "greedy decoding",
            lambda x: _sample_with(x, x.policy_version, top_k=1),
            frozenset({sm}),
            False,
        ),
        Cheat(
            "cherry-picked samples (best 4 of 12 draws)",
            lambda x: _sample_with(x, x.policy_version, seed_offset=1, n=3 * x.group_size),
            frozenset({sm}),
            False,
        ),
        Cheat(
            "inflated rewards (answer swapped in)",
            _byz("inflate_reward"),
            frozenset({lm, sm}),
            False,
        ),
        Cheat(
            "truncated groups",
            lambda x: _groups(
                x, lambda gs: [msgspec.structs.replace(g, samples=g.samples[:-1]) for g in gs]
            ),
            frozenset({ig}),
            True,
        ),
        Cheat(
            "cherry-picked prompts (one dropped)",
            lambda x: _groups(x, lambda gs: gs[:-1]),
            frozenset({ig}),
            True,
        ),
        Cheat("self-chosen prompts", _self_chosen, frozenset({ig}), True),
        Cheat(
            "claims a newer version", _version(+1), frozenset({ReasonCode.VERSION_MISMATCH}), True
        ),
        Cheat(
            "claims an older version", _version(-1), frozenset({ReasonCode.VERSION_MISMATCH}), True
        ),
        Cheat(
            "out-of-vocabulary tokens",
            _byz("oov_tokens"),
            frozenset({ReasonCode.TOKEN_OUT_OF_VOCAB}),
            True,
        ),
        Cheat("copies another node's submission", None, frozenset({ReasonCode.WRONG_NODE}), True),
        Cheat("copies another node's groups into its lease", None, frozenset({ig}), True),
    ]


# --- the swarm ----------------------------------------------------------------------------------
@dataclass
class Swarm:
    coord: CoordinatorProc
    trainer: Trainer

    async def node(self) -> TestNode:
        node = TestNode(self.trainer.transport, self.coord.peer_id)
        await node.register()
        return node


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    tmp = tmp_path_factory.mktemp("byzantine")
    trainer_id = Identity.generate()
    config = coordinator_toml(
        tmp,
        trainer_id,
        intake={"spot_check_fraction": SPOT_FRACTION},
        reputation={"strikes_to_ban": STRIKES_TO_BAN, "ban_base_s": 3600.0},
        leases={"max_active_per_node": 8},
    )
    coord = await launch_coordinator(tmp, config)
    trainer = Trainer(coord, trainer_id, tmp)
    try:
        await trainer.start()
        await trainer.publish(1)
        await trainer.publish(2)  # leases are for v2; v1 exists to claim as "older"
        yield Swarm(coord, trainer)
    finally:
        try:
            await trainer.stop()
        finally:
            coord.proc.stop()


async def lease_or_refusal(node: TestNode) -> Lease | ReasonCode | None:
    """A lease, the refusal code (banned), or None on standby."""
    try:
        got = await node.client.lease(
            LeaseRequest(peer_id=node.transport.peer_id, policy_version=None, max_prompts=2)
        )
    except Rejected as exc:
        return exc.code
    return None if isinstance(got, Standby) else got


async def test_every_cheat_is_refused_struck_and_banned_while_honest_nodes_train(
    swarm: Swarm,
) -> None:
    honest = [await swarm.node(), await swarm.node()]
    victim = await swarm.node()  # an honest node whose work the copy cheats steal
    plays = cheats()
    for cheat in plays:
        cheat.node = await swarm.node()
    honest_keys: set[tuple[str, str, int]] = set()
    seq = 0

    async def feed_len() -> int:
        return len(await swarm.trainer.fetch(0))

    for _round in range(MAX_ROUNDS):
        for node in honest:  # honest nodes are served in every round
            lease = await node.lease()
            verdict = await node.submit(node.rollouts(lease))
            assert isinstance(verdict, Ack), verdict
            honest_keys |= {
                (lease.lease_id, p.prompt_id, j)
                for p in lease.prompts
                for j in range(lease.group_size)
            }
        playing = [c for c in plays if c.banned_at is None]
        if not playing:
            break
        for cheat in playing:
            assert cheat.node is not None
            got = await lease_or_refusal(cheat.node)
            if got is None:
                continue
            if isinstance(got, ReasonCode):
                assert got is ReasonCode.BANNED, (cheat.name, got)
                assert cheat.detected_at is not None, f"{cheat.name}: banned before detection?"
                cheat.banned_at = cheat.attempts
                continue
            cheat.attempts += 1
            if cheat.name == "copies another node's submission":
                stolen = await victim.lease()
                verdict = await cheat.node.submit(victim.rollouts(stolen))
                assert isinstance(await victim.submit(victim.rollouts(stolen)), Ack)
            elif cheat.name == "copies another node's groups into its lease":
                stolen = await victim.lease()
                theirs = victim.rollouts(stolen)
                verdict = await cheat.node.submit(
                    msgspec.structs.replace(honest_submission(got), groups=theirs.groups)
                )
                assert isinstance(await victim.submit(theirs), Ack)
            else:
                assert cheat.make is not None
                verdict = await cheat.node.submit(cheat.make(got))
            cheat.verdicts.append("ack" if isinstance(verdict, Ack) else verdict.code.value)
            if isinstance(verdict, Ack):
                assert cheat.detected_at is None, (
                    f"{cheat.name}: accepted after its first detection: {cheat.verdicts}"
                )
                assert not cheat.always, f"{cheat.name}: accepted: {cheat.verdicts}"
                cheat.accepted_before_detection += len(got.prompts) * got.group_size
                continue
            assert verdict.code in cheat.codes, (cheat.name, verdict)
            if cheat.detected_at is None:
                cheat.detected_at = cheat.attempts
                seq = await feed_len()
                cheat.detected_seq = seq

    report = [
        f"{c.name}: {c.attempts} attempts, detected at #{c.detected_at}, banned after "
        f"#{c.banned_at}, {c.accepted_before_detection} samples accepted before detection, "
        f"verdicts {c.verdicts}"
        for c in plays
    ]
    print("\n".join(["", *report]))
    for cheat in plays:
        assert cheat.banned_at is not None, f"not banned: {cheat.name}: {cheat.verdicts}"
        refused = [v for v in cheat.verdicts if v != "ack"]
        assert len(refused) == STRIKES_TO_BAN, (cheat.name, cheat.verdicts)

    feed = await swarm.trainer.fetch(0)
    by_node: dict[str, list[int]] = {}
    for row in feed:
        by_node.setdefault(row.node_fingerprint, []).append(row.seq)
    for cheat in plays:
        assert cheat.node is not None and cheat.detected_seq is not None
        late = [
            s for s in by_node.get(cheat.node.identity.fingerprint, []) if s > cheat.detected_seq
        ]
        assert late == [], f"{cheat.name}: accepted after its first detection: {late}"
        accepted = len(by_node.get(cheat.node.identity.fingerprint, []))
        assert accepted == cheat.accepted_before_detection, cheat.name
    got_honest = {
        (r.lease_id, r.prompt_id, r.sample_index)
        for r in feed
        if r.node_fingerprint in {n.identity.fingerprint for n in honest}
    }
    assert got_honest == honest_keys  # every honest sample, once
    assert len(feed) == len({(r.lease_id, r.prompt_id, r.sample_index) for r in feed})
    status = await swarm.trainer.status()
    banned = set(status["nodes_banned"])  # type: ignore[arg-type]
    assert banned == {c.node.identity.fingerprint for c in plays if c.node is not None}
    assert not banned & {n.identity.fingerprint for n in [*honest, victim]}


async def test_a_replayed_envelope_is_refused_and_strikes_nobody(swarm: Swarm) -> None:
    """A third party re-sends a node's signed submission byte for byte: refused as replayed, not
    counted twice, and the signer (who did nothing wrong) gets no strike."""
    node = await swarm.node()
    lease = await node.lease()
    wire = node.sealed(node.rollouts(lease))
    call = swarm.trainer.transport.call
    first = decode(await call(swarm.coord.peer_id, rpc.SUBMIT, wire, timeout=30))
    assert isinstance(first, Ack), first
    before = len(await swarm.trainer.fetch(0))
    for _ in range(3):
        again = decode(await call(swarm.coord.peer_id, rpc.SUBMIT, wire, timeout=30))
        assert isinstance(again, Reject) and again.code is ReasonCode.REPLAYED, again
    assert len(await swarm.trainer.fetch(0)) == before
    nxt = await node.lease()  # the signer is not banned or struck
    assert isinstance(await node.submit(node.rollouts(nxt)), Ack)
    assert unpack_tokens(nxt.prompts[0].token_ids)
