"""``swarm demo`` says why nodes fail instead of printing ``step -`` forever.

The coordinator keeps each node's last problem (the reason it gave when it released a lease) on
``/status`` ``node_problems``; the demo shows them in its view and ends with the node's error once
every node has stopped taking leases (a deterministic failure, node/failures.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.shell.demo import Demo, DemoError
from swarm.shell.demo_options import DemoOptions
from swarm.shell.demo_report import LiveView

PROBLEM = (
    "stopped taking leases after 3 identical failures: generation failed: ValueError: prompt of "
    "300 tokens + max_new_tokens 64 exceeds the model's 256 positions; lower max_new_tokens"
)


def _demo(tmp_path: Path, nodes: int = 1) -> Demo:
    demo = Demo(DemoOptions(nodes=nodes, run_dir=tmp_path / "run", live=False))
    demo.curve = []
    return demo


def test_the_demo_ends_with_the_nodes_error_once_every_node_gave_up(tmp_path: Path) -> None:
    demo = _demo(tmp_path, nodes=2)
    demo.status = {"trainer_step": None, "node_problems": {"ed25519:aaaa": PROBLEM}}
    assert demo.done_reason() is None  # one of two nodes: the other may still work
    demo.status["node_problems"]["ed25519:bbbb"] = PROBLEM
    with pytest.raises(DemoError, match=r"stopped taking leases.*256 positions"):
        demo.done_reason()


def test_the_plain_view_prints_each_nodes_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = _demo(tmp_path)
    demo.status = {
        "node_problems": {"ed25519:aaaaaaaaaaaaaaaaaaaaaaaa": "generation failed: X (2x)"}
    }
    LiveView(demo, enabled=False).update()
    out = capsys.readouterr().out
    assert "step -" in out and "node ed25519:aaaaaaaaaaaa" in out
    assert "generation failed: X (2x)" in out


def test_swarm_inspect_shows_node_problems_as_plain_text() -> None:
    """``swarm inspect`` prints each node's problem from ``/status``; a node's own words are never
    read as rich markup (a hostile node could otherwise restyle or hide the table)."""
    from rich.console import Console

    from swarm.shell.inspect import render

    view = {
        "nodes": [],
        "coordinator": {
            "node_problems": {"ed25519:aaaaaaaaaaaaaaaaaaaaaaaa": "[red]x[/red] " + PROBLEM}
        },
        "error": None,
    }
    console = Console(width=400, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "node ed25519:aaaaaaaaaaaa" in text and "256 positions" in text
    assert "[red]x[/red]" in text  # shown literally, not interpreted


def test_node_backends_cycle_and_bad_ones_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="--node-backend must be hf or vllm"):
        DemoOptions(nodes=2, run_dir=tmp_path / "a", node_backends=["hf", "sglang"])
    demo = Demo(DemoOptions(nodes=3, run_dir=tmp_path / "run", live=False,
                            node_backends=["vllm", "hf"]))  # fmt: skip
    spawned: list[str] = []
    monkeypatch.setattr(demo, "_spawn", lambda name, args: spawned.append(name))
    demo.run_dir.mkdir(parents=True)
    demo.coordinator = {"multiaddrs": ["/ip4/127.0.0.1/tcp/1"], "fingerprint": "ed25519:x"}
    demo._start_nodes("/ip4/127.0.0.1/tcp/1", "ed25519:x")
    backends = [(demo.run_dir / f"{n}.toml").read_text().splitlines()[0] for n in spawned]
    assert backends == ['backend = "vllm"', 'backend = "hf"', 'backend = "vllm"']


def test_a_benchmarks_trainer_overrides_win_over_the_profile(tmp_path: Path) -> None:
    """bench/capacity.py sets ``minibatches`` (also a profile setting) and ``overlap``: one key
    each in the trainer's TOML (a duplicate key would make the file unreadable), overrides win."""
    from trainer.config import TrainerConfig

    opts = DemoOptions(
        nodes=1, run_dir=tmp_path / "run", live=False,
        trainer_overrides={"minibatches": 3, "overlap": False, "idle_window_s": 45.0},
    )  # fmt: skip
    demo = Demo(opts)
    demo.run_dir.mkdir(parents=True)
    demo._write_configs("ed25519:" + "a" * 52)
    cfg = TrainerConfig.from_toml(demo.run_dir / "trainer.toml")
    assert (cfg.minibatches, cfg.overlap, cfg.idle_window_s) == (3, False, 45.0)


def test_the_embedded_demo_trains_with_the_kl_adaptive_learning_rate(tmp_path: Path) -> None:
    """The embedded profile turns on target_step_kl = 0.02 (measured on its task); a
    --trainer-set of "none" turns it off again; TrainerConfig's own default stays off."""
    from trainer.config import TrainerConfig

    assert TrainerConfig().target_step_kl is None
    for overrides, want in (({}, 0.02), ({"target_step_kl": "none"}, None)):
        opts = DemoOptions(
            nodes=1, run_dir=tmp_path / f"run{want}", live=False, trainer_overrides=overrides
        )
        demo = Demo(opts)
        demo.run_dir.mkdir(parents=True)
        demo._write_configs("ed25519:" + "a" * 52)
        assert TrainerConfig.from_toml(demo.run_dir / "trainer.toml").target_step_kl == want


def test_trainer_settings_from_the_command_line_reach_the_trainer(tmp_path: Path) -> None:
    """``swarm demo --trainer-set KEY=VALUE``: TOML values (bool, float, string, bare word)."""
    from swarm.shell.demo_options import parse_trainer_settings
    from trainer.config import TrainerConfig

    settings = parse_trainer_settings(
        [
            "filter_groups=true",
            "entropy_coef = 0.05",
            'weight_mode="mask"',
            "entropy_groups=informative",
            "target_step_kl=none",
        ]
    )
    assert settings == {
        "filter_groups": True, "entropy_coef": 0.05, "weight_mode": "mask",
        "entropy_groups": "informative", "target_step_kl": "none",
    }  # fmt: skip
    opts = DemoOptions(nodes=1, run_dir=tmp_path / "run", live=False, trainer_overrides=settings)
    demo = Demo(opts)
    demo.run_dir.mkdir(parents=True)
    demo._write_configs("ed25519:" + "a" * 52)
    cfg = TrainerConfig.from_toml(demo.run_dir / "trainer.toml")
    assert (cfg.filter_groups, cfg.entropy_coef, cfg.weight_mode) == (True, 0.05, "mask")
    assert cfg.entropy_groups == "informative" and cfg.max_staleness == opts.staleness
    assert cfg.target_step_kl is None  # "none" switches the default-on schedule off
