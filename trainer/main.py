"""The trainer process: the GRPO recipe on the network (``swarm trainer run``).

Rollouts come from a :class:`~trainer.swarm_client.CoordinatorSource` (long-polls the
coordinator's ``rswarm/fetch`` and reports the learner's figures back) and versions go out through
a :class:`~trainer.swarm_client.SwarmPublisher` (the coordinator signs the manifest, the trainer
seeds the chunks through the peer-assisted broadcast); see :mod:`trainer.swarm_client`. Before
training, the coordinator's newest version (``rswarm/status``) is handed to
:meth:`~trainer.recipe.Trainer.sync_published`, and a ``version_not_newer`` refusal becomes
:class:`~trainer.sources.VersionNotNewer`: a trainer restarted after a crash in the middle of a
publication continues with strictly newer versions instead of being refused again and again.
This module runs the process: identity, transport, the recipe, signals, the CLI's checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from protocol.identity import Identity
from swarm.tasks import cancel_and_wait
from trainer.swarm_client import CoordinatorError, CoordinatorSource, SwarmPublisher, digest_hex

#: Gives a trainer its held-out evaluation: ``(trainer, the coordinator's status, the leases' stop
#: ids, the source)`` -> the task, to close when done. The shell passes it in
#: (:func:`swarm.shell.heldout.start_evaluation`: the coordinator's task with the policy's
#: evaluation protocol), so the trainer imports neither the coordinator nor the shell.
StartEvaluation = Callable[[Any, dict[str, Any], Sequence[int], Any], Any]

log = logging.getLogger(__name__)

#: On SIGINT/SIGTERM, seconds the work in progress (the learner step in its thread, a
#: publication, the model's set-up) may take to finish; then it is abandoned (docs/operations.md).
STOP_GRACE_S = 10.0
#: seconds the last report of the learner's figures may take on the way out
REPORT_TIMEOUT_S = 3.0


class StepAbandoned(Exception):
    """Stopping: the learner's thread (a step, or the model's set-up) did not finish within
    ``STOP_GRACE_S``; the process must exit without waiting for it (:func:`run_from_cli`)."""


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
    progress gets ``STOP_GRACE_S`` to finish, failed requests are not retried; then the final
    checkpoint. A step still running after the grace raises :class:`StepAbandoned` (the last
    checkpoint stands; the caller exits without joining the thread).

    ``dist``: the process group (:func:`trainer.distributed.init_distributed`) when this is
    rank 0 of a sharded trainer; the other ranks run :func:`trainer.launch.run_follower` (and
    take this rank's config, with the adopted sampling contract, and the leases' stop set)."""
    from policy.model import (
        ModelSpec,
        config_fingerprint,
        load_config,
        load_tokenizer,
        max_positions,
    )
    from protocol.identity import parse_fingerprint
    from swarm.adverts import swarm_validators
    from swarm.broadcast import BroadcastNode
    from swarm.chunks import ChunkStore
    from swarm.dht import PeerConfig, SwarmPeer
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
    try:
        # Joining can take the start-up timeout (15 s + 5 s) against a bootstrap that never
        # answers: a stop ends it (the DHT process and p2pd it started are ended on the way out,
        # swarm.signals.end_descendants)
        await _race_stop(peer.start(), stop)
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
        )
        broadcast.dialable = False  # announced as a holder only once a dial-back says so
        await broadcast.start()
        reach = asyncio.create_task(
            _watch_reachability(transport, peer, coordinator_peer, broadcast), name="reachability"
        )
        spec = ModelSpec(path=config.model_path, dtype=config.dtype)
        publisher = SwarmPublisher(
            transport,
            broadcast,
            coordinator_peer,
            identity,
            model_config_hash=digest_hex(config_fingerprint(load_config(spec))),
            tokenizer_hash=digest_hex(load_tokenizer(spec).fingerprint()),
            chunk_size=chunk_size,
            publish_dtype=config.publish_dtype,
            keyframe_every=config.keyframe_every,
        )
        # The sampling contract is the coordinator's: adopt it, or refuse what cannot match.
        from trainer.contract import adopt_contract

        status = await _race_stop(publisher.status(), stop)
        config, lease_stops = adopt_contract(config, status, max_positions(spec))
        log.info("sampling contract: %s, stop set %s", config.processing, list(lease_stops))
        # Building the model (and resuming a sharded checkpoint: a minute on a loaded machine)
        # runs in a thread, so a stop is seen meanwhile; it may finish within the grace.
        setup = asyncio.ensure_future(asyncio.to_thread(Trainer.setup, config, dist=dist))
        await _within_grace(setup, stop, "setting up the model")
        trainer = setup.result()
        trainer.stop_token_ids |= frozenset(lease_stops)
        source = CoordinatorSource(transport, coordinator_peer, identity)
        # The coordinator may hold a version this trainer has no record of (killed between the
        # coordinator's answer to PublishVersion and published.json): continue after it.
        if stop.is_set():  # one short status request, not retried
            publisher.stop()
            try:
                latest = await asyncio.wait_for(publisher.latest_version(), REPORT_TIMEOUT_S)
            except TimeoutError:
                raise _Stopped from None
        else:
            latest = await _race_stop(publisher.latest_version(), stop)
        trainer.sync_published(latest)
        _attach_stats(trainer, source, publisher)
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
            busy=lambda: getattr(trainer, "_training", False),
        )
        if not run.done():  # a publication's network wait (no thread busy): cut it short
            log.warning("the learner did not stop within %.0f s; cutting it short", STOP_GRACE_S)
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
            _final_checkpoint(trainer)
        else:
            try:
                run.result()
            except PublicationStopped as exc:  # stopping while a publication failed
                log.warning("%s", exc)
                _final_checkpoint(trainer)
        if source.failures == 0:  # the last step's figures reach /status before we leave
            await source.report(timeout=REPORT_TIMEOUT_S)
        if trainer.evaluation is not None:
            trainer.evaluation.close()
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


