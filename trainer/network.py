"""The trainer on the network: :func:`run_trainer` joins the swarm, sets the recipe up and
trains on the coordinator's rollouts until stopped (``swarm trainer run``'s rank 0; the CLI's
checks, the ranks and the exit codes are :mod:`trainer.main`).

Read :func:`run_trainer` top to bottom: the swarm peer and transport (while the DHT comes up, a
thread imports the model's config, tokenizer and modelling code: :func:`_model_facts`), the
coordinator's pinned key, the broadcast node that seeds versions, the reachability watch, the
:class:`~trainer.swarm_client.SwarmPublisher` (the coordinator signs the manifest, the trainer
seeds the chunks) and the sampling contract (``rswarm/status``, adopted); the
:class:`~trainer.recipe.Trainer`, set up in a thread with the leases' stop set; the
:class:`~trainer.swarm_client.CoordinatorSource` (long-polls ``rswarm/fetch``, reports the
learner's figures back, :class:`StepReport`). Before training, the coordinator's newest version
is handed to :meth:`~trainer.recipe.Trainer.sync_published`, and a ``version_not_newer`` refusal
becomes :class:`~trainer.sources.VersionNotNewer`: a trainer restarted after a crash in the
middle of a publication continues with strictly newer versions instead of being refused again
and again. A stop (SIGINT/SIGTERM) gives the work in progress ``stop_grace_s`` (the config's;
at most and by default ``STOP_GRACE_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.identity import Identity
from swarm.tasks import cancel_and_wait
from trainer.config import STOP_GRACE_S as STOP_GRACE_S  # re-exported (trainer.main)
from trainer.swarm_client import CoordinatorError, CoordinatorSource, SwarmPublisher, digest_hex

if TYPE_CHECKING:
    from trainer.evaluation import EvalRunner
    from trainer.progress import LearnerProgress, PendingRollouts

#: Gives a trainer its held-out evaluation: ``(trainer, the coordinator's status, the leases' stop
#: ids, the source)`` -> the task, to close when done. The shell passes it in
#: (:func:`swarm.shell.heldout.start_evaluation`: the coordinator's task with the policy's
#: evaluation protocol), so the trainer imports neither the coordinator nor the shell.
StartEvaluation = Callable[[Any, dict[str, Any], Sequence[int], Any], Any]

log = logging.getLogger(__name__)

# On SIGINT/SIGTERM, the work in progress (the learner step in its thread, a publication, the
# model's set-up) gets the config's ``stop_grace_s`` (default and most: ``STOP_GRACE_S``, imported
# above from trainer.config) to finish; then it is abandoned (docs/operations.md).
#: seconds the last report of the learner's figures may take on the way out
REPORT_TIMEOUT_S = 3.0
#: Seconds the loop's task, cut short after the stop grace, is given to end (:func:`_cut_short`).
CUT_SHORT_S = 5.0


class StepAbandoned(Exception):
    """Stopping: the learner's thread (a step, or the model's set-up) did not finish within
    ``stop_grace_s``; the process must exit without waiting for it
    (:func:`trainer.main.run_from_cli`)."""


async def _race_stop(aw: Any, stop: asyncio.Event) -> Any:
    """Await ``aw`` unless ``stop`` is set first: then ``aw`` is cancelled and
    :class:`_Stopped` raised. For network waits (a wait for the coordinator that is gone)."""
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _Stopped


class _Stopped(Exception):
    """A stop arrived while the trainer was still joining the swarm: nothing to save."""


async def run_trainer(
    config: Any,
    *,
    coordinator_maddr: str,
    coordinator_key: str,
    state_dir: Path,
    start_evaluation: StartEvaluation,
    chunk_size: int = 4 << 20,
    stop: asyncio.Event | None = None,
    dist: Any = None,
) -> int:
    """Join the swarm, publish v0, then train on the coordinator's rollouts until stopped.

    On ``stop``: waits for the coordinator end at once; the step, publication or set-up in
    progress gets ``config.stop_grace_s`` to finish, failed requests are not retried; then the final
    checkpoint. A step still running after the grace raises :class:`StepAbandoned` (the last
    checkpoint stands; the caller exits without joining the thread).

    ``dist``: the process group (:func:`trainer.distributed.init_distributed`) when this is
    rank 0 of a sharded trainer; the other ranks run :func:`trainer.launch.run_follower` (and
    take this rank's config, with the adopted sampling contract, and the leases' stop set)."""
    from policy.model import ModelSpec
    from protocol.identity import parse_fingerprint
    from swarm.adverts import swarm_validators
    from swarm.broadcast import BroadcastNode
    from swarm.chunks import ChunkStore
    from swarm.dht import PeerConfig, SwarmPeer
    from swarm.direct import settings_for
    from swarm.errors import SwarmError
    from swarm.holders import DhtHolderDirectory
    from swarm.transport import P2PTransport
    from trainer.recipe import Trainer
    from trainer.swarm_client import PublicationStopped

    stop = stop if stop is not None else asyncio.Event()
    state_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(state_dir / "trainer.key")
    pinned = parse_fingerprint(coordinator_key)
    coordinator_peer = coordinator_maddr.rsplit("/p2p/", 1)[-1]
    peer = SwarmPeer(
        PeerConfig(initial_peers=(coordinator_maddr,), identity_path=str(state_dir / "p2p.key")),
        record_validators=swarm_validators(),
    )
    spec = ModelSpec(path=config.model_path, dtype=config.dtype)
    joining = asyncio.ensure_future(peer.start())
    # The model's facts (config, tokenizer) and modelling code are imported in a thread while the
    # DHT comes up and the coordinator answers: seconds of transformers' imports (4-8 s on a
    # loaded 2-core machine) off the start-up's path. peer.start() forks the DHT process before
    # its first await, so one turn of the loop first: a child forked while a thread imports could
    # inherit a module lock that no thread of its own will release.
    await asyncio.sleep(0)
    facts = asyncio.ensure_future(asyncio.to_thread(_model_facts, spec))
    facts.add_done_callback(_retrieved)  # left unawaited when the start-up ends early
    try:
        # Joining can take the start-up timeout (15 s + 5 s) against a bootstrap that never
        # answers: a stop ends it (the DHT process and p2pd it started are ended on the way out,
        # swarm.signals.end_descendants)
        await _race_stop(joining, stop)
    except (_Stopped, SwarmError):
        if stop.is_set():  # asked to stop while joining: not a failure to report
            log.info("stopped while joining the swarm")
            return 0
        raise
    broadcast: BroadcastNode | None = None
    reach: asyncio.Task[None] | None = None
    publisher: SwarmPublisher | None = None
    try:
        transport = P2PTransport(peer.p2p)
        # The pinned key is a fingerprint; the raw key comes from the coordinator's signed
        # address record, accepted only if it hashes to the pinned fingerprint.
        pinned_key = await _race_stop(_coordinator_public_key(peer, pinned), stop)
        broadcast = BroadcastNode(
            transport,
            # Seeds keep more than S + 1 versions: receivers may still be fetching older ones.
            ChunkStore(state_dir / "seed", keep_versions=2 * config.max_staleness + 4),
            DhtHolderDirectory(peer),
            pinned_key,
            direct=settings_for(PeerConfig().host_maddrs, config.direct_port),
        )
        broadcast.dialable = False  # announced as a holder only once a dial-back says so
        await broadcast.start()
        reach = asyncio.create_task(
            _watch_reachability(transport, peer, coordinator_peer, broadcast), name="reachability"
        )
        config_hash, tokenizer_hash, positions = await _race_stop(facts, stop)
        publisher = SwarmPublisher(
            transport,
            broadcast,
            coordinator_peer,
            identity,
            model_config_hash=config_hash,
            tokenizer_hash=tokenizer_hash,
            chunk_size=chunk_size,
            publish_dtype=config.publish_dtype,
            keyframe_every=config.keyframe_every,
        )
        # The sampling contract is the coordinator's: adopt it, or refuse what cannot match.
        from trainer.contract import adopt_contract

        status = await _race_stop(publisher.status(), stop)
        config, lease_stops = adopt_contract(config, status, positions)
        log.info("sampling contract: %s, stop set %s", config.processing, list(lease_stops))
        # Building the model (and resuming a sharded checkpoint: a minute on a loaded machine)
        # runs in a thread, so a stop is seen meanwhile; it may finish within the grace.
        setup = asyncio.ensure_future(
            asyncio.to_thread(Trainer.setup, config, dist=dist, lease_stop_ids=lease_stops)
        )
        await _within_grace(setup, stop, "setting up the model", grace_s=config.stop_grace_s)
        trainer = setup.result()
        source = CoordinatorSource(transport, coordinator_peer, identity)
        # The coordinator may hold a version this trainer has no record of (killed between the
        # coordinator's answer to PublishVersion and published.json): continue after it.
        answered, latest = await _latest_version(publisher, stop, sharded=trainer.distributed)
        if not answered:  # a sharded job stopped before the coordinator answered
            # The other ranks are already in the loop's first collective: leaving now would
            # strand them. End the job with them (their final checkpoint), publishing nothing.
            trainer.request_stop()
            await trainer.run(source, None)
            trainer.close()
            return 0
        trainer.sync_published(latest)
        trainer.on_step.append(
            StepReport(
                source,
                progress=trainer.progress,
                pending=trainer.pending,
                kappa=trainer.config.kappa,
                max_staleness=trainer.config.max_staleness,
                evaluation=trainer.evaluation,
                publisher=publisher,
            )
        )
        if trainer.evaluation is not None:  # the held-out evaluation (StartEvaluation)
            start_evaluation(trainer, status, lease_stops, source)
        if stop.is_set():  # stopped during the set-up: a final checkpoint, as on any stop
            trainer.request_stop()
        run = asyncio.create_task(trainer.run(source, publisher), name="trainer-loop")
        await _within_grace(
            run,
            stop,
            "the learner step",
            on_stop=[trainer.request_stop, publisher.stop],
            busy=lambda: trainer.training,
            grace_s=config.stop_grace_s,
        )
        if not run.done():  # a publication's network wait (no thread busy): cut it short
            log.warning(
                "the learner did not stop within %g s; cutting it short", config.stop_grace_s
            )
            await _cut_short(run)
            _final_checkpoint(trainer)
        else:
            try:
                run.result()
            except PublicationStopped as exc:  # stopping while a publication failed
                log.warning("%s", exc)
                _final_checkpoint(trainer)
        if source.failures == 0:  # the last step's figures reach /status before we leave
            await source.report(timeout=REPORT_TIMEOUT_S)
        trainer.close()
        return 0
    except _Stopped:
        log.info("stopped before training (the checkpoint it resumed from, if any, stands)")
        return 0
    except PublicationStopped as exc:  # the first publication, or the set-up's status request
        if not stop.is_set():
            raise
        log.warning("%s", exc)
        return 0
    finally:
        if reach is not None:
            await cancel_and_wait([reach])
        if broadcast is not None:  # on failures too: its announcer must not outlive the peer
            await broadcast.stop()
        await peer.stop()


def _model_facts(spec: Any) -> tuple[str, str, int | None]:
    """``(config hash, tokenizer hash, max positions)`` of the policy ``spec`` names; imports the
    modelling code :meth:`~trainer.recipe.Trainer.setup` will build it with, too (run in a thread
    while the trainer joins the swarm)."""
    from policy.model import config_fingerprint, load_config, load_tokenizer, max_positions

    model_config = load_config(spec)
    facts = (
        digest_hex(config_fingerprint(model_config)),
        digest_hex(load_tokenizer(spec).fingerprint()),
        max_positions(spec),
    )
    from transformers import AutoModelForCausalLM

    # only an import ahead of time: a model transformers cannot build fails in the set-up, with
    # its own message
    with contextlib.suppress(KeyError, ImportError, AttributeError, ValueError):
        AutoModelForCausalLM._model_mapping[type(model_config)]
    return facts


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s outcome seen: one the start-up left behind (it ended early) is not an
    error of its own (awaited, it raises where it is awaited)."""
    if not future.cancelled():
        future.exception()


