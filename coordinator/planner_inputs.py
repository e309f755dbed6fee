"""The planner's inputs kept in memory, updated by the events that change them (issue 35).

A re-plan of 10,000 nodes used to read every live node's row from SQLite and rebuild its figures
(~45 ms of its ~90). :class:`PlannerInputs` keeps, per registered node, the
:func:`coordinator.capacity.capacity_columns` row the planner reads, as numpy arrays, and re-reads
only what changed since the last re-plan:

* **node rows** (a registration or advert: price, token rate; a completed or expired lease: the
  durable rate and the lease counts; a node deleted): temporary SQLite triggers on the ``nodes``
  table, installed on the store's connection (``TEMP``: nothing in the database file changes),
  note the key of every inserted, deleted or changed row in a temporary table, which a re-plan
  reads and empties. Every writer of the table is caught, whichever module it is in. A commit
  by another connection (another process opening the database) changes ``PRAGMA data_version``;
  the next re-plan then reads every row again;
* **measured figures** (:class:`~coordinator.throughput.ThroughputBook`, a completed lease): the
  book calls :meth:`PlannerInputs.figures_changed` with the node's key;
* **liveness and bans** change with time, not with a write: each re-plan reads the keys of the
  registered nodes that are *not* live (last seen before the horizon, or banned now) — one
  indexed-free scan done in SQLite that returns few rows, not 10,000.

:class:`Predictions` reuses the two step-period predictions (the pool's and the active set's;
informative, the choice never reads them) of large pools for up to :data:`PREDICT_MAX_AGE_S`
while their inputs move by less than :data:`PREDICT_TOLERANCE`.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable

import numpy as np

from coordinator.capacity import Pipeline, _period_of, _Pool
from coordinator.store import Store
from coordinator.throughput import NodeFigures, ThroughputBook
from coordinator.verify_budget import PlannerRow

#: a prediction is reused for at most this long (clock seconds)
PREDICT_MAX_AGE_S = 60.0
#: ... and while every figure it depends on stays within this relative distance
PREDICT_TOLERANCE = 0.02
#: pools smaller than this are always predicted afresh (it is cheap; demos compare it per second)
PREDICT_MIN_NODES = 500

_COLS = "node_key, price_per_hour, tokens_per_s, rollouts_per_s, leases_completed, leases_expired"
_WATCHED = ("price_per_hour", "tokens_per_s", "rollouts_per_s", "leases_completed",
            "leases_expired")  # fmt: skip
_instances = itertools.count()
_NO_COLUMNS = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # an unmeasured node's (never read: not measured)


class PlannerInputs:
    """Per registered node: its planner row and capacity columns (module docstring)."""

    def __init__(self, store: Store, throughput: ThroughputBook) -> None:
        self.store = store
        self.throughput = throughput
        self._table = f"planner_dirty_{next(_instances)}"
        self._install()
        throughput.listeners.append(self.figures_changed)
        self._version: int | None = None  # PRAGMA data_version at the last read; None: read all
        self._slot: dict[bytes, int] = {}
        self._ids: list[str] = []
        self._rows: list[PlannerRow | None] = []
        self._fig_dirty: set[bytes] = set()
        self._fig_lock = threading.Lock()  # the book may be written from another thread
        self._cols = np.zeros((0, 6))
        self._measured = np.zeros(0, dtype=bool)
        self._present = np.zeros(0, dtype=bool)
        self._inv_tps = np.zeros(0)
        self._rank_for: np.ndarray | None = None
        self._rank = np.zeros(0, dtype=np.intp)
        #: full reads of the table so far (the first one, and one per foreign commit)
        self.full_reads = 0

    def _install(self) -> None:
        t = self._table
        changed = " OR ".join(f"OLD.{c} IS NOT NEW.{c}" for c in ("node_key", *_WATCHED))
        def note(key: str) -> str:
            # Not INSERT OR IGNORE: an UPSERT's conflict policy overrides a trigger's (a second
            # re-registration through Store.upsert_node failed "UNIQUE constraint failed").
            return (
                f"INSERT INTO {t} SELECT {key}"
                f" WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE node_key = {key});"
            )

        self.store.ensure_schema(
            f"CREATE TEMP TABLE IF NOT EXISTS {t} (node_key BLOB PRIMARY KEY);"
            f"CREATE TEMP TRIGGER IF NOT EXISTS {t}_ins AFTER INSERT ON main.nodes"
            f" BEGIN {note('NEW.node_key')} END;"
            f"CREATE TEMP TRIGGER IF NOT EXISTS {t}_del AFTER DELETE ON main.nodes"
            f" BEGIN {note('OLD.node_key')} END;"
            f"CREATE TEMP TRIGGER IF NOT EXISTS {t}_upd AFTER UPDATE OF node_key,"
            f" {', '.join(_WATCHED)} ON main.nodes WHEN {changed}"
            f" BEGIN {note('OLD.node_key')} {note('NEW.node_key')} END;"
        )

    def figures_changed(self, node_key: bytes) -> None:
        """The throughput book's figures of ``node_key`` changed (its listener)."""
        with self._fig_lock:
            self._fig_dirty.add(node_key)

    # --- reading ---------------------------------------------------------------------------------
    def refresh(self, seen_after: float, now: float) -> np.ndarray:
        """Bring the arrays up to date; returns the slots of the live nodes (last seen at or after
        ``seen_after``, not banned at ``now``: :meth:`Store.planner_rows`' rule)."""
        store = self.store
        with store.locked():
            version = int(store.query("PRAGMA data_version")[0][0])
            if version != self._version:
                rows = store.query(f"SELECT {_COLS} FROM nodes")
                store.query(f"DELETE FROM temp.{self._table}")
                gone = set(self._slot)
                self.full_reads += 1
            else:  # the changed rows; a deleted one comes back as NULLs
                cols = ", ".join(f"n.{c}" for c in _COLS.split(", ")[1:])
                rows = store.query(
                    f"SELECT d.node_key, n.node_key IS NULL, {cols} FROM temp.{self._table} d"
                    " LEFT JOIN nodes n ON n.node_key = d.node_key"
                )
                store.query(f"DELETE FROM temp.{self._table}")
                gone = {bytes(r[0]) for r in rows if r[1]}
                rows = [(r[0], *r[2:]) for r in rows if not r[1]]
            self._version = version
            out = store.query(
                "SELECT node_key FROM nodes WHERE last_seen < ?"
                " UNION SELECT node_key FROM bans WHERE banned_until > ?",
                (seen_after, now),
            )
        fresh: dict[bytes, PlannerRow] = {}
        for k, p, t, r, c, e in rows:
            key = bytes(k)
            fresh[key] = (key, p, t, r, int(c), int(e))
        gone.difference_update(fresh)
        for key in gone:
            self._drop(key)
        with self._fig_lock:
            figures, self._fig_dirty = self._fig_dirty, set()
        for key in figures.difference(fresh):
            slot = self._slot.get(key)
            row = None if slot is None else self._rows[slot]
            if row is not None:
                fresh[key] = row
        self._put(fresh)
        live = self._present.copy()
        for (k,) in out:
            slot = self._slot.get(bytes(k))
            if slot is not None:
                live[slot] = False
        return np.nonzero(live)[0]

    def _put(self, rows: dict[bytes, PlannerRow]) -> None:
        """Set the rows and columns of these nodes (new ones get a slot), in one array write."""
        slots: list[int] = []
        cols: list[tuple[float, float, float, float, float, float]] = []
        measured: list[bool] = []
        inv_tps: list[float] = []
        get = self.throughput.get
        for key, row in rows.items():
            slot = self._slot.get(key)
            if slot is None:
                slot = len(self._ids)
                if slot == len(self._present):
                    self._grow()
                self._slot[key] = slot
                self._ids.append(key.hex())
                self._rows.append(row)
                self._present[slot] = True
            self._rows[slot] = row
            _key, price, tps, rps, done, expired = row
            got = _columns(get(key), price, rps, (done + 1) / (done + expired + 2))
            slots.append(slot)
            measured.append(got is not None)
            cols.append(_NO_COLUMNS if got is None else got)
            inv_tps.append(1.0 / tps if tps is not None and tps > 0 else 0.0)
        if slots:
            at = np.array(slots, dtype=np.intp)
            self._cols[at] = np.array(cols, dtype=float).reshape(len(at), 6)
            self._measured[at] = measured
            self._inv_tps[at] = inv_tps

    def _drop(self, key: bytes) -> None:
        slot = self._slot.pop(key, None)
        if slot is None:
            return
        self._rows[slot] = None
        self._present[slot] = False
        self._measured[slot] = False
        if len(self._slot) < len(self._ids) // 2:  # mostly holes: compact
            self._compact()

    def _grow(self) -> None:
        n = max(64, 2 * len(self._present))
        extra = n - len(self._present)
        self._cols = np.concatenate((self._cols, np.zeros((extra, 6))))
        self._measured = np.concatenate((self._measured, np.zeros(extra, dtype=bool)))
        self._present = np.concatenate((self._present, np.zeros(extra, dtype=bool)))
        self._inv_tps = np.concatenate((self._inv_tps, np.zeros(extra)))

    def _compact(self) -> None:
        keep = np.nonzero(self._present[: len(self._ids)])[0]
        at = keep.tolist()
        self._ids = [self._ids[i] for i in at]
        self._rows = [self._rows[i] for i in at]
        self._slot = {row[0]: i for i, row in enumerate(self._rows) if row is not None}
        n = len(at)
        for name in ("_cols", "_measured", "_present", "_inv_tps"):
            arr = getattr(self, name)
            fresh = np.zeros((len(arr), *arr.shape[1:]), dtype=arr.dtype)
            fresh[:n] = arr[keep]
            setattr(self, name, fresh)
        self._rank_for = None

    # --- what a re-plan takes --------------------------------------------------------------------
    def rows(self, live: np.ndarray) -> list[PlannerRow]:
        """The planner rows of the slots ``live`` (for the verification budget)."""
        rows = self._rows
        return [r for r in [rows[i] for i in live.tolist()] if r is not None]

    def measured(self, live: np.ndarray) -> np.ndarray:
        """The slots of ``live`` whose node has measured figures (they enter the plan)."""
        out: np.ndarray = live[self._measured[live]]
        return out

    def t_gen_rate(self, live: np.ndarray) -> float:
        """max over ``live`` of 1 / tokens_per_s (0 when none advertises a rate)."""
        return float(self._inv_tps[live].max()) if len(live) else 0.0

    def pool(self, at: np.ndarray, pipe: Pipeline) -> tuple[_Pool, np.ndarray]:
        """The :class:`~coordinator.capacity._Pool` of the slots ``at`` and each one's place in
        id order (re-sorted only when the set changed)."""
        ids = [self._ids[i] for i in at.tolist()]
        if self._rank_for is None or not np.array_equal(self._rank_for, at):
            self._rank = np.argsort(np.argsort(np.array(ids, dtype=str), kind="stable"))
            self._rank_for = at.copy()
        return _Pool(None, pipe, cols=self._cols[at], ids=ids), self._rank


