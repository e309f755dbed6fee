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
  their timeouts, up to 60 s): the node gives the lease in hand 8 s to be handed back;
* the trainer in the middle of a learner step that outlasts the stop grace (a stall injected at
  the end of the step, on the step's thread: ``RSWARM_STALLS``): the step is abandoned, the last
  checkpoint stands; a node at work and the coordinator it works for;
* the sharded trainer's launcher (``--nproc 2``) while the coordinator is gone;
* a node and a trainer started while their coordinator is gone (start-up: joining, registering,
  waiting for the coordinator's record), stopped by SIGINT;
* ``swarm demo`` mid-run: it ends every process it started within its bound (exit 130 as for
  Ctrl-C, its documented exit code when interrupted).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from swarm_harness import Proc, coordinator_toml, launch_coordinator, until
from test_process_faults import node_proc, published_versions, trainer_toml

from protocol.identity import Identity
from swarm.peerproc import PeerProcess
from swarm.signals import SELF_ENDING, STOP_BOUND_S, descendants, process_name

#: seconds torch's shared-memory manager may take to notice its client exited
SELF_ENDING_S = 10.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stop_within(proc: Proc, role: str, *, sig: int = signal.SIGTERM, code: int = 0) -> float:
    """Signal ``proc``; assert it exits with ``code`` within its role's bound and that every
    descendant it had is gone; returns the seconds it took."""
    tree = descendants(proc.popen.pid)
    names = {p: process_name(p) for p in tree}
    bound = STOP_BOUND_S[role]
    t0 = time.monotonic()
    proc.signal(sig)
    try:
        got = proc.wait(bound)
    except Exception:
        raise AssertionError(
            f"{role} (pid {proc.popen.pid}) still running {bound:.0f} s after "
            f"{signal.Signals(sig).name}\n{proc.text()[-3000:]}"
        ) from None
    took = time.monotonic() - t0
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
    assert not left, f"{role}: descendants {left} of {names} outlived it\n{proc.text()[-2000:]}"
    assert tree, f"{role}: no child process was seen (DHT process, p2pd)"
    print(f"{role} stopped in {took:.1f} s (bound {bound:.0f} s), {len(tree)} descendants gone")
    return took


def _trainer(tmp: Path, coord_maddr: str, key: str, name: str, **env: str) -> Proc:
    state = tmp / name
    args = ["trainer", "run", "--config", str(trainer_toml(tmp, state)), "--coordinator"]
    args += [coord_maddr, "--coordinator-key", key, "--state-dir", str(state)]
    return Proc(args, tmp / f"{name}.log", env=env or None)


async def _swarm(tmp: Path, trainer: str = "trainer") -> tuple[object, Path, Identity]:
    state = tmp / trainer
    key = Identity.load_or_create(state / "trainer.key")
    config = coordinator_toml(
        tmp,
        key,
        sampling={"max_new_tokens": 5},
        leases={"min_deadline_s": 10.0, "target_lease_s": 0.5, "max_prompts_per_lease": 8},
        intake={"spot_check_fraction": 0.1},
    )
    return await launch_coordinator(tmp, config), state, key


async def test_trainer_and_node_stop_while_their_coordinator_is_gone(
    tmp_path: Path, procs: list[Proc]
) -> None:
    coord, _, _ = await _swarm(tmp_path)
    procs.append(coord.proc)  # type: ignore[attr-defined]
    maddr, fp = coord.maddr, coord.fingerprint  # type: ignore[attr-defined]
    node = node_proc(tmp_path, maddr, fp, "n1", max_prompts=8)
    procs.append(node)
    # Each step ends with a 6 s pause (shorter than the stop grace): the coordinator is stopped
    # during the first one, so the version that step publishes meets a coordinator that is gone
    # and its publication retries (what kept the trainer running > 20 s after SIGTERM).
    trainer = _trainer(tmp_path, maddr, fp, "trainer", RSWARM_STALLS="trainer.step=6")
    procs.append(trainer)
    await until(lambda: "trainer.step stalls" in trainer.text(), "the first step", 240, trainer)
    stop_within(coord.proc, "coordinator")  # type: ignore[attr-defined]
    await until(lambda: re.search(r"publishing v\d+ failed", trainer.text()),
                "the publication's retries", 60, trainer)  # fmt: skip
    await until(lambda: "failed" in node.text().rsplit("accepted", 1)[-1], "the node's retries",
                60, node)  # fmt: skip
    await asyncio.sleep(2)  # into their back-off
    stop_within(trainer, "trainer")
    stop_within(node, "node")
    assert "Traceback" not in trainer.text(), trainer.text()[-3000:]


async def test_trainer_and_node_stop_while_their_coordinator_is_frozen(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """SIGSTOP: the coordinator's libp2p daemon still accepts streams, its process never answers,
    so every request in flight waits for its timeout (up to 60 s for a submission)."""
    coord, _, _ = await _swarm(tmp_path)
    procs.append(coord.proc)  # type: ignore[attr-defined]
    maddr, fp = coord.maddr, coord.fingerprint  # type: ignore[attr-defined]
    node = node_proc(tmp_path, maddr, fp, "n1", max_prompts=8)
    procs.append(node)
    trainer = _trainer(tmp_path, maddr, fp, "trainer")
    procs.append(trainer)
    await until(lambda: published_versions(trainer.text())[-1:] >= [1], "a trained step", 240,
                trainer)  # fmt: skip
    coord.proc.signal(signal.SIGSTOP)  # type: ignore[attr-defined]
    try:
        await asyncio.sleep(4.0)  # the node's next submission or lease request is in flight
        stop_within(node, "node")
        stop_within(trainer, "trainer")
    finally:
        coord.proc.signal(signal.SIGCONT)  # type: ignore[attr-defined]
    stop_within(coord.proc, "coordinator")  # type: ignore[attr-defined]


async def test_trainer_abandons_a_step_that_outlasts_the_grace(
    tmp_path: Path, procs: list[Proc]
) -> None:
    coord, state, _ = await _swarm(tmp_path)
    procs.append(coord.proc)  # type: ignore[attr-defined]
    maddr, fp = coord.maddr, coord.fingerprint  # type: ignore[attr-defined]
    node = node_proc(tmp_path, maddr, fp, "n1", max_prompts=8)
    procs.append(node)
    # the second step stalls for 10 minutes at its end, on the step's thread
    trainer = _trainer(tmp_path, maddr, fp, "trainer", RSWARM_STALLS="trainer.step=600")
    procs.append(trainer)
    await until(lambda: "trainer.step stalls" in trainer.text(), "a stalled step", 240, trainer)
    before = sorted(p.name for p in (state / "checkpoints").glob("step-*"))
    took = stop_within(trainer, "trainer")
    assert took >= 10.0 - 0.5, "the step was given no grace"  # STOP_GRACE_S
    text = trainer.text()
    assert "did not finish within 10 s of the stop; abandoned" in text, text[-3000:]
    after = sorted(p.name for p in (state / "checkpoints").glob("step-*"))
    assert after == before, (before, after)  # the last checkpoint stands, nothing half-written
    stop_within(node, "node")  # at work for a live coordinator
    stop_within(coord.proc, "coordinator")  # type: ignore[attr-defined]


async def test_sharded_launcher_stops_while_its_coordinator_is_gone(
    tmp_path: Path, procs: list[Proc]
) -> None:
    coord, state, _ = await _swarm(tmp_path)
    procs.append(coord.proc)  # type: ignore[attr-defined]
    maddr, fp = coord.maddr, coord.fingerprint  # type: ignore[attr-defined]
    args = ["trainer", "run", "--nproc", "2", "--config", str(trainer_toml(tmp_path, state))]
    args += ["--coordinator", maddr, "--coordinator-key", fp, "--state-dir", str(state)]
    launcher = Proc(args, tmp_path / "launcher.log")
    procs.append(launcher)
    await until(lambda: published_versions(launcher.text()), "v0 from the sharded trainer", 300,
                launcher)  # fmt: skip
    stop_within(coord.proc, "coordinator")  # type: ignore[attr-defined]
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
