"""``swarm simulate``: run scenarios, print a summary, write docs/simulation.md.

Exit status: 0 every run kept the structural invariants (nothing accepted lost or doubled, every
acknowledged submission stored); 1 one did not; 2 bad input (one line on stderr). Bad rollouts
trained on are reported (they are a finding about the verification settings, not a crash).
"""

from __future__ import annotations

import cProfile
import json
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.sim.results import RunResult
from coordinator.sim.scenario import POLICIES, Scenario, ScenarioError, load_scenario

STRUCTURAL = ("acked_durable", "one_group_per_prompt", "nothing_lost")


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (VALUE in TOML syntax; a bare word is a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--set {item!r}: use KEY=VALUE, e.g. --set churn.per_hour=0.3")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out[key.strip()] = value
    return out


def store_runs(cache: Path, key: str, results: Sequence[RunResult]) -> None:
    """Keep the figures of a scenario's latest runs (the scaling section reads them back)."""
    data = json.loads(cache.read_text()) if cache.exists() else {}
    data[key] = [r.as_dict() for r in results]
    cache.write_text(json.dumps(data, indent=1, default=str) + "\n")


def load_runs(cache: Path) -> list[RunResult]:
    if not cache.exists():
        return []
    data = json.loads(cache.read_text())
    return [RunResult.from_dict(d) for runs in data.values() for d in runs]


def run_cli(
    scenarios: Sequence[str],
    *,
    hours: float | None = None,
    sets: Sequence[str] = (),
    policies: Sequence[str] = (),
    sweep: bool = True,
    out: Path | None = None,
    write: bool = True,
    json_out: Path | None = None,
    scaling: bool = False,
    profile: bool = False,
    runs: bool = True,
) -> int:
    from coordinator.sim.calibration import CalibrationError, load_calibration
    from coordinator.sim.catalogue import load_catalogue
    from coordinator.sim.costs import load_figures
    from coordinator.sim.report import DOC, scenario_section, slug, write_section
    from coordinator.sim.runner import build_pool, run_one, run_scenario
    from coordinator.sim.scaling import fsync_ms, profile_top, scaling_section, simpy_event_us

    try:
        overrides = parse_sets(sets)
        if hours is not None:
            overrides["hours"] = hours
        bad = [p for p in policies if p not in POLICIES]
        if bad:
            raise ScenarioError(f"--policy {bad[0]!r}: use one of {', '.join(POLICIES)}")
        loaded: list[tuple[str, Scenario]] = []
        for name in scenarios or ["nodes100"]:
            sc = load_scenario(name, overrides)
            if policies:
                sc = sc.with_values({"policies": list(policies)})
            if not sweep:
                sc = sc.with_values({"sweep": {}})
            loaded.append((name, sc))
        catalogue = load_catalogue()
        for _, sc in loaded:
            build_pool(sc, catalogue)  # unknown GPU kinds fail here, before hours of running
        cal = load_calibration()
    except (ScenarioError, CalibrationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    figures = load_figures()
    doc = out or DOC
    command = "swarm simulate " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "swarm simulate"
    status = 0
    everything: list[dict[str, Any]] = []
    cache = doc.with_name(doc.stem + "-runs.json")
    for name, sc in loaded if runs else []:
        pool = build_pool(sc, catalogue)

        def report(
            done: list[RunResult], sc: Scenario = sc, name: str = name, pool: Any = pool
        ) -> None:
            if write:  # --no-write writes nothing: no section, no plots, no runs file
                section = scenario_section(sc, name, pool, done, figures, cal, doc.parent, command)
                store_runs(cache, slug(sc.name), done)
                write_section(slug(sc.name), section, doc)

        results = run_scenario(sc, catalogue, figures, calibration=cal, on_result=report)
        if not write:
            print(scenario_section(sc, name, pool, results, figures, cal, None, command))
        everything += [r.as_dict() for r in results]
        broken = [
            (r.policy, r.label, k) for r in results for k in STRUCTURAL if not r.invariants[k][0]
        ]
        if broken:
            status = 1
            for policy, label, k in broken:
                print(f"INVARIANT BROKEN: {sc.name} {policy} {label}: {k}", file=sys.stderr)
        base = {r.policy: r for r in results if r.label == "base"}
        if "cost_aware" in base and "all_nodes" in base:
            ca, al = base["cost_aware"], base["all_nodes"]
            verdict = "<=" if ca.cost_per_accepted <= al.cost_per_accepted else "> (!)"
            print(
                f"[{sc.name}] cost per accepted rollout: cost-aware {ca.cost_per_accepted:.5f} "
                f"{verdict} all nodes {al.cost_per_accepted:.5f} USD",
                file=sys.stderr,
            )
    scaling_runs = [r for r in load_runs(cache) if r.policy == "cost_aware" and r.label == "base"]
    if scaling and scaling_runs:
        top: list[tuple[str, float, float]] = []
        note = ""
        if profile:
            name, sc = max(loaded, key=lambda x: x[1].nodes)
            minutes = min(sc.hours * 60, 6.0)
            short = sc.with_values({"hours": minutes / 60, "warmup_minutes": minutes / 4})
            prof = cProfile.Profile()
            prof.enable()
            run_one(short, "cost_aware", catalogue, figures, calibration=cal)
            prof.disable()
            top = profile_top(prof)
            note = f"cProfile of {minutes:g} simulated minutes of `{name}`, policy cost_aware"
        text = scaling_section(
            scaling_runs, figures, fsync=fsync_ms(), event_us=simpy_event_us(), profile=top,
            profile_note=note,
            out_dir=doc.parent if write else None, command=command,
        )  # fmt: skip
        if write:
            write_section("scaling", text, doc)
        else:
            print(text)
    if json_out is not None:
        json_out.write_text(json.dumps(everything, indent=1, default=str))
    if write:
        print(f"wrote {doc}", file=sys.stderr)
    return status
