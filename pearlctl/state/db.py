"""Opening the state database: pragmas, versioned migrations, read-only connections.

``connect`` is the only place a SQLite connection is made. What it guarantees:

- read-write connections run in WAL mode with ``synchronous=FULL`` (a committed write survives power
  loss), ``foreign_keys=ON`` and a ``busy_timeout``, so a writer waits for another writer's lock
  instead of failing with "database is locked";
- the schema is brought to ``SCHEMA_VERSION`` one migration per transaction; ``PRAGMA user_version``
  records which ran, so a crash mid-migration leaves the previous version intact. Two processes
  migrating at once serialise: the second re-reads the version under the write lock and skips what the
  first did;
- a database written by newer code (higher ``user_version``) is refused, never downgraded;
- ``readonly=True`` opens ``file:...?mode=ro`` with ``query_only=ON``: it can never write, never
  migrates, and refuses a database that is not exactly at ``SCHEMA_VERSION``. In a directory this
  process cannot write (a read-only mount) or on a full disk, where SQLite cannot create the WAL's
  shared-memory file that readers need, a database with no write-ahead log left is read as
  ``immutable``;
- a database that cannot be used at all raises ``StateUnavailable`` (one line: the path, the problem,
  what to do) instead of a raw ``sqlite3`` error: not a database (corrupted or overwritten), a read-only
  directory or file, a full disk, an I/O error. :func:`unavailable` makes the same translation for
  errors that surface later, on a write.

Connections use ``isolation_level=None``: the sqlite3 driver never opens transactions by itself, so the
Store's explicit ``BEGIN IMMEDIATE`` ... ``COMMIT`` is the whole truth about transaction boundaries.
The database belongs on the head node's local disk (docs/architecture.md, "State"): WAL needs shared memory that
network filesystems do not provide, which is why a failed switch to WAL is an error, not a warning.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pearlctl.state.errors import IncompatibleSchema, NotFound, StateError, StateUnavailable
from pearlctl.state.schema import MIGRATIONS, SCHEMA_VERSION

BUSY_TIMEOUT_MS = 10_000


class Database:
    """A connection and the little the Store asks of it: rows as dicts, the table names, a migration script run
    inside the caller's transaction. (sqlite-utils did this before; importing it imports pandas where pandas is
    installed, as it is beside vLLM: a third of a second on every command and agent start.)"""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def query(self, sql: str, params: Sequence[Any] = ()) -> Iterator[dict[str, Any]]:
        cursor = self.conn.execute(sql, params)
        names = [d[0] for d in cursor.description or ()]
        return (dict(zip(names, row, strict=True)) for row in cursor)

    def table_names(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]

    def executescript(self, script: str) -> None:
        """Run ``script`` statement by statement: unlike ``sqlite3.executescript``, no implicit COMMIT first, so
        inside a transaction the whole script stays atomic."""
        statement = ""
        for line in script.splitlines(keepends=True):
            statement += line
            if sqlite3.complete_statement(statement):
                self.conn.execute(statement)
                statement = ""
        if statement.strip():
            self.conn.execute(statement)

    def close(self) -> None:
        self.conn.close()


def connect(path: str | os.PathLike[str], *, readonly: bool = False) -> Database:
    """Open (creating and migrating if needed) the state database at ``path``.

    Raises StateUnavailable when the database cannot be used (see :func:`unavailable`)."""
    path = Path(path)
    try:
        return _connect_readonly(path) if readonly else _connect_readwrite(path)
    except (sqlite3.Error, OSError) as exc:
        problem = unavailable(exc, path)
        if problem is None:
            raise
        raise problem from exc


def _connect_readwrite(path: Path) -> Database:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StateError(
                f"could not put {path} in WAL mode (got {mode!r}); keep the state database on a local "
                "disk, not on NFS or another network filesystem"
            )
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        db = Database(conn)
        migrate(db, str(path))
    except BaseException:
        conn.close()
        raise
    return db


def _connect_readonly(path: Path) -> Database:
    if not path.exists():
        raise NotFound(f"no state database at {path}")
    try:
        return _open_readonly(path, immutable=False)
    except sqlite3.OperationalError as exc:
        # A reader of a WAL database needs its -shm file, and creates it if it is missing: impossible in
        # a directory this process cannot write (a read-only mount) or on a full disk. With no -wal file
        # either, every commit is in the main file: read it as immutable (no locks, no shared memory).
        if _primary(exc) not in (sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR) or _wal_pending(path):
            raise
        if _writable(path.parent) and not _disk_full(path.parent):
            raise
        return _open_readonly(path, immutable=True)


def _wal_pending(path: Path) -> bool:
    """Whether a -wal file with content is next to ``path`` (commits not yet in the main file)."""
    try:
        return Path(f"{path}-wal").stat().st_size > 0
    except FileNotFoundError:
        return False


def _open_readonly(path: Path, *, immutable: bool) -> Database:
    uri = f"{path.resolve().as_uri()}?mode=ro" + ("&immutable=1" if immutable else "")
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA foreign_keys = ON")
        found = schema_version(conn)
        if found != SCHEMA_VERSION:
            advice = (
                "Upgrade pearlctl to read it."
                if found > SCHEMA_VERSION
                else "Open it read-write once (start the daemon) so it gets migrated."
            )
            raise IncompatibleSchema(str(path), found, SCHEMA_VERSION, advice)
        db = Database(conn)
    except BaseException:
        conn.close()
        raise
    return db


def empty() -> Database:
    """A read-only, in-memory database at ``SCHEMA_VERSION`` with nothing in it: what a reader sees where
    no state database exists yet, without creating one."""
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db = Database(conn)
    migrate(db, ":memory:")
    conn.execute("PRAGMA query_only = ON")
    return db


def _primary(exc: BaseException) -> int | None:
    """The primary SQLite result code of ``exc`` (``SQLITE_IOERR`` for ``SQLITE_IOERR_WRITE``), or None."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK)


