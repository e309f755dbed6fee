"""``swarm audit``: verify the coordinator's receipt log and trace one rollout through it.

Reads the coordinator's SQLite file read-only (it may be running), recomputes the hash chain and
checks every seal (:func:`coordinator.receipts.verify_chain`), then, with ``--receipt``, prints
how one rollout got into training: lease → node key → policy version → checks run and their
figures → verdict → the learner step that consumed it, with the entries' hashes and the seal
that covers them. Exit 0 when the chain verifies (and the receipt is found), 1 when it does not,
2 for bad input.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

from coordinator.receipts import ChainReport, Entry, load_entries, verify_chain

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _db_path(state_dir: Path | None, db: Path | None) -> Path:
    if db is not None:
        return db
    base = state_dir if state_dir is not None else Path("coordinator-data")
    return base / "state.sqlite"


def _rollout(db: Path, receipt: str) -> dict[str, Any] | None:
    """The stored rollout named by ``receipt``: its ``seq``, or ``LEASE/PROMPT_ID/SAMPLE``."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cols = "seq, lease_id, prompt_id, sample_index, version, reward, finish_reason"
        if receipt.isdigit():
            rows = conn.execute(f"SELECT {cols} FROM rollouts WHERE seq = ?", (int(receipt),))
        else:
            parts = receipt.rsplit("/", 1)
            head = parts[0].split("/", 1)
            if len(parts) != 2 or len(head) != 2 or not parts[1].isdigit():
                raise ValueError(
                    f"--receipt {receipt!r}: give a rollout seq (e.g. 1234) or "
                    "LEASE_ID/PROMPT_ID/SAMPLE_INDEX"
                )
            rows = conn.execute(
                f"SELECT {cols} FROM rollouts WHERE lease_id = ? AND prompt_id = ?"
                " AND sample_index = ?",
                (head[0], head[1], int(parts[1])),
            )
        row = rows.fetchone()
    finally:
        conn.close()
    if row is None:
        return None
    keys = ("seq", "lease", "prompt_id", "sample_index", "version", "reward", "finish_reason")
    return dict(zip(keys, row, strict=True))


def trace(entries: list[Entry], seq: int) -> dict[str, Any]:
    """The entries that account for rollout ``seq``: its verdict, the learner step that consumed
    it, and the first seal covering each."""
    out: dict[str, Any] = {"verdict": None, "consumed": None}
    for e in entries:
        data = e.data()
        span = data.get("seqs")
        if not (isinstance(span, list) and len(span) == 2 and span[0] <= seq <= span[1]):
            continue
        if e.kind == "verdict" and out["verdict"] is None:
            out["verdict"] = (e, data)
        elif e.kind == "consumed" and out["consumed"] is None:
            out["consumed"] = (e, data)
    for name in ("verdict", "consumed"):
        found = out[name]
        if found is None:
            continue
        seal = next(
            (
                s
                for s in entries
                if s.kind == "seal" and int(s.data()["sealed_seq"]) >= found[0].seq
            ),
            None,
        )
        out[f"{name}_seal"] = seal.seq if seal is not None else None
    return out


def _summary(report: ChainReport) -> str:
    signers = ", ".join(sorted(report.signers)) or "nobody"
    state = "verifies" if report.ok else f"DOES NOT VERIFY ({len(report.problems)} problems)"
    return (
        f"receipt log {state}: {report.entries} entries, {report.seals} seals by {signers}, "
        f"sealed up to #{report.sealed_seq} ({report.unsealed} entries after the last seal)"
    )


def run_audit(
    *,
    state_dir: Path | None,
    db: Path | None,
    receipt: str | None,
    coordinator_key: str | None,
    json_out: bool,
) -> int:
    from protocol.identity import parse_fingerprint

    def fail(message: str, code: int) -> int:
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        return code

    path = _db_path(state_dir, db)
    try:
        pinned = parse_fingerprint(coordinator_key) if coordinator_key else None
        entries = load_entries(path)
        rollout = _rollout(path, receipt) if receipt is not None else None
    except (ValueError, FileNotFoundError, sqlite3.Error) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    report = verify_chain(entries)
    if pinned is not None and report.signers - {pinned}:
        report.problems.append(
            f"seals signed by {', '.join(sorted(report.signers))}, not the pinned {pinned}"
        )
    result: dict[str, Any] = {
        "ok": report.ok,
        "entries": report.entries,
        "seals": report.seals,
        "sealed_seq": report.sealed_seq,
        "unsealed": report.unsealed,
        "signers": sorted(report.signers),
        "problems": report.problems,
    }
    lines = [_summary(report), *[f"  problem: {p}" for p in report.problems]]
    if pinned is None and report.seals:
        lines.append("  (pass --coordinator-key to check the seals against the pinned key)")
    found = True
    if receipt is not None:
        if rollout is None:
            found = False
            lines.append(f"rollout {receipt}: not in the database")
        else:
            chain = trace(entries, int(rollout["seq"]))
            result["receipt"] = _receipt_json(rollout, chain)
            lines += _receipt_lines(rollout, chain)
            found = chain["verdict"] is not None
    if json_out:
        print(json.dumps(result, indent=2, default=str))
    else:
        print("\n".join(lines))
    return EXIT_OK if report.ok and found else EXIT_FAILED


def _receipt_json(rollout: dict[str, Any], chain: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"rollout": rollout}
    for name in ("verdict", "consumed"):
        found = chain.get(name)
        if found is not None:
            entry, data = found
            out[name] = {"entry": entry.seq, "hash": entry.hash.hex(), **data}
            out[f"{name}_sealed_by"] = chain.get(f"{name}_seal")
    return out


def _receipt_lines(rollout: dict[str, Any], chain: dict[str, Any]) -> list[str]:
    lines = [
        f"rollout #{rollout['seq']}: lease {rollout['lease']}, prompt {rollout['prompt_id']}, "
        f"sample {rollout['sample_index']}, policy v{rollout['version']}, reward "
        f"{rollout['reward']:.3f} ({rollout['finish_reason']})"
    ]
    if chain["verdict"] is None:
        lines.append("  no verdict entry covers it: not traceable (written before receipts?)")
        return lines
    entry, data = chain["verdict"]
    checks = data.get("checks") or {}
    figures = ", ".join(f"{k}={v}" for k, v in (checks.get("figures") or {}).items()) or "-"
    spot = (
        f"spot check {'passed' if checks.get('passed') else 'failed'}"
        f"{' (every sample)' if checks.get('full') else ''}: {figures}"
        if checks.get("spot_checked")
        else "not spot-checked"
    )
    sealed = chain.get("verdict_seal")
    lines += [
        f"  lease     {data['lease']} (epoch {data['epoch']}), node {data['node']}, held to "
        f"{data['held_to']}",
        f"  version   {data['version']}",
        f"  checks    structure, version, seeds, rewards; check rate {checks.get('rate')}; {spot}",
        f"  verdict   {data['verdict']}: {data['detail']}",
        f"            entry #{entry.seq} {entry.hash.hex()[:16]}…, "
        + (f"sealed by #{sealed}" if sealed else "not sealed yet"),
    ]
    if chain["consumed"] is None:
        lines.append("  learner   not consumed yet")
    else:
        c_entry, c_data = chain["consumed"]
        c_sealed = chain.get("consumed_seal")
        lines.append(
            f"  learner   consumed by step {c_data['step']} (entry #{c_entry.seq}, "
            + (f"sealed by #{c_sealed})" if c_sealed else "not sealed yet)")
        )
    return lines
