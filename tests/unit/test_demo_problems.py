"""``swarm demo`` says why nodes fail instead of printing ``step -`` forever.

The coordinator keeps each node's last problem (the reason it gave when it released a lease) on
``/status`` ``node_problems``; the demo shows them in its view and ends with the node's error once
every node has stopped taking leases (a deterministic failure, node/failures.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.demo import Demo, DemoError, DemoOptions
from swarm.demo_report import LiveView

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

    from swarm.inspect import render

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
