"""Durable state of pearlctl: the only package that touches SQLite (docs/architecture.md, checked by ruff).

- ``machines``: the state enums and their edge tables (pure).
- ``schema``: the migrations that define the tables.
- ``db``: opening a database (pragmas, migrations, read-only connections).
- ``store``: ``Store``, the guarded reads and writes everybody else uses: its core and its parts.
- ``core``: the Store's connection, transactions, guarded writes (compare-and-set, journal, fencing) and cache.
- ``runs``: ``Runs`` (``store.runs``), a run with its pools and nodes.
- ``fleet``: ``Fleet`` (``store.fleet``), allocations, GPUs, workers and a heartbeat's fingerprint.
- ``transitions``: ``Transitions`` (``store.transitions``), role transitions and their steps.
- ``journal``: ``Journal`` (``store.journal``), reading the append-only journal.
- ``leases``: ``Leases`` (``store.leases``), the named, expiring, epoch-numbered locks that fence writes.
- ``node_gpus``: what a registration or a poll says an allocation's GPUs are, planned (pure) and written.
- ``rows``: the typed rows its readers return (transitions, steps, GPUs, workers, allocations).
- ``errors``: what a refused write raises (all ``StateError``).
- ``views``: read-only compositions of state that several readers share (the CLI, the daemon's API).
"""

from pearlctl.state.errors import (
    DuplicateRun,
    DuplicateStep,
    IllegalTransition,
    IncompatibleSchema,
    InvalidWrite,
    NotFound,
    ReadOnlyStore,
    StaleEpoch,
    StaleWrite,
    StateError,
)
from pearlctl.state.machines import (
    MACHINES,
    AllocationState,
    GpuState,
    PoolKind,
    Role,
    RunState,
    StepKind,
    StepState,
    TransitionState,
    WorkerState,
    check_edge,
)
from pearlctl.state.store import Store, run_lease_name

__all__ = [
    "MACHINES",
    "AllocationState",
    "DuplicateRun",
    "DuplicateStep",
    "GpuState",
    "IllegalTransition",
    "IncompatibleSchema",
    "InvalidWrite",
    "NotFound",
    "PoolKind",
    "ReadOnlyStore",
    "Role",
    "RunState",
    "StaleEpoch",
    "StaleWrite",
    "StateError",
    "StepKind",
    "StepState",
    "Store",
    "TransitionState",
    "WorkerState",
    "check_edge",
    "run_lease_name",
]
