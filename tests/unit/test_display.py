"""Human-readable figures (swarm.display) and ``swarm inspect``'s tables at 80 columns."""

from __future__ import annotations

import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from protocol.identity import Identity
from protocol.messages import CapabilityAdvert, CpuInfo, GpuInfo
from swarm.display import (
    counts_line,
    describe_hardware,
    fmt_bytes,
    fmt_duration,
    fmt_number,
    short_ids,
)
from swarm.shell.inspect import render

B32 = "abcdefghijklmnopqrstuvwxyz234567"


def test_fmt_number_rounds_to_three_significant_figures() -> None:
    assert fmt_number(0.2422889139328864) == "0.242"
    assert fmt_number(0.0017750714431729233) == "0.00178"
    assert fmt_number(5179.218211822567) == "5,179"
    assert fmt_number(12.345) == "12.3"
    assert fmt_number(1234567) == "1,234,567"
    assert fmt_number(0.0) == "0"
    assert fmt_number(None) == "–"
    assert fmt_number(float("nan")) == "–"
    assert fmt_number(True) == "yes"


def test_units() -> None:
    assert fmt_bytes(24 * 2**30) == "24 GiB"
    assert fmt_bytes(3500) == "3.4 KiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_duration(42.4) == "42s"
    assert fmt_duration(185) == "3m05s"
    assert fmt_duration(7800) == "2h10m"
    assert fmt_duration(None) == "–"
    assert counts_line({"stale_version": 1, "bad_signature": 3, "zero": 0}) == (
        "bad_signature 3 · stale_version 1"
    )
    assert counts_line({}) == "none"


def test_describe_hardware() -> None:
    ident = Identity.generate()
    base: dict[str, Any] = dict(
        peer_id="Qm1", node_key=ident.public_key, backend="hf", dtype="float32",
        tokens_per_s=1.0, rollouts_per_s=1.0, price_per_hour=None, policy_version=None,
        reachability="unknown", software_version="x", expires_at=time.time() + 60,
    )  # fmt: skip
    cpu = CapabilityAdvert(gpus=[], cpu=CpuInfo(cores=8, memory_bytes=31 * 2**30), **base)
    assert describe_hardware(cpu) == "CPU 8 cores, 31 GiB"
    gpu = CapabilityAdvert(
        gpus=[GpuInfo(name="NVIDIA H100", memory_bytes=80 * 2**30, compute_capability="9.0",
                      count=2)],
        cpu=None, **base,
    )  # fmt: skip
    assert describe_hardware(gpu) == "2× NVIDIA H100 (80 GiB)"


@given(st.lists(st.text(alphabet=B32, min_size=52, max_size=52), min_size=1, max_size=40))
def test_short_ids_are_unique_prefixes(bodies: list[str]) -> None:
    fps = [f"ed25519:{b}" for b in bodies]
    ids = short_ids(fps)
    assert set(ids) == set(fps)
    for fp, short in ids.items():
        assert fp.removeprefix("ed25519:").startswith(short) and len(short) >= 6
    distinct = set(fps)
    assert len({ids[fp] for fp in distinct}) == len(distinct)


def test_short_ids_grow_only_where_needed() -> None:
    a, b, c = (f"ed25519:{p}{'a' * 40}" for p in ("abcdefghijkl", "abcdefghzzzz", "qqqqqqqqqqqq"))
    assert short_ids([a, b, c]) == {a: "abcdefghi", b: "abcdefghz", c: "qqqqqq"}


# --- swarm inspect --------------------------------------------------------------------------------
def _node(fp: str, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "fingerprint": fp, "peer_id": "QmcChiRZiGCGeQkd8c8xpDK5MZaALU9qC6EQmhCzXsu2Nw",
        "gpus": [], "cpu": {"cores": 2, "memory_bytes": 24 * 2**30}, "backend": "hf",
        "dtype": "float32", "tokens_per_s": 5179.218211822567, "rollouts_per_s": 1197.25,
        "price_per_hour": None, "policy_version": 14, "reachability": "unknown",
        "software_version": "rollout-swarm/0.1.0", "state": "active", "last_seen_s": 0.3,
        "advert_expires_in_s": 50.0,
    }  # fmt: skip
    row.update(kw)
    return row


def _view() -> dict[str, Any]:
    ids = [Identity.generate().fingerprint for _ in range(3)]
    h100 = [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85520809984,
             "compute_capability": "9.0", "count": 8}]  # fmt: skip
    hostile = [{"name": "[bold red]<script>alert(1)</script>", "memory_bytes": 2**34,
                "compute_capability": "8.0", "count": 1}]  # fmt: skip
    nodes = [
        _node(ids[0]),
        _node(ids[1], gpus=h100, backend="vllm", dtype="bfloat16", price_per_hour=2.5),
        _node(ids[2], gpus=hostile, state="banned", software_version="[link=x]evil[/link]"),
    ]
    status = {
        "trainer_step": 15, "trainer_step_time_s": 0.13902307700004712, "policy_version": 15,
        "versions": [13, 14, 15], "trainer_exact_match": 0.4375, "trainer_reward_mean": 0.11328125,
        "trainer_idle_frac": 0.2422889139328864, "trainer_staleness_mean": 1.0,
        "trainer_staleness_hist": {"1": 256, "2": 12}, "rollouts_accepted": 8576,
        "queue_depth": 2176, "rejected_by_reason": {"bad_logprobs": 3},
        "plan_required_rollouts_per_s": 1608.25, "plan_available_rollouts_per_s": 2660.8,
        "plan_meets_rule": True, "plan": "need 1.61e+03 rollouts/s; 2 of 3 nodes active",
    }  # fmt: skip
    return {"time": time.time(), "nodes": nodes, "coordinator": status, "error": None}


def _text(view: dict[str, Any], width: int) -> str:
    console = Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(view, width))
    return console.export_text()


def test_inspect_is_readable_at_80_columns() -> None:
    view = _view()
    text = _text(view, 80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    ids = short_ids([n["fingerprint"] for n in view["nodes"]])
    for n in view["nodes"]:  # each node by its short unique id, whole (not cut with "…")
        assert any(line.split()[:1] == [ids[n["fingerprint"]]] for line in lines), text
    assert "…" not in text
    assert "hf/fp32" in text and "vllm/bf16" in text and "5,179" in text
    assert "24.2 % of wall time" in text  # not 0.2422889139328864
    rows = {line[:26].strip(): line[26:].strip() for line in lines if line.startswith(" ")}
    assert rows["exact match"] == "0.438" and rows["mean reward"] == "0.113"  # not a raw tuple
    assert rows["learner step"] == "15 (0.139 s a step)"
    assert rows["staleness histogram"] == "Δ1 256 · Δ2 12"
    assert rows["rejected"] == "bad_logprobs 3"
    assert rows["capacity required"] == "1,608 rollouts/s"
    assert rows["capacity available"] == "2,661 rollouts/s (meets the rule)"
    assert "0.2422889" not in text and "5179.218" not in text
    # a node's own words are printed as text, not interpreted as rich markup
    assert "1× [bold" in text and "red]<script>alert(1)" in text and "</script> 16 GiB" in text


def test_inspect_adds_columns_on_a_wide_terminal() -> None:
    view = _view()
    narrow, wide = _text(view, 80), _text(view, 140)
    assert "roll/s" not in narrow and "software" not in narrow
    assert "roll/s" in wide and "1,197" in wide and "rollout-swarm/0.1.0" in wide
    assert "[link=x]evil[/link]" in wide  # markup shown literally
    assert max(len(line) for line in wide.splitlines()) <= 140
