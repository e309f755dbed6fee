"""``swarm inspect``: join the DHT as a client and show the swarm.

Nodes come from their signed capability adverts in the DHT (records that do not verify are
skipped); their state (active / standby / banned / gone) and the learner's figures come from the
coordinator's ``rswarm/status`` RPC. ``--json`` prints one machine-readable document.

The tables fit an 80-column terminal: nodes by their shortest unique fingerprint prefix (at
least 6 characters, as git abbreviates hashes), figures rounded to three significant digits with
their units; from :data:`WIDE` columns on, throughput in rollouts and the software version are added
(peer ids: ``--json``).
Every string a node chose (GPU names, software) is printed as text, never as rich markup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from protocol import rpc
from protocol.codec import decode, encode
from protocol.messages import CapabilityAdvert, StatusRequest, StatusResponse
from swarm.display import (
    counts_line,
    fmt_bytes,
    fmt_duration,
    fmt_number,
    fmt_rate,
    short_ids,
)


def _advert_row(fp: str, advert: CapabilityAdvert, status: dict[str, Any]) -> dict[str, Any]:
    states = status.get("node_states") or {}
    # the coordinator's own dial-back result when it has one, else what the node advertises
    measured = (status.get("node_reachability") or {}).get(fp)
    return {
        "fingerprint": fp,
        "peer_id": advert.peer_id,
        "gpus": [
            {
                "name": g.name,
                "memory_bytes": g.memory_bytes,
                "compute_capability": g.compute_capability,
                "count": g.count,
            }
            for g in advert.gpus
        ],
        "cpu": (
            {"cores": advert.cpu.cores, "memory_bytes": advert.cpu.memory_bytes}
            if advert.cpu
            else None
        ),
        "backend": advert.backend,
        "dtype": advert.dtype,
        "tokens_per_s": advert.tokens_per_s,
        "rollouts_per_s": advert.rollouts_per_s,
        "price_per_hour": advert.price_per_hour,
        "policy_version": advert.policy_version,
        "reachability": measured if measured in ("public", "private") else advert.reachability,
        "software_version": advert.software_version,
        "state": states.get(fp, "unregistered"),
        # what the node said when it last gave a lease back (e.g. a generation failure)
        "problem": (status.get("node_problems") or {}).get(fp),
        "last_seen_s": (status.get("node_last_seen_s") or {}).get(fp),
        "advert_expires_in_s": round(advert.expires_at - time.time(), 1),
    }


async def snapshot(peer: Any, coordinator_peer: str | None, timeout: float) -> dict[str, Any]:
    """One view of the swarm: adverts from the DHT + the coordinator's status."""
    from swarm.adverts import list_adverts
    from swarm.transport import P2PTransport

    status: dict[str, Any] = {}
    error = None
    if coordinator_peer is not None:
        try:
            raw = await P2PTransport(peer.p2p).call(
                coordinator_peer, rpc.STATUS, encode(StatusRequest(verbose=True)), timeout=timeout
            )
            status = dict(decode(raw, StatusResponse).status)
        except Exception as exc:  # shown to the user; the DHT part is still useful
            error = f"coordinator status unavailable: {exc}"
    adverts = await list_adverts(peer, timeout=timeout)
    nodes = [_advert_row(fp, ad, status) for fp, ad in sorted(adverts.items())]
    return {"time": time.time(), "nodes": nodes, "coordinator": status, "error": error}


#: Terminal width from which ``render`` adds the wide-screen columns.
WIDE = 120
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _hardware(n: dict[str, Any]) -> str:
    """``1× H100 80GB HBM3 80 GiB`` / ``CPU 2c 24 GiB`` (compact: the 80-column table)."""
    if n["gpus"]:
        return ", ".join(
            f"{g['count']}× {g['name'].removeprefix('NVIDIA ')} {fmt_bytes(g['memory_bytes'])}"
            for g in n["gpus"]
        )
    cpu = n["cpu"] or {}
    return f"CPU {cpu.get('cores', '?')}c {fmt_bytes(cpu.get('memory_bytes'))}"


def _version(v: Any) -> str:
    return "–" if v is None else f"v{v}"


def _idle_breakdown(c: dict[str, Any]) -> str:
    """`` (rollouts 3 %, fetch 1 %, ...)``: the causes the learner reported, largest first."""
    parts = {
        cause: c.get(f"trainer_idle_{cause}_frac")
        for cause in ("rollouts", "stale", "fetch", "publish", "checkpoint", "other")
    }
    shown = sorted(
        ((k, v) for k, v in parts.items() if isinstance(v, int | float) and v >= 0.005),
        key=lambda kv: -kv[1],
    )
    if not shown:
        return ""
    return " (" + ", ".join(f"{k} {fmt_number(100 * v)} %" for k, v in shown) + ")"


