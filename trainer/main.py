"""``swarm trainer run``: the CLI's checks, the ranks, the exit codes.

:func:`run_from_cli` checks the flags and the config (bad input: exit 2 with one ``error:``
line), starts ``--nproc`` ranks here (:mod:`trainer.launch`) or joins torchrun's process group,
and runs this rank: rank 0 the network process (:func:`trainer.network.run_trainer`: the swarm,
the recipe, the stop grace), every other rank a follower (:func:`trainer.launch.run_follower`).
The network process's names (:func:`~trainer.network.run_trainer`, :data:`StartEvaluation`,
:data:`STOP_GRACE_S`, :class:`StepAbandoned`) are importable from here too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from protocol.identity import Identity
from trainer.network import (
    STOP_GRACE_S,
    StartEvaluation,
    StepAbandoned,
    run_trainer,
)
from trainer.swarm_client import CoordinatorError

__all__ = ["STOP_GRACE_S", "StartEvaluation", "StepAbandoned", "run_from_cli", "run_trainer"]

log = logging.getLogger(__name__)


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

        exit_launcher(launch_local(nproc, argv, stop_grace_s=cfg.stop_grace_s))

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
