"""Every process stops when told (issue 36 item 6): real processes on 127.0.0.1, each put in a
state, then SIGTERM (or SIGINT): it must exit 0 within its stated bound
(``swarm.signals.STOP_BOUND_S``, docs/operations.md "Stopping") and leave none of its descendants
(DHT process, p2pd, the launcher's ranks) behind. The descendants are read from
``/proc/<pid>/task/*/children`` (recursively) just before the signal.

States covered:

* the trainer and a node while their coordinator is already gone (the trainer kept retrying for
  more than 20 s and had to be killed, leaving its DHT process and p2pd behind); the coordinator
  itself while they run;
* the trainer and a node while their coordinator is frozen (SIGSTOP: requests in flight wait for
  their timeouts, up to 60 s): the node gives the lease in hand its drain time to be handed back;
* the trainer in the middle of a learner step that outlasts the stop grace (a stall injected at
  the end of the step, on the step's thread: ``RSWARM_STALLS``): the step is abandoned, the last
  checkpoint stands; a node at work and the coordinator it works for;

The last two spend the node's drain and the trainer's grace in full. They run with shorter ones
(``drain_s``, ``stop_grace_s``: :data:`SHORT`) and are held to their role's bound minus what that
saved, which proves the bound with the defaults (the rest of the shutdown does not depend on
them) in up to 13 s (frozen) and 7 s (abandoned step) less.
* the sharded trainer's launcher (``--nproc 2``) while the coordinator is gone;
* a node and a trainer started while their coordinator is gone (start-up: joining, registering,
  waiting for the coordinator's record), stopped by SIGINT;
* ``swarm demo`` mid-run: it ends every process it started within its bound (exit 130 as for
  Ctrl-C, its documented exit code when interrupted).

The coordinator and trainer of each of the first four are started ahead of their test
(:class:`Starter`: one swarm after the other, on a thread), so that a test's start-up overlaps
the waits of the test before it; each test starts its own node and puts its swarm in its state.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from swarm_harness import (
    FAST_CALIBRATION,
    CoordinatorProc,
    Proc,
    coordinator_toml,
    coordinator_up,
    start_coordinator,
    until,
)
from test_process_faults import node_proc, published_versions, trainer_toml

from node.config import DRAIN_S
from protocol.identity import Identity
from swarm.peerproc import PeerProcess
from swarm.signals import SELF_ENDING, STOP_BOUND_S, descendants, process_name
from trainer.config import STOP_GRACE_S

#: seconds torch's shared-memory manager may take to notice its client exited
SELF_ENDING_S = 10.0
#: the drain (node) and grace (trainer) of the tests that spend them in full, in seconds; each is
#: held to its role's bound less what this saves on the default (DRAIN_S, STOP_GRACE_S)
SHORT = {"node": 2.0, "trainer": 3.0}
SAVED = {"node": DRAIN_S - SHORT["node"], "trainer": STOP_GRACE_S - SHORT["trainer"]}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stop_within(
    proc: Proc, role: str, *, sig: int = signal.SIGTERM, code: int = 0, saved: float = 0.0
) -> float:
    """Signal ``proc``; assert it exits with ``code`` within its role's bound (less ``saved``
    seconds: a shorter drain or grace than the default) and that every descendant it had is
    gone; returns the seconds it took."""
    return stop_all_within([(proc, role)], sig=sig, code=code, saved={role: saved})[0]


def stop_all_within(
    stops: list[tuple[Proc, str]],
    *,
    sig: int = signal.SIGTERM,
    code: int = 0,
    saved: dict[str, float] | None = None,
) -> list[float]:
    """:func:`stop_within` for several processes signalled at once (as a host's service manager
    stops them): each is held to its own role's bound (less ``saved[role]``) from its own signal,
    its exit code and its descendants; returns the seconds each took (its exit seen within
    50 ms)."""
    bound = {role: STOP_BOUND_S[role] - (saved or {}).get(role, 0.0) for _, role in stops}
    trees = [descendants(proc.popen.pid) for proc, _ in stops]
    names = [{p: process_name(p) for p in tree} for tree in trees]
    started = []
    for proc, _ in stops:
        started.append(time.monotonic())
        proc.signal(sig)
    took: list[float | None] = [None] * len(stops)
    while True:
        now = time.monotonic()
        for i, (proc, _) in enumerate(stops):
            if took[i] is None and proc.popen.poll() is not None:
                took[i] = now - started[i]
        waiting = [i for i, t in enumerate(took) if t is None]
        late = [i for i in waiting if now - started[i] > bound[stops[i][1]]]
        if late or not waiting:
            break
        time.sleep(0.05)
    for i in late:
        proc, role = stops[i]
        raise AssertionError(
            f"{role} (pid {proc.popen.pid}) still running {bound[role]:.0f} s after "
            f"{signal.Signals(sig).name}\n{proc.text()[-3000:]}"
        )
    for (proc, role), tree, named, t in zip(stops, trees, names, took, strict=True):
        got = proc.popen.returncode
        assert got == code, f"{role} exited {got}, not {code}\n{proc.text()[-3000:]}"
        deadline = time.monotonic() + 1.0  # an exited child's zombie counts as gone
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        # torch's shared-memory manager ends by itself once its client is gone (SELF_ENDING)
        helpers = [p for p in tree if process_name(p) in SELF_ENDING]
        deadline = time.monotonic() + SELF_ENDING_S
        while any(_alive(p) for p in helpers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in tree if _alive(p)]
        assert not left, f"{role}: descendants {left} of {named} outlived it\n{proc.text()[-2000:]}"
        assert tree, f"{role}: no child process was seen (DHT process, p2pd)"
        print(f"{role} stopped in {t:.1f} s (bound {bound[role]:.0f} s), "
              f"{len(tree)} descendants gone")  # fmt: skip
    return [t for t in took if t is not None]


def _trainer(tmp: Path, coord_maddr: str, key: str, name: str, **env: str) -> Proc:
    state = tmp / name
    args = ["trainer", "run", "--config", str(trainer_toml(tmp, state)), "--coordinator"]
    args += [coord_maddr, "--coordinator-key", key, "--state-dir", str(state)]
    return Proc(args, tmp / f"{name}.log", env=env or None)


def _coordinator_config(tmp: Path) -> Path:
    key = Identity.load_or_create(tmp / "trainer" / "trainer.key")
    return coordinator_toml(
        tmp,
        key,
        sampling={"max_new_tokens": 5},
        leases={"min_deadline_s": 10.0, "target_lease_s": 0.5, "max_prompts_per_lease": 8},
        intake={"spot_check_fraction": 0.1, **FAST_CALIBRATION},
    )


@dataclass
class Swarm:
    """A coordinator and the trainer of one test (state in ``tmp``), started ahead of it."""

    tmp: Path
    coord: CoordinatorProc
    trainer: Proc


#: The swarm tests of this module, in the order they run: the trainer's CLI arguments (beyond
#: its coordinator and state dir) and the environment it is started with.
SWARMS: dict[str, tuple[list[str], dict[str, str]]] = {
    # Each step ends with a 4 s pause (shorter than the stop grace, longer than the coordinator
    # takes to stop: well under 1 s): the coordinator is stopped during the first one, so the
    # version that step publishes meets a coordinator that is gone and its publication retries
    # (what kept the trainer running > 20 s after SIGTERM).
    "gone": ([], {"RSWARM_STALLS": "trainer.step=4"}),
    "frozen": ([], {}),
    # the first step stalls for 10 minutes at its end, on the step's thread
    "abandon": ([], {"RSWARM_STALLS": "trainer.step=600"}),
    "sharded": (["--nproc", "2"], {}),
}


#: trainer settings beyond trainer_toml's, per swarm: the two that spend the grace in full
TRAINER_EXTRA = {name: f"stop_grace_s = {SHORT['trainer']}\n" for name in ("frozen", "abandon")}

#: the test that uses each swarm
_TESTS = {
    "gone": "test_trainer_and_node_stop_while_their_coordinator_is_gone",
    "frozen": "test_trainer_and_node_stop_while_their_coordinator_is_frozen",
    "abandon": "test_trainer_abandons_a_step_that_outlasts_the_grace",
    "sharded": "test_sharded_launcher_stops_while_its_coordinator_is_gone",
}


class Starter:
    """Starts the coordinator and trainer of each swarm test of this module ahead of the test,
    one swarm after the other on a thread, so that the next test's start-up (seconds of imports,
    joining, the model's set-up and v0) overlaps the waits of the test before it (a stop grace,
    a drain, a stall). A trainer started ahead only publishes v0 and waits: its first step
    needs rollouts, and the test starts the node. Each test stops its own processes; whatever
    is left (a test that failed or was not selected) is stopped at the end of the module."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.started: dict[str, Swarm | BaseException] = {}
        self.procs: list[Proc] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(root, names), name="swarm-starter", daemon=True
        )
        self._thread.start()

    def _run(self, root: Path, names: list[str]) -> None:
        for name in names:
            if self._closing.is_set():
                return
            try:
                got: Swarm | BaseException = self._start(root / name, *SWARMS[name])
            except BaseException as exc:  # handed to the test that asks for this swarm
                got = exc
            with self._lock:
                self.started[name] = got
            if isinstance(got, Swarm):  # its trainer's start-up (the heavy part) before the next
                trainer, deadline = got.trainer, time.monotonic() + 240
                while not published_versions(trainer.text()) and trainer.popen.poll() is None:
                    if time.monotonic() > deadline or self._closing.is_set():
                        break
                    time.sleep(0.2)

    def _start(self, tmp: Path, args: list[str], env: dict[str, str]) -> Swarm:
        tmp.mkdir(parents=True)
        coord = start_coordinator(tmp, _coordinator_config(tmp))
        self.procs.append(coord)
        info = tmp / "coord" / "coordinator.json"
        deadline = time.monotonic() + 120
        while not info.exists():
            late = time.monotonic() > deadline or self._closing.is_set()
            if coord.popen.poll() is not None or late:
                raise AssertionError(f"coordinator did not come up\n{coord.text()[-3000:]}")
            time.sleep(0.1)
        up = coordinator_up(tmp, coord)
        state = tmp / "trainer"
        extra = TRAINER_EXTRA.get(tmp.name, "")
        cmd = ["trainer", "run", *args, "--config", str(trainer_toml(tmp, state, extra=extra))]
        cmd += ["--coordinator", up.maddr, "--coordinator-key", up.fingerprint]
        trainer = Proc([*cmd, "--state-dir", str(state)], tmp / "trainer.log", env=env or None)
        self.procs.append(trainer)
        return Swarm(tmp, up, trainer)

    async def swarm(self, name: str, procs: list[Proc]) -> Swarm:
        """The swarm of test ``name`` (its coordinator up, its trainer started); its processes
        are added to ``procs`` (stopped at the end of the test)."""
        deadline = time.monotonic() + 600
        while True:
            with self._lock:
                got = self.started.get(name)
            if got is not None:
                break
            assert time.monotonic() < deadline, f"swarm {name!r} not started within 600 s"
            await asyncio.sleep(0.1)
        if isinstance(got, BaseException):
            raise got
        procs += [got.coord.proc, got.trainer]
        return got

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=300)
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def starter(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Starter]:
    selected = {item.name for item in request.session.items}
    names = [n for n in SWARMS if any(_TESTS[n] == t for t in selected)]
    started = Starter(tmp_path_factory.mktemp("stop"), names)
    try:
        yield started
    finally:
        started.close()


