"""The fleet part of the Store (``store.fleet``): allocations, their GPUs and their workers.

What it guarantees: every write is one transaction of the core (pearlctl/state/core.py) with its journal row,
fenced by the caller's epoch; an allocation's array index is never reused; ``upsert_node_gpus`` is idempotent
(pearlctl/state/node_gpus.py); whole-run reads of GPUs and workers are served from the core's generation cache
(the rows are immutable values); ``fingerprint`` answers a repeated heartbeat with one indexed read on a
connection of its own, never waiting for the core's lock behind a whole-run read.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from pearlctl.state.core import JOINED_SELECT, Core, check_role
from pearlctl.state.db import BUSY_TIMEOUT_MS
from pearlctl.state.errors import InvalidWrite, NotFound
from pearlctl.state.machines import OPEN_TRANSITION_STATES
from pearlctl.state.node_gpus import write_node_gpus
from pearlctl.state.rows import Allocation, Gpu, Worker


class Fleet:
    """Allocations, GPUs and workers: what the watcher, the agents' reports and elastic sizing write."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._reader: tuple[sqlite3.Connection, threading.Lock | threading.RLock] | None = None  # fingerprints
        # allocation -> ((revision, the reader's data_version) it was read at, its fingerprint)
        self._fingerprints: dict[int, tuple[tuple[int, int], tuple | None]] = {}

    def close(self) -> None:
        """Close the fingerprints' reader (the Store closes the core's connection)."""
        if self._reader is not None and self._reader[0] is not self._core._conn:
            self._reader[0].close()
        self._reader = None

    def allocations(self, run_id: str, *, cached: bool = False) -> list[Allocation]:
        """Allocations of the run, each with its pool's name as ``pool``.

        ``cached``: the rows as of the last change a decision reads (``generation``), not read again while
        nothing changed. Their ``agent_seen_at`` is bookkeeping, so it may be older than the table's: only a
        caller that keeps newer heartbeat times itself (the daemon's controller) asks for this."""

        def read() -> list[Allocation]:
            order = "ORDER BY a.pool_id, a.array_index"
            return self._core._typed(
                Allocation, f"{JOINED_SELECT['allocations']} WHERE a.run_id = ? {order}", (run_id,)
            )

        return self._core._cached("allocations", run_id, read) if cached else read()

    def allocation(self, allocation_id: int) -> Allocation:
        return self._core.get(Allocation.TABLE, allocation_id)

    def gpus(self, run_id: str, *, allocation_id: int | None = None) -> list[Gpu]:
        """GPUs of the run (of one allocation only, if given: an index, not a scan), each with its node's
        name as ``node`` and its pool's name as ``pool``."""
        where, params = "g.run_id = ?", [run_id]
        if allocation_id is not None:
            where, params = where + " AND g.allocation_id = ?", [*params, allocation_id]

        def read() -> list[Gpu]:
            return self._core._typed(Gpu, f"{JOINED_SELECT['gpus']} WHERE {where} ORDER BY n.name, g.idx, g.id", params)

        return read() if allocation_id is not None else self._core._cached("gpus", run_id, read)

    def gpu(self, gpu_id: int) -> Gpu:
        return self._core.get(Gpu.TABLE, gpu_id)

    def workers(self, run_id: str, *, allocation_id: int | None = None) -> list[Worker]:
        """Workers of the run (of one allocation only, if given), oldest first."""
        if allocation_id is None:
            return self._core._cached(
                "workers",
                run_id,
                lambda: self._core._typed(Worker, "SELECT * FROM workers WHERE run_id = ? ORDER BY id", (run_id,)),
            )
        return self._core._typed(
            Worker, "SELECT * FROM workers WHERE run_id = ? AND allocation_id = ? ORDER BY id", (run_id, allocation_id)
        )

    def worker(self, worker_id: int) -> Worker:
        return self._core.get(Worker.TABLE, worker_id)

    def add_allocation(
        self,
        run_id: str,
        pool_id: int,
        *,
        event: str = "allocation.requested",
        data: Mapping[str, Any] | None = None,
        epoch: int | None = None,
    ) -> Allocation:
        """Record one more REQUESTED allocation of a pool, journaled as ``event``: the intent an elastic pool
        writes before it submits a task (pearlctl.daemon.elastic). Its array index is one above the highest
        the pool ever had, so an index is never reused and ``(pool, index)`` names one submission for good.
        Returns the new row."""
        with self._core._write() as conn:
            owner = conn.execute("SELECT run_id, name FROM pools WHERE id = ?", (pool_id,)).fetchone()
            if owner is None or owner[0] != run_id:
                raise NotFound(f"run {run_id!r} has no pool {pool_id}")
            self._core._fence(conn, run_id, epoch)
            now = self._core._clock()
            (index,) = conn.execute(
                "SELECT COALESCE(MAX(array_index), -1) + 1 FROM allocations WHERE pool_id = ?", (pool_id,)
            ).fetchone()
            allocation_id = self._core._create(
                conn,
                "allocations",
                run_id,
                {"run_id": run_id, "pool_id": pool_id, "array_index": index},
                event,
                now=now,
                epoch=epoch,
                data={**(data or {}), "pool": owner[1], "array_index": index},
            )
        return self.allocation(allocation_id)

    def add_worker(
        self,
        *,
        run_id: str,
        allocation_id: int,
        role: str,
        engine: str,
        url: str | None = None,
        pid: int | None = None,
        weight_version: str | None = None,
        ready_s: float | None = None,
        epoch: int | None = None,
    ) -> int:
        """Record a worker (STARTING) on an allocation of the run; returns its id."""
        check_role(role)
        with self._core._write() as conn:
            owner = conn.execute("SELECT run_id FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
            if owner is None or owner[0] != run_id:
                raise NotFound(f"run {run_id!r} has no allocation {allocation_id}")
            self._core._fence(conn, run_id, epoch)
            now = self._core._clock()
            return self._core._create(
                conn,
                "workers",
                run_id,
                {
                    "run_id": run_id,
                    "allocation_id": allocation_id,
                    "role": role,
                    "engine": engine,
                    "url": url,
                    "pid": pid,
                    "weight_version": weight_version,
                    "ready_s": ready_s,
                },
                "worker.created",
                now=now,
                epoch=epoch,
                data={"allocation_id": allocation_id, "role": role, "engine": engine},
            )

    def upsert_node_gpus(
        self,
        run_id: str,
        allocation_id: int,
        node: str,
        gpu_indices: Sequence[int],
        role: str,
        *,
        epoch: int | None = None,
    ) -> None:
        """Make the allocation's GPUs match what its agent reported: ``gpu_indices`` on ``node``.

        New indices get UP rows with ``role``; GONE or LOST ones come back UP (a GONE one, a fresh start,
        also takes ``role`` and is no longer lent nor holds a parked worker; a LOST one keeps its role and
        lending: its workers may have kept running); an index
        reported on another node moves there; indices no longer reported go GONE. UP and DRAINING rows
        keep their role, so re-registration never undoes a borrow. Calling it again changes nothing.
        """
        check_role(role)
        if not node:
            raise InvalidWrite("node name must not be empty")
        indices = list(gpu_indices)
        if len(set(indices)) != len(indices) or any(not isinstance(i, int) or i < 0 for i in indices):
            raise InvalidWrite(f"gpu indices must be distinct non-negative ints, got {indices}")
        with self._core._write() as conn:
            owner = conn.execute("SELECT run_id FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
            if owner is None or owner[0] != run_id:
                raise NotFound(f"run {run_id!r} has no allocation {allocation_id}")
            self._core._fence(conn, run_id, epoch)
            write_node_gpus(self._core, conn, run_id, allocation_id, node, indices, role, epoch)

    def record_agents_seen(self, run_id: str, seen: Mapping[int, float], *, epoch: int | None = None) -> None:
        """When each allocation's agent was last heard from (``agent_seen_at``), many in one transaction: a
        daemon keeps heartbeat times in memory and writes them once per tick, not once per heartbeat. Only
        later times are written, and none to a PENDING allocation (its requeue reset the time: a heartbeat of the
        task's last run must not come back); bookkeeping (not in ``revision``), no journal row, fenced by
        ``epoch``."""
        if not seen:
            return
        with self._core._write(bookkeeping=True) as conn:
            self._core._fence(conn, run_id, epoch)
            conn.executemany(
                "UPDATE allocations SET agent_seen_at = ? WHERE id = ? AND run_id = ?"
                " AND state != 'PENDING' AND (agent_seen_at IS NULL OR agent_seen_at < ?)",
                [(at, alloc_id, run_id, at) for alloc_id, at in seen.items()],
            )

    def fingerprint(self, alloc_id: int) -> tuple | None:
        """A value that changes whenever anything an agent's report is folded against changes: the
        allocation's row, its GPUs, its workers, the run's open transitions, the trainer's weight export (every
        row is versioned). One indexed query, for a heartbeat that repeats its last report, and none while the
        database is unchanged since the allocation's last one (this store's ``revision`` and the reader's ``PRAGMA
        data_version``, which moves with every commit of another connection); None if there is no such
        allocation."""
        open_states = sorted(OPEN_TRANSITION_STATES)
        conn, lock = self._fingerprint_reader()
        with lock:
            unchanged = (self._core.revision, conn.execute("PRAGMA data_version").fetchone()[0])
            hit = self._fingerprints.get(alloc_id)
            if hit is not None and hit[0] == unchanged:
                return hit[1]
            row = conn.execute(
                "SELECT a.version,"
                " (SELECT group_concat(id || '.' || version) FROM gpus WHERE allocation_id = a.id),"
                " (SELECT group_concat(id || '.' || version) FROM workers WHERE allocation_id = a.id),"
                " (SELECT count(*) || '.' || max(id) || '.' || sum(version) FROM transitions"
                f"  WHERE run_id = a.run_id AND state IN ({', '.join('?' * len(open_states))})),"
                " (SELECT json_extract(trainer, '$.weight_version') || '|' || json_extract(trainer, '$.weights_path')"
                "  FROM runs WHERE id = a.run_id)"
                " FROM allocations a WHERE a.id = ?",
                [*open_states, alloc_id],
            ).fetchone()
            fingerprint = None if row is None else tuple(row)
            self._fingerprints[alloc_id] = (unchanged, fingerprint)
        return fingerprint

    def _fingerprint_reader(self) -> tuple[sqlite3.Connection, threading.Lock | threading.RLock]:
        """A read-only connection of its own for fingerprints (WAL: it sees every committed write), so that a
        heartbeat never waits for the store's lock behind a whole-run read; the store's own connection where
        the database has no file."""
        if self._reader is None:
            path = self._core._conn.execute("PRAGMA database_list").fetchone()[2]
            if not path:
                self._reader = (self._core._conn, self._core._lock)
            else:
                reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
                reader.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                self._reader = (reader, threading.Lock())
        return self._reader