def _coordinator_rows(c: dict[str, Any]) -> list[tuple[str, str]]:
    step_time = c.get("trainer_step_time_s")
    idle = c.get("trainer_idle_frac")
    hist = c.get("trainer_staleness_hist")
    plan_ok = c.get("plan_meets_rule")
    return [
        ("learner step", fmt_number(c.get("trainer_step"))
         + (f" ({fmt_number(step_time)} s a step)" if step_time is not None else "")),
        ("policy version", _version(c.get("policy_version"))
         + (f" (usable: {', '.join(f'v{v}' for v in c['versions'])})"
            if c.get("versions") else "")),
        ("exact match", fmt_number(c.get("trainer_exact_match"))),
        ("mean reward", fmt_number(c.get("trainer_reward_mean"))),
        ("learner idle", "–" if idle is None else f"{fmt_number(100 * idle)} % of wall time"
         + _idle_breakdown(c)),
        ("predicted idle", "–" if c.get("plan_predicted_idle_frac") is None
         else f"{fmt_number(100 * c['plan_predicted_idle_frac'])} % (capacity rule)"),
        ("mean staleness", fmt_rate(c.get("trainer_staleness_mean"), "versions")),
        ("staleness histogram", counts_line({f"Δ{k}": v for k, v in (hist or {}).items()})
         if isinstance(hist, dict) else "–"),
        ("rollouts accepted", fmt_number(c.get("rollouts_accepted"))),
        ("queue (not yet trained)", fmt_rate(c.get("queue_depth"), "rollouts")),
        ("rejected", counts_line(c.get("rejected_by_reason") or {})),
        ("capacity required", fmt_rate(c.get("plan_required_rollouts_per_s"), "rollouts/s")),
        ("capacity available", fmt_rate(c.get("plan_available_rollouts_per_s"), "rollouts/s")
         + ("" if plan_ok is None else " (meets the rule)" if plan_ok else " (short)")),
        ("capacity plan", "–" if c.get("plan") is None else str(c["plan"])),
    ]  # fmt: skip


