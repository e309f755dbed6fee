"""Bad input to every ``swarm`` command: one ``error:`` line, exit 2 (1 for runtime failures),
no traceback, and ``swarm --help`` without the heavy imports.

Cheap cases call :func:`swarm.shell.cli.main` in-process (it exits like the console script); the
ones that need a real peer (port in use, unreachable coordinator/peer) run
``python -m swarm.shell.cli`` with short timeouts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protocol.identity import Identity
from swarm.shell import cli

REPO = Path(__file__).resolve().parents[2]
KEY = "ed25519:t7zy4sqvttem4rnbowlxlyiss2gwzxrfog4wrcldgyk5uymcbbva"
PEER = "QmTdjMKHewEygMGmbkfgBCMPuH6o21STxBs4Tq6ZvkReMb"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CLOSED = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{PEER}"
Runner = Callable[..., tuple[int | str | None, str, str]]


def assert_one_error(rc: int | str | None, out: str, err: str, code: int) -> str:
    """Exit code, exactly one non-empty ``error:`` line (on stderr), no traceback."""
    assert "Traceback" not in out + err, out + err
    lines = [line for line in (out + "\n" + err).splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out + err
    assert lines[0].removeprefix("error:").strip(), lines
    assert lines[0] in err.splitlines(), "the error line goes to stderr"
    assert rc == code, (rc, out, err)
    return lines[0]


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Runner]:
    """``run_cli(*argv) -> (exit code, stdout, stderr)``, in-process, cwd = tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "install_fork_signal_reset", lambda: None)  # no hook in pytest

    def run(*argv: str) -> tuple[int | str | None, str, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli.main(list(argv))
        out, err = capsys.readouterr()
        return info.value.code, out, err

    yield run


def run_sub(*argv: str, timeout: float = 30, cwd: Path | None = None) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "swarm.shell.cli", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=env,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


# --- usage errors and --help -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--bogus"], "No such option: --bogus"),
        (["demo", "--nodes", "x"], "--nodes"),
        (["nosuch"], "No such command"),
        (["keygen"], "Missing argument"),
        (["coordinator", "launch", "--port", "abc"], "--port"),
        (["node", "run", "--price-per-hour", "cheap"], "--price-per-hour"),
        (["inspect", "--timeout"], "--timeout"),
    ],
)
def test_usage_errors_are_one_line(run_cli: Runner, argv: list[str], needle: str) -> None:
    line = assert_one_error(*run_cli(*argv), code=2)
    assert needle in line and "--help" in line


def test_help_is_fast_and_light() -> None:
    code = (
        "import sys, time\nt = time.monotonic()\nfrom swarm.shell import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit as e:\n    rc = e.code\n"
        "heavy = [m for m in ('torch', 'hivemind', 'transformers', 'numpy') if m in sys.modules]\n"
        "print('RESULT', rc, heavy, time.monotonic() - t)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env
    )
    result = proc.stdout.splitlines()[-1].split(" ", 3)
    assert result[:3] == ["RESULT", "0", "[]"], proc.stdout + proc.stderr
    assert float(result[3]) < 1.0


