"""Measured figures the simulation charges as simulated time (docs/benchmarks.md sections).

* ``broadcast`` (bench/broadcast.py): the peer-assisted broadcast's last-receiver time as a
  multiple of M/B for N = 1, 2, 4, 8. The simulation fits ``ratio(N) = a + b·log2 N`` (a pipelined
  relay adds a per-hop delay, and hops grow with log N) by least squares and scales it by each
  node's own bandwidth: ``T_i = ratio(N) · bytes / B_i``.
* ``intake`` (bench/intake.py): rollouts verified per CPU-second without log-prob re-scoring (the
  cheap checks 3–6 plus the SQLite commit), and the extra time of a re-scored lease, from which the
  re-scoring rate of that machine follows; a real model's re-score is charged as
  ``2 · params · tokens`` FLOPs on the verifier GPU (``verification.verifier_tflops``).
* ``protocol`` (bench/protocol.py): signed messages verified and decoded per CPU-second (the
  simulation calls the coordinator core directly, so this per-message cost is added in the CPU
  analysis rather than spent).

When docs/benchmarks.md is not there (an installed package), the figures recorded below are used.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"

#: The embedded model bench/intake.py re-scores (params) and its lease shape.
INTAKE_MODEL_PARAMS = 133_440
INTAKE_SAMPLES_RESCORED = 8
INTAKE_TOKENS_PER_SAMPLE = 5 + 8  # prompt + completion cap


@dataclass(frozen=True)
class Figures:
    """The measured inputs, with where they came from."""

    #: (N, peer-assisted t_last / (M/B)) points
    broadcast: tuple[tuple[int, float], ...]
    #: rollouts verified per CPU-second, spot check off
    intake_rollouts_per_cpu_s: float
    #: extra milliseconds of a lease whose samples were re-scored (p50 re-scored − p50 plain)
    intake_rescore_ms: float
    #: signed messages verified + decoded per CPU-second
    protocol_msgs_per_s: float
    source: str

    @property
    def broadcast_fit(self) -> tuple[float, float]:
        """(a, b) of ratio(N) = a + b·log2 N, least squares over the measured points."""
        xs = [math.log2(n) for n, _ in self.broadcast]
        ys = [r for _, r in self.broadcast]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        b = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        return my - b * mx, b

    def broadcast_ratio(self, n_nodes: int) -> float:
        a, b = self.broadcast_fit
        return max(1.0, a + b * math.log2(max(1, n_nodes)))

    @property
    def cheap_check_s(self) -> float:
        """CPU seconds of checks 3–6 + commit per rollout (short completions)."""
        return 1.0 / self.intake_rollouts_per_cpu_s

    @property
    def rescore_flops_per_s(self) -> float:
        """Effective FLOP/s of the CPU re-scoring in bench/intake.py (for comparison)."""
        flops = 2 * INTAKE_MODEL_PARAMS * INTAKE_SAMPLES_RESCORED * INTAKE_TOKENS_PER_SAMPLE
        return flops / (self.intake_rescore_ms / 1e3)


RECORDED = Figures(
    broadcast=((1, 1.01), (2, 1.08), (4, 1.22), (8, 1.47)),
    intake_rollouts_per_cpu_s=26_281.0,
    intake_rescore_ms=2.6,
    protocol_msgs_per_s=10_527.0,
    source="figures recorded in coordinator/sim/costs.py (docs/benchmarks.md not found)",
)


def _section(text: str, name: str) -> str:
    m = re.search(rf"<!-- bench:{name}:start -->(.*?)<!-- bench:{name}:end -->", text, re.S)
    return m.group(1) if m else ""


def _rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _num(cell: str) -> float:
    return float(cell.replace(",", "").replace("*", ""))


def load_figures(path: Path = BENCHMARKS) -> Figures:
    """Parse the three sections; any missing or unreadable one falls back to :data:`RECORDED`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return RECORDED
    try:
        bc = [r for r in _rows(_section(text, "broadcast"))[1:] if r[0].isdigit()]
        broadcast = tuple((int(r[0]), _num(r[4])) for r in bc)
        intake = _rows(_section(text, "intake"))
        plain = next(r for r in intake if r[0] == "fraction 0")
        checked = next(r for r in intake if r[0].startswith("fraction") and r[0] != "fraction 0")
        proto = _rows(_section(text, "protocol"))
        full = next(r for r in proto if r[0].startswith("verify + decode"))
        figures = Figures(
            broadcast=broadcast,
            intake_rollouts_per_cpu_s=_num(plain[-1]),
            intake_rescore_ms=max(0.0, _num(checked[7]) - _num(plain[5])),
            protocol_msgs_per_s=_num(full[1]),
            source=f"{path.name} (bench/broadcast.py, bench/intake.py, bench/protocol.py)",
        )
    except (StopIteration, IndexError, ValueError):
        return RECORDED
    if len(figures.broadcast) < 2 or figures.intake_rescore_ms <= 0:
        return RECORDED
    return figures


def token_check_cost(tokens: int = 2048, repeats: int = 5) -> float:
    """CPU seconds per completion token of the intake's per-token checks (check 5 and reward
    decoding), measured here on one synthetic sample with the real functions (best of
    ``repeats``): what a long completion adds to the short-completion figure of bench/intake.py."""
    from coordinator.intake import IntakeContext, check_sample
    from coordinator.store import LeaseRecord
    from policy.model import CharTokenizer
    from protocol.messages import Sample, pack_logprobs, pack_tokens

    tok = CharTokenizer()
    letters = tok.encode("abcd")
    body = [letters[i % 4] for i in range(tokens - 1)] + [tok.eos_token_id]
    sample = Sample(
        token_ids=pack_tokens(body),
        logprobs=pack_logprobs([-0.5] * tokens),
        finish_reason="eos",
        seed=0,
    )
    lease = LeaseRecord("L", b"k", 1, 1, (0,), 1, tokens, 0.0, 1.0, "active")
    ctx = IntakeContext(
        node_key=b"k", lease=lease, slots={}, open_prompts=frozenset(), known_versions=frozenset(),
        current_version=1, staleness_bound=1, vocab_size=tok.vocab_size,
        eos_token_id=tok.eos_token_id, stop_token_ids=frozenset({tok.eos_token_id}),
    )  # fmt: skip
    best = math.inf
    for _ in range(repeats):
        t0 = time.process_time()
        ids, _ = check_sample(sample, ctx, "calibration")
        tok.decode(ids)
        best = min(best, time.process_time() - t0)
    return best / tokens
