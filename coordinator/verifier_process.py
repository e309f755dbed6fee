"""A verifier process: re-scores the coordinator's spot checks on another GPU or machine (issue 35).

The operator runs ``swarm coordinator verifier --coordinator MULTIADDR --coordinator-key FP``
with the coordinator's own config file, on each GPU it gives to verification, and lists the
fingerprint it prints in the coordinator's ``verification.verifier_keys``. It:

1. joins the swarm as a libp2p peer (the coordinator is its bootstrap peer) with its own
   Ed25519 key (``<state_dir>/verifier.key``);
2. asks for a job (``rswarm/vtake``, a long poll of ``take_wait_s``), which names the policy
   version and the samples to re-score;
3. holds that version: downloads it from the coordinator (every chunk verified against the
   manifest the pinned coordinator key signed; a LoRA version's adapter over its base) into its
   chunk store, the last ``S + 1`` versions kept;
4. re-scores with the same :class:`~coordinator.logprobs.InProcessLogprobVerifier` the
   coordinator builds from the same config (tolerances, calibration, sampling), and answers
   ``rswarm/vdone`` with the verdict, its re-scoring seconds and tokens (V of the budget).

A version it cannot hold (no seed answered, another base model) is answered ``unavailable``:
the coordinator gives the job to another verifier. A network failure waits and asks again
(back-off up to 30 s); a refusal of its key (``unknown_node``) ends the process with one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from coordinator.config import CoordinatorConfig
from coordinator.holding import SpotCheckModels, model_spec
from coordinator.logprobs import InProcessLogprobVerifier, VerifierUnavailable
from coordinator.verifier_pool import job_args, verdict_message
from protocol import limits as L
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity, short_fingerprint
from protocol.messages import (
    Ack,
    Reject,
    Standby,
    VerifyJob,
    VerifyTake,
    VerifyVerdict,
)
from swarm.errors import BroadcastError, RemoteError, TransportError

log = logging.getLogger(__name__)

#: seconds one ask for a job is held open by the coordinator when none is queued
TAKE_WAIT_S = 10.0
#: a version's download must finish within this (seconds)
DOWNLOAD_TIMEOUT_S = 120.0
BACKOFF_MAX_S = 30.0


class VerifierRefused(Exception):
    """The coordinator refused this verifier's key (``unknown_node``): not a verifier of it."""