async def test_trainer_and_node_stop_while_their_coordinator_is_gone(
    starter: Starter, procs: list[Proc]
) -> None:
    sw = await starter.swarm("gone", procs)
    coord, trainer = sw.coord, sw.trainer
    node = node_proc(sw.tmp, coord.maddr, coord.fingerprint, "n1", max_prompts=8)
    procs.append(node)
    await until(lambda: "trainer.step stalls" in trainer.text(), "the first step", 240, trainer)
    stop_within(coord.proc, "coordinator")
    await until(lambda: re.search(r"publishing v\d+ failed", trainer.text()),
                "the publication's retries", 60, trainer)  # fmt: skip
    await until(lambda: "failed" in node.text().rsplit("accepted", 1)[-1], "the node's retries",
                60, node)  # fmt: skip
    await asyncio.sleep(2)  # into their back-off
    stop_all_within([(trainer, "trainer"), (node, "node")])
    assert "Traceback" not in trainer.text(), trainer.text()[-3000:]


async def test_trainer_and_node_stop_while_their_coordinator_is_frozen(
    starter: Starter, procs: list[Proc]
) -> None:
    """SIGSTOP: the coordinator's libp2p daemon still accepts streams, its process never answers,
    so every request in flight waits for its timeout (up to 60 s for a submission)."""
    sw = await starter.swarm("frozen", procs)
    coord, trainer = sw.coord, sw.trainer
    node = node_proc(sw.tmp, coord.maddr, coord.fingerprint, "n1", max_prompts=8,
                     extra=f"drain_s = {SHORT['node']}\n")  # fmt: skip
    procs.append(node)
    await until(lambda: published_versions(trainer.text())[-1:] >= [1], "a trained step", 240,
                trainer)  # fmt: skip
    coord.proc.signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(4.0)  # the node's next submission or lease request is in flight
        stop_within(node, "node", saved=SAVED["node"])
        stop_within(trainer, "trainer", saved=SAVED["trainer"])
    finally:
        coord.proc.signal(signal.SIGCONT)
    stop_within(coord.proc, "coordinator")