async def _latest_version(
    publisher: Any, stop: asyncio.Event, *, sharded: bool
) -> tuple[bool, int | None]:
    """``(answered, the newest version the coordinator holds)``. Stopped before the request:
    stop the publisher and ask once, within ``REPORT_TIMEOUT_S``. Otherwise wait for the answer
    (retried by the publisher) unless a stop comes first. No answer: :class:`_Stopped` for one
    process; ``(False, None)`` for a sharded job, whose other ranks already wait in the loop's
    first collective (the caller ends the job with them)."""
    try:
        if stop.is_set():  # one short status request, not retried
            publisher.stop()
            try:
                return True, await asyncio.wait_for(publisher.latest_version(), REPORT_TIMEOUT_S)
            except TimeoutError:
                raise _Stopped from None
        return True, await _race_stop(publisher.latest_version(), stop)
    except _Stopped:
        if not sharded:
            raise
        return False, None


async def _within_grace(
    task: asyncio.Future[Any],
    stop: asyncio.Event,
    what: str,
    *,
    on_stop: Any = (),
    busy: Any = lambda: True,
    grace_s: float,
) -> None:
    """Wait for ``task``; once ``stop`` is set, call ``on_stop`` and give it ``grace_s``.
    Still running then: :class:`StepAbandoned` if ``busy()`` (a thread that cannot be
    interrupted is at work), else return with ``task`` pending (the caller cancels it)."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return
    log.info("stopping: %s may take %g s more to finish", what, grace_s)
    for call in on_stop:
        call()
    await asyncio.wait([task], timeout=grace_s)
    if not task.done() and busy():
        raise StepAbandoned(
            f"{what} did not finish within {grace_s:g} s of the stop; abandoned: the last "
            "checkpoint stands (a restart resumes from it)"
        )


async def _cut_short(run: asyncio.Task[Any]) -> None:
    """Cancel the learner loop's task, waiting in the network (a publication), until it ends:
    the cancel is repeated (Python 3.11's ``asyncio.wait_for`` inside the transport can swallow
    one, and a single ``cancel(); await`` then waits for ever), bounded by
    :data:`CUT_SHORT_S`; a straggler is logged and left."""
    await cancel_and_wait([run], timeout=CUT_SHORT_S)


def _final_checkpoint(trainer: Any) -> None:
    """The checkpoint of a stop that cut the loop short (one process; sharded, a checkpoint is a
    collective the other ranks are not in, so the last one stands)."""
    if trainer.distributed:
        log.warning(
            "the sharded learner stopped outside a step boundary: the last checkpoint stands"
        )
        return
    trainer.save_checkpoint()


async def _watch_reachability(
    transport: Any, peer: Any, coordinator_peer: str, broadcast: Any
) -> None:
    """Measure (a dial-back by the coordinator) whether nodes can dial this trainer; only then
    is it announced as a holder (the coordinator reaches it over its own connection anyway)."""
    from swarm.reachability import ReachabilityMonitor

    def changed(state: str) -> None:
        broadcast.dialable = state == "public"

    monitor = ReachabilityMonitor(
        transport, peer.visible_maddrs, lambda: coordinator_peer, on_change=changed
    )
    await monitor.run()


async def _coordinator_public_key(peer: Any, fingerprint: str) -> bytes:
    """The raw public key of the pinned coordinator, from its signed DHT address record (the
    record's signer must hash to the pinned fingerprint); waits up to 30 s for it to appear."""
    from swarm.errors import DhtError
    from swarm.records import find_coordinator_key

    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        with contextlib.suppress(DhtError):
            found = await find_coordinator_key(peer, fingerprint)
            if found is not None:
                return found[0]
        await asyncio.sleep(0.5)
    raise CoordinatorError(
        f"no coordinator with key {fingerprint} announced itself in the DHT within 30 s; "
        "check --coordinator and --coordinator-key"
    )


#: Step-record keys reported to the coordinator for capacity planning and the idle breakdown.
CAPACITY_STATS = (
    "t_train_s",
    "t_train_cv",
    "batch_rollouts",
    "publish_s",
    "publish_deferred",
    "idle_rollouts_frac",
    "idle_stale_frac",
    "idle_fetch_frac",
    "idle_publish_frac",
    "idle_checkpoint_frac",
    "idle_other_frac",
)


class StepReport:
    """A step callback (:attr:`trainer.recipe.Trainer.on_step`): mirrors each step's metrics into
    the stats ``source`` reports to the coordinator (``/status``, capacity planning). It reads the
    counters it is handed (the published version, the rollout cursor), the held-out evaluation's
    latest figures and the publisher's last preparation time."""

    def __init__(
        self,
        source: CoordinatorSource,
        *,
        progress: LearnerProgress,
        pending: PendingRollouts,
        kappa: int,
        max_staleness: int | None = None,
        evaluation: EvalRunner | None = None,
        publisher: SwarmPublisher | None = None,
    ) -> None:
        self.source = source
        self.progress = progress
        self.pending = pending
        self.kappa = kappa
        #: the learner's own S (reported: the coordinator's backlog bound counts what it trains)
        self.max_staleness = max_staleness
        self.evaluation = evaluation
        self.publisher = publisher

    def __call__(self, record: dict[str, Any]) -> None:
        from swarm.faults import stall_point

        stall_point("trainer.step")  # tests: a step that outlasts the stop grace
        # Runs on the step thread while the event loop may be encoding ``source.stats`` for a
        # fetch: build the new mapping aside and swap it in (one reference assignment).
        stats = dict(self.source.stats)
        stats.update(
            {
                "step": record["step"],
                "version": record["version"],
                "published_version": self.progress.published_version,
                "reward_mean": record["reward_mean"],
                "exact_match": record["reward_full_frac"],
                "staleness_mean": record["staleness_mean"],
                "staleness_hist": record["staleness_hist"],
                "dropped_stale": record["dropped_stale"],
                "dropped_uniform": record["dropped_uniform"],
                "mismatch_kl": record["mismatch_kl"],
                "out_of_support_frac": record["out_of_support_frac"],
                "ess_frac": record["ess_frac"],
                # stability monitors (trainer/monitors.py) and their warning line ("" = healthy)
                "clip_frac": record["clip_frac"],
                "mask_frac": record["mask_frac"],
                "weight_modified_frac": record["weight_modified_frac"],
                "grad_norm": record["grad_norm"],
                "entropy": record["entropy"],
                # the step rollback (max_step_kl; step_kl is None while it is off)
                "step_kl": record.get("step_kl"),
                "rollbacks": record.get("rollbacks", 0),
                # the KL-adaptive learning rate (target_step_kl; 1.0 while it is off)
                "lr_factor": record.get("lr_factor", 1.0),
                "stability_warning": record["stability_warning"],
                "idle_frac": record["idle_frac"],
                "step_time_s": record["step_time_s"],
                "rollout_cursor": self.pending.cursor,
            }
        )
        # Capacity planning and the idle breakdown (docs/capacity.md): smoothed T_train, B,
        # how long publishing takes, and where the idle time went.
        stats.update({k: record[k] for k in CAPACITY_STATS if k in record})
        stats["kappa"] = self.kappa
        if self.max_staleness is not None:
            stats["max_staleness"] = self.max_staleness
        if self.evaluation is not None:  # the latest held-out score and its curve
            stats.update(self.evaluation.stats())
        publisher = self.publisher
        if publisher is not None and publisher.last_prepare_s is not None:
            stats["publish_prepare_s"] = publisher.last_prepare_s
        self.source.stats = stats