def _columns(
    fig: NodeFigures | None, price: float | None, rps: float | None, reliability: float
) -> tuple[float, float, float, float, float, float] | None:
    """The capacity columns of one node (:func:`coordinator.activation._capacity`'s figures, in
    :func:`coordinator.capacity.capacity_columns`' layout); None when it has completed no lease."""
    cost = 0.0 if price is None else price
    if fig is not None:
        load = fig.load_s or 0.0
        return (fig.gen_rate, reliability, fig.lease_s, fig.overhead_s, load, cost)
    if not rps:
        return None
    return (rps, reliability, math.nan, 0.0, 0.0, cost)


class Predictions:
    """The step-period predictions of :func:`coordinator.capacity.plan_pool`, reused (module
    docstring). A prediction is made afresh when the pool has fewer than ``min_nodes`` nodes,
    when ``max_age_s`` has passed, when κ or S changed, or when the node count, the pool's rate
    (Σ μ_i·r_i·g_i/(g_i + o_i)), its admissible supply at T_train, its rate-weighted lags, B,
    T_train, T_bcast, t_gen or the step-time variability moved by more than ``tolerance``; but
    at most one stale one per re-plan (:meth:`next_plan`) unless κ or S changed or it is twice
    ``max_age_s`` old (so neither waits for ever)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        max_age_s: float = PREDICT_MAX_AGE_S,
        tolerance: float = PREDICT_TOLERANCE,
        min_nodes: int = PREDICT_MIN_NODES,
    ) -> None:
        self.clock = clock
        self.max_age_s = max_age_s
        self.tolerance = tolerance
        self.min_nodes = min_nodes
        #: which -> (made at, exact key, figures, period)
        self._memo: dict[str, tuple[float, tuple[object, ...], np.ndarray, float]] = {}
        #: predictions made afresh (for tests and the bench)
        self.made = 0
        self._made_this_plan = False

    def __call__(self, pool: _Pool, which: str) -> float:
        if len(pool.ids) < self.min_nodes:
            self.made += 1
            return _period_of(pool)
        pipe = pool.pipe
        q = pool.eff * pool.duty
        total = float(q.sum())
        lag = float((q * (pool.g + pool.o + pool.d)).sum()) / total if total > 0 else 0.0
        load = float((q * pool.d).sum()) / total if total > 0 else 0.0
        figures = np.array([
            len(pool.ids), total, float(pool.rates().sum()), lag, load, pipe.batch,
            pipe.t_train, pipe.t_bcast, pipe.t_gen, pipe.t_train_cv,
        ])  # fmt: skip
        exact = (pipe.kappa, pipe.staleness_bound)
        now = self.clock()
        memo = self._memo.get(which)
        if memo is not None and memo[1] == exact:
            at, _key, old, period = memo
            close = np.abs(figures - old) <= self.tolerance * np.maximum(
                np.abs(figures), np.abs(old)
            )
            if 0.0 <= now - at < self.max_age_s and bool(close.all()):
                return period
            if self._made_this_plan and now - at < 2 * self.max_age_s:
                return period  # one prediction per re-plan: this one waits for the next
        period = _period_of(pool)
        self.made += 1
        self._made_this_plan = True
        self._memo[which] = (now, exact, figures, period)
        return period

    def next_plan(self) -> None:
        """A re-plan starts: it may make one stale prediction afresh (a second one, whose κ and
        S are unchanged, is reused until the next re-plan, so a re-plan rarely pays for both)."""
        self._made_this_plan = False
