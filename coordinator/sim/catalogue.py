"""The GPU catalogue (``gpus.toml``): throughput per model size, price per hour, reliability.

Throughput between two listed model sizes is interpolated linearly in log(size)–log(rate) space;
outside the listed range it is extrapolated with rate ∝ 1/size from the nearest point. A size at or
above the first listed size with rate 0 does not fit the card (rate 0: such nodes never get work).
"""

from __future__ import annotations

import itertools
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from coordinator.sim.scenario import ScenarioError

CATALOGUE = Path(__file__).parent / "gpus.toml"


@dataclass(frozen=True)
class GpuKind:
    name: str
    #: "consumer" or "datacenter" (selects the network profile; premium-only uses datacenter)
    klass: str
    memory_gb: float
    price_per_hour: float
    #: P(no unplanned failure in one hour)
    reliability: float
    #: ((size in billions of parameters, tokens/s), ...) sorted by size
    points: tuple[tuple[float, float], ...]

    @property
    def premium(self) -> bool:
        return self.klass == "datacenter"

    @property
    def failures_per_hour(self) -> float:
        return -math.log(max(1e-9, min(1.0, self.reliability)))

    def tokens_per_s(self, params_b: float) -> float:
        """Aggregate decode rate for a model of ``params_b`` billion parameters (0: no fit)."""
        pts = self.points
        zero = [s for s, r in pts if r <= 0]
        if zero and params_b >= min(zero):
            return 0.0
        live = [(s, r) for s, r in pts if r > 0]
        if params_b <= live[0][0]:
            return live[0][1] * live[0][0] / params_b
        if params_b >= live[-1][0]:
            return live[-1][1] * live[-1][0] / params_b
        for (s0, r0), (s1, r1) in itertools.pairwise(live):
            if s0 <= params_b <= s1:
                w = (math.log(params_b) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        raise AssertionError("unreachable")


def load_catalogue(path: Path = CATALOGUE) -> dict[str, GpuKind]:
    """Parse the catalogue; a malformed entry raises :class:`ScenarioError` naming it."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read the GPU catalogue: {exc}") from exc
    out = {}
    for name, entry in data.items():
        try:
            klass = str(entry["class"])
            if klass not in ("consumer", "datacenter"):
                raise ValueError(f"class {klass!r} is not consumer/datacenter")
            points = tuple(
                sorted((float(k), float(v)) for k, v in dict(entry["tokens_per_s"]).items())
            )
            if not points or all(r <= 0 for _, r in points) or any(r < 0 for _, r in points):
                raise ValueError("tokens_per_s needs at least one positive rate, none negative")
            out[name] = GpuKind(
                name=name,
                klass=klass,
                memory_gb=float(entry["memory_gb"]),
                price_per_hour=float(entry["price_per_hour"]),
                reliability=float(entry["reliability"]),
                points=points,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ScenarioError(f"{path}: GPU {name!r}: {exc}") from exc
    return out