# --- swarm demo --------------------------------------------------------------------------------
def test_demo_bad_input(run_cli: Runner, tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("earlier run")
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, needle in [
        (["--nodes", "0"], "--nodes"),
        (["--run-dir", str(full)], "not empty"),
        (["--run-dir", str(a_file)], "is a file"),
        (["--model-dir", str(no_model)], "config.json"),
        (["--model-dir", str(tmp_path / "missing")], "no such directory"),
        (["--task", "bogus"], "unknown task"),
        (["--task", f"jsonl:{tmp_path / 'missing.jsonl'}"], "cannot read"),
        (["--max-steps", "0"], "--max-steps"),
        (["--time-limit", "nan"], "--time-limit"),
        (["--trainer-set", "filter_groups"], "KEY=VALUE"),
        (["--trainer-set", "filter_group=true"], "not a trainer setting"),
        (["--trainer-set", "max_staleness=4"], "--staleness"),
        (["--trainer-set", "filter_max_batches=0"], "filter_max_batches"),
        (["--trainer-set", "entropy_groups=some"], "entropy_groups"),
    ]:
        line = assert_one_error(*run_cli("demo", *argv), code=2)
        assert needle in line, (argv, line)


def test_demo_unwritable_run_dir(run_cli: Runner, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    line = assert_one_error(*run_cli("demo", "--run-dir", str(tmp_path / "a-file" / "run")), code=2)
    assert "cannot create the run folder" in line and "--run-dir" in line


# --- swarm coordinator launch / plan -----------------------------------------------------------
def test_coordinator_launch_bad_config_and_flags(run_cli: Runner, tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text('task = "reverse3\n')
    (tmp_path / "unknown.toml").write_text("bogus_key = 1\n")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "a-file").write_text("")
    sd = str(tmp_path / "state")
    for argv, needle in [
        (["--config", str(tmp_path / "missing.toml")], "no such config file"),
        (["--config", str(tmp_path / "bad.toml")], "not valid TOML"),
        (["--config", str(tmp_path / "unknown.toml")], "bogus_key"),
        (["--config", str(tmp_path / "binary.toml")], "not a text file"),
        (["--config", str(tmp_path)], "is a directory"),
        (["--trainer-key", "nonsense"], "--trainer-key"),
        (["--port", "70000"], "--port 70000"),
        (["--host", "not-an-ip"], "--host"),
        (["--state-dir", str(tmp_path / "a-file" / "state")], "--state-dir"),
    ]:
        if "--state-dir" not in argv:
            argv = [*argv, "--state-dir", sd]
        line = assert_one_error(*run_cli("coordinator", "launch", *argv), code=2)
        assert needle in line, (argv, line)


def test_coordinator_launch_insecure_key_file(run_cli: Runner, tmp_path: Path) -> None:
    state = tmp_path / "state"
    Identity.load_or_create(state / "coordinator.key")
    (state / "coordinator.key").chmod(0o644)
    line = assert_one_error(*run_cli("coordinator", "launch", "--state-dir", str(state)), code=2)
    assert "chmod 600" in line


@pytest.mark.timeout(90)
def test_coordinator_launch_port_in_use(tmp_path: Path) -> None:
    port = _closed_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    first = subprocess.Popen(
        [sys.executable, "-m", "swarm.shell.cli", "coordinator", "launch", "--port", str(port),
         "--state-dir", str(tmp_path / "c1")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert first.stdout is not None
        deadline = time.monotonic() + 40
        for line in first.stdout:
            if line.startswith("coordinator key:") or time.monotonic() > deadline:
                break
        assert first.poll() is None, "the first coordinator did not start"
        rc, out, err = run_sub(
            "coordinator", "launch", "--port", str(port), "--state-dir", str(tmp_path / "c2")
        )
        line = assert_one_error(rc, out, err, code=1)
        assert f"port {port}" in line and "already in use" in line
        rc, out, err = run_sub("coordinator", "launch", "--state-dir", str(tmp_path / "c1"))
        line = assert_one_error(rc, out, err, code=1)
        assert "in use by another running coordinator" in line
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=20) == 0  # and a clean shutdown does not hang
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()


def test_forked_children_stay_killable() -> None:
    """A child forked after loop.add_signal_handler must die on SIGTERM (hivemind's DHT process
    is terminated that way; it used to inherit asyncio's no-op handler and hang the exit)."""
    code = (
        "import asyncio, multiprocessing as mp, signal, time\n"
        "from swarm.signals import install_fork_signal_reset\n"
        "async def main():\n"
        "    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)\n"
        "    install_fork_signal_reset()\n"
        "    p = mp.get_context('fork').Process(target=time.sleep, args=(30,))\n"
        "    p.start(); time.sleep(0.2); p.terminate(); p.join(5)\n"
        "    print('EXIT', p.exitcode)\n"
        "    if p.exitcode is None: p.kill(); p.join()\n"
        "asyncio.run(main())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env
    )
    assert f"EXIT {-signal.SIGTERM}" in proc.stdout, proc.stdout + proc.stderr


def test_coordinator_plan_bad_pool(run_cli: Runner, tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "entry.json").write_text('[{"id": "a"}]')
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    for argv, needle in [
        (["--pool", str(tmp_path / "missing.json")], "no such pool file"),
        (["--pool", str(tmp_path / "broken.json")], "not valid JSON"),
        (["--pool", str(tmp_path / "entry.json")], "rollouts_per_s is required"),
        (["--pool", str(tmp_path)], "cannot read pool file"),
        (["--config", str(tmp_path / "binary.toml")], "not a text file"),
        (["--t-train", "-1"], "t_train_s"),
    ]:
        line = assert_one_error(*run_cli("coordinator", "plan", *argv), code=2)
        assert needle in line, (argv, line)


# --- swarm node run ----------------------------------------------------------------------------
def test_node_run_bad_input(run_cli: Runner, tmp_path: Path) -> None:
    good = ["--coordinator", CLOSED, "--coordinator-key", KEY]
    sd = ["--state-dir", str(tmp_path / "node")]
    for argv, needle in [
        (sd, "--coordinator and --coordinator-key required"),
        (["--coordinator", "garbage", "--coordinator-key", KEY, *sd], "--coordinator garbage"),
        (["--coordinator", "/ip4/127.0.0.1/tcp/1", "--coordinator-key", KEY, *sd], "/p2p/"),
        (["--coordinator", "/ip4/127.0.0.1/tcp/1/p2p/zzz", "--coordinator-key", KEY, *sd],
         "not a valid multiaddr"),
        (["--coordinator", CLOSED, "--coordinator-key", "ed25519:short", *sd], "fingerprint"),
        ([*good, "--backend", "tpu", *sd], "--backend tpu"),
        ([*good, "--price-per-hour", "-1", *sd], "--price-per-hour -1"),
        ([*good, "--config", str(tmp_path / "missing.toml"), *sd], "no such config file"),
        ([*good, "--status-port", "70000", *sd], "--status-port 70000"),
    ]:  # fmt: skip
        line = assert_one_error(*run_cli("node", "run", *argv), code=2)
        assert needle in line, (argv, line)


def test_node_status_port_in_use_is_one_line_before_joining(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, out, err = run_sub(
            "node", "run", "--coordinator", CLOSED, "--coordinator-key", KEY, "--backend", "fake",
            "--status-port", str(port), "--state-dir", str(tmp_path / "node"), timeout=120,
        )  # fmt: skip
    line = assert_one_error(rc, out, err, code=2)
    assert f"cannot serve the status page on 127.0.0.1:{port}" in line, line
    assert "--status-port" in line and "coordinator" not in line.split(";")[0], line


def test_node_run_vllm_without_gpu(run_cli: Runner, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv = ["--coordinator", CLOSED, "--coordinator-key", KEY, "--backend", "vllm"]
    line = assert_one_error(
        *run_cli("node", "run", *argv, "--state-dir", str(tmp_path / "node")), code=2
    )
    assert "GPU" in line


def test_node_run_unreachable_coordinator(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        'backend = "fake"\nstartup_timeout_s = 5.0\nregister_timeout_s = 3.0\n'
        "probe_budget_s = 0.2\n"
    )
    rc, out, err = run_sub(
        "node", "run", "--coordinator", CLOSED, "--coordinator-key", KEY, "--config", str(cfg),
        "--state-dir", str(tmp_path / "node"), timeout=40,
    )  # fmt: skip
    line = assert_one_error(rc, out, err, code=1)
    assert "cannot reach the coordinator" in line


# --- swarm trainer run -------------------------------------------------------------------------
def test_trainer_run_bad_input(run_cli: Runner, tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("seed = [\n")
    (tmp_path / "unknown.toml").write_text("bogus_key = 1\n")
    good = ["--coordinator", CLOSED, "--coordinator-key", KEY]
    for argv, needle in [
        ([], "--coordinator MULTIADDR and --coordinator-key FINGERPRINT required"),
        (["--coordinator", CLOSED], "--coordinator-key FINGERPRINT required"),
        (["--coordinator", "/ip4/127.0.0.1/tcp/1", "--coordinator-key", KEY], "/p2p/"),
        (["--coordinator", CLOSED, "--coordinator-key", "nonsense"], "--coordinator-key"),
        ([*good, "--config", str(tmp_path / "missing.toml")], "no such config file"),
        ([*good, "--config", str(tmp_path / "bad.toml")], "not valid TOML"),
        ([*good, "--config", str(tmp_path / "unknown.toml")], "bogus_key"),
        ([*good, "--max-steps", "0"], "--max-steps 0"),
        ([*good, "--nproc", "0"], "--nproc 0"),
    ]:
        line = assert_one_error(*run_cli("trainer", "run", *argv), code=2)
        assert needle in line, (argv, line)


def test_trainer_run_nproc_under_torchrun(
    run_cli: Runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torchrun already started the ranks: one line from rank 0, the same exit code, no line from
    # the others (bad input is the same on every rank).
    argv = ["--coordinator", CLOSED, "--coordinator-key", KEY, "--nproc", "2"]
    argv += ["--state-dir", str(tmp_path / "t")]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    line = assert_one_error(*run_cli("trainer", "run", *argv), code=2)
    assert "drop --nproc" in line
    monkeypatch.setenv("RANK", "1")
    code, out, err = run_cli("trainer", "run", *argv)
    assert code == 2 and "error:" not in out + err


def test_trainer_run_unreachable_coordinator(tmp_path: Path) -> None:
    rc, out, err = run_sub(
        "trainer", "run", "--coordinator", CLOSED, "--coordinator-key", KEY, "--state-dir",
        str(tmp_path / "trainer"), timeout=40,
    )  # fmt: skip
    line = assert_one_error(rc, out, err, code=1)
    assert "cannot reach the coordinator" in line


# --- swarm inspect / keygen --------------------------------------------------------------------
def test_inspect_bad_peer(run_cli: Runner, tmp_path: Path) -> None:
    for argv, needle in [
        (["--peer", "garbage"], "/p2p/"),
        (["--peer", "/ip4/127.0.0.1/tcp/1/p2p/zzz"], "not a valid multiaddr"),
        (["--peer", CLOSED, "--timeout", "0"], "--timeout"),
        (["--run-dir", str(tmp_path)], "coordinator.json"),
    ]:
        line = assert_one_error(*run_cli("inspect", *argv), code=2)
        assert needle in line, (argv, line)


def test_inspect_unreachable_peer() -> None:
    t0 = time.monotonic()
    rc, out, err = run_sub("inspect", "--peer", CLOSED, "--timeout", "5", timeout=40)
    line = assert_one_error(rc, out, err, code=1)
    assert "could not join the swarm" in line
    assert time.monotonic() - t0 < 30


def test_keygen_bad_paths(run_cli: Runner, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    loose = tmp_path / "loose.key"
    Identity.load_or_create(loose)
    loose.chmod(0o644)
    for path, needle in [
        (tmp_path / "a-file" / "x.key", "cannot create key file"),
        (loose, "chmod 600"),
        (tmp_path, "is a directory"),
    ]:
        line = assert_one_error(*run_cli("keygen", str(path)), code=2)
        assert needle in line, (path, line)
