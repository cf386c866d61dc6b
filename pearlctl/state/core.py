"""The Store's core: the connection, its transactions, and the guarded writes every part of the Store uses.

What it guarantees (docs/architecture.md, "State"):

- **One transaction per write, with its journal entry.** Every write runs inside ``_write``:
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
  journal row), so pollers can write what they saw on every poll.
- **Readers never write.** A store opened ``readonly=True`` refuses writes (``ReadOnlyStore``) before
  touching SQLite, and its connection is ``mode=ro`` anyway. Under WAL, readers never block the writer
  and the writer never blocks them.

The parts of the Store (pearlctl/state/store.py: runs, fleet, transitions, journal, leases) write through
this core's ``_write``, ``_cas``, ``_journal`` and ``_fence`` and read through ``_query``, ``_typed`` and
``_cached``: those are the state package's own, used by no other package. One core may be shared by threads:
a lock serialises its use of the single connection.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, Self, TypeVar

from pearlctl.state.db import Database, connect, insert, plain, schema_version
from pearlctl.state.errors import (
    InvalidWrite,
    NotFound,
    ReadOnlyStore,
    StaleEpoch,
    StaleWrite,
)
from pearlctl.state.machines import Role, check_edge, machine
from pearlctl.state.rows import ROW_TYPES, TypedRow
from pearlctl.state.schema import JSON_COLUMNS

Clock = Callable[[], float]
Row = dict[str, Any]  # a row of a table without a typed row (pearlctl.state.rows)
R = TypeVar("R", bound=TypedRow)

# Columns only the Store itself writes: identity, ownership, state and bookkeeping.
_MANAGED_COLUMNS = frozenset({"id", "run_id", "state", "version", "updated_at", "created_at"})
# Tables with their own write paths: the journal is append-only, leases go through the lease methods.
_NO_FIELD_UPDATES = frozenset({"journal", "leases"})
# The reads of a typed table that join names in (a GPU's node and pool, an allocation's pool), by table.
JOINED_SELECT: Mapping[str, str] = {
    "gpus": "SELECT g.*, n.name AS node, p.name AS pool FROM gpus g JOIN nodes n ON n.id = g.node_id"
    " JOIN allocations a ON a.id = g.allocation_id JOIN pools p ON p.id = a.pool_id",
    "allocations": "SELECT a.*, p.name AS pool FROM allocations a JOIN pools p ON p.id = a.pool_id",
}
_JOINED_ID: Mapping[str, str] = {"gpus": "g.id", "allocations": "a.id"}  # the id column under their aliases


def run_lease_name(run_id: str) -> str:
    """The name of the lease whose epoch fences writes to a run."""
    return f"run:{run_id}"


class Core:
    """The connection, its transactions and the guarded writes (``Store`` adds the parts: pearlctl/state/store.py)."""

    def __init__(self, db: Database, *, readonly: bool = False, clock: Clock = time.time) -> None:
        self._db = db
        self._conn: sqlite3.Connection = db.conn
        self.readonly = readonly
        self._clock = clock
        self._lock = threading.RLock()
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
        self._columns: dict[str, frozenset[str]] = {
            table: frozenset(row[1] for row in self._conn.execute(f'PRAGMA table_info("{table}")'))
            for table in db.table_names()
        }

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, readonly: bool = False, clock: Clock = time.time) -> Self:
        return cls(connect(path, readonly=readonly), readonly=readonly, clock=clock)

    def close(self) -> None:
        with self._lock:
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
        if table == "gpus" and "role" in fields and event is None:  # the live timeline reads roles from the journal
            raise InvalidWrite("a GPU's role is written with its journal row: give update_fields an event")
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

    # ------------------------------------------------------------------ reads

    def get(self, table: str, row_id: int | str) -> Row | TypedRow:
        """One row of any table by id: a typed table's as its type (pearlctl.state.rows; ``transition``,
        ``step``, ... say which), any other's as a dict, JSON decoded; ``NotFound`` if absent."""
        if "id" not in self._columns.get(table, ()):
            raise NotFound(f"no table {table!r} with ids; tables: {', '.join(sorted(self._columns))}")
        select = JOINED_SELECT.get(table, f'SELECT * FROM "{table}"')
        key = _JOINED_ID.get(table, "id")
        rows = self._query(f"{select} WHERE {key} = ?", (row_id,), table=table)
        if not rows:
            raise NotFound(f"{table} has no row {row_id!r}")
        row_type = ROW_TYPES.get(table)
        return row_type.from_row(rows[0]) if row_type else rows[0]

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

    def _create(
        self,
        conn: sqlite3.Connection,
        table: str,
        run_id: str,
        columns: Mapping[str, Any],
        event: str,
        *,
        now: float,
        epoch: int | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> int:
        """Insert a row of ``table`` in its machine's initial state, at version 1, with its journal row (``event``,
        to that state): the one way the parts create a row. Returns its id."""
        state = machine(table).initial
        row_id = insert(conn, table, {**columns, "state": state, "version": 1, "updated_at": now})
        self._journal(conn, now, run_id, table, row_id, event, to_state=state, epoch=epoch, data=data)
        return row_id

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
                "data": None if data is None else encode_json(data),
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
        return {c: encode_json(v) if c in json_columns and v is not None else plain(v) for c, v in fields.items()}


# ---------------------------------------------------------------------- module helpers


def check_role(role: str) -> None:
    """Refuse a role that is not one of ``Role`` (``InvalidWrite``)."""
    if role not in values(Role):
        raise InvalidWrite(f"role {role!r} is not one of {', '.join(Role)}")


def values(states: type[StrEnum]) -> frozenset[str]:
    """The string values of an enum (what a column may hold)."""
    return frozenset(s.value for s in states)


def _current_version(conn: sqlite3.Connection, table: str, row_id: int | str) -> int:
    return int(conn.execute(f'SELECT version FROM "{table}" WHERE id = ?', (row_id,)).fetchone()[0])


def _with_fields(data: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """The journal payload: the caller's data plus, under ``fields``, the columns written with it."""
    if not fields:
        return None if data is None else dict(data)
    return {**(data or {}), "fields": dict(fields)}


def encode_json(value: Any) -> str:
    """A JSON column's text: keys sorted, no spaces (equal values encode equally)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
