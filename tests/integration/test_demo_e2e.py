"""``swarm demo`` end to end: a real local swarm (coordinator, trainer, three hf nodes, each its own
process with its own libp2p daemon) trains the embedded default until its exact match reaches 0.42
(a level no policy that ignores the order of the prompt reaches but by chance: TARGET_EXACT), and
``swarm inspect`` reads the nodes' adverts from the DHT while it runs.

The demo is started as a subprocess in its own session; its children are its own business (it
ends them by PID), and this test only checks afterwards that none of them is left
(:mod:`demo_harness` holds the process checks and the last-resort clean-up).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from demo_harness import (
    REPO,
    alive,
    demo_env,
    last_resort_cleanup,
    leftovers,
    status_of,
    wait_for,
)

CHILDREN = ("coordinator", "trainer", "node-0", "node-1", "node-2")
START_LINES = {  # what each process logs once it is up and doing its job
    "coordinator": r"coordinator up: /ip4/",
    "trainer": r"published policy v0 ",
    "node-0": r"joined: backend hf/",
    "node-1": r"joined: backend hf/",
    "node-2": r"joined: backend hf/",
}
#: A bound for a failing run only (a passing one ends at the target). At the trainer's default rate
#: reaching 0.5 took 115 learner steps, 168 s, on a 2-core box at load 13; at DEMO_LR at load
#: 16-19, start-up alone took 90 s and a step 3-4 s (78 steps, exact 0.44, in 300 s).
DEMO_TIME_LIMIT_S = 420
DEMO_TIMEOUT_S = DEMO_TIME_LIMIT_S + 60.0  # plus start-up and shutdown
#: The learner's rate, 4x the trainer's 5e-4. The demo's time is start-up (five processes) plus
#: learner steps, and the steps were most of it and all of its spread: at 5e-4 reaching 0.5 took
#: ~115 steps (102-151 s of test). In process at S = 2 (bench/staleness.py's run_one, the demo's
#: learner settings, current policy on 256 samples every 3 steps), the first evaluation >= 0.5
#: came at step 117 (seed 0) at 5e-4 and at 75, 57, 69 (seeds 0, 1, 2) at 2e-3, in half the CPU
#: time; 4e-3 was no faster (the demo's KL-adaptive rate, target_step_kl, holds each step's move
#: near 0.02 nat/token). A lower entropy bonus is not a way: at 1e-3 with entropy_coef 0.05 the
#: policy settled on a wrong answer (exact 0.0 after 200 steps).
DEMO_LR = 2e-3
#: The learning bar: the demo must reach this exact match on reverse3 (3 letters over `abcd`). A
#: uniform random policy over the 26 symbols scores (1/26)^4 ≈ 2e-6; the best answer that ignores
#: the prompt 1/64; echoing the prompt 1/4 (the palindromes); the best answer that ignores the
#: order of the prompt's letters (one fixed arrangement of its multiset) 4/64·1 + 36/64·1/3 +
#: 24/64·1/6 = 0.3125, the most any order-blind policy scores on average. The demo stops on the
#: mean of three learner steps' batches, 3 × 32 prompts × 8 samples: for that best order-blind
#: policy, a prompt's 8-sample mean has variance Var(p) + E[p(1-p)]/8 = 0.0378 + 0.0221 = 0.060
#: over the prompt mix, so the mean of 96 prompts has std 0.025 and 0.42 is 4.3 std above 0.3125
#: (p ≈ 1e-5 per look; the running mean over a run's ~30 independent windows: ~3e-4). Only a
#: policy that uses the order gets there. It was 0.5: in three earlier runs of this test at DEMO_LR
#: (their curve.jsonl, a loaded machine) the three-step mean crossed 0.42 at steps 55, 73 and 74,
#: and 0.5 at 57, 89 and not by step 78 (that run hit its time limit): 2-16 learner steps sooner
#: (the steps are most of the test's time and all of its spread).
TARGET_EXACT = 0.42


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``swarm ARGS`` in its own session; afterwards nothing of that session may be left
    (``swarm inspect`` starts a libp2p daemon, which must go away with it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm.shell.cli", *args], cwd=REPO, env=demo_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        deadline = time.monotonic() + 10
        while (left := leftovers(None, {proc.pid})) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # a no-op unless it hung or left something
        proc.wait()
    assert not left, f"swarm {args[0]} left processes behind: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _log(t0: float, what: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {what}", flush=True)  # shown with -s or on failure


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 90)  # the SIGTERM'd demo's 60 s and the checks after it
def test_demo_trains_broadcasts_and_cleans_up(tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    out = tmp_path / "demo.out"
    argv = [
        sys.executable, "-m", "swarm.shell.cli", "demo", "--no-live", "--nodes", "3",
        "--target", str(TARGET_EXACT), "--time-limit", str(DEMO_TIME_LIMIT_S),
        "--batch-prompts", "32", "--group-size", "8", "--run-dir", str(run_dir),
        "--trainer-set", f"lr={DEMO_LR}",
    ]  # fmt: skip
    with open(out, "wb") as fh:
        demo = subprocess.Popen(
            argv, cwd=REPO, env=demo_env(), stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        # --- while it runs: the coordinator is up, all three nodes deliver, inspect sees them.
        # `swarm inspect` needs ~15 s on a busy 2-core machine (importing hivemind + torch), so
        # it starts as soon as the nodes have registered, while the first rollouts come in.
        info_path = run_dir / "coordinator" / "coordinator.json"
        info = wait_for(
            "coordinator.json", lambda: json.loads(info_path.read_text()), demo, out, 90
        )
        http_url = info["http_url"]
        registered = wait_for(
            "three nodes to register",
            lambda: set(states) if len(states := status_of(http_url)["node_states"]) == 3 else None,
            demo, out, 120,
        )  # fmt: skip
        _log(t0, "nodes registered")
        with ThreadPoolExecutor(1) as pool:
            inspecting = pool.submit(
                _cli, "inspect", "--json", "--run-dir", str(run_dir), timeout=60
            )
            wait_for(
                "accepted rollouts",
                lambda: status_of(http_url)["rollouts_accepted"] > 0,
                demo, out, 120,
            )  # fmt: skip
            _log(t0, "rollouts accepted")
            res = inspecting.result()
        _log(t0, "inspect done")
        assert res.returncode == 0, f"inspect failed: {res.stdout}\n{res.stderr}"
        view = json.loads(res.stdout)
        if not {n["fingerprint"] for n in view["nodes"]} >= registered and demo.poll() is None:
            # an advert can reach the DHT a moment after its node registered: look once more
            res = _cli("inspect", "--json", "--run-dir", str(run_dir), timeout=60)
            assert res.returncode == 0, f"inspect failed: {res.stdout}\n{res.stderr}"
            view = json.loads(res.stdout)
        nodes = {n["fingerprint"]: n for n in view["nodes"]}
        assert set(nodes) == registered, f"inspect listed {sorted(nodes)}, expected {registered}"
        for n in nodes.values():
            assert n["backend"] == "hf", n
            assert n["dtype"] == "float32", n
            assert n["cpu"] is not None and n["cpu"]["cores"] >= 1, n
            assert n["cpu"]["memory_bytes"] > 0, n
            assert n["tokens_per_s"] > 0, n
            assert n["state"] in ("active", "standby"), n
            assert n["peer_id"].startswith(("Qm", "12D3")), n
        assert view["error"] is None, view["error"]
        assert set(view["coordinator"]["node_states"]) == registered  # status came through too

        # --- the demo ends by itself (the exact match reached the target)
        try:
            rc = demo.wait(timeout=max(DEMO_TIMEOUT_S - (time.monotonic() - t0), 10))
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"demo did not end within {DEMO_TIMEOUT_S:.0f}s:\n{out.read_text()[-3000:]}"
            )
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)  # the demo stops its children on SIGTERM
            try:
                demo.wait(timeout=60)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
            last_resort_cleanup(run_dir, demo.pid)

    _log(t0, f"demo ended ({demo.returncode})")

    # --- the process tree is gone (p2pd daemons included)
    pids = json.loads((run_dir / "demo.json").read_text())["pids"]
    sessions = {demo.pid, *pids.values()}
    deadline = time.monotonic() + 10
    while True:
        left = [name for name, pid in pids.items() if alive(pid)]
        strays = leftovers(run_dir, sessions)
        if (not left and not strays) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left or strays:
        last_resort_cleanup(run_dir, demo.pid)
    assert not left, f"still running: {left}"
    assert not strays, f"processes of the demo are still running: {strays}"

    text = out.read_text()
    assert rc == 0, f"demo exited {rc}:\n{text[-3000:]}"
    assert f"swarm demo ended (exact match reached {TARGET_EXACT:.2f})" in text, text[-3000:]

    # --- every process came up
    assert set(pids) == set(CHILDREN)
    logs = {name: (run_dir / "logs" / f"{name}.log").read_text() for name in CHILDREN}
    for name, pattern in START_LINES.items():
        assert re.search(pattern, logs[name]), f"{name}.log lacks its start line:\n{logs[name]}"

    # --- rollouts were accepted from each of the three nodes (the final /status snapshot)
    summary = (run_dir / "summary.md").read_text()
    figures = json.loads(summary.split("```json", 1)[1].split("```", 1)[0])
    final = figures["final_status"]
    completed = final["node_leases_completed"]
    assert len(completed) == 3 and all(v > 0 for v in completed.values()), completed
    assert final["rollouts_accepted"] > 0
    assert not final["nodes_banned"], final["nodes_banned"]

    # --- at least two policy versions reached every node through the broadcast
    for name in ("node-0", "node-1", "node-2"):
        versions = set(re.findall(r"loaded policy v(\d+) ", logs[name]))
        assert len(versions) >= 2, f"{name} loaded only {sorted(versions)}"

    # --- it learned: from the random init's ~0 to an exact match no order-blind policy reaches.
    # The demo stops when the mean of its last three /status readings (the trainer's batches,
    # sampled by the nodes from policies at most S versions old) is >= the target.
    rows = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    exact = [r["exact"] for r in rows if r["exact"] is not None]
    assert len(exact) >= 3, rows
    assert exact[0] < 0.05, f"the untrained policy already scored {exact[0]}"
    assert sum(exact[-3:]) / 3 >= TARGET_EXACT, f"exact match did not reach the target: {exact}"
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    assert rewards[-1] > rewards[0] + 0.3, f"reward did not rise: {rewards}"
    assert (run_dir / "demo.png").is_file()

    # --- the trainer's stability monitors reach /status (and the demo's curve)
    for key in ("ess_frac", "mismatch_kl", "clip_frac", "mask_frac", "grad_norm"):
        value = final[f"trainer_{key}"]
        assert isinstance(value, int | float) and value >= 0, (key, value)
    assert 0 < final["trainer_ess_frac"] <= 1
    assert isinstance(final["trainer_stability_warning"], str)
    assert all("stability_warning" in r for r in rows)


def test_demo_refuses_bad_flags_without_starting_anything(tmp_path: Path) -> None:
    for flags, named in ((["--nodes", "0"], "--nodes"), (["--group-size", "1"], "--group-size")):
        run_dir = tmp_path / "run"
        res = _cli("demo", "--no-live", *flags, "--run-dir", str(run_dir), timeout=60)
        assert res.returncode == 2, res
        assert res.stdout == "", res.stdout
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
        assert not run_dir.exists()  # nothing was written, so nothing was started


def test_demo_refuses_a_run_dir_that_holds_an_earlier_run(tmp_path: Path) -> None:
    # Reusing it would hand the old coordinator.json (a dead address) to the new trainer and nodes.
    old = tmp_path / "run" / "coordinator" / "coordinator.json"
    old.parent.mkdir(parents=True)
    old.write_text('{"multiaddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmOld"]}')
    res = _cli("demo", "--no-live", "--run-dir", str(tmp_path / "run"), timeout=60)
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--run-dir" in lines[0] and "not empty" in lines[0], lines
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == [
        "coordinator",
        "coordinator.json",
    ]


def test_inspect_refuses_a_missing_run_dir() -> None:
    res = _cli("inspect", "--json", "--run-dir", "/nonexistent", timeout=60)
    assert res.returncode == 2, res
    assert res.stdout == "", res.stdout  # --json consumers never see the error as output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent" in lines[0], lines