async def test_trainer_abandons_a_step_that_outlasts_the_grace(
    starter: Starter, procs: list[Proc]
) -> None:
    sw = await starter.swarm("abandon", procs)
    coord, trainer, state = sw.coord, sw.trainer, sw.tmp / "trainer"
    node = node_proc(sw.tmp, coord.maddr, coord.fingerprint, "n1", max_prompts=8)
    procs.append(node)
    await until(lambda: "trainer.step stalls" in trainer.text(), "a stalled step", 240, trainer)
    before = sorted(p.name for p in (state / "checkpoints").glob("step-*"))
    # the node (at work for a live coordinator) is stopped meanwhile
    took, _ = stop_all_within(
        [(trainer, "trainer"), (node, "node")], saved={"trainer": SAVED["trainer"]}
    )
    assert took >= SHORT["trainer"] - 0.5, "the step was given no grace"  # stop_grace_s
    text = trainer.text()
    grace = f"{SHORT['trainer']:g}"
    assert f"did not finish within {grace} s of the stop; abandoned" in text, text[-3000:]
    after = sorted(p.name for p in (state / "checkpoints").glob("step-*"))
    assert after == before, (before, after)  # the last checkpoint stands, nothing half-written
    stop_within(coord.proc, "coordinator")


async def test_sharded_launcher_stops_while_its_coordinator_is_gone(
    starter: Starter, procs: list[Proc]
) -> None:
    sw = await starter.swarm("sharded", procs)
    launcher = sw.trainer  # swarm trainer run --nproc 2
    await until(lambda: published_versions(launcher.text()), "v0 from the sharded trainer", 300,
                launcher)  # fmt: skip
    stop_within(sw.coord.proc, "coordinator")
    await until(lambda: "fetching rollouts failed" in launcher.text(), "rank 0's retries", 60,
                launcher)  # fmt: skip
    tree = descendants(launcher.popen.pid)
    assert len(tree) >= 4, tree  # two ranks, rank 0's DHT process and p2pd at least
    stop_within(launcher, "trainer")
    assert "error:" not in launcher.text(), launcher.text()[-3000:]