async def _within_grace(
    task: asyncio.Future[Any],
    stop: asyncio.Event,
    what: str,
    *,
    on_stop: Any = (),
    busy: Any = lambda: True,
) -> None:
    """Wait for ``task``; once ``stop`` is set, call ``on_stop`` and give it ``STOP_GRACE_S``.
    Still running then: :class:`StepAbandoned` if ``busy()`` (a thread that cannot be
    interrupted is at work), else return with ``task`` pending (the caller cancels it)."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return
    log.info("stopping: %s may take %.0f s more to finish", what, STOP_GRACE_S)
    for call in on_stop:
        call()
    await asyncio.wait([task], timeout=STOP_GRACE_S)
    if not task.done() and busy():
        raise StepAbandoned(
            f"{what} did not finish within {STOP_GRACE_S:.0f} s of the stop; abandoned: the last "
            "checkpoint stands (a restart resumes from it)"
        )


def _final_checkpoint(trainer: Any) -> None:
    """The checkpoint of a stop that cut the loop short (one process; sharded, a checkpoint is a
    collective the other ranks are not in, so the last one stands)."""
    if trainer.dist.enabled:
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


def _attach_stats(
    trainer: Any, source: CoordinatorSource, publisher: SwarmPublisher | None = None
) -> None:
    """Mirror each step's metrics into the stats the source reports to the coordinator."""

    from swarm.faults import stall_point

    def on_step(record: dict[str, Any]) -> None:
        stall_point("trainer.step")  # tests: a step that outlasts the stop grace
        # Runs on the step thread while the event loop may be encoding ``source.stats`` for a
        # fetch: build the new mapping aside and swap it in (one reference assignment).
        stats = dict(source.stats)
        stats.update(
            {
                "step": record["step"],
                "version": record["version"],
                "published_version": trainer.published_version,
                "reward_mean": record["reward_mean"],
                "exact_match": record["reward_full_frac"],
                "staleness_mean": record["staleness_mean"],
                "staleness_hist": record["staleness_hist"],
                "dropped_stale": record["dropped_stale"],
                "dropped_uniform": record["dropped_uniform"],
                "mismatch_kl": record["mismatch_kl"],
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
                "rollout_cursor": trainer.cursor,
            }
        )
        # Capacity planning and the idle breakdown (docs/capacity.md): smoothed T_train, B,
        # how long publishing takes, and where the idle time went.
        stats.update({k: record[k] for k in CAPACITY_STATS if k in record})
        stats["kappa"] = trainer.config.kappa
        if trainer.evaluation is not None:  # the latest held-out score and its curve
            stats.update(trainer.evaluation.stats())
        if publisher is not None and publisher.last_prepare_s is not None:
            stats["publish_prepare_s"] = publisher.last_prepare_s
        source.stats = stats

    trainer.on_step.append(on_step)


