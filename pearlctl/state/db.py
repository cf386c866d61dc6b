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
  migrates, and refuses a database that is not exactly at ``SCHEMA_VERSION``.

Connections use ``isolation_level=None``: the sqlite3 driver never opens transactions by itself, so the
Store's explicit ``BEGIN IMMEDIATE`` ... ``COMMIT`` is the whole truth about transaction boundaries.
The database belongs on the head node's local disk (design.md §2): WAL needs shared memory that
network filesystems do not provide, which is why a failed switch to WAL is an error, not a warning.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from sqlite_utils import Database

from pearlctl.state.errors import IncompatibleSchema, NotFound, StateError
from pearlctl.state.schema import MIGRATIONS, SCHEMA_VERSION

BUSY_TIMEOUT_MS = 10_000


def connect(path: str | os.PathLike[str], *, readonly: bool = False) -> Database:
    """Open (creating and migrating if needed) the state database at ``path``."""
    path = Path(path)
    if readonly:
        return _connect_readonly(path)
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
        db = Database(conn, execute_plugins=False)
        migrate(db, str(path))
    except BaseException:
        conn.close()
        raise
    return db


def _connect_readonly(path: Path) -> Database:
    if not path.exists():
        raise NotFound(f"no state database at {path}")
    conn = sqlite3.connect(
        f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
    )
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
        db = Database(conn, execute_plugins=False)
    except BaseException:
        conn.close()
        raise
    return db


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
            # Inside an open transaction sqlite-utils runs the script statement by statement, without
            # sqlite3.executescript's implicit COMMIT, so the migration stays atomic.
            db.executescript(MIGRATIONS[found])
            conn.execute(f"PRAGMA user_version = {found + 1}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
