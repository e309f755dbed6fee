"""The victim of ``test_checkpoint_attacks.py``: a node's checkpoint stack in its own OS process.

It is wired exactly as :meth:`node.worker.NodeWorker.start` wires it (a real hivemind/libp2p
peer with the standard record validators, ``BroadcastNode`` with the node's download config and
a zero placeholder key, ``CheckpointManager`` pinned by fingerprint, the ``hf`` backend on the
embedded model), minus the coordinator: the test says which version to load and from which seeds.

Driven over stdin/stdout, one JSON object per line::

    -> {"op": "ensure", "version": 3, "seeds": ["12D3Koo..."]}
    <- {"ok": true, "state": {...}}   or   {"ok": false, "error": "CheckpointRefused",
                                              "code": "version_not_newer", "detail": "...",
                                              "state": {...}}
    -> {"op": "state"}
    <- {"ok": true, "state": {...}}
    -> {"op": "stop"}                 (leaves the DHT and exits 0)

``state``: the backend's loaded version and a digest of its weights, the highest accepted
version (the on-disk record), the store's versions with their verified chunks, every file under
the store, and the download scores the fetcher keeps per peer. ``READY <json>`` is the first line.
The process also exits when its stdin closes (but a process forked by the parent after this one
started, such as a hivemind DHT process, inherits the pipe and keeps it open: send ``stop``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def weights_digest(state_dict: Mapping[str, Any]) -> str:
    """SHA-256 over the names and raw bytes of a state dict (same on both sides of the test)."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


async def _amain(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    from node.backends.hf import HFBackend
    from node.checkpoints import CheckpointManager
    from policy.model import ModelSpec
    from swarm.adverts import swarm_validators
    from swarm.broadcast import BroadcastNode
    from swarm.chunks import ChunkStore
    from swarm.dht import PeerConfig, SwarmPeer
    from swarm.fetcher import DownloadConfig
    from swarm.holders import DhtHolderDirectory
    from swarm.transport import P2PTransport

    state_dir = Path(args.state)
    state_dir.mkdir(parents=True, exist_ok=True)
    backend = HFBackend(ModelSpec(), device="cpu")
    peer = SwarmPeer(
        PeerConfig(initial_peers=[args.bootstrap], identity_path=str(state_dir / "libp2p.key")),
        record_validators=swarm_validators(),
    )
    await peer.start()
    store = ChunkStore(state_dir / "checkpoints", keep_versions=args.keep_versions)
    broadcast = BroadcastNode(
        P2PTransport(peer.p2p),
        store,
        DhtHolderDirectory(peer),
        bytes(32),  # replaced by the pinned key once resolved, as in NodeWorker
        # a node's settings, except that it gives up on a failing seed after 5 s of failures
        # rather than 30 (seed_grace): the tests wait that long for each refused version
        config=DownloadConfig(deadline=args.download_timeout, seed_grace=5.0),
    )
    await broadcast.start()
    seeds: list[str] = []
    manager = CheckpointManager(
        broadcast,
        backend,
        state_dir=state_dir,
        coordinator_fingerprint=args.coordinator_key,
        seeds=lambda: list(seeds),
        download_timeout_s=args.download_timeout,
        progress=False,
    )

    def state() -> dict[str, Any]:
        root = store.root
        return {
            "loaded_version": backend.loaded_version,
            "digest": weights_digest(backend.model.state_dict()),
            "highest_accepted": manager.highest_accepted,
            "store": {str(v): sorted(store.have(v)) for v in store.versions()},
            "files": sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()),
            "scores": broadcast.scores.snapshot(),
        }

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("READY " + json.dumps({"peer_id": peer.peer_id}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "stop":
                break
            out: dict[str, Any] = {"ok": True}
            if cmd["op"] == "ensure":
                seeds[:] = cmd["seeds"]
                try:
                    await manager.ensure(int(cmd["version"]))
                except Exception as exc:  # reported to the test, which asserts on it
                    code = getattr(exc, "code", None)
                    out = {
                        "ok": False,
                        "error": type(exc).__name__,
                        "code": None if code is None else str(getattr(code, "value", code)),
                        "detail": str(exc),
                    }
            out["state"] = state()
            print(json.dumps(out), flush=True)
    finally:
        await broadcast.stop()
        await peer.stop()
    return 0


def main() -> int:
    import logging

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--state", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--coordinator-key", required=True, help="pinned coordinator fingerprint")
    p.add_argument("--keep-versions", type=int, default=3)
    p.add_argument("--download-timeout", type=float, default=60.0)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    return asyncio.run(_amain(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