def run_from_cli(
    *,
    config: Path | None,
    coordinator: str | None,
    coordinator_key: str | None,
    state_dir: Path | None,
    max_steps: int | None = None,
    nproc: int | None = None,
    start_evaluation: StartEvaluation,
) -> int:
    """``swarm trainer run``. Exit 0 clean (SIGINT/SIGTERM or max_steps), 2 bad input, 1 failure.

    Every error is one ``error:`` line on stderr. ``nproc`` > 1 starts that many ranks here
    (:func:`trainer.launch.launch_local`); under torchrun (``WORLD_SIZE`` > 1) this is one rank.
    ``start_evaluation`` gives rank 0 its held-out evaluation (:data:`StartEvaluation`).
    """
    import os
    import sys

    from protocol.errors import KeyFileError
    from protocol.identity import parse_fingerprint
    from swarm.errors import BootstrapUnreachable, SwarmError
    from trainer.contract import ContractError
    from trainer.distributed import torchrun_world_size

    world = torchrun_world_size()
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    if world > 1:
        from trainer.launch import stop_with_launcher

        stop_with_launcher()

    def error(message: str, code: int) -> int:
        # Bad input is the same on every rank: rank 0 says it once.
        if rank == 0 or code != 2:
            where = f"rank {rank}/{world}: " if world > 1 and code != 2 else ""
            print(f"error: {where}{' '.join(message.split())}", file=sys.stderr, flush=True)
        return code

    who = f"rank{rank} " if world > 1 else ""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
    )
    if nproc is not None and nproc < 1:
        return error(f"--nproc {nproc}: must be >= 1", 2)
    if nproc is not None and nproc > 1 and world > 1:
        return error(
            f"--nproc {nproc} under torchrun (WORLD_SIZE={world}): torchrun starts the "
            "processes; drop --nproc",
            2,
        )
    if coordinator is None or coordinator_key is None:
        missing = " and ".join(
            flag
            for flag, value in (
                ("--coordinator MULTIADDR", coordinator),
                ("--coordinator-key FINGERPRINT", coordinator_key),
            )
            if value is None
        )
        return error(
            f"{missing} required; `swarm coordinator launch` prints both (lines 'multiaddr:' "
            "and 'coordinator key:')",
            2,
        )
    if not coordinator.startswith("/") or "/p2p/" not in coordinator:
        return error(
            f"--coordinator {coordinator!r} must be a full multiaddr "
            "/ip4/HOST/tcp/PORT/p2p/PEER_ID, as printed by `swarm coordinator launch`",
            2,
        )
    try:
        parse_fingerprint(coordinator_key)
    except ValueError as exc:
        return error(f"--coordinator-key: {exc}", 2)
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(coordinator)
    except Exception as exc:  # the multiaddr library raises several unrelated types
        return error(f"--coordinator {coordinator!r} is not a valid multiaddr ({exc})", 2)
    try:
        cfg = _cli_config(config, state_dir=state_dir, max_steps=max_steps)
    except ValueError as exc:
        return error(str(exc), 2)
    out = Path(cfg.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
        ident = Identity.load_or_create(out / "trainer.key") if rank == 0 else None
    except KeyFileError as exc:
        return error(str(exc), 2)
    except OSError as exc:
        where = "--state-dir" if state_dir is not None else "out_dir"
        why = (
            "a file is in the way of the directory"
            if isinstance(exc, FileExistsError | NotADirectoryError)
            else exc.strerror or exc
        )
        return error(f"{where} {out} is not usable: {why}; pass a writable --state-dir", 2)
    import torch

    if nproc is not None and nproc > 1:
        if torch.cuda.is_available() and nproc > torch.cuda.device_count():
            return error(
                f"--nproc {nproc}: only {torch.cuda.device_count()} GPUs are visible (one "
                "rank per GPU); lower --nproc",
                2,
            )
        from trainer.launch import launch_local

        argv = ["--coordinator", coordinator, "--coordinator-key", coordinator_key]
        argv += ["--state-dir", str(out.resolve())]
        if config is not None:
            argv += ["--config", str(config.resolve())]
        if max_steps is not None:
            argv += ["--max-steps", str(max_steps)]
        from swarm.signals import exit_now as exit_launcher

        exit_launcher(launch_local(nproc, argv, stop_grace_s=STOP_GRACE_S))

    from swarm.signals import (
        become_subreaper,
        end_descendants,
        exit_now,
        install_fork_signal_reset,
    )
    from trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    install_fork_signal_reset()  # the DHT process forks after the signal handlers are set
    become_subreaper()  # a p2pd orphaned on the way out is still ours to end

    async def main(dist: Any) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_trainer(
            cfg, coordinator_maddr=coordinator, coordinator_key=coordinator_key, state_dir=out,
            start_evaluation=start_evaluation, stop=stop, dist=dist,
        )  # fmt: skip

    dist = None
    if world > 1:
        try:
            dist = init_distributed()
        except Exception as exc:  # rendezvous failures come in several types
            return error(f"cannot join the process group: {type(exc).__name__}: {exc}", 1)
    code = 1
    try:
        if rank != 0:
            code = _run_follower(cfg, dist)
        else:
            assert ident is not None
            print(f"trainer key: {ident.fingerprint}", flush=True)
            runner = asyncio.Runner()
            try:
                code = runner.run(main(dist))
            except StepAbandoned as exc:
                # The step's thread cannot be interrupted and joining it (asyncio's teardown,
                # the interpreter's exit) would wait for it: the network is already shut down,
                # so end what is left of the process tree and exit now.
                log.warning("%s", exc)
                exit_now(0)
            except BaseException:
                runner.close()
                raise
            # run_trainer has stopped the swarm peer; asyncio's and the interpreter's teardown
            # are skipped (exit_now below)
    except BootstrapUnreachable as exc:
        code = error(f"cannot reach the coordinator at {coordinator}: {exc}", 1)
    except ContractError as exc:
        code = error(str(exc), 2)
    except (SwarmError, CoordinatorError) as exc:
        code = error(str(exc), 1)
    except Exception as exc:  # last resort: the traceback goes to the log, one line to the user
        log.exception("trainer failed")
        code = error(f"trainer failed: {_one_line(exc, distributed=world > 1)}", 1)
    finally:
        if dist is not None:
            shutdown_distributed(clean=code == 0)
        end_descendants()
    exit_now(code)  # done: skip the interpreter's slow teardown (swarm.signals.exit_now)


def _run_follower(cfg: Any, dist: Any) -> int:
    """A rank other than 0 (see :mod:`trainer.launch`)."""
    from trainer.launch import ignore_stop_signals, run_follower

    ignore_stop_signals(dist.rank)
    return asyncio.run(run_follower(cfg, dist))


def _one_line(exc: BaseException, *, distributed: bool) -> str:
    """``Type: message``; a collective that failed because another rank is gone says so (gloo
    raises a plain RuntimeError naming its transport, NCCL a DistError)."""
    import torch.distributed as tdist

    text = " ".join(str(exc).split())
    lost = isinstance(exc, tdist.DistError) or any(
        mark in text for mark in ("gloo/transport", "Connection reset", "Connection closed")
    )
    if distributed and lost:
        first = text.split(". ")[0][:240]
        return f"lost another rank of the job ({type(exc).__name__}: {first})"
    return f"{type(exc).__name__}: {text}"


def _cli_config(config: Path | None, *, state_dir: Path | None, max_steps: int | None) -> Any:
    """The TrainerConfig of the TOML file (if any) and the flags; ValueError with one line."""
    from pydantic import ValidationError

    from swarm.configfile import read_toml
    from trainer.config import TrainerConfig, nones

    data: dict[str, Any] = {}
    source = "defaults"
    if config is not None:
        source = str(config)
        # ValueError subclass; "none" switches off a None-able setting (TOML has no null)
        data = nones(read_toml(config, example="trainer/trainer.example.toml"))
    flags: dict[str, tuple[str, Any]] = {"max_steps": ("--max-steps", max_steps)}
    if state_dir is not None:
        flags["out_dir"] = ("--state-dir", str(state_dir))
    for key, (_, value) in flags.items():
        if value is not None:
            data[key] = value
    try:
        cfg = TrainerConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else ""
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown option; see trainer/trainer.example.toml for the valid ones"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        flag, value = flags.get(key, (None, None))
        where = f"{flag} {value}" if flag is not None and value is not None else f"{source}: {key}"
        raise ValueError(f"{where}: {msg}{more}") from exc
    model = getattr(cfg, "model_path", None)
    if model is not None and not (Path(model).expanduser() / "config.json").is_file():
        raise ValueError(
            f"{source}: model_path {model!r} is not a local HF model directory (no config.json)"
        )
    from policy.model import ModelSpec, load_tokenizer

    try:  # a tokenizer without EOS (no sample could end) is refused here, not after start-up
        load_tokenizer(ModelSpec(path=model))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc
    return cfg
