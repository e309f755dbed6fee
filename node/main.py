"""``swarm node run``: parse config, preflight, then run a :class:`~node.worker.NodeWorker`.

Order (config first, heavy imports after, so errors in flags answer instantly):

1. config: TOML file + CLI overrides (:func:`node.config.load_node_config`); the pinned
   coordinator key must parse; ``--coordinator`` and ``--coordinator-key`` are required unless
   ``--dry-run``;
2. ``torch.set_num_threads(torch_threads)`` (1 by default: nodes share hosts with other work);
3. preflight, each failure one actionable line: state_dir writable and with ``min_free_disk_mb``
   free, node key file, GPU usable when a CUDA device or vLLM is asked for, backend builds, the
   capability probe (benchmark cached per hardware);
4. ``--dry-run``: print the advert the node would publish as JSON and exit 0, contacting nobody;
5. run: the libp2p daemon and DHT start, the coordinator answers ``register`` within
   ``register_timeout_s``, then the work loop runs until SIGINT/SIGTERM. The first signal drains
   (submit or release the lease in hand, leave the DHT, exit 0; during start-up it ends the
   start-up at once); a second one exits at once. Either way the node is gone within
   ``swarm.signals.STOP_BOUND_S["node"]`` and no process of its tree (DHT process, p2pd) is left.

Exit codes: 0 clean, 2 bad input (flags, config, key, model path, unavailable backend/GPU),
1 runtime failure (start-up, unreachable coordinator, disk space, a fatal error while running).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.config import ConfigError, NodeConfig, load_node_config
from swarm.files import atomic_write_text

if TYPE_CHECKING:
    from node.backends.base import InferenceBackend
    from node.probe import Capability
    from node.statuspage import NodeStatusPage
    from node.worker import NodeWorker
    from policy.model import Tokenizer
    from protocol.identity import Identity

__all__ = ["run_from_cli"]

log = logging.getLogger("node")

EXIT_OK, EXIT_RUNTIME, EXIT_BAD_INPUT = 0, 1, 2


class _Fail(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _PeerFilter(logging.Filter):
    """Adds ``record.peer`` (short libp2p peer id of this node) to every log record."""

    peer = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = self.peer
        return True


_PEER = _PeerFilter()


def _short_peer(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 14 else f"{peer_id[:4]}…{peer_id[-8:]}"


def _setup_logging(level: str) -> None:
    root = logging.getLogger()
    root.setLevel(level)
    if any(_PEER in h.filters for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_PEER)
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s [peer %(peer)s] %(name)s: %(message)s", "%H:%M:%S"
        )
    )
    root.addHandler(handler)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _error(message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def run_from_cli(
    *,
    coordinator: str | None = None,
    coordinator_key: str | None = None,
    backend: str | None = None,
    price_per_hour: float | None = None,
    config: Path | None = None,
    state_dir: Path | None = None,
    dry_run: bool = False,
    status_port: int | None = None,
) -> int:
    """Entry point of ``swarm node run``; returns the process exit code."""
    overrides = {
        "coordinator": coordinator,
        "coordinator_key": coordinator_key,
        "backend": backend,
        "price_per_hour": price_per_hour,
        "state_dir": state_dir,
        "status_port": status_port,
    }
    try:
        cfg = load_node_config(config, overrides)
        if not dry_run:
            _require_coordinator(cfg)
            _check_multiaddrs(cfg, from_flag=coordinator is not None)
    except ConfigError as exc:
        _error(_flag_message(exc, overrides))
        return EXIT_BAD_INPUT
    _setup_logging(cfg.log_level)
    backend_obj: InferenceBackend | None = None
    try:
        identity = _preflight_local(cfg)
        backend_obj, capability, tokenizer = _build_backend(cfg)
        if dry_run:
            print(json.dumps(_advert_json(cfg, identity, backend_obj, capability), indent=2))
            return EXIT_OK
        from swarm.signals import become_subreaper

        become_subreaper()  # a p2pd orphaned on the way out is still ours to end
        rc, _ = asyncio.run(_serve(cfg, identity, backend_obj, capability, tokenizer))
    except _Fail as exc:
        _error(str(exc))
        return exc.code
    except Exception as exc:  # last resort: the traceback goes to the log, one line to the user
        log.exception("node failed")
        _error(f"node failed: {type(exc).__name__}: {exc}")
        return EXIT_RUNTIME
    finally:
        if backend_obj is not None:
            backend_obj.close()
        from swarm.signals import end_descendants

        end_descendants()
    # Exit now: a generation thread still running (its lease is already released) cannot be
    # interrupted and the interpreter's teardown would join it; the teardown also spends seconds
    # collecting torch's modules (swarm.signals.exit_now). Everything the node keeps is on disk.
    from swarm.signals import exit_now

    exit_now(rc)


def _flag_message(exc: ConfigError, overrides: dict[str, Any]) -> str:
    """Name the flag, not the config file, when a command-line value is the bad one."""
    from pydantic import ValidationError

    cause = exc.__cause__
    if isinstance(cause, ValidationError):
        first = cause.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else ""
        if overrides.get(key) is not None:
            msg = first["msg"].removeprefix("Value error, ")
            return f"--{key.replace('_', '-')} {overrides[key]}: {msg}"
    return str(exc)


def _check_multiaddrs(cfg: NodeConfig, *, from_flag: bool) -> None:
    """The coordinator address and initial_peers must parse (bad input, caught before start-up)."""
    from hivemind.utils.multiaddr import Multiaddr

    named = [("--coordinator" if from_flag else "coordinator", cfg.coordinator)]
    named += [("initial_peers", addr) for addr in cfg.initial_peers]
    for name, addr in named:
        if addr is None:
            continue
        try:
            Multiaddr(addr)
        except Exception as exc:  # the multiaddr library raises several unrelated types
            raise ConfigError(
                f"{name} {addr!r} is not a valid multiaddr ({exc}); expected "
                "/ip4/HOST/tcp/PORT/p2p/PEER_ID, as printed by `swarm coordinator launch`"
            ) from exc


def _require_coordinator(cfg: NodeConfig) -> None:
    missing = [
        flag
        for flag, value in (
            ("--coordinator", cfg.coordinator),
            ("--coordinator-key", cfg.coordinator_key),
        )
        if value is None
    ]
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)} required (flag or config file); `swarm coordinator "
            "launch` prints both (lines 'multiaddr:' and 'coordinator key:')"
        )


def _preflight_local(cfg: NodeConfig) -> Identity:
    """torch threads, state_dir, disk space, node key."""
    import torch

    from protocol.errors import KeyFileError
    from protocol.identity import Identity

    torch.set_num_threads(cfg.torch_threads)
    state = Path(cfg.state_dir).expanduser()
    try:
        state.mkdir(parents=True, exist_ok=True)
        probe_file = state / ".write-test"
        probe_file.write_bytes(b"ok")
        probe_file.unlink()
    except OSError as exc:
        raise _Fail(
            f"state_dir {state} is not writable ({exc.strerror}); pass --state-dir DIR",
            EXIT_BAD_INPUT,
        ) from exc
    free_mb = shutil.disk_usage(state).free // (1 << 20)
    if free_mb < cfg.min_free_disk_mb:
        raise _Fail(
            f"only {free_mb} MiB free in {state}; checkpoints need at least "
            f"{cfg.min_free_disk_mb} MiB (min_free_disk_mb): free space or use --state-dir",
            EXIT_RUNTIME,
        )
    try:
        return Identity.load_or_create(state / "node.key")
    except KeyFileError as exc:
        raise _Fail(str(exc), EXIT_BAD_INPUT) from exc


def _check_gpu(cfg: NodeConfig) -> None:
    wants_gpu = cfg.device.startswith("cuda") or cfg.backend == "vllm"
    if not wants_gpu:
        return
    import torch

    device = cfg.device if cfg.device.startswith("cuda") else "cuda"
    if not torch.cuda.is_available():
        raise _Fail(
            f"a GPU is required (device={cfg.device!r}, backend={cfg.backend!r}) but CUDA is not "
            "available to torch; check the driver / CUDA_VISIBLE_DEVICES or use --backend hf "
            "with device='cpu'",
            EXIT_BAD_INPUT,
        )
    try:
        (torch.ones(4, device=device) * 2).sum().item()
    except Exception as exc:  # any CUDA failure here means the device is not usable
        raise _Fail(
            f"GPU {device} is present but unusable ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}); check the driver and free memory",
            EXIT_BAD_INPUT,
        ) from exc


def vllm_options(cfg: NodeConfig) -> dict[str, Any]:
    """What node.toml sets on the vllm backend: LoRA versions up to ``vllm_max_lora_rank`` (None:
    none), the engine holding ``keep_versions`` (S + 1) adapters, as the checkpoint manager does."""
    return {"max_lora_rank": cfg.vllm_max_lora_rank, "max_loras": cfg.keep_versions}


def _build_backend(
    cfg: NodeConfig,
) -> tuple[InferenceBackend, Capability, Tokenizer | None]:
    from node.backends import BackendError, make_backend
    from node.probe import probe
    from policy.model import ModelSpec, load_tokenizer

    _check_gpu(cfg)
    spec = ModelSpec(path=cfg.model_path, dtype=cfg.dtype)
    try:
        backend = make_backend(cfg.backend, spec, device=cfg.device, vllm_options=vllm_options(cfg))
    except BackendError as exc:
        raise _Fail(str(exc), EXIT_BAD_INPUT) from exc
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise _Fail(f"cannot build the {cfg.backend} backend: {exc}", EXIT_BAD_INPUT) from exc
    if backend.sampling_rule is None:
        backend.close()
        raise _Fail(
            f"the {backend.name} backend does not draw with the swarm's sampling rule "
            "(policy.draw.draw_tokens at the seeded uniforms); the coordinator replays every "
            "draw and would refuse its samples: use --backend hf",
            EXIT_BAD_INPUT,
        )
    try:
        capability = probe(
            backend,
            spec,
            cache_dir=Path(cfg.state_dir).expanduser() / "probe",
            budget_s=cfg.probe_budget_s,
            refresh=cfg.probe_refresh,
        )
        tokenizer = load_tokenizer(spec) if "inflate_reward" in cfg.misbehave else None
    except Exception:
        backend.close()
        raise
    return backend, capability, tokenizer


def _advert_json(
    cfg: NodeConfig, identity: Identity, backend: InferenceBackend, capability: Capability
) -> dict[str, Any]:
    import time

    import msgspec

    from node.status import make_advert

    advert = make_advert(
        cfg,
        identity,
        backend,
        capability,
        peer_id="(assigned when the node starts)",
        tokens_per_s=None,
        now=time.time(),
    )
    out: dict[str, Any] = msgspec.to_builtins(advert)
    out["node_key"] = identity.public_key.hex()
    out["node_fingerprint"] = identity.fingerprint
    out["benchmark_cached"] = capability.cached
    return out


async def _serve(
    cfg: NodeConfig,
    identity: Identity,
    backend: InferenceBackend,
    capability: Capability,
    tokenizer: Tokenizer | None,
) -> tuple[int, bool]:
    """Run the worker until a signal; (exit code, whether a generation thread is abandoned)."""
    from node.worker import NodeWorker
    from swarm.signals import install_fork_signal_reset

    install_fork_signal_reset()  # the DHT process forks after the signal handlers are set
    worker = NodeWorker(cfg, backend, identity, capability=capability, tokenizer=tokenizer)
    loop = asyncio.get_running_loop()
    signals = 0
    stop = asyncio.Event()

    def on_signal(name: str) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            from swarm.signals import end_descendants

            print(f"{name} again: exiting at once", file=sys.stderr, flush=True)
            end_descendants(grace_s=0.5)
            os._exit(EXIT_RUNTIME)
        log.warning("%s: finishing the lease in hand, then exiting (again: exit at once)", name)
        stop.set()
        worker.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    page = await _start_status_page(cfg, worker)
    try:
        return await _run_worker(cfg, worker, identity, stop)
    finally:
        if page is not None:
            await page.stop()


async def _start_status_page(cfg: NodeConfig, worker: NodeWorker) -> NodeStatusPage | None:
    """The volunteer's page (``--status-port``), up before the node joins so it shows start-up;
    its URL also goes to ``<state_dir>/node.json`` (``swarm demo`` reads it from there)."""
    if cfg.status_port is None:
        return None
    from node.statuspage import NodeStatusPage

    page = NodeStatusPage(worker)
    try:
        url = page.serve(cfg.status_host, cfg.status_port)
    except OSError as exc:
        raise _Fail(
            f"cannot serve the status page on {cfg.status_host}:{cfg.status_port} "
            f"({exc.strerror or exc}); pick another --status-port, or 0 for any free port",
            EXIT_BAD_INPUT,
        ) from exc
    await page.start()
    info = {"fingerprint": worker.identity.fingerprint, "status_url": url}
    atomic_write_text(Path(cfg.state_dir).expanduser() / "node.json", json.dumps(info, indent=2))
    log.info("status page: %s/", url)
    return page


async def _work_until_drained(worker: NodeWorker, stop: asyncio.Event, drain_s: float) -> None:
    """Until the work loop ends; after a stop, at most ``drain_s`` more, then the loop (its task
    ``node-work``) is cancelled: the lease in hand is left to expire at its deadline."""
    work = asyncio.ensure_future(worker.wait())
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([work, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not work.done():
        await asyncio.wait([work], timeout=drain_s)
    if not work.done():
        log.warning("the lease in hand was not handed back within %g s; leaving it to its "
                    "deadline", drain_s)  # fmt: skip
        await worker.abandon_work()  # stop() then no longer waits to drain it
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return
    work.result()


async def _run_worker(
    cfg: NodeConfig, worker: NodeWorker, identity: Identity, stop: asyncio.Event
) -> tuple[int, bool]:
    """Start the worker (one-line errors for each way start-up fails), run it until it ends.
    A stop during start-up (joining the DHT, registering with retries) ends it at once: exit 0."""
    from node.client import CoordinatorError, CoordinatorUnavailable, Rejected
    from swarm.errors import BootstrapUnreachable, StartupError

    starting = asyncio.ensure_future(worker.start())
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not starting.done():
        log.info("stopped during start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await worker.stop()
        return EXIT_OK, False
    try:
        starting.result()
    except BootstrapUnreachable as exc:
        await worker.stop()
        raise _Fail(
            f"cannot reach the coordinator at {cfg.coordinator} (nor initial_peers "
            f"{cfg.initial_peers}) within {cfg.startup_timeout_s:g} s; check that it runs and "
            "that the address and its /p2p/ peer id are right",
            EXIT_RUNTIME,
        ) from exc
    except StartupError as exc:
        await worker.stop()
        raise _Fail(f"libp2p/DHT did not start: {exc}", EXIT_RUNTIME) from exc
    except CoordinatorUnavailable as exc:
        await worker.stop()
        raise _Fail(
            f"coordinator {cfg.coordinator} did not answer register within "
            f"{cfg.register_timeout_s:g} s ({exc}); check that it runs and that the multiaddr "
            "and its /p2p/ peer id are right",
            EXIT_RUNTIME,
        ) from exc
    except Rejected as exc:
        await worker.stop()
        raise _Fail(f"coordinator refused to register this node: {exc}", EXIT_RUNTIME) from exc
    except CoordinatorError as exc:
        await worker.stop()
        raise _Fail(f"registration failed: {exc}", EXIT_RUNTIME) from exc
    _PEER.peer = _short_peer(worker.peer_id)
    print(f"node running: peer {worker.peer_id}, key {identity.fingerprint}", flush=True)
    rc = EXIT_OK
    try:
        await _work_until_drained(worker, stop, cfg.drain_s)
        if worker.failures.gave_up:  # stopped by a signal after giving up: say so in the code
            rc = EXIT_RUNTIME
    except Exception:
        log.exception("node failed")
        rc = EXIT_RUNTIME
    finally:
        await worker.stop()
    return rc, worker.generation_in_flight
