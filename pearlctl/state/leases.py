"""Leases: named, expiring, epoch-numbered locks (the daemon's hold on a run, the decision lock).

What it guarantees (docs/architecture.md, "State"): every lease change is one write transaction of the
Store's core with its journal row (bookkeeping renewals aside); epochs only grow, so a holder whose lease
lapsed is fenced by the core's ``_fence`` (pearlctl/state/core.py), which reads the same ``leases`` table;
``break_held`` is compare-and-set on holder and epoch. Reached as ``store.leases``; it shares the core's
connection, lock and clock.
"""

from __future__ import annotations

from typing import Any

from pearlctl.state.core import Core

Row = dict[str, Any]


def _lease_run(name: str) -> str | None:
    return name.removeprefix("run:") if name.startswith("run:") else None


class Leases:
    """The lease table's writes and read, inside the core's transactions."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def acquire(self, name: str, holder: str, ttl_s: float) -> int | None:
        """Take the lease; returns its epoch, or None while another holder's lease is unexpired.

        The same holder re-acquiring an unexpired lease renews it and keeps its epoch. An expired lease
        (whoever held it) is taken over with epoch + 1, so a holder that lapsed learns it was presumed
        dead: its old epoch is fenced.
        """
        with self._core._write() as conn:
            now = self._core._clock()
            row = conn.execute("SELECT holder, epoch, expires_at FROM leases WHERE name = ?", (name,)).fetchone()
            if row is not None and row[2] > now:
                if row[0] != holder:
                    return None
                conn.execute("UPDATE leases SET expires_at = ? WHERE name = ?", (now + ttl_s, name))
                return int(row[1])
            epoch = 1 if row is None else int(row[1]) + 1
            conn.execute(
                "INSERT INTO leases (name, holder, epoch, expires_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, epoch = excluded.epoch,"
                " expires_at = excluded.expires_at",
                (name, holder, epoch, now + ttl_s),
            )
            previous = None if row is None else row[0]
            self._core._journal(
                conn,
                now,
                _lease_run(name),
                "leases",
                name,
                "lease.acquired",
                epoch=epoch,
                data={"holder": holder, "previous_holder": previous},
            )
            return epoch

    def renew(self, name: str, holder: str, epoch: int, ttl_s: float) -> bool:
        """Extend an unexpired lease this holder has at this epoch; False if it lapsed or changed hands.
        Bookkeeping (``_write``): a renewal changes nothing a decision or a cached read derives from."""
        with self._core._write(bookkeeping=True) as conn:
            now = self._core._clock()
            renewed = conn.execute(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND epoch = ? AND expires_at > ?",
                (now + ttl_s, name, holder, epoch, now),
            ).rowcount
            return renewed == 1

    def release(self, name: str, holder: str) -> None:
        """Expire the lease now if ``holder`` has it. The row (and its epoch) stays, so epochs only grow."""
        with self._core._write() as conn:
            now = self._core._clock()
            released = conn.execute(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND expires_at > ?",
                (now, name, holder, now),
            ).rowcount
            if released:
                self._core._journal(
                    conn, now, _lease_run(name), "leases", name, "lease.released", data={"holder": holder}
                )

    def break_held(self, name: str, holder: str, epoch: int, why: str) -> bool:
        """Expire the lease now if ``holder`` still has it at ``epoch`` — for a holder known to be dead
        (its process is gone). Compare-and-set: a lease renewed or taken meanwhile is left alone."""
        with self._core._write() as conn:
            now = self._core._clock()
            broken = conn.execute(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND epoch = ? AND expires_at > ?",
                (now, name, holder, epoch, now),
            ).rowcount
            if broken:
                self._core._journal(
                    conn, now, _lease_run(name), "leases", name, "lease.broken", data={"holder": holder, "why": why}
                )
            return broken == 1

    def get(self, name: str) -> Row | None:
        rows = self._core._query("SELECT * FROM leases WHERE name = ?", (name,))
        return rows[0] if rows else None
