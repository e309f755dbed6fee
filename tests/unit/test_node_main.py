"""node.main.run_from_cli: dry run, preflight messages and exit codes (no network)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node.main import run_from_cli
from protocol.identity import Identity

MADDR = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """run_from_cli sets torch threads and installs a root log handler: undo both."""
    threads, root = torch.get_num_threads(), logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    torch.set_num_threads(threads)
    root.setLevel(level)
    root.handlers[:] = handlers


def config_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "node.toml"
    path.write_text(f"probe_budget_s = 0.05\nlog_level = 'WARNING'\n{extra}")
    return path


def test_dry_run_prints_the_advert_and_contacts_nobody(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = run_from_cli(
        backend="fake",
        price_per_hour=0.25,
        config=config_file(tmp_path),
        state_dir=tmp_path / "state",
        dry_run=True,
    )
    assert rc == 0
    advert = json.loads(capsys.readouterr().out)
    ident = Identity.load(tmp_path / "state" / "node.key")
    assert advert["node_fingerprint"] == ident.fingerprint
    assert advert["node_key"] == ident.public_key.hex()
    assert advert["backend"] == "fake" and advert["price_per_hour"] == 0.25
    assert advert["policy_version"] is None and advert["cpu"]["cores"] >= 1
    assert advert["tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "--coordinator and --coordinator-key required"),
        ({"coordinator": MADDR}, "--coordinator-key required"),
        ({"coordinator": MADDR, "coordinator_key": "ed25519:short"}, "not a node fingerprint"),
        ({"coordinator": "localhost:9000", "coordinator_key": None}, "not a coordinator multiaddr"),
        ({"backend": "tpu"}, "backend"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kwargs: dict[str, str], needle: str
) -> None:
    rc = run_from_cli(config=config_file(tmp_path), state_dir=tmp_path / "s", **kwargs)  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and needle in err and "\n" not in err


def test_not_enough_disk_is_a_runtime_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config_file(tmp_path, "min_free_disk_mb = 1000000000\n")
    rc = run_from_cli(backend="fake", config=cfg, state_dir=tmp_path / "s", dry_run=True)
    assert rc == 1
    assert "MiB free" in capsys.readouterr().err


def test_gpu_asked_without_cuda_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    cfg = config_file(tmp_path, "device = 'cuda'\n")
    rc = run_from_cli(backend="hf", config=cfg, state_dir=tmp_path / "s", dry_run=True)
    assert rc == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_insecure_key_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "s"
    Identity.load_or_create(state / "node.key")
    (state / "node.key").chmod(0o644)
    rc = run_from_cli(backend="fake", config=config_file(tmp_path), state_dir=state, dry_run=True)
    assert rc == 2
    assert "chmod 600" in capsys.readouterr().err
