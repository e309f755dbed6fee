"""``swarm inspect``: join the DHT as a client and show the swarm.

Nodes come from their signed capability adverts in the DHT (records that do not verify are
skipped); their state (active / standby / banned / gone) and the learner's figures come from the
coordinator's ``rswarm/status`` RPC. ``--json`` prints one machine-readable document.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from protocol import rpc
from protocol.codec import decode, encode
from protocol.messages import CapabilityAdvert, StatusRequest, StatusResponse


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


def render(view: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    nodes = Table(title=f"nodes ({len(view['nodes'])})")
    for col in ("node", "hardware", "backend", "tok/s", "roll/s", "price/h", "version",
                "state", "reach", "seen"):  # fmt: skip
        nodes.add_column(col)
    for n in view["nodes"]:
        if n["gpus"]:
            hw = ", ".join(f"{g['count']}× {g['name']} {g['memory_bytes'] / 2**30:.0f} GiB"
                           for g in n["gpus"])  # fmt: skip
        else:
            cpu = n["cpu"] or {}
            hw = f"CPU {cpu.get('cores')} cores {cpu.get('memory_bytes', 0) / 2**30:.0f} GiB"
        nodes.add_row(
            n["fingerprint"][:20] + "…", hw, f"{n['backend']}/{n['dtype']}",
            f"{n['tokens_per_s']:.0f}", f"{n['rollouts_per_s']:.1f}",
            "-" if n["price_per_hour"] is None else f"${n['price_per_hour']:.2f}",
            str(n["policy_version"]), n["state"], n["reachability"],
            "-" if n["last_seen_s"] is None else f"{n['last_seen_s']:.0f}s ago",
        )  # fmt: skip
    c = view["coordinator"]
    coord = Table(title="coordinator", show_header=False)
    coord.add_column("what")
    coord.add_column("value")
    rows = [
        ("learner step", c.get("trainer_step")),
        ("policy version", c.get("policy_version")),
        ("queue depth (accepted, not yet trained)", c.get("queue_depth")),
        ("rollouts accepted", c.get("rollouts_accepted")),
        ("rejected by reason", c.get("rejected_by_reason")),
        ("staleness histogram", c.get("trainer_staleness_hist")),
        ("learner idle fraction", c.get("trainer_idle_frac")),
        ("exact match / mean reward", (c.get("trainer_exact_match"), c.get("trainer_reward_mean"))),
        ("capacity: required rollouts/s", c.get("plan_required_rollouts_per_s")),
        ("capacity: available rollouts/s", c.get("plan_available_rollouts_per_s")),
        ("capacity plan", c.get("plan")),
    ]
    for what, value in rows:
        coord.add_row(what, "-" if value is None else str(value))
    parts: list[Any] = [nodes, coord]
    if view.get("error"):
        parts.append(f"[yellow]{view['error']}[/yellow]")
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

                    Console().print(render(view))
                return 0
            from rich.live import Live

            if json_out:  # one JSON document per line, nothing else on stdout
                while True:
                    view = await snapshot(swarm_peer, coordinator_peer, timeout)
                    print(json.dumps(view, default=str), flush=True)
                    await asyncio.sleep(interval)
            with Live(refresh_per_second=1) as live:
                while True:
                    live.update(render(await snapshot(swarm_peer, coordinator_peer, timeout)))
                    await asyncio.sleep(interval)
        finally:
            await swarm_peer.stop()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0
    except SwarmError as exc:  # the DHT or the peer failed after joining
        return error(f"lost the swarm through {maddr}: {exc}", 1)
