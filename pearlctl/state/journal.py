"""The journal part of the Store (``store.journal``): reading the append-only journal.

What it guarantees: reads only (the core appends: every write's journal row, ``Store.journal_event``); rows
come back oldest first with their ``data`` decoded; reads by entity use the journal's entity index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pearlctl.state.core import Core, Row


class Journal:
    """The journal's readers: since an id, by entity and event, when a row entered a state, workers' failures."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def read(self, run_id: str | None = None, since_id: int = 0, limit: int | None = None) -> list[Row]:
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
        return self._core._query(sql, params, table="journal")

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
        return list(reversed(self._core._query(sql, params, table="journal")))

    def entered_at(self, table: str, row_id: int | str, state: str) -> float | None:
        """When the row last moved into ``state`` (the time of its journal row), or None if it never did."""
        rows = self._core._query(
            "SELECT ts FROM journal WHERE entity = ? AND entity_id = ? AND to_state = ? ORDER BY id DESC LIMIT 1",
            (table, str(row_id), str(state)),
        )
        return float(rows[0]["ts"]) if rows else None

    def failure_reasons(self, run_id: str) -> dict[int, str]:
        """Each FAILED worker's reason, as its agent reported it (the ``error`` journaled on its move to FAILED,
        the latest if it failed more than once); workers without one are absent. Reads the journal by entity
        (its index), only for the run's FAILED workers."""
        failed = [
            str(r["id"])
            for r in self._core._query("SELECT id FROM workers WHERE run_id = ? AND state = 'FAILED'", [run_id])
        ]
        if not failed:
            return {}
        rows = self._core._query(
            "SELECT entity_id, data FROM journal WHERE entity = 'workers' AND entity_id IN"
            f" ({', '.join('?' * len(failed))}) AND to_state = 'FAILED' AND json_extract(data, '$.error') IS NOT NULL"
            " ORDER BY id",
            failed,
            table="journal",
        )
        return {int(r["entity_id"]): r["data"]["error"] for r in rows}
