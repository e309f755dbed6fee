"""``swarm demo`` shows the trainer's stability figures, the KL-adaptive learning rate included."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from swarm.shell.demo_report import monitor_line

STATUS = {
    "trainer_ess_frac": 0.93,
    "trainer_mismatch_kl": 0.12,
    "trainer_clip_frac": 0.02,
    "trainer_mask_frac": 0.0,
    "trainer_grad_norm": 1.5,
    "trainer_step_kl": 0.061,
    "trainer_lr_factor": 0.6666666,
    "trainer_stability_warning": "",
}


def test_the_monitor_line_names_the_step_move_and_the_learning_rate_factor() -> None:
    line = monitor_line(STATUS)
    assert "step KL 0.061" in line and "lr x0.67" in line and "WARNING" not in line
    assert "WARNING: grad_norm 4 > 3" in monitor_line(
        {**STATUS, "trainer_stability_warning": "grad_norm 4 > 3"}
    )
    # a trainer from before the schedule (no figures yet) reads as dashes, not a crash
    assert "step KL - lr x-" in monitor_line({})


def test_the_live_view_has_the_two_columns(tmp_path: Path) -> None:
    from swarm.shell.demo import Demo
    from swarm.shell.demo_options import DemoOptions
    from swarm.shell.demo_report import LiveView

    demo = Demo(DemoOptions(nodes=1, run_dir=tmp_path / "run", live=False))
    demo.curve = []
    demo.status = dict(STATUS)
    console = Console(width=160, record=True)
    console.print(LiveView(demo, enabled=False)._render())
    text = console.export_text()
    assert "step KL" in text and "lr ×" in text and "0.061" in text and "0.67" in text