def render(view: dict[str, Any], width: int = 80) -> Any:
    """The swarm as rich tables fitting ``width`` columns (more columns from :data:`WIDE`)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    wide = width >= WIDE
    ids = short_ids([n["fingerprint"] for n in view["nodes"]])
    nodes = Table(title=f"nodes ({len(view['nodes'])})", box=box.SIMPLE_HEAD, padding=(0, 1),
                  pad_edge=False, title_justify="left")  # fmt: skip
    nodes.add_column("node", no_wrap=True)
    nodes.add_column("hardware", overflow="fold", max_width=None if wide else 22)
    nodes.add_column("backend", no_wrap=True)
    nodes.add_column("tok/s", justify="right", no_wrap=True)
    if wide:
        nodes.add_column("roll/s", justify="right", no_wrap=True)
    nodes.add_column("$/h", justify="right", no_wrap=True)
    nodes.add_column("ver", justify="right", no_wrap=True)
    nodes.add_column("state", no_wrap=True)
    if wide:  # measured by the coordinator's dial-back (also in --json at any width)
        nodes.add_column("reach", no_wrap=True)
    nodes.add_column("seen", justify="right", no_wrap=True)
    if wide:
        nodes.add_column("software", no_wrap=True)
    for n in view["nodes"]:
        cells = [
            ids[n["fingerprint"]],
            _hardware(n),
            f"{n['backend']}/{_DTYPES.get(n['dtype'], n['dtype'])}",
            fmt_number(n["tokens_per_s"]),
        ]
        if wide:
            cells.append(fmt_number(n["rollouts_per_s"]))
        price = n["price_per_hour"]
        cells += [
            "free" if price is None else f"{price:.2f}",
            _version(n["policy_version"]),
            n["state"],
            *([n["reachability"]] if wide else []),
            fmt_duration(n["last_seen_s"]),
        ]
        if wide:
            cells.append(n["software_version"])
        nodes.add_row(*(escape(c) for c in cells))
    coord = Table(title="coordinator", show_header=False, box=box.SIMPLE, padding=(0, 1),
                  pad_edge=False, title_justify="left")  # fmt: skip
    coord.add_column("what", style="dim", no_wrap=True)
    coord.add_column("value", overflow="fold")
    for what, value in _coordinator_rows(view["coordinator"]):
        coord.add_row(what, escape(value))
    parts: list[Any] = [nodes, coord]
    from rich.text import Text

    problems = view["coordinator"].get("node_problems") or {}
    for fp, problem in sorted(problems.items()):  # the node's own words: never rich markup
        parts.append(Text(f"node {ids.get(fp, fp[:20])}: {problem}", style="yellow"))
    if view.get("error"):
        parts.append(f"[yellow]{escape(view['error'])}[/yellow]")
    return Group(*parts)


def _resolve_peer(peer: str | None, run_dir: Path | None) -> str:
    if peer is not None:
        return peer
    if run_dir is None:
        runs = sorted(Path("runs").glob("demo-*/coordinator/coordinator.json"))
        if not runs:
            raise ValueError("give --peer MULTIADDR or --run-dir of a `swarm demo` run")
        return str(json.loads(runs[-1].read_text())["multiaddrs"][0])
    info = run_dir / "coordinator" / "coordinator.json"
    if not info.is_file():
        raise ValueError(f"{info} not found: is {run_dir} a `swarm demo` run folder?")
    return str(json.loads(info.read_text())["multiaddrs"][0])


def run_inspect(
    *,
    peer: str | None,
    run_dir: Path | None,
    watch: bool,
    interval: float,
    json_out: bool,
    timeout: float,
) -> int:
    """``swarm inspect``. Exit 0 shown, 2 bad input, 1 swarm unreachable."""
    import logging

    from swarm.adverts import swarm_validators
    from swarm.dht import PeerConfig, SwarmPeer
    from swarm.errors import SwarmError

    logging.basicConfig(level=logging.WARNING)

    def error(message: str, code: int) -> int:
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        return code

    if not timeout > 0:
        return error(f"--timeout must be a positive number of seconds, got {timeout}", 2)
    if watch and not interval > 0:
        return error(f"--interval must be a positive number of seconds, got {interval}", 2)
    try:
        maddr = _resolve_peer(peer, run_dir)
    except ValueError as exc:
        return error(str(exc), 2)
    except (OSError, KeyError, IndexError, TypeError) as exc:
        info = (
            run_dir / "coordinator" / "coordinator.json"
            if run_dir is not None
            else "the newest runs/demo-*/coordinator/coordinator.json"
        )
        return error(f"{info}: no coordinator multiaddr in it ({exc!r}); use --peer", 2)
    if "/p2p/" not in maddr:
        return error("--peer must be a full multiaddr ending in /p2p/<peer id>", 2)
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(maddr)
    except Exception as exc:  # the multiaddr library raises several unrelated types
        return error(
            f"--peer {maddr!r} is not a valid multiaddr ({exc}); expected "
            "/ip4/HOST/tcp/PORT/p2p/PEER_ID, as printed by `swarm coordinator launch`",
            2,
        )
    # Status is asked of the peer we joined through; for a non-coordinator peer it fails politely.
    coordinator_peer = maddr.rsplit("/p2p/", 1)[-1]

    async def main() -> int:
        swarm_peer = SwarmPeer(
            PeerConfig(initial_peers=(maddr,), client_mode=True, startup_timeout=timeout),
            record_validators=swarm_validators(),
        )
        try:
            await asyncio.wait_for(swarm_peer.start(), timeout)
        except (SwarmError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await swarm_peer.stop()
            why = str(exc) or f"no answer within {timeout:g} s"
            return error(f"could not join the swarm through {maddr}: {why}", 1)
        try:
            if not watch:
                view = await snapshot(swarm_peer, coordinator_peer, timeout)
                if json_out:
                    print(json.dumps(view, indent=2, default=str))
                else:
                    from rich.console import Console

                    console = Console()
                    console.print(render(view, console.width))
                return 0
            from rich.live import Live

            if json_out:  # one JSON document per line, nothing else on stdout
                while True:
                    view = await snapshot(swarm_peer, coordinator_peer, timeout)
                    print(json.dumps(view, default=str), flush=True)
                    await asyncio.sleep(interval)
            with Live(refresh_per_second=1) as live:
                while True:
                    view = await snapshot(swarm_peer, coordinator_peer, timeout)
                    live.update(render(view, live.console.width))
                    await asyncio.sleep(interval)
        finally:
            await swarm_peer.stop()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0
    except SwarmError as exc:  # the DHT or the peer failed after joining
        return error(f"lost the swarm through {maddr}: {exc}", 1)
