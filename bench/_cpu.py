"""Shared by the bench scripts: CPU time of a process tree by kind, from /proc (Linux)."""

from __future__ import annotations

import os


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid`` and its descendants, by kind: ``p2pd`` (libp2p
    daemons), ``python`` (``pid`` itself) and ``dht`` (everything else: hivemind's DHT process)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"p2pd": 0.0, "python": 0.0, "dht": 0.0}
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as fh:
                stat = fh.read()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            kind = "p2pd" if comm == "p2pd" else ("python" if p == pid else "dht")
            out[kind] += cpu
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (OSError, ValueError):
            continue  # gone meanwhile
    return out
