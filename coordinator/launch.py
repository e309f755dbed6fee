"""``swarm coordinator launch``: flag checks, port test-binds, the state-dir lock, signals.

:func:`launch_from_cli` validates everything it can before anything starts (exit 2 on bad input,
1 on a runtime failure, one ``error:`` line on stderr), then runs a
:class:`~coordinator.service.CoordinatorService` until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.service import CoordinatorService
from coordinator.tasks import make_task
from policy.preflight import PolicySetup
from protocol.identity import parse_fingerprint

log = logging.getLogger(__name__)


def launch_from_cli(
    *,
    config: Path | None,
    host: str | None,
    port: int | None,
    http_port: int | None,
    state_dir: Path | None,
    trainer_key: str | None = None,
) -> int:
    """``swarm coordinator launch``: run until SIGINT/SIGTERM.

    Exit 0 clean, 2 bad input (config, flags, state dir, key file), 1 runtime failure (a port
    already in use, the peer failed to start). Every error is one ``error:`` line on stderr.
    """
    import signal

    from coordinator.errors import ConfigError
    from protocol.errors import KeyFileError
    from swarm.errors import SwarmError
    from swarm.signals import install_fork_signal_reset

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = _launch_config(config, host=host, port=port, http_port=http_port,
                             trainer_key=trainer_key)  # fmt: skip
        setup = _preflight(cfg, str(config) if config is not None else "defaults")
    except ConfigError as exc:
        _cli_error(str(exc))
        return 2
    net = cfg.network
    for what, flag, bind_host, bind_port in (
        ("libp2p", "--port", net.host, net.port),
        ("/status", "--http-port", net.http_host, net.http_port),
    ):
        problem = _cannot_bind(bind_host, bind_port)
        if problem is not None:
            in_use, reason = problem
            if in_use:
                _cli_error(
                    f"{what} port {bind_port} on {bind_host} is already in use (another "
                    f"coordinator?); stop that process or pick another {flag} (0 = any free port)"
                )
                return 1
            _cli_error(f"cannot listen for {what} on {bind_host}:{bind_port}: {reason}")
            return 2
    state = Path(state_dir or "coordinator-data")
    try:
        _check_writable(state)
        lock = _lock_state_dir(state)  # held (open) until this function returns
        if isinstance(lock, str):
            _cli_error(
                f"state dir {state} is in use by another running coordinator ({lock}); stop it "
                "or pass another --state-dir"
            )
            return 1
        service = CoordinatorService(cfg, state, setup=setup)
    except KeyFileError as exc:
        _cli_error(str(exc))
        return 2
    except OSError as exc:
        if isinstance(exc, FileExistsError | NotADirectoryError):
            reason = "a file is in the way of the directory"
        else:
            reason = str(exc.strerror or exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(state) else ""
        _cli_error(f"state dir {state} is not usable: {reason}{where}; pass a writable --state-dir")
        return 2
    except ValueError as exc:
        _cli_error(str(exc))
        return 2
    import torch

    from swarm.signals import STOP_BOUND_S, become_subreaper, end_descendants, exit_now

    torch.set_num_threads(1)
    install_fork_signal_reset()  # the DHT process forks after the signal handlers are set
    become_subreaper()  # a p2pd orphaned on the way out is still ours to end
    # the service's shutdown gets the stop bound less a margin for ending leftovers and exiting
    shutdown_s = STOP_BOUND_S["coordinator"] - 3.0
    stuck: list[bool] = []

    async def stop_service() -> None:
        """``service.stop()`` within ``shutdown_s``; past it, note that it is stuck."""
        task = asyncio.ensure_future(service.stop())
        await asyncio.wait([task], timeout=shutdown_s)
        if not task.done():
            log.warning("the service did not stop within %.0f s; exiting anyway", shutdown_s)
            stuck.append(True)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        starting = asyncio.ensure_future(service.start())
        waiter = asyncio.ensure_future(stop.wait())
        try:  # a stop during start-up ends it (building the model, joining the DHT)
            await asyncio.wait([starting, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not starting.done():
            log.info("stopped during start-up")
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
            await stop_service()
            return 0
        try:
            starting.result()
        except Exception as exc:  # whatever failed, stop what did start so the process can exit
            if isinstance(exc, SwarmError | OSError):
                message = str(exc)
            else:
                log.exception("coordinator failed to start")
                message = f"{type(exc).__name__}: {exc}"
            await stop_service()
            _cli_error(f"coordinator failed to start: {message}")
            return 1
        for maddr in service.multiaddrs:
            print(f"multiaddr: {maddr}", flush=True)
        print(f"coordinator key: {service.fingerprint}", flush=True)
        print(f"dashboard: {service.http_url}/", flush=True)
        print(f"status: {service.http_url}/status  metrics: {service.http_url}/metrics", flush=True)
        await stop.wait()
        log.info("shutting down")
        await stop_service()
        return 0

    runner = asyncio.Runner()
    try:
        code = runner.run(main())
    except BaseException:
        runner.close()
        end_descendants()
        raise
    if stuck:
        log.warning("exiting with the service's shutdown unfinished")
    # No asyncio teardown (a task that swallows its cancellation would hold it) nor interpreter
    # teardown (seconds, with torch loaded): the service has stopped, the database is closed.
    exit_now(code)


def _cli_error(message: str) -> None:
    import sys

    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _launch_config(
    config: Path | None,
    *,
    host: str | None,
    port: int | None,
    http_port: int | None,
    trainer_key: str | None,
) -> CoordinatorConfig:
    """The config file (or defaults) with the flags applied; :class:`ConfigError` names the flag."""
    import ipaddress

    from pydantic import ValidationError

    from coordinator.config import NetworkSection, load_config, parse_config
    from coordinator.errors import ConfigError

    cfg = load_config(config) if config is not None else parse_config({})
    flags = {"host": host, "port": port, "http_port": http_port, "trainer_key": trainer_key}
    overrides = {k: v for k, v in flags.items() if v is not None}

    def name(key: str) -> str:
        if key in overrides:
            return f"--{key.replace('_', '-')} {overrides[key]}"
        return f"{config}: network.{key}"

    try:
        net = NetworkSection.model_validate({**cfg.network.model_dump(), **overrides})
    except ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else "network"
        raise ConfigError(f"{name(key)}: {first['msg'].removeprefix('Value error, ')}") from exc
    try:
        ipaddress.IPv4Address(net.host)
    except ValueError as exc:
        raise ConfigError(
            f"{name('host')}: not an IPv4 address; use e.g. 127.0.0.1, or 0.0.0.0 for all "
            "interfaces"
        ) from exc
    if net.trainer_key is not None:
        try:
            parse_fingerprint(net.trainer_key)
        except ValueError as exc:
            raise ConfigError(f"{name('trainer_key')}: {exc}") from exc
    source = str(config) if config is not None else "defaults"
    model_dir = None if cfg.model_path is None else Path(cfg.model_path).expanduser()
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{source}: model_path {cfg.model_path!r} is not a local HF model directory (no "
            "config.json); fix the path or unset it for the embedded default"
        )
    try:
        task = make_task(cfg.task, seed=cfg.task_seed, format_reward=cfg.format_reward)
    except OSError as exc:
        raise ConfigError(
            f"{source}: task {cfg.task!r}: cannot read {exc.filename or 'the file'}: "
            f"{exc.strerror or exc}"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"{source}: task: {exc}") from exc
    close = getattr(task, "close", None)
    if callable(close):
        close()
    return cfg.model_copy(update={"network": net})


def _preflight(cfg: CoordinatorConfig, source: str) -> PolicySetup:
    """Tokenizer, prompt renderer and stop set, checked (policy/preflight.py): an impossible
    set-up is refused now, with the setting named, not as a loop of failed leases later."""
    from coordinator.errors import ConfigError
    from policy.model import ModelSpec
    from policy.preflight import prepare

    task = make_task(cfg.task, seed=cfg.task_seed, format_reward=cfg.format_reward)
    try:
        return prepare(
            ModelSpec(path=cfg.model_path),
            task=task,
            max_new_tokens=cfg.sampling.max_new_tokens,
            extra_stop_ids=cfg.sampling.stop_token_ids,
            template=cfg.prompt.template,
            system_prompt=cfg.prompt.system_prompt,
        )
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    finally:
        close = getattr(task, "close", None)
        if callable(close):
            close()


def _cannot_bind(host: str, port: int) -> tuple[bool, str] | None:
    """None if ``host:port`` can be listened on now, else (address in use?, reason).

    A plain bind without SO_REUSEPORT: libp2p sets that option, so a second coordinator on the
    same port would otherwise start "successfully" and share the port with the first one.
    """
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return False, f"cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            sock.bind(address)
            sock.listen(1)
        except OverflowError as exc:
            return False, str(exc)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE, exc.strerror or str(exc)
    return None


def _lock_state_dir(state: Path) -> Any:
    """An exclusive lock on ``state/coordinator.lock`` (the open file), or who holds it (str).

    Two coordinators on one state dir would share the SQLite state, the keys and the libp2p
    identity; nothing else stops the second one from starting.
    """
    import fcntl
    import os

    fh = open(state / "coordinator.lock", "a+")  # noqa: SIM115 (held for the process's life)
    try:
        # a POSIX record lock: held by this process only (a forked child does not inherit it)
        # and released when it exits, however it exits
        fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip()
        fh.close()
        return f"pid {holder}" if holder.isdigit() else "lock file held"
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _check_writable(state: Path) -> None:
    """Create ``state`` and write a probe file in it; raises OSError when that fails."""
    import os

    state.mkdir(parents=True, exist_ok=True)
    probe = state / f".write-test-{os.getpid()}"
    probe.write_bytes(b"ok")
    probe.unlink()