def _disk_full(directory: Path) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail == 0 or (st.f_files > 0 and st.f_favail == 0)  # (f_files 0: no inode limit, btrfs)


def sqlite_fault(exc: BaseException, path: str | os.PathLike[str]) -> StateUnavailable | None:
    """:func:`unavailable` for a ``sqlite3`` error only (callers outside this package cannot name them)."""
    return unavailable(exc, path) if isinstance(exc, sqlite3.Error) else None


def unavailable(exc: BaseException, path: str | os.PathLike[str]) -> StateUnavailable | None:
    """``exc`` (a ``sqlite3`` error or an ``OSError`` met using the state database at ``path``) as a
    StateUnavailable saying what is wrong and what to do, or None when it is not such a fault (a lock
    timeout, a bug): the caller re-raises it then."""
    path = Path(path)
    where = path.parent
    readonly_advice = (
        f"make {where} writable, or set PEARL_STATE_DIR to a writable directory on local disk "
        "(`pearlctl status` and `journal` can still read it)"
    )
    full_advice = f"free space on that filesystem (df {where}) and run the command again; the failed write was not made"
    if isinstance(exc, OSError) and not isinstance(exc, sqlite3.Error):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StateUnavailable(str(path), f"the disk holding {where} is full", full_advice)
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return StateUnavailable(str(path), f"cannot write to {where} ({exc.strerror})", readonly_advice)
        return None
    code = _primary(exc)
    message = str(exc)
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT) or "file is not a database" in message:
        return StateUnavailable(
            str(path),
            f"not a pearlctl state database ({message}: corrupted or overwritten)",
            f"move it aside (mv {path} {path}.broken) to start with an empty state, or restore it from a backup",
        )
    if code == sqlite3.SQLITE_FULL or "database or disk is full" in message:
        return StateUnavailable(str(path), f"the disk holding {where} is full", full_advice)
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM, sqlite3.SQLITE_IOERR):
        if _disk_full(where):
            return StateUnavailable(str(path), f"the disk holding {where} is full ({message})", full_advice)
        if not _writable(where):
            return StateUnavailable(str(path), f"the state directory {where} is read-only ({message})", readonly_advice)
        if path.exists() and not os.access(path, os.W_OK):
            return StateUnavailable(str(path), f"the file is read-only ({message})", readonly_advice)
        if code == sqlite3.SQLITE_IOERR:
            return StateUnavailable(
                str(path), f"disk I/O error ({message})", "check the disk (dmesg) and run `pearlctl doctor`"
            )
        if code == sqlite3.SQLITE_CANTOPEN:
            return StateUnavailable(
                str(path),
                f"cannot open it ({message})",
                f"check that {where} exists and this user can read and write it",
            )
    return None


def schema_version(conn: sqlite3.Connection) -> int:
    """The migration level recorded in the database (``PRAGMA user_version``)."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(db: Database, path: str) -> None:
    """Apply the migrations ``db`` lacks, each in its own ``BEGIN IMMEDIATE`` transaction."""
    conn = db.conn
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read under the write lock: another process may have migrated since we opened.
            found = schema_version(conn)
            if found > SCHEMA_VERSION:
                raise IncompatibleSchema(
                    path, found, SCHEMA_VERSION, "A newer pearlctl wrote it; upgrade pearlctl to use it."
                )
            if found == SCHEMA_VERSION:
                conn.execute("COMMIT")
                return
            # statement by statement, inside this transaction: the migration stays atomic
            db.executescript(MIGRATIONS[found])
            conn.execute(f"PRAGMA user_version = {found + 1}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def plain(value: Any) -> Any:
    """Enum members bind as their value, so a StrEnum stored is the same text as its string."""
    return value.value if isinstance(value, StrEnum) else value


def insert(conn: sqlite3.Connection, table: str, values: Mapping[str, Any]) -> int:
    """INSERT one row (``values`` by column) on ``conn``; its id. The Store's writes and pearlctl.state.node_gpus
    share it."""
    columns = ", ".join(f'"{c}"' for c in values)
    placeholders = ", ".join("?" * len(values))
    cursor = conn.execute(
        f'INSERT INTO "{table}" ({columns}) VALUES ({placeholders})', [plain(v) for v in values.values()]
    )
    return int(cursor.lastrowid or 0)
