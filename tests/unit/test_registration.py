"""Registration and version publication as parts built alone (issue 33): the pure decisions
(:func:`coordinator.registration.decide_registration`,
:func:`coordinator.publication_desk.publication_refusal`) on hand-made contexts, then
:class:`RegistrationDesk` and :class:`PublicationDesk` over a real store with their real
collaborators (no Coordinator)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from coord_harness import FakeClock, advert, config
from prometheus_client import CollectorRegistry

from coordinator.activation import ActiveSet, LearnerFigures
from coordinator.config import CoordinatorConfig
from coordinator.errors import Rejection
from coordinator.leases import LeaseManager, newest_servable
from coordinator.liveness import HeartbeatSchedule, Liveness
from coordinator.publication_desk import PublicationDesk, publication_refusal
from coordinator.receipts import ReceiptLog
from coordinator.records import NodeRecord
from coordinator.registration import RegistrationContext, RegistrationDesk, decide_registration
from coordinator.reputation import Ban
from coordinator.store import Store
from coordinator.throughput import LeaseLag, ThroughputBook
from coordinator.trust import PUT_SQL, Trust, TrustState, put_args
from coordinator.verify_budget import VerificationBudget
from protocol.errors import AuthError, ReasonCode
from protocol.identity import Identity, fingerprint_of
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import DeltaInfo, Manifest

NOW = 1_000_000.0


def cfg(tmp_path: Path, **overrides: object) -> CoordinatorConfig:
    return config(tmp_path, **overrides)


def row(ident: Identity, *, at: float, backend: str = "hf", dtype: str = "float32") -> NodeRecord:
    return NodeRecord(
        node_key=ident.public_key,
        fingerprint=fingerprint_of(ident.public_key),
        advert=None,
        registered_at=at,
        last_seen=at,
        tokens_per_s=50.0,
        rollouts_per_s=2.0,
        price_per_hour=None,
        backend=backend,
        dtype=dtype,
        leases_completed=4,
        leases_expired=1,
    )


def ctx(
    node: NodeRecord | None = None,
    *,
    ban: Ban | None = None,
    trust: TrustState | None = None,
    unwritten: float = -math.inf,
    horizon: float = -math.inf,
) -> RegistrationContext:
    return RegistrationContext(node, ban, trust, 3 if node is None else None, unwritten, horizon)


# --- the pure decision ---------------------------------------------------------------------------
def test_a_new_identity_is_admitted_with_a_receipt_and_no_replan(tmp_path: Path) -> None:
    c, ident = cfg(tmp_path), Identity.generate()
    d = decide_registration(ident.public_key, advert(ident, NOW), ctx(), NOW, c)
    assert d.new and d.trust is None and not d.replan
    assert d.record.registered_at == d.record.last_seen == NOW
    assert d.record.tokens_per_s == 100.0 and d.record.rollouts_per_s is None  # advert's claim
    assert d.receipt == {"node": fingerprint_of(ident.public_key), "held_to": "hf/float32",
                         "previous": None}  # fmt: skip


def test_refusals_in_order_signer_dtype_ban(tmp_path: Path) -> None:
    c, ident, other = cfg(tmp_path), Identity.generate(), Identity.generate()
    with pytest.raises(Rejection) as e:  # the advert names another key
        decide_registration(other.public_key, advert(ident, NOW, dtype="bfloat16"), ctx(), NOW, c)
    assert e.value.code is ReasonCode.SCHEMA
    c16 = cfg(tmp_path, intake={"accepted_dtypes": ["float32"]})
    with pytest.raises(Rejection) as e:
        decide_registration(ident.public_key, advert(ident, NOW, dtype="bfloat16"), ctx(), NOW, c16)
    assert e.value.code is ReasonCode.REGISTRATION_MISMATCH and not e.value.strike
    ban = Ban(until=NOW + 30.0, count=2, reason="forged")
    with pytest.raises(Rejection) as e:
        decide_registration(
            ident.public_key, advert(ident, NOW), ctx(row(ident, at=NOW - 5), ban=ban), NOW, c
        )
    assert e.value.code is ReasonCode.BANNED and e.value.retry_after_s == pytest.approx(30.0)
    with pytest.raises(Rejection) as e:  # as before: a banned key with no row must register
        decide_registration(ident.public_key, advert(ident, NOW), ctx(ban=ban), NOW, c)
    assert e.value.code is ReasonCode.UNKNOWN_NODE


def test_a_relabel_waits_its_interval_then_restarts_the_clean_history(tmp_path: Path) -> None:
    c, ident = cfg(tmp_path), Identity.generate()
    interval = c.intake.registration_change_interval_s
    old = row(ident, at=NOW - 10.0)
    trust = TrustState(5, True, NOW - 50.0, None, 7)  # a suspect with some clean work
    ad = advert(ident, NOW, dtype="bfloat16")
    with pytest.raises(Rejection) as e:  # 10 s after registering
        decide_registration(ident.public_key, ad, ctx(old, trust=trust), NOW, c)
    assert e.value.code is ReasonCode.REGISTRATION_MISMATCH and not e.value.strike
    assert e.value.retry_after_s == pytest.approx(interval - 10.0)
    later = NOW - 10.0 + interval + 1.0
    d = decide_registration(ident.public_key, ad, ctx(old, trust=trust), later, c)
    assert not d.new and d.trust == TrustState(0, True, NOW - 50.0, later, 0)
    assert d.receipt is not None and d.receipt["previous"] == "hf/float32"
    assert d.receipt["held_to"] == "hf/bfloat16"
    assert d.record.registered_at == NOW - 10.0 and d.record.leases_completed == 4
    changed = replace(trust, label_changed_at=later)  # the next change counts from that one
    with pytest.raises(Rejection):
        decide_registration(ident.public_key, advert(ident, later + 5), ctx(
            replace(old, dtype="bfloat16"), trust=changed), later + 5, c)  # fmt: skip


def test_replan_only_when_the_plan_inputs_changed(tmp_path: Path) -> None:
    c, ident = cfg(tmp_path), Identity.generate()
    horizon = c.heartbeat_interval_s * c.heartbeat_misses
    old = row(ident, at=NOW - 10.0)
    ad = advert(ident, NOW)

    def replan(node: NodeRecord, unwritten: float = -math.inf, price: float | None = None) -> bool:
        loaded = ctx(node, unwritten=unwritten, horizon=NOW - horizon)
        return decide_registration(
            ident.public_key, advert(ident, NOW, price=price), loaded, NOW, c
        ).replan

    assert decide_registration(ident.public_key, ad, ctx(old), NOW, c).receipt is None
    assert not replan(old)  # alive and unchanged (its measured throughput stays)
    assert replan(replace(old, tokens_per_s=None))  # the advert's claim fills the gap
    gone = replace(old, last_seen=NOW - horizon - 1.0)
    assert replan(gone)  # a returning node
    assert not replan(gone, unwritten=NOW - 1.0)  # heard since, not yet written: not gone
    assert replan(old, price=2.5)  # another price


# --- the desk over a store ---------------------------------------------------------------------
class Parts:
    """The registration desk with its real collaborators over a temp store."""

    def __init__(self, tmp_path: Path, **overrides: object) -> None:
        self.cfg = cfg(tmp_path, **overrides)
        self.clock = FakeClock(NOW)
        self.store = Store(self.cfg.db_path)
        self.liveness = Liveness(self.store, HeartbeatSchedule.from_config(self.cfg))
        self.receipts = ReceiptLog(self.store)
        trust = Trust(self.store, self.cfg.intake)
        leases = LeaseManager(
            self.store, self.cfg.leases, clock=self.clock, group_size=self.cfg.group_size,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
        )  # fmt: skip
        budget = VerificationBudget(
            self.cfg, trust=trust, clock=self.clock, lease_size=leases.lease_size, checks_on=False
        )
        self.active = ActiveSet(
            self.cfg, store=self.store, clock=self.clock, liveness=self.liveness,
            throughput=ThroughputBook(0.3), learner=LearnerFigures.from_config(self.cfg),
            registry=CollectorRegistry(), verification=budget,
        )  # fmt: skip
        self.replans = 0

        def replan() -> object:
            self.replans += 1
            return self.active.replan()

        self.desk = RegistrationDesk(
            self.cfg, store=self.store, clock=self.clock, liveness=self.liveness, budget=budget,
            receipts=self.receipts, replan=replan,
            lease_version=lambda: newest_servable(self.store.recent_versions(3), None),
        )  # fmt: skip

    def join(self, **changes: object) -> Identity:
        ident = Identity.generate()
        self.desk.register(ident.public_key, advert(ident, self.clock(), **changes))  # type: ignore[arg-type]
        return ident


def test_the_desk_registers_relabels_and_writes_once(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    ident = p.join()
    ack = p.desk.register(ident.public_key, advert(ident, p.clock()))  # re-sent: no receipt
    assert ack.node_fingerprint == fingerprint_of(ident.public_key)
    assert ack.current_policy_version is None and ack.server_time == NOW
    assert [e.kind for e in p.receipts.entries()] == ["register"]
    p.store.execute(PUT_SQL, put_args(ident.public_key, TrustState(3, False, None, None, 9)))
    p.clock.advance(p.cfg.intake.registration_change_interval_s + 1.0)
    p.liveness.saw(ident.public_key, p.clock())  # its heartbeats, not yet written
    p.desk.register(ident.public_key, advert(ident, p.clock(), dtype="bfloat16"))
    node = p.store.get_node(ident.public_key)
    assert node is not None and node.dtype == "bfloat16" and node.registered_at == NOW
    assert Trust(p.store, p.cfg.intake).state(ident.public_key) == TrustState(
        0, False, None, p.clock(), 0
    )
    entries = p.receipts.entries()
    assert [e.kind for e in entries] == ["register", "register"]
    assert entries[1].data()["previous"] == "hf/float32"
    assert p.replans == 0  # alive (heard), same price: the plan's inputs did not change


def test_a_relabelled_node_with_a_strike_on_record_stays_a_suspect(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    ident = p.join()
    p.store.add_strike(ident.public_key, "bad_logprobs", "", p.clock())  # no trust row yet
    p.clock.advance(p.cfg.intake.registration_change_interval_s + 1.0)
    p.desk.register(ident.public_key, advert(ident, p.clock(), dtype="bfloat16"))
    state = Trust(p.store, p.cfg.intake).state(ident.public_key)
    assert state == TrustState(0, True, None, p.clock(), 0)


def test_a_full_table_forgets_the_longest_gone_node_or_refuses(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_nodes=2)
    first = p.join()
    p.clock.advance(10.0)
    second = p.join()
    with pytest.raises(Rejection) as e:  # both alive: nobody to forget, nothing lost
        p.join()
    horizon = p.cfg.heartbeat_interval_s * p.cfg.heartbeat_misses
    assert e.value.code is ReasonCode.SWARM_FULL and e.value.retry_after_s == horizon
    assert p.store.node_count() == 2
    p.clock.advance(horizon + 5.0)
    p.liveness.saw(second.public_key, p.clock())  # heard, not yet written: the flush counts it
    third = p.join()
    keys = {n.node_key for n in p.store.nodes()}
    assert keys == {second.public_key, third.public_key}  # the first, gone longest, forgotten
    assert p.liveness.unwritten(second.public_key) == -math.inf  # flushed before choosing
    assert first.public_key not in keys


def test_a_returning_node_replans(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    ident = p.join()
    p.clock.advance(p.cfg.heartbeat_interval_s * p.cfg.heartbeat_misses + 1.0)
    p.desk.register(ident.public_key, advert(ident, p.clock()))
    assert p.replans == 1


# --- publication ---------------------------------------------------------------------------------
def manifest(version: int, delta: DeltaInfo | None = None) -> Manifest:
    files = {"model.safetensors": b"w" * 64} | ({"delta.rsd": b"d" * 10} if delta else {})
    m, _ = build_manifest(
        files, version=version, parent_version=None, model_config_hash="ab", tokenizer_hash="cd",
        created_at=NOW, expires_at=NOW + 600, chunk_size=32, tensors=[] if delta else None,
        delta=delta,
    )  # fmt: skip
    return m


def test_publication_refusal_is_a_function_of_what_was_read() -> None:
    v1 = manifest(1)
    assert publication_refusal(v1, None, None) is None
    refusal = publication_refusal(v1, 1, None)
    assert refusal is not None and refusal.code is ReasonCode.VERSION_NOT_NEWER
    good = DeltaInfo(base_version=1, base_root_hash=v1.root_hash, files=["delta.rsd"])
    assert publication_refusal(manifest(2, good), 1, v1) is None
    missing = publication_refusal(manifest(2, good), 1, None)  # its base was never published
    assert missing is not None and missing.code is ReasonCode.DELTA_BASE_MISSING
    assert "never published" in missing.detail
    other = publication_refusal(manifest(2, replace_root(good)), 1, v1)  # other base bytes
    assert other is not None and other.code is ReasonCode.DELTA_BASE_MISSING
    assert "other bytes" in other.detail


def test_the_publication_desk_records_versions(tmp_path: Path) -> None:
    c, clock, trainer = cfg(tmp_path), FakeClock(NOW), Identity.generate()
    store, registry = Store(c.db_path), CollectorRegistry()
    lag, learner = LeaseLag(0.3), LearnerFigures.from_config(c)
    desk = PublicationDesk(
        store=store, clock=clock, publisher_key=trainer.public_key, lease_lag=lag,
        learner=learner, registry=registry,
    )  # fmt: skip
    v1 = manifest(1)
    assert desk.publish(sign_manifest(v1, trainer, NOW)) == v1
    delta = DeltaInfo(base_version=1, base_root_hash=v1.root_hash, files=["delta.rsd"])
    desk.publish(sign_manifest(manifest(2, delta), trainer, NOW))
    assert store.latest_version() == 2 and learner.last_published == 2
    assert registry.get_sample_value("swarm_policy_version") == 2.0
    for m, code in ((manifest(2), ReasonCode.VERSION_NOT_NEWER),
                    (manifest(3, replace_root(delta)), ReasonCode.DELTA_BASE_MISSING)):  # fmt: skip
        with pytest.raises(Rejection) as e:
            desk.publish(sign_manifest(m, trainer, NOW))
        assert e.value.code is code
    assert store.latest_version() == 2
    with pytest.raises(AuthError) as bad:  # signed by someone else
        desk.publish(sign_manifest(manifest(3), Identity.generate(), NOW))
    assert bad.value.code is ReasonCode.BAD_SIGNATURE
    keyless = PublicationDesk(
        store=store, clock=clock, publisher_key=None, lease_lag=lag, learner=learner,
        registry=CollectorRegistry(),
    )  # fmt: skip
    with pytest.raises(Rejection) as e:
        keyless.publish(sign_manifest(manifest(3), trainer, NOW))
    assert e.value.code is ReasonCode.INTERNAL


def replace_root(delta: DeltaInfo) -> DeltaInfo:
    return DeltaInfo(base_version=delta.base_version, base_root_hash=bytes(32), files=delta.files)
