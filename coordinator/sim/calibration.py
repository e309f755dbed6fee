"""What the coordinator's work costs, as the simulation charges it: a checked-in calibration.

The simulation runs the coordinator's real code, but the *time* that code takes must not come from
a clock read during the run: a measurement differs from run to run (and with the machine's load),
and fed into simulated time it makes two runs of the same seed differ. So every cost the simulation
charges as simulated time comes from ``coordinator/sim/calibration.json``, measured once by
``bench/sim_calibrate.py`` on the real code and checked in:

* ``token_check_s``: CPU seconds per completion token of the intake's per-token checks (check 5 and
  reward decoding) — what a long completion adds to bench/intake.py's short-completion figure;
* ``open_s`` + ``open_token_s · tokens``: the Ed25519 verify and strict decode of one signed
  message (``Coordinator.open``), a small one plus what each submitted token adds;
* ``op_s``: CPU seconds of one call of the core per operation (``register``, ``heartbeat``,
  ``lease`` — a lease or a standby answer —, ``submit``, ``release``, ``fetch``, ``publish``),
  the means of a calibration run of the simulation itself;
* ``tick_s + tick_node_s · n``, ``plan_s + plan_node_s · n`` (``plan_short_*`` when the pool is
  short of the rule), ``status_s + status_node_s · n``: the upkeep tick without a re-plan, a
  re-plan, and the ``/status`` document the service builds every tick, each a line through two
  measured pool sizes (``bench/coord_scale.py``); the status has two lines, ``status_small_*``
  up to ``status_maps_max`` nodes (:data:`coordinator.status.NODE_MAPS_MAX`: per-node maps
  included) and ``status_*`` above (counts only).

The simulation charges these to one coordinator core (:class:`CoreQueue`): a message waits while
the core is busy, so a coordinator that cannot keep up shows as delayed answers, expired leases and
an idle learner, as it would in production. The measured CPU of every call is still booked and
reported, but no longer decides anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION = Path(__file__).with_name("calibration.json")

#: The core operations a node or the learner causes (``op_s`` keys).
OPERATIONS = ("register", "heartbeat", "lease", "submit", "release", "fetch", "publish")


class CalibrationError(ValueError):
    """The calibration file is missing or unusable; the message says what to run."""


@dataclass(frozen=True)
class Calibration:
    """Costs in CPU seconds of one coordinator core (module docstring)."""

    token_check_s: float
    open_s: float
    open_token_s: float
    op_s: dict[str, float]
    tick_s: float
    tick_node_s: float
    plan_s: float
    plan_node_s: float
    plan_short_s: float
    plan_short_node_s: float
    status_s: float
    status_node_s: float
    #: up to this many nodes the status carries its per-node maps (``status_small_*`` line)
    status_maps_max: int = 0
    status_small_s: float = 0.0
    status_small_node_s: float = 0.0
    #: where and when it was measured (free text, for the report)
    source: str = ""
    #: extra facts of the measurement (machine, load average, sizes)
    meta: dict[str, Any] = field(default_factory=dict)

    def message_s(self, op: str, tokens: float = 0.0) -> float:
        """One node message of ``op``: open (verify + decode) and the core's call."""
        return self.open_s + self.open_token_s * tokens + self.op_s.get(op, 0.0)

    def upkeep_s(self, nodes: int, *, replanned: bool, short: bool, status: bool) -> float:
        """One tick for ``nodes`` live nodes: the tick, a re-plan when one ran (``short``: the
        pool fell short of the rule, the dearer case), the status document."""
        cost = self.tick_s + self.tick_node_s * nodes
        if replanned and short:
            cost += self.plan_short_s + self.plan_short_node_s * nodes
        elif replanned:
            cost += self.plan_s + self.plan_node_s * nodes
        if status and nodes <= self.status_maps_max:
            cost += self.status_small_s + self.status_small_node_s * nodes
        elif status:
            cost += self.status_s + self.status_node_s * nodes
        return cost

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_calibration(path: Path = CALIBRATION) -> Calibration:
    """Read ``path``; a missing or malformed file is a :class:`CalibrationError` (one line)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CalibrationError(
            f"{path}: cannot read the calibration ({exc.strerror}); run bench/sim_calibrate.py"
        ) from exc
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc
    try:
        cal = Calibration(**data)
    except TypeError as exc:
        raise CalibrationError(f"{path}: {exc}; run bench/sim_calibrate.py") from exc
    numbers = {k: v for k, v in cal.as_dict().items() if k not in ("op_s", "source", "meta")}
    numbers.update({f"op_s.{k}": v for k, v in cal.op_s.items()})
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalibrationError(f"{path}: {name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise CalibrationError(f"{path}: {name} must be a finite number >= 0, got {value!r}")
    missing = [op for op in OPERATIONS if op not in cal.op_s]
    if missing:
        raise CalibrationError(
            f"{path}: op_s lacks {', '.join(missing)}; run bench/sim_calibrate.py"
        )
    return cal


def write_calibration(cal: Calibration, path: Path = CALIBRATION) -> None:
    path.write_text(json.dumps(cal.as_dict(), indent=1, sort_keys=True) + "\n", encoding="utf-8")


class CoreQueue:
    """One coordinator core in simulated time: work is served first come, first served.

    ``charge(now, seconds)`` books ``seconds`` of work arriving at ``now`` and returns when it is
    done (``now`` plus any backlog plus the work). The core's call itself runs at arrival on the
    real code (its state changes then); the answer leaves at the returned time. Busy time is
    counted per window for the report."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.calls = 0
        self.max_backlog_s = 0.0

    def charge(self, now: float, seconds: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        self.wait_s += start - now
        self.calls += 1
        self.max_backlog_s = max(self.max_backlog_s, start - now)
        return self.free_at