async def test_node_and_trainer_stop_during_start_up(tmp_path: Path, procs: list[Proc]) -> None:
    # A DHT peer that is not the coordinator: both join the DHT through it, then wait for a
    # coordinator that never answers (the node's registration retries, the trainer's wait for
    # the coordinator's signed record, 30 s each at most).
    bootstrap = PeerProcess(
        ["--store", str(tmp_path / "store"), "--coordinator-key", os.urandom(32).hex()],
        log_path=str(tmp_path / "bootstrap.log"),
    )
    await bootstrap.start()
    try:
        maddr, fp = bootstrap.maddrs[0], Identity.generate().fingerprint
        state = tmp_path / "n1"
        state.mkdir()
        (state / "node.toml").write_text(
            'host_maddrs = ["/ip4/127.0.0.1/tcp/0"]\nprobe_budget_s = 0.2\n'
            "register_timeout_s = 120.0\n"
        )
        args = ["node", "run", "--coordinator", maddr, "--coordinator-key", fp, "--backend"]
        args += ["hf", "--config", str(state / "node.toml"), "--state-dir", str(state)]
        node = Proc(args, tmp_path / "n1.log")
        procs.append(node)
        trainer = _trainer(tmp_path, maddr, fp, "trainer")
        procs.append(trainer)
        await until(lambda: "registration failed" in node.text(), "the node's registration retries",
                    180, node)  # fmt: skip
        await until(lambda: "swarm peer" in trainer.text(), "the trainer joining the DHT", 180,
                    trainer)  # fmt: skip
        await asyncio.sleep(1.0)
        stop_within(node, "node", sig=signal.SIGINT)
        stop_within(trainer, "trainer", sig=signal.SIGINT)
        assert "error:" not in trainer.text() + node.text()
    finally:
        await bootstrap.close()


