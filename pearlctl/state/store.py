"""The Store: every read and write of pearlctl's durable state.

What it guarantees (docs/architecture.md, "State"):

- **One transaction per write, with its journal entry.** Every write method runs inside ``_write``:
  ``BEGIN IMMEDIATE`` takes SQLite's write lock up front, so concurrent writers queue on the busy
  timeout instead of failing half-way, and the row change and its journal row commit or vanish
  together.
- **Compare-and-set.** ``set_state`` checks the edge against the table's state machine, then updates
  only ``WHERE id=? AND state=? [AND version=?]``; no match is ``StaleWrite`` and nothing is written.
  Every write to a row bumps its ``version``.
- **Fencing.** A write stamped with ``epoch`` — state changes, field updates and journal events alike —
  is refused (``StaleEpoch``) when the run's lease (``run:<run_id>``) exists at another epoch: a daemon
  that lost its lease cannot write.
- **Idempotent observations.** ``update_fields`` that changes nothing is a no-op (no version bump, no
  journal row), so pollers can write what they saw on every poll; ``upsert_node_gpus`` likewise.
- **Readers never write.** A store opened ``readonly=True`` refuses writes (``ReadOnlyStore``) before
  touching SQLite, and its connection is ``mode=ro`` anyway. Under WAL, readers never block the writer
  and the writer never blocks them.

Reads of transitions, steps, GPUs, workers and allocations return typed rows (pearlctl.state.rows); the other
tables' reads return dicts; JSON columns are decoded either way. One ``Store`` may be shared by threads: a lock
serialises its use of the single connection.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, Self, TypeVar

from pearlctl.state.db import BUSY_TIMEOUT_MS, Database, connect, insert, plain, schema_version
from pearlctl.state.errors import (
    DuplicateRun,
    DuplicateStep,
    InvalidWrite,
    NotFound,
    ReadOnlyStore,
    StaleEpoch,
    StaleWrite,
)
from pearlctl.state.leases import Leases, run_lease_name
from pearlctl.state.machines import (
    OPEN_TRANSITION_STATES,
    PoolKind,
    Role,
    StepKind,
    check_edge,
    machine,
)
from pearlctl.state.node_gpus import write_node_gpus
from pearlctl.state.rows import ROW_TYPES, Allocation, Gpu, Step, Transition, TypedRow, Worker
from pearlctl.state.schema import JSON_COLUMNS

Clock = Callable[[], float]
Row = dict[str, Any]  # a row of a table without a typed row (pearlctl.state.rows)
R = TypeVar("R", bound=TypedRow)

BACKENDS = ("slurm", "local")
# Keys a pool dict passed to create_run may carry (pools columns minus id, run_id, job_id).
POOL_REQUIRED = frozenset({"name", "kind", "role", "nodes", "gpus_per_node", "job_name"})
POOL_OPTIONAL = frozenset({"partition"})
# Columns only the Store itself writes: identity, ownership, state and bookkeeping.
_MANAGED_COLUMNS = frozenset({"id", "run_id", "state", "version", "updated_at", "created_at"})
# Tables with their own write paths: the journal is append-only, leases go through the lease methods.
_NO_FIELD_UPDATES = frozenset({"journal", "leases"})
# The reads of a typed table that join names in (a GPU's node and pool, an allocation's pool), by table.
_JOINED: Mapping[str, str] = {
    "gpus": "SELECT g.*, n.name AS node, p.name AS pool FROM gpus g JOIN nodes n ON n.id = g.node_id"
    " JOIN allocations a ON a.id = g.allocation_id JOIN pools p ON p.id = a.pool_id",
    "allocations": "SELECT a.*, p.name AS pool FROM allocations a JOIN pools p ON p.id = a.pool_id",
}
_JOINED_ID: Mapping[str, str] = {"gpus": "g.id", "allocations": "a.id"}  # the id column under their aliases
# Steps may only be added while their transition is still moving.


class Store:
    """Typed access to the state database. Open with ``Store.open(path)``; close or use as a context."""

    def __init__(self, db: Database, *, readonly: bool = False, clock: Clock = time.time) -> None:
        self._db = db
        self._conn: sqlite3.Connection = db.conn
        self.readonly = readonly
        self._clock = clock
        self._lock = threading.RLock()
        self.leases = Leases(self)  # acquire, renew, release, break_held, get (pearlctl/state/leases.py)
        # each commit's wall time is given to this (the daemon's histogram of them), and counted per thread
        # (``commits_on_this_thread``): a commit waits for the disk (synchronous=FULL)
        self.on_commit: Callable[[float], None] | None = None
        self._here = threading.local()
        # committed writes that changed a row, bookkeeping aside (``_write``): a reader compares it with the
        # value it last saw to learn cheaply whether anything may have changed since (the daemon's long polls)
        self.revision = 0
        # whole-run reads of the largest tables (gpus, workers), kept while nothing could have changed them:
        # (what, run_id) -> (generation, rows)
        self._cache: dict[tuple[str, str], tuple[tuple[int, int], list[Row]]] = {}
        self._reader: tuple[sqlite3.Connection, threading.Lock | threading.RLock] | None = None  # fingerprints
        # allocation -> ((revision, the reader's data_version) it was read at, its fingerprint)
        self._fingerprints: dict[int, tuple[tuple[int, int], tuple | None]] = {}
        self._columns: dict[str, frozenset[str]] = {
            table: frozenset(row[1] for row in self._conn.execute(f'PRAGMA table_info("{table}")'))
            for table in db.table_names()
        }

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, readonly: bool = False, clock: Clock = time.time) -> Self:
        return cls(connect(path, readonly=readonly), readonly=readonly, clock=clock)

    def close(self) -> None:
        with self._lock:
            if self._reader is not None and self._reader[0] is not self._conn:
                self._reader[0].close()
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transactions

    @contextmanager
    def _write(self, *, bookkeeping: bool = False) -> Iterator[sqlite3.Connection]:
        """The one way to write: a ``BEGIN IMMEDIATE`` transaction, committed or rolled back whole (inside
        ``atomic``, a savepoint of its transaction). A write that changed rows counts in ``revision`` unless it
        is ``bookkeeping`` (heartbeat times, progress counts: facts no desired state is derived from)."""
        if self.readonly:
            raise ReadOnlyStore("this store was opened read-only; only the daemon writes state")
        with self._lock:
            conn = self._conn
            before = conn.total_changes
            if getattr(self._here, "atomic", False):  # inside ``atomic``: a savepoint of its transaction
                conn.execute("SAVEPOINT write")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK TO write")
                    conn.execute("RELEASE write")
                    raise
                conn.execute("RELEASE write")
                if not bookkeeping and conn.total_changes != before:
                    self.revision += 1  # this thread's next read sees the write (the cache is keyed on it)
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            self._commit(conn)
            if not bookkeeping and conn.total_changes != before:
                self.revision += 1

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """The writes made inside, on this thread, as one transaction: each is still its own guarded write (a
        failed one raises and undoes only itself), and they commit together at the end — one commit, one wait
        for the disk, instead of one each — or, if the block raises, not at all. For writes that record facts
        with no effect outside state between them (an agent's report folded in); a step's intent must commit
        before its effect, so never around one. Other threads' writes and reads on this store wait until the
        block ends; a nested ``atomic`` joins the outer one."""
        if self.readonly:
            raise ReadOnlyStore("this store was opened read-only; only the daemon writes state")
        with self._lock:
            if getattr(self._here, "atomic", False):
                yield
                return
            conn = self._conn
            before = conn.total_changes
            conn.execute("BEGIN IMMEDIATE")
            self._here.atomic = True
            try:
                yield
                self._here.atomic = False
                if conn.total_changes == before:  # nothing written (most ticks' agent check): no disk wait to time
                    conn.execute("COMMIT")
                else:
                    self._commit(conn)  # its writes counted in ``revision`` as they were made
            except BaseException:
                self._here.atomic = False
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                self.revision += 1  # rows read inside the block may be cached: they were never committed
                raise

    def _commit(self, conn: sqlite3.Connection) -> None:
        """COMMIT, timed (``on_commit``, ``commits_on_this_thread``)."""
        started = time.monotonic()
        conn.execute("COMMIT")
        took = time.monotonic() - started
        commits, commit_s = self.commits_on_this_thread()
        self._here.commits, self._here.commit_s = commits + 1, commit_s + took
        if self.on_commit is not None:
            self.on_commit(took)

    def commits_on_this_thread(self) -> tuple[int, float]:
        """How many writes the calling thread committed, and the seconds their COMMITs took, over the store's
        life: the difference across a slow tick or a long hold of the daemon's lock says how much was the disk."""
        return getattr(self._here, "commits", 0), getattr(self._here, "commit_s", 0.0)

    def generation(self) -> tuple[int, int]:
        """Changes whenever anything a decision reads may have changed: a write of this store (``revision``;
        bookkeeping aside) or a commit by another connection (``PRAGMA data_version``). Cheap: microseconds."""
        with self._lock:
            return self.revision, self._conn.execute("PRAGMA data_version").fetchone()[0]

    def allocation_fingerprint(self, alloc_id: int) -> tuple | None:
        """A value that changes whenever anything an agent's report is folded against changes: the
        allocation's row, its GPUs, its workers, the run's open transitions, the trainer's weight export (every
        row is versioned). One indexed query, for a heartbeat that repeats its last report, and none while the
        database is unchanged since the allocation's last one (this store's ``revision`` and the reader's ``PRAGMA
        data_version``, which moves with every commit of another connection); None if there is no such
        allocation."""
        open_states = sorted(OPEN_TRANSITION_STATES)
        conn, lock = self._fingerprint_reader()
        with lock:
            unchanged = (self.revision, conn.execute("PRAGMA data_version").fetchone()[0])
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
            path = self._conn.execute("PRAGMA database_list").fetchone()[2]
            if not path:
                self._reader = (self._conn, self._lock)
            else:
                reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
                reader.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                self._reader = (reader, threading.Lock())
        return self._reader

    def _cached(self, what: str, run_id: str, read: Callable[[], list[R]]) -> list[R]:
        """``read()``, or its last rows while the ``generation`` is the same (bookkeeping writes never touch these
        tables). A daemon's tick and its HTTP handlers read a 4,096-GPU run many times a second; most of those
        reads find nothing changed. The rows are values, so the same ones are handed out again."""
        with self._lock:
            generation = self.generation()
            hit = self._cache.get((what, run_id))
            if hit is None or hit[0] != generation:
                hit = (generation, read())
                self._cache[(what, run_id)] = hit
        return list(hit[1])

    def _typed(self, cls: type[R], sql: str, params: Sequence[Any] = ()) -> list[R]:
        """The rows of ``sql`` (over ``cls``'s table, JSON columns decoded) as ``cls`` values."""
        return [cls.from_row(row) for row in self._query(sql, params, table=cls.TABLE)]

    def _query(self, sql: str, params: Sequence[Any] = (), *, table: str | None = None) -> list[Row]:
        with self._lock:
            rows = list(self._db.query(sql, params))
        json_columns = JSON_COLUMNS.get(table or "", frozenset())
        for row in rows:
            for column in json_columns & row.keys():
                if row[column] is not None:
                    row[column] = json.loads(row[column])
        return rows

    # ------------------------------------------------------------------ runs

    def create_run(
        self,
        *,
        run_id: str,
        name: str,
        spec: Mapping[str, Any],
        spec_path: str | None,
        run_dir: str | None,
        backend: str,
        policy: str | None,
        pools: Sequence[Mapping[str, Any]],
    ) -> None:
        """Record a run (CREATED), its pools, and one REQUESTED allocation per pool node, atomically."""
        if backend not in BACKENDS:
            raise InvalidWrite(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        checked = [_check_pool(pool) for pool in pools]
        with self._write() as conn:
            clash = conn.execute("SELECT id, name FROM runs WHERE id = ? OR name = ?", (run_id, name)).fetchone()
            if clash is not None:
                raise DuplicateRun(f"a run with id {clash[0]!r} / name {clash[1]!r} already exists")
            now = self._clock()
            run_state = machine("runs").initial
            conn.execute(
                "INSERT INTO runs (id, name, state, version, spec, spec_path, run_dir, backend, policy,"
                " created_at, updated_at) VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, name, run_state, _json(spec), spec_path, run_dir, backend, policy, now, now),
            )
            self._journal(
                conn,
                now,
                run_id,
                "runs",
                run_id,
                "run.created",
                to_state=run_state,
                data={"name": name, "backend": backend, "pools": [p["name"] for p in checked]},
            )
            allocation_state = machine("allocations").initial
            for pool in checked:
                pool_id = insert(conn, "pools", {"run_id": run_id, **pool})
                for index in range(pool["nodes"]):
                    allocation_id = insert(
                        conn,
                        "allocations",
                        {
                            "run_id": run_id,
                            "pool_id": pool_id,
                            "array_index": index,
                            "state": allocation_state,
                            "version": 1,
                            "updated_at": now,
                        },
                    )
                    self._journal(
                        conn,
                        now,
                        run_id,
                        "allocations",
                        allocation_id,
                        "allocation.requested",
                        to_state=allocation_state,
                        data={"pool": pool["name"], "array_index": index},
                    )

    def get_run(self, run_id: str) -> Row:
        rows = self._query("SELECT * FROM runs WHERE id = ?", (run_id,), table="runs")
        if not rows:
            raise NotFound(f"no run with id {run_id!r}")
        return rows[0]

    def find_run(self, name_or_id: str) -> Row | None:
        """The run with that id, else the run with that name, else None."""
        rows = self._query(
            "SELECT * FROM runs WHERE id = ? OR name = ? ORDER BY id = ? DESC LIMIT 1",
            (name_or_id, name_or_id, name_or_id),
            table="runs",
        )
        return rows[0] if rows else None

    def list_runs(self) -> list[Row]:
        return self._query("SELECT * FROM runs ORDER BY created_at, id", table="runs")

    # ------------------------------------------------------------------ guarded writes

    def set_state(
        self,
        table: str,
        row_id: int | str,
        *,
        expect: str,
        to: str,
        event: str,
        expect_version: int | None = None,
        epoch: int | None = None,
        data: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> int:
        """Move a row from ``expect`` to ``to`` (compare-and-set), journaled; returns the new version."""
        check_edge(table, expect, to)
        columns = self._writable(table, fields)
        with self._write() as conn:
            run_id = self._run_of(conn, table, row_id)
            self._fence(conn, run_id, epoch)
            return self._cas(
                conn,
                table,
                row_id,
                run_id,
                expect=expect,
                to=to,
                event=event,
                expect_version=expect_version,
                epoch=epoch,
                data=_with_fields(data, fields),
                columns=columns,
            )

    def update_fields(
        self,
        table: str,
        row_id: int | str,
        *,
        event: str | None = None,
        data: Mapping[str, Any] | None = None,
        epoch: int | None = None,
        bookkeeping: bool = False,
        **fields: Any,
    ) -> int | None:
        """Write non-state columns; journal ``event`` if given. Returns the row's version (None if the
        table has none). Writing values the row already has changes nothing and journals nothing.
        ``bookkeeping``: not counted in ``revision`` (see ``_write``)."""
        if not fields:
            raise InvalidWrite("update_fields needs at least one field; use journal_event to record an event")
        columns = self._writable(table, fields)
        versioned = "version" in self._columns[table]
        with self._write(bookkeeping=bookkeeping) as conn:
            run_id = self._run_of(conn, table, row_id)
            self._fence(conn, run_id, epoch)
            now = self._clock()
            sets = [f'"{c}" = ?' for c in columns]
            params: list[Any] = list(columns.values())
            if versioned:
                sets.append("version = version + 1")
            if "updated_at" in self._columns[table]:
                sets.append("updated_at = ?")
                params.append(now)
            changed = " OR ".join(f'"{c}" IS NOT ?' for c in columns)
            returning = "version" if versioned else "id"
            row = conn.execute(
                f'UPDATE "{table}" SET {", ".join(sets)} WHERE id = ? AND ({changed}) RETURNING {returning}',
                [*params, row_id, *columns.values()],
            ).fetchall()
            if not row:  # nothing differed: keep the write idempotent
                return _current_version(conn, table, row_id) if versioned else None
            if event is not None:
                self._journal(conn, now, run_id, table, row_id, event, epoch=epoch, data=_with_fields(data, fields))
            return row[0][0] if versioned else None

    def record_agents_seen(self, run_id: str, seen: Mapping[int, float], *, epoch: int | None = None) -> None:
        """When each allocation's agent was last heard from (``agent_seen_at``), many in one transaction: a
        daemon keeps heartbeat times in memory and writes them once per tick, not once per heartbeat. Only
        later times are written, and none to a PENDING allocation (its requeue reset the time: a heartbeat of the
        task's last run must not come back); bookkeeping (not in ``revision``), no journal row, fenced by
        ``epoch``."""
        if not seen:
            return
        with self._write(bookkeeping=True) as conn:
            self._fence(conn, run_id, epoch)
            conn.executemany(
                "UPDATE allocations SET agent_seen_at = ? WHERE id = ? AND run_id = ?"
                " AND state != 'PENDING' AND (agent_seen_at IS NULL OR agent_seen_at < ?)",
                [(at, alloc_id, run_id, at) for alloc_id, at in seen.items()],
            )

    def journal_event(
        self,
        run_id: str | None,
        entity: str,
        entity_id: int | str,
        event: str,
        data: Mapping[str, Any] | None = None,
        epoch: int | None = None,
    ) -> int:
        """Append an observation to the journal; returns its id. Stamped with ``epoch``, it is fenced like
        every other write (a deposed daemon cannot add to the journal); unstamped (the CLI without a daemon),
        it is not."""
        with self._write() as conn:
            if run_id is not None:
                self._fence(conn, run_id, epoch)
            return self._journal(conn, self._clock(), run_id, entity, entity_id, event, epoch=epoch, data=data)

    # ------------------------------------------------------------------ nodes, GPUs, workers, transitions

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
        _check_role(role)
        if not node:
            raise InvalidWrite("node name must not be empty")
        indices = list(gpu_indices)
        if len(set(indices)) != len(indices) or any(not isinstance(i, int) or i < 0 for i in indices):
            raise InvalidWrite(f"gpu indices must be distinct non-negative ints, got {indices}")
        with self._write() as conn:
            owner = conn.execute("SELECT run_id FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
            if owner is None or owner[0] != run_id:
                raise NotFound(f"run {run_id!r} has no allocation {allocation_id}")
            self._fence(conn, run_id, epoch)
            write_node_gpus(self, conn, run_id, allocation_id, node, indices, role, epoch)

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
        epoch: int | None = None,
    ) -> int:
        """Record a worker (STARTING) on an allocation of the run; returns its id."""
        _check_role(role)
        with self._write() as conn:
            owner = conn.execute("SELECT run_id FROM allocations WHERE id = ?", (allocation_id,)).fetchone()
            if owner is None or owner[0] != run_id:
                raise NotFound(f"run {run_id!r} has no allocation {allocation_id}")
            self._fence(conn, run_id, epoch)
            now = self._clock()
            state = machine("workers").initial
            worker_id = insert(
                conn,
                "workers",
                {
                    "run_id": run_id,
                    "allocation_id": allocation_id,
                    "role": role,
                    "engine": engine,
                    "state": state,
                    "version": 1,
                    "url": url,
                    "pid": pid,
                    "weight_version": weight_version,
                    "updated_at": now,
                },
            )
            self._journal(
                conn,
                now,
                run_id,
                "workers",
                worker_id,
                "worker.created",
                to_state=state,
                epoch=epoch,
                data={"allocation_id": allocation_id, "role": role, "engine": engine},
            )
            return worker_id

    def add_transition(
        self,
        *,
        run_id: str,
        kind: str,
        from_role: str,
        to_role: str,
        gpu_ids: Sequence[int],
        epoch: int | None = None,
    ) -> int:
        """Record a planned role transition (PLANNED) of GPUs of the run; returns its id."""
        _check_role(from_role)
        _check_role(to_role)
        ids = sorted(set(gpu_ids))
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
                raise NotFound(f"no run with id {run_id!r}")
            self._fence(conn, run_id, epoch)
            placeholders = ", ".join("?" * len(ids))
            known = {
                r[0]
                for r in conn.execute(
                    f"SELECT id FROM gpus WHERE run_id = ? AND id IN ({placeholders})", (run_id, *ids)
                )
            }
            if missing := [i for i in ids if i not in known]:
                raise InvalidWrite(f"run {run_id!r} has no GPUs with ids {missing}")
            now = self._clock()
            state = machine("transitions").initial
            transition_id = insert(
                conn,
                "transitions",
                {
                    "run_id": run_id,
                    "kind": kind,
                    "from_role": from_role,
                    "to_role": to_role,
                    "gpu_ids": _json(ids),
                    "state": state,
                    "version": 1,
                    "created_at": now,
                    "updated_at": now,
                },
            )
            self._journal(
                conn,
                now,
                run_id,
                "transitions",
                transition_id,
                "transition.planned",
                to_state=state,
                epoch=epoch,
                data={"kind": kind, "from_role": from_role, "to_role": to_role, "gpu_ids": ids},
            )
            return transition_id

    def add_step(
        self,
        *,
        transition_id: int,
        seq: int,
        kind: str,
        idempotency_key: str,
        detail: Mapping[str, Any] | None = None,
        epoch: int | None = None,
    ) -> int:
        """Durably record a step's INTENT before its effect runs; returns its id.

        ``DuplicateStep`` if the key (or the seq within the transition) exists: after a crash the
        caller finds that step with ``steps()`` and probes its effect instead of redoing it.
        """
        if kind not in _values(StepKind):
            raise InvalidWrite(f"step kind {kind!r} is not one of {', '.join(StepKind)}")
        with self._write() as conn:
            owner = conn.execute("SELECT run_id, state FROM transitions WHERE id = ?", (transition_id,)).fetchone()
            if owner is None:
                raise NotFound(f"no transition with id {transition_id}")
            run_id, transition_state = owner
            self._fence(conn, run_id, epoch)
            if transition_state not in OPEN_TRANSITION_STATES:
                raise InvalidWrite(
                    f"transition {transition_id} is {transition_state}; steps can only be "
                    f"added while it is {', '.join(sorted(OPEN_TRANSITION_STATES))}"
                )
            clash = conn.execute(
                "SELECT id, idempotency_key, seq FROM steps WHERE idempotency_key = ?"
                " OR (transition_id = ? AND seq = ?)",
                (idempotency_key, transition_id, seq),
            ).fetchone()
            if clash is not None:
                raise DuplicateStep(
                    f"step {clash[0]} already has key {clash[1]!r} / seq {clash[2]} "
                    f"(asked: key {idempotency_key!r}, seq {seq} of transition {transition_id})"
                )
            now = self._clock()
            state = machine("steps").initial
            step_id = insert(
                conn,
                "steps",
                {
                    "transition_id": transition_id,
                    "seq": seq,
                    "kind": kind,
                    "idempotency_key": idempotency_key,
                    "state": state,
                    "version": 1,
                    "detail": None if detail is None else _json(detail),
                    "updated_at": now,
                },
            )
            self._journal(
                conn,
                now,
                run_id,
                "steps",
                step_id,
                "step.intent",
                to_state=state,
                epoch=epoch,
                data={"transition_id": transition_id, "seq": seq, "kind": kind, "key": idempotency_key},
            )
            return step_id

    # ------------------------------------------------------------------ elastic pools

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
        with self._write() as conn:
            owner = conn.execute("SELECT run_id, name FROM pools WHERE id = ?", (pool_id,)).fetchone()
            if owner is None or owner[0] != run_id:
                raise NotFound(f"run {run_id!r} has no pool {pool_id}")
            self._fence(conn, run_id, epoch)
            now = self._clock()
            (index,) = conn.execute(
                "SELECT COALESCE(MAX(array_index), -1) + 1 FROM allocations WHERE pool_id = ?", (pool_id,)
            ).fetchone()
            state = machine("allocations").initial
            allocation_id = insert(
                conn,
                "allocations",
                {
                    "run_id": run_id,
                    "pool_id": pool_id,
                    "array_index": index,
                    "state": state,
                    "version": 1,
                    "updated_at": now,
                },
            )
            self._journal(
                conn,
                now,
                run_id,
                "allocations",
                allocation_id,
                event,
                to_state=state,
                epoch=epoch,
                data={**(data or {}), "pool": owner[1], "array_index": index},
            )
        return self.allocation(allocation_id)

    def entered_at(self, table: str, row_id: int | str, state: str) -> float | None:
        """When the row last moved into ``state`` (the time of its journal row), or None if it never did."""
        rows = self._query(
            "SELECT ts FROM journal WHERE entity = ? AND entity_id = ? AND to_state = ? ORDER BY id DESC LIMIT 1",
            (table, str(row_id), str(state)),
        )
        return float(rows[0]["ts"]) if rows else None

    def entity_events(
        self, entity: str, entity_id: int | str, events: Sequence[str], *, limit: int | None = None
    ) -> list[Row]:
        """Journal rows of one entity whose event is one of ``events``, oldest first; with ``limit``, the
        newest ``limit`` of them."""
        if not events:
            return []
        marks = ", ".join("?" * len(events))
        sql = f"SELECT * FROM journal WHERE entity = ? AND entity_id = ? AND event IN ({marks}) ORDER BY id DESC"
        params: list[Any] = [entity, str(entity_id), *events]
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return list(reversed(self._query(sql, params, table="journal")))

    # ------------------------------------------------------------------ reads

    def get(self, table: str, row_id: int | str) -> Row | TypedRow:
        """One row of any table by id: a typed table's as its type (pearlctl.state.rows; ``transition``,
        ``step``, ... say which), any other's as a dict, JSON decoded; ``NotFound`` if absent."""
        if "id" not in self._columns.get(table, ()):
            raise NotFound(f"no table {table!r} with ids; tables: {', '.join(sorted(self._columns))}")
        select = _JOINED.get(table, f'SELECT * FROM "{table}"')
        key = _JOINED_ID.get(table, "id")
        rows = self._query(f"{select} WHERE {key} = ?", (row_id,), table=table)
        if not rows:
            raise NotFound(f"{table} has no row {row_id!r}")
        row_type = ROW_TYPES.get(table)
        return row_type.from_row(rows[0]) if row_type else rows[0]

    def allocation(self, allocation_id: int) -> Allocation:
        return self.get(Allocation.TABLE, allocation_id)

    def gpu(self, gpu_id: int) -> Gpu:
        return self.get(Gpu.TABLE, gpu_id)

    def worker(self, worker_id: int) -> Worker:
        return self.get(Worker.TABLE, worker_id)

    def transition(self, transition_id: int) -> Transition:
        return self.get(Transition.TABLE, transition_id)

    def step(self, step_id: int) -> Step:
        return self.get(Step.TABLE, step_id)

    def pools(self, run_id: str) -> list[Row]:
        return self._query("SELECT * FROM pools WHERE run_id = ? ORDER BY id", (run_id,))

    def allocations(self, run_id: str, *, cached: bool = False) -> list[Allocation]:
        """Allocations of the run, each with its pool's name as ``pool``.

        ``cached``: the rows as of the last change a decision reads (``generation``), not read again while
        nothing changed. Their ``agent_seen_at`` is bookkeeping, so it may be older than the table's: only a
        caller that keeps newer heartbeat times itself (the daemon's controller) asks for this."""

        def read() -> list[Allocation]:
            order = "ORDER BY a.pool_id, a.array_index"
            return self._typed(Allocation, f"{_JOINED['allocations']} WHERE a.run_id = ? {order}", (run_id,))

        return self._cached("allocations", run_id, read) if cached else read()

    def nodes(self, run_id: str) -> list[Row]:
        return self._query("SELECT * FROM nodes WHERE run_id = ? ORDER BY name", (run_id,))

    def gpus(self, run_id: str, *, allocation_id: int | None = None) -> list[Gpu]:
        """GPUs of the run (of one allocation only, if given: an index, not a scan), each with its node's
        name as ``node`` and its pool's name as ``pool``."""
        where, params = "g.run_id = ?", [run_id]
        if allocation_id is not None:
            where, params = where + " AND g.allocation_id = ?", [*params, allocation_id]

        def read() -> list[Gpu]:
            return self._typed(Gpu, f"{_JOINED['gpus']} WHERE {where} ORDER BY n.name, g.idx, g.id", params)

        return read() if allocation_id is not None else self._cached("gpus", run_id, read)

    def workers(self, run_id: str, *, allocation_id: int | None = None) -> list[Worker]:
        """Workers of the run (of one allocation only, if given), oldest first."""
        if allocation_id is None:
            return self._cached(
                "workers",
                run_id,
                lambda: self._typed(Worker, "SELECT * FROM workers WHERE run_id = ? ORDER BY id", (run_id,)),
            )
        return self._typed(
            Worker, "SELECT * FROM workers WHERE run_id = ? AND allocation_id = ? ORDER BY id", (run_id, allocation_id)
        )

    def transitions(
        self, run_id: str, *, states: Iterable[str] | None = None, kind: str | None = None, last: int | None = None
    ) -> list[Transition]:
        """The run's transitions, oldest first: only those in ``states`` and of ``kind`` when given, only the
        ``last`` n when given. The daemon's loop asks for the open ones and the latest few, never the whole
        history, which grows by a few rows per training step."""
        sql, params = "SELECT * FROM transitions WHERE run_id = ?", [run_id]
        if states is not None:
            wanted = sorted(states)
            sql += f" AND state IN ({', '.join('?' * len(wanted))})"
            params += wanted
        if kind is not None:
            sql += " AND kind = ?"
            params.append(kind)
        if last is None:
            return self._typed(Transition, sql + " ORDER BY id", params)
        return self._typed(Transition, sql + " ORDER BY id DESC LIMIT ?", [*params, last])[::-1]

    def open_transitions(self, run_id: str) -> list[Transition]:
        return self.transitions(run_id, states=OPEN_TRANSITION_STATES)

    def steps(self, transition_id: int) -> list[Step]:
        return self._typed(Step, "SELECT * FROM steps WHERE transition_id = ? ORDER BY seq", (transition_id,))

    def step_by_key(self, run_id: str, key: str) -> Step | None:
        """The run's step with this idempotency key (a trainer command's id is its step's key)."""
        rows = self._typed(
            Step,
            "SELECT steps.* FROM steps JOIN transitions ON transitions.id = steps.transition_id "
            "WHERE steps.idempotency_key = ? AND transitions.run_id = ?",
            (key, run_id),
        )
        return rows[0] if rows else None

    def recent_steps(self, run_id: str, *, state: str, per_kind: int) -> list[Step]:
        """The run's latest ``per_kind`` steps in ``state`` of each step kind, oldest first (running
        estimates of step durations)."""
        return self._typed(
            Step,
            "SELECT * FROM (SELECT steps.*, ROW_NUMBER() OVER (PARTITION BY steps.kind ORDER BY steps.id DESC) AS n "
            "FROM steps JOIN transitions ON transitions.id = steps.transition_id "
            "WHERE transitions.run_id = ? AND steps.state = ?) WHERE n <= ? ORDER BY id",
            (run_id, state, per_kind),
        )

    def journal(self, run_id: str | None = None, since_id: int = 0, limit: int | None = None) -> list[Row]:
        """Journal rows with ``id > since_id``, oldest first; only the run's if ``run_id`` is given."""
        sql = "SELECT * FROM journal WHERE id > ?"
        params: list[Any] = [since_id]
        if run_id is not None:
            sql += " AND run_id = ?"
            params.append(run_id)
        sql += " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return self._query(sql, params, table="journal")

    def failure_reasons(self, run_id: str) -> dict[int, str]:
        """Each FAILED worker's reason, as its agent reported it (the ``error`` journaled on its move to FAILED,
        the latest if it failed more than once); workers without one are absent. Reads the journal by entity
        (its index), only for the run's FAILED workers."""
        failed = [
            str(r["id"]) for r in self._query("SELECT id FROM workers WHERE run_id = ? AND state = 'FAILED'", [run_id])
        ]
        if not failed:
            return {}
        rows = self._query(
            "SELECT entity_id, data FROM journal WHERE entity = 'workers' AND entity_id IN"
            f" ({', '.join('?' * len(failed))}) AND to_state = 'FAILED' AND json_extract(data, '$.error') IS NOT NULL"
            " ORDER BY id",
            failed,
            table="journal",
        )
        return {int(r["entity_id"]): r["data"]["error"] for r in rows}

    def health(self) -> Row:
        """What ``pearlctl doctor`` reports: SQLite's integrity check, journal mode, schema version and
        row counts. Read-only; works on a read-only store."""
        with self._lock:
            conn = self._conn
            problems = [str(r[0]) for r in conn.execute("PRAGMA integrity_check(5)")]
            return {
                "integrity": "ok" if problems == ["ok"] else "; ".join(problems),
                "journal_mode": str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower(),
                "schema_version": schema_version(conn),
                "runs": conn.execute("SELECT count(*) FROM runs").fetchone()[0],
                "journal_rows": conn.execute("SELECT count(*) FROM journal").fetchone()[0],
            }

    # ------------------------------------------------------------------ internals (inside a transaction)

    def _cas(
        self,
        conn: sqlite3.Connection,
        table: str,
        row_id: int | str,
        run_id: str,
        *,
        expect: str,
        to: str,
        event: str,
        expect_version: int | None = None,
        epoch: int | None,
        data: Mapping[str, Any] | None,
        columns: Mapping[str, Any],
    ) -> int:
        check_edge(table, expect, to)
        now = self._clock()
        sets = "".join(f', "{c}" = ?' for c in columns)
        sql = f'UPDATE "{table}" SET state = ?, version = version + 1, updated_at = ?{sets} WHERE id = ? AND state = ?'
        params: list[Any] = [str(to), now, *columns.values(), row_id, str(expect)]
        if expect_version is not None:
            sql += " AND version = ?"
            params.append(expect_version)
        updated = conn.execute(sql + " RETURNING version", params).fetchall()
        if not updated:
            state, version = conn.execute(f'SELECT state, version FROM "{table}" WHERE id = ?', (row_id,)).fetchone()
            raise StaleWrite(
                table,
                row_id,
                expected_state=str(expect),
                expected_version=expect_version,
                current_state=state,
                current_version=version,
            )
        self._journal(conn, now, run_id, table, row_id, event, from_state=expect, to_state=to, epoch=epoch, data=data)
        return int(updated[0][0])

    def _journal(
        self,
        conn: sqlite3.Connection,
        ts: float,
        run_id: str | None,
        entity: str,
        entity_id: int | str,
        event: str,
        *,
        from_state: str | None = None,
        to_state: str | None = None,
        epoch: int | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> int:
        return insert(
            conn,
            "journal",
            {
                "ts": ts,
                "run_id": run_id,
                "entity": entity,
                "entity_id": str(entity_id),
                "event": event,
                "from_state": None if from_state is None else str(from_state),
                "to_state": None if to_state is None else str(to_state),
                "epoch": epoch,
                "data": None if data is None else _json(data),
            },
        )

    def _run_of(self, conn: sqlite3.Connection, table: str, row_id: int | str) -> str:
        """The run a row belongs to (for fencing and the journal); ``NotFound`` if the row is absent."""
        if table == "runs":
            sql = "SELECT id FROM runs WHERE id = ?"
        elif table == "steps":
            sql = "SELECT t.run_id FROM steps s JOIN transitions t ON t.id = s.transition_id WHERE s.id = ?"
        else:
            sql = f'SELECT run_id FROM "{table}" WHERE id = ?'
        row = conn.execute(sql, (row_id,)).fetchone()
        if row is None:
            raise NotFound(f"{table} has no row {row_id!r}")
        return str(row[0])

    def _fence(self, conn: sqlite3.Connection, run_id: str, epoch: int | None) -> None:
        """Refuse a write stamped with an epoch that is not the run lease's current one."""
        if epoch is None:
            return
        name = run_lease_name(run_id)
        row = conn.execute("SELECT epoch FROM leases WHERE name = ?", (name,)).fetchone()
        if row is not None and row[0] != epoch:
            raise StaleEpoch(name, epoch, row[0])

    def _writable(self, table: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Validate caller-chosen columns (their names become SQL) and encode their values."""
        if table not in self._columns or table in _NO_FIELD_UPDATES:
            writable = sorted(set(self._columns) - _NO_FIELD_UPDATES)
            raise InvalidWrite(f"cannot write fields of table {table!r}; tables: {', '.join(writable)}")
        managed = sorted(_MANAGED_COLUMNS & fields.keys())
        if managed:
            raise InvalidWrite(
                f"{table}: {', '.join(managed)} cannot be written as fields (state changes go through set_state)"
            )
        unknown = sorted(fields.keys() - self._columns[table])
        if unknown:
            columns = ", ".join(sorted(self._columns[table] - _MANAGED_COLUMNS))
            raise InvalidWrite(f"{table} has no column {', '.join(unknown)}; writable columns: {columns}")
        json_columns = JSON_COLUMNS.get(table, frozenset())
        return {c: _json(v) if c in json_columns and v is not None else plain(v) for c, v in fields.items()}


# ---------------------------------------------------------------------- module helpers


def _check_pool(pool: Mapping[str, Any]) -> dict[str, Any]:
    missing = sorted(POOL_REQUIRED - pool.keys())
    unknown = sorted(pool.keys() - POOL_REQUIRED - POOL_OPTIONAL)
    if missing or unknown:
        raise InvalidWrite(
            f"pool {pool.get('name', '?')!r}: missing {missing}, unknown {unknown}; "
            f"keys are {sorted(POOL_REQUIRED | POOL_OPTIONAL)}"
        )
    if pool["kind"] not in _values(PoolKind):
        raise InvalidWrite(f"pool {pool['name']!r}: kind {pool['kind']!r} is not one of {', '.join(PoolKind)}")
    _check_role(pool["role"])
    if not isinstance(pool["nodes"], int) or pool["nodes"] < 1:
        raise InvalidWrite(f"pool {pool['name']!r}: nodes must be an int >= 1, got {pool['nodes']!r}")
    return {"partition": None, **{k: plain(v) for k, v in pool.items()}}


def _check_role(role: str) -> None:
    if role not in _values(Role):
        raise InvalidWrite(f"role {role!r} is not one of {', '.join(Role)}")


def _values(states: type[StrEnum]) -> frozenset[str]:
    return frozenset(s.value for s in states)


def _current_version(conn: sqlite3.Connection, table: str, row_id: int | str) -> int:
    return int(conn.execute(f'SELECT version FROM "{table}" WHERE id = ?', (row_id,)).fetchone()[0])


def _with_fields(data: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """The journal payload: the caller's data plus, under ``fields``, the columns written with it."""
    if not fields:
        return None if data is None else dict(data)
    return {**(data or {}), "fields": dict(fields)}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