class VerifierProcess:
    """One verifier process (module docstring). ``coordinator``: the coordinator's multiaddr
    with ``/p2p/<peer id>``; ``coordinator_key``: its fingerprint (manifests are verified
    against it); ``pad_id``: the tokenizer's (the coordinator's preflight gives it)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        state_dir: Path,
        *,
        coordinator: str,
        coordinator_key: str,
        pad_id: int,
        take_wait_s: float = TAKE_WAIT_S,
        download_timeout_s: float = DOWNLOAD_TIMEOUT_S,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(self.state_dir / "verifier.key")
        self.coordinator = coordinator
        self.coordinator_peer_id = coordinator.rsplit("/p2p/", 1)[-1].split("/", 1)[0]
        self.coordinator_key = coordinator_key
        self.pad_id = pad_id
        self.take_wait_s = take_wait_s
        self.download_timeout_s = download_timeout_s
        self.host = host
        self.peer: Any = None
        self.transport: Any = None
        self.broadcast: Any = None
        self.verifier: InProcessLogprobVerifier | None = None
        self._key_resolved = False
        #: jobs answered: pass, fail, unavailable
        self.answered: Counter[str] = Counter()

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    async def start(self) -> None:
        from swarm.adverts import swarm_validators
        from swarm.broadcast import BroadcastNode
        from swarm.chunks import ChunkStore
        from swarm.dht import PeerConfig, SwarmPeer
        from swarm.holders import DhtHolderDirectory
        from swarm.transport import P2PTransport

        cfg = self.config
        keep = cfg.staleness_bound + 1
        self.peer = SwarmPeer(
            PeerConfig(
                initial_peers=(self.coordinator,),
                host_maddrs=(f"/ip4/{self.host}/tcp/0",),
                identity_path=str(self.state_dir / "p2p.key"),
                client_mode=True,
            ),
            record_validators=swarm_validators(),
        )
        await self.peer.start()
        self.transport = P2PTransport(self.peer.p2p, io_timeout=cfg.network.request_timeout_s)
        chunks = ChunkStore(self.state_dir / "checkpoints", keep_versions=keep)
        self.broadcast = BroadcastNode(  # downloads only: it serves and announces nothing
            self.transport, chunks, DhtHolderDirectory(self.peer), bytes(32), relay=False
        )
        await self.broadcast.start()
        models = SpotCheckModels(chunks, model_spec(cfg))
        await asyncio.to_thread(models.warm_up)
        self.verifier = InProcessLogprobVerifier.for_config(cfg, models.load, pad_id=self.pad_id)
        log.info(
            "verifier %s up: peer %s, coordinator %s",
            self.fingerprint, self.peer.peer_id, self.coordinator_peer_id,
        )  # fmt: skip

    async def stop(self) -> None:
        if self.broadcast is not None:
            await self.broadcast.stop()
        if self.peer is not None:
            await self.peer.stop()

    # --- the coordinator's two methods -----------------------------------------------------------
    async def _call(self, method: str, msg: msgspec.Struct, timeout: float) -> object:
        request = encode(seal(self.identity, msg, now=time.time()))
        try:
            raw = await self.transport.call(
                self.coordinator_peer_id, method, request, timeout=timeout
            )
        except RemoteError as exc:
            if exc.code == "unknown_method":
                raise VerifierRefused(
                    "the coordinator takes no verifier processes (its verification."
                    f"verifier_keys is empty): add {self.fingerprint} to it and restart it"
                ) from exc
            raise TransportError(f"{method}: coordinator answered {exc}") from exc
        answer = decode(raw)
        if isinstance(answer, Reject) and answer.code is ReasonCode.UNKNOWN_NODE:
            raise VerifierRefused(
                f"the coordinator refused this verifier's key {short_fingerprint(self.fingerprint)}"
                f": {answer.detail} (add {self.fingerprint} to its verification.verifier_keys)"
            )
        return answer

    async def take(self) -> VerifyJob | None:
        """The next job (None: none within the long poll). Raises TransportError, ProtocolError,
        VerifierRefused."""
        timeout = rpc.DEFAULT_TIMEOUTS[rpc.VERIFY_TAKE] + self.take_wait_s
        answer = await self._call(rpc.VERIFY_TAKE, VerifyTake(wait_s=self.take_wait_s), timeout)
        if isinstance(answer, VerifyJob):
            return answer
        if isinstance(answer, Standby):
            return None
        if isinstance(answer, Reject):
            raise TransportError(f"{rpc.VERIFY_TAKE}: {answer.code.value}: {answer.detail}")
        raise TransportError(f"{rpc.VERIFY_TAKE}: unexpected {type(answer).__name__}")

    async def answer(self, verdict: VerifyVerdict) -> bool:
        """Send a verdict; False when the coordinator no longer wanted it (given to another)."""
        out = await self._call(rpc.VERIFY_DONE, verdict, rpc.DEFAULT_TIMEOUTS[rpc.VERIFY_DONE])
        if isinstance(out, Ack):
            return True
        if isinstance(out, Reject):
            log.warning("verdict of job %s refused: %s: %s", verdict.job_id, out.code.value,
                        out.detail)  # fmt: skip
            return False
        raise TransportError(f"{rpc.VERIFY_DONE}: unexpected {type(out).__name__}")

    async def deliver(self, verdict: VerifyVerdict, deadline: float, stop: asyncio.Event) -> None:
        """:meth:`answer`, tried again on network trouble until the job's ``deadline`` (after
        it the coordinator has given the job to another verifier: its verdict counts too if it
        arrives first, so one last try is made)."""
        delay = 0.5
        while True:
            try:
                await self.answer(verdict)
                return
            except (TransportError, ProtocolError) as exc:
                if time.time() + delay > deadline or stop.is_set():
                    raise
                log.warning("verdict of job %s not delivered (%s); again in %.1f s",
                            verdict.job_id, exc, delay)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(BACKOFF_MAX_S, delay * 2)

    # --- one job ---------------------------------------------------------------------------------
    async def hold(self, version: int) -> None:
        """Have ``version`` in the chunk store (download it from the coordinator if not).
        Raises VerifierUnavailable with the reason when it cannot."""
        from swarm.pinned import resolve_pinned_key

        store = self.broadcast.store
        if store.is_complete(version):
            return
        seeds = [self.coordinator_peer_id]
        try:
            if not self._key_resolved:
                key = await resolve_pinned_key(
                    self.coordinator_key, version, store=store, transport=self.transport,
                    seeds=seeds,
                )  # fmt: skip
                self.broadcast.downloader.pinned_key = key
                self._key_resolved = True
            await asyncio.wait_for(self.broadcast.download(version, seeds), self.download_timeout_s)
        except (BroadcastError, TransportError, ProtocolError, TimeoutError) as exc:
            what = str(exc) or f"no answer within {self.download_timeout_s:.0f} s"
            raise VerifierUnavailable(f"cannot fetch v{version}: {what}") from exc

    async def rescore(self, job: VerifyJob) -> VerifyVerdict:
        """The verdict of ``job`` (``unavailable`` when its version cannot be held here)."""
        assert self.verifier is not None
        try:
            args = job_args(job)
            await self.hold(job.version)
            seconds, tokens = self.verifier.compute_s, self.verifier.tokens
            verdict = await args.run(self.verifier)
        except Exception as exc:  # whatever failed here, another verifier may not fail it
            unavailable = isinstance(exc, VerifierUnavailable)
            if not unavailable:
                log.exception("re-score job %s failed", job.job_id)
            detail = str(exc) if unavailable else f"{type(exc).__name__}: {exc}"
            return VerifyVerdict(
                job_id=job.job_id, outcome="unavailable" if unavailable else "error", metric="",
                value=0.0, threshold=0.0, detail=detail[: L.MAX_TEXT_LEN],
                code=ReasonCode.INTERNAL, figures={}, compute_s=0.0, tokens=0,
            )  # fmt: skip
        return verdict_message(
            job.job_id, verdict,
            compute_s=self.verifier.compute_s - seconds, tokens=self.verifier.tokens - tokens,
        )  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        """Take, re-score and answer jobs until ``stop`` is set. Raises VerifierRefused."""
        delay = 1.0
        while not stop.is_set():
            try:
                job = await self.take()
                if job is None:
                    delay = 1.0
                    continue
                verdict = await self.rescore(job)
                await self.deliver(verdict, job.deadline, stop)
                self.answered[verdict.outcome] += 1
                log.info(
                    "job %s: v%d, %d samples: %s (%s)", job.job_id, job.version,
                    sum(len(g.samples) for g in job.groups), verdict.outcome, verdict.detail,
                )  # fmt: skip
                delay = 1.0
            except (TransportError, ProtocolError) as exc:
                log.warning("the coordinator did not answer as asked (%s); asking again in "
                            "%.0f s", exc, delay)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(BACKOFF_MAX_S, delay * 2)


def run_from_cli(
    *,
    config: Path | None,
    coordinator: str | None,
    coordinator_key: str | None,
    state_dir: Path | None,
    host: str | None = None,
) -> int:
    """``swarm coordinator verifier``: run until SIGINT/SIGTERM. Exit 0 clean, 2 bad input, 1
    runtime failure (the peer did not start, the coordinator refused the key); one ``error:``
    line on stderr."""
    import signal
    import sys

    from coordinator.config import load_config, parse_config
    from coordinator.errors import ConfigError
    from coordinator.launch import _preflight
    from protocol.errors import KeyFileError
    from protocol.identity import parse_fingerprint
    from swarm.errors import SwarmError

    def fail(message: str, code: int) -> int:
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        return code

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not coordinator or "/p2p/" not in coordinator:
        return fail(
            "--coordinator needs the coordinator's multiaddr with its peer id "
            "(/ip4/HOST/tcp/PORT/p2p/PEER, as `swarm coordinator launch` prints it)", 2
        )  # fmt: skip
    if not coordinator_key:
        return fail("--coordinator-key is required (the fingerprint the coordinator prints)", 2)
    try:
        fingerprint = parse_fingerprint(coordinator_key)
    except ValueError as exc:
        return fail(f"--coordinator-key: {exc}", 2)
    try:
        cfg = load_config(config) if config is not None else parse_config({})
        setup = _preflight(cfg, str(config) if config is not None else "defaults")
    except ConfigError as exc:
        return fail(str(exc), 2)
    try:
        process = VerifierProcess(
            cfg, Path(state_dir or "verifier-data"), coordinator=coordinator,
            coordinator_key=fingerprint, pad_id=setup.tokenizer.pad_token_id,
            host=host or "127.0.0.1",
        )  # fmt: skip
    except KeyFileError as exc:
        return fail(str(exc), 2)
    except OSError as exc:
        return fail(f"state dir {state_dir} is not usable: {exc.strerror or exc}", 2)
    print(f"verifier key: {process.fingerprint}", flush=True)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            try:
                await process.start()
            except Exception as exc:  # one line, whatever failed (peer, model, disk)
                if not isinstance(exc, SwarmError | OSError):
                    log.exception("verifier failed to start")
                return fail(f"verifier failed to start: {type(exc).__name__}: {exc}", 1)
            await process.run(stop)
        except VerifierRefused as exc:
            return fail(str(exc), 1)
        finally:
            with contextlib.suppress(Exception):
                await process.stop()
        return 0

    return asyncio.run(main())