async def test_trainer_stops_while_joining_through_a_silent_bootstrap(
    tmp_path: Path, procs: list[Proc]
) -> None:
    # A TCP port that accepts and never speaks libp2p: joining the DHT through it hangs until the
    # start-up timeout (15 s), then fails; stopped meanwhile, the trainer exits 0 (not 1).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    async def accept() -> None:
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            conn, _ = await loop.sock_accept(listener)
            held.append(conn)

    acceptor = asyncio.create_task(accept())
    try:
        maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmbGGLyeczPQgE4zbC5xf9PKkLJdSkJG2x4RahNVJrULrF"
        trainer = _trainer(tmp_path, maddr, Identity.generate().fingerprint, "trainer")
        procs.append(trainer)
        await until(lambda: held, "the trainer dialling the silent bootstrap", 120, trainer)
        await asyncio.sleep(1.0)
        stop_within(trainer, "trainer", sig=signal.SIGINT)
        assert "error:" not in trainer.text(), trainer.text()[-2000:]
    finally:
        acceptor.cancel()
        for conn in held:
            conn.close()
        listener.close()


async def test_demo_stops_every_process_it_started(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    args = ["demo", "--nodes", "1", "--time-limit", "600", "--run-dir", str(run), "--no-live"]
    demo = Proc(args, tmp_path / "demo.log")
    try:

        def training() -> bool:
            curve = run / "curve.jsonl"
            return curve.exists() and len(curve.read_text().splitlines()) >= 2

        await until(training, "the demo to train", 300, demo)
        tree = descendants(demo.popen.pid)
        assert len(tree) >= 6, tree  # coordinator, trainer, node and their DHT processes, p2pd
        stop_within(demo, "demo", code=130)
    finally:
        demo.stop()
    info = json.loads((run / "coordinator" / "coordinator.json").read_text())
    assert info["peer_id"], info
    assert os.path.exists(run / "summary.md")
