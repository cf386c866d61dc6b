"""The Store: every read and write of pearlctl's durable state, one object with a part per concern.

``Store.open(path)`` gives the core (pearlctl/state/core.py: transactions, ``set_state``, ``update_fields``,
``journal_event``, ``get``, ``generation``, ``atomic``) and its parts, each a module of this package:

- ``store.runs`` (runs.py): a run with its pools and nodes;
- ``store.fleet`` (fleet.py): allocations, GPUs, workers, and a heartbeat's fingerprint of an allocation;
- ``store.transitions`` (transitions.py): role transitions and their steps;
- ``store.journal`` (journal.py): reading the journal;
- ``store.leases`` (leases.py): the named, expiring, epoch-numbered locks that fence writes.

What it guarantees is the core's, for every part alike (docs/architecture.md, "State"): one transaction per
write with its journal row, compare-and-set state changes, fencing by the run lease's epoch, idempotent
observations, and a read-only store that never writes. Reads of transitions, steps, GPUs, workers and
allocations return typed rows (pearlctl/state/rows.py); the other tables' reads return dicts. One ``Store`` may
be shared by threads.
"""

from __future__ import annotations

import time

from pearlctl.state.core import Clock, Core, run_lease_name
from pearlctl.state.db import Database
from pearlctl.state.fleet import Fleet
from pearlctl.state.journal import Journal
from pearlctl.state.leases import Leases
from pearlctl.state.runs import Runs
from pearlctl.state.transitions import Transitions

__all__ = ["Store", "run_lease_name"]


class Store(Core):
    """Typed access to the state database. Open with ``Store.open(path)``; close or use as a context."""

    def __init__(self, db: Database, *, readonly: bool = False, clock: Clock = time.time) -> None:
        super().__init__(db, readonly=readonly, clock=clock)
        self.runs = Runs(self)
        self.fleet = Fleet(self)
        self.transitions = Transitions(self)
        self.journal = Journal(self)
        self.leases = Leases(self)

    def close(self) -> None:
        with self._lock:
            self.fleet.close()
            super().close()
