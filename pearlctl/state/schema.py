"""The SQLite schema of the state database, as an ordered list of migrations.

``MIGRATIONS[i]`` takes a database from schema version ``i`` to ``i + 1`` (``PRAGMA user_version``).
Migrations are append-only: once released, a script is never edited; a change is a new script. The
database is the daemon's durable memory (docs/architecture.md), so every table that has a state machine has
``state`` plus a ``version`` that each write bumps (compare-and-set), and the journal refuses UPDATE and
DELETE at the SQL level, not only in Python.

State columns carry no CHECK of their values on purpose: the allowed states live in
``pearlctl.state.machines`` and are enforced by ``Store.set_state``; a CHECK would need a migration for
every new state. JSON columns do carry ``json_valid`` checks.
"""

from __future__ import annotations

from collections.abc import Mapping

MIGRATION_1 = """
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    spec TEXT NOT NULL CHECK (json_valid(spec)),
    spec_path TEXT,
    run_dir TEXT,
    backend TEXT NOT NULL CHECK (backend IN ('slurm', 'local')),
    policy TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    last_poll_at REAL
);

CREATE TABLE pools (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    role TEXT NOT NULL,
    "partition" TEXT,
    nodes INTEGER NOT NULL CHECK (nodes >= 1),
    gpus_per_node INTEGER NOT NULL CHECK (gpus_per_node >= 0),
    job_id TEXT,
    job_name TEXT NOT NULL,
    UNIQUE (run_id, name)
);

-- One row per Slurm array task (array_index) of a pool. Written REQUESTED before sbatch runs, so a
-- crash between sbatch and recording the job id leaves a row recovery can look for (by job name).
CREATE TABLE allocations (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    pool_id INTEGER NOT NULL REFERENCES pools(id),
    array_index INTEGER NOT NULL,
    job_id TEXT,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    slurm_state TEXT,
    reason TEXT,
    node TEXT,
    restarts INTEGER NOT NULL DEFAULT 0,
    preempted_at REAL,
    started_at REAL,
    ended_at REAL,
    updated_at REAL NOT NULL,
    UNIQUE (pool_id, array_index)
);
CREATE INDEX allocations_by_run ON allocations (run_id);
CREATE INDEX allocations_by_job ON allocations (job_id);

CREATE TABLE nodes (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    name TEXT NOT NULL,
    UNIQUE (run_id, name)
);

CREATE TABLE workers (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    allocation_id INTEGER NOT NULL REFERENCES allocations(id),
    role TEXT NOT NULL,
    engine TEXT NOT NULL,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    url TEXT,
    pid INTEGER,
    weight_version TEXT,
    updated_at REAL NOT NULL
);
CREATE INDEX workers_by_run ON workers (run_id);
CREATE INDEX workers_by_allocation ON workers (allocation_id);

-- A GPU is (allocation, device index): a requeued allocation may come back on another node, so the
-- node is a column, not part of the key.
CREATE TABLE gpus (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    allocation_id INTEGER NOT NULL REFERENCES allocations(id),
    node_id INTEGER NOT NULL REFERENCES nodes(id),
    idx INTEGER NOT NULL CHECK (idx >= 0),
    role TEXT NOT NULL,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    borrowed INTEGER NOT NULL DEFAULT 0,
    return_deadline REAL,
    worker_id INTEGER REFERENCES workers(id),
    updated_at REAL NOT NULL,
    UNIQUE (allocation_id, idx)
);
CREATE INDEX gpus_by_run ON gpus (run_id);

CREATE TABLE transitions (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(id),
    kind TEXT NOT NULL,
    from_role TEXT NOT NULL,
    to_role TEXT NOT NULL,
    gpu_ids TEXT NOT NULL CHECK (json_valid(gpu_ids)),
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX transitions_by_run ON transitions (run_id, state);

CREATE TABLE steps (
    id INTEGER PRIMARY KEY,
    transition_id INTEGER NOT NULL REFERENCES transitions(id),
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    idempotency_key TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    detail TEXT CHECK (detail IS NULL OR json_valid(detail)),
    updated_at REAL NOT NULL,
    UNIQUE (transition_id, seq)
);

-- The append-only log of intents, effects and observations. run_id is deliberately not a foreign key:
-- lease events and events about runs that failed to be created are journaled too.
CREATE TABLE journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    run_id TEXT,
    entity TEXT NOT NULL,
    entity_id TEXT NOT NULL,
    event TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT,
    epoch INTEGER,
    data TEXT CHECK (data IS NULL OR json_valid(data))
);
CREATE INDEX journal_by_run ON journal (run_id, id);
CREATE INDEX journal_by_entity ON journal (entity, entity_id, id);
CREATE TRIGGER journal_no_update BEFORE UPDATE ON journal
BEGIN
    SELECT RAISE(ABORT, 'journal is append-only');
END;
CREATE TRIGGER journal_no_delete BEFORE DELETE ON journal
BEGIN
    SELECT RAISE(ABORT, 'journal is append-only');
END;

-- Epochs only ever grow per lease name: a released lease keeps its row (expired), so the next holder
-- gets a higher epoch and every write stamped with an older one is fenced off.
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    expires_at REAL NOT NULL
);
"""

# Agents (one per allocation) and the workers they report. The daemon marks an agent's GPUs and
# workers LOST when its heartbeats stop, whatever Slurm says about the allocation.
MIGRATION_2 = """
ALTER TABLE allocations ADD COLUMN agent_pid INTEGER;
ALTER TABLE allocations ADD COLUMN agent_seen_at REAL;
ALTER TABLE workers ADD COLUMN worker_key TEXT;
ALTER TABLE workers ADD COLUMN gpu_idx TEXT CHECK (gpu_idx IS NULL OR json_valid(gpu_idx));
CREATE UNIQUE INDEX workers_by_key ON workers (allocation_id, worker_key);
"""

# Role transitions: a worker is routable once REGISTER made it so (rollout clients discover routable
# workers); a transition carries its parameters (return deadline, policy); the run carries the trainer's
# last phase report.
MIGRATION_3 = """
ALTER TABLE workers ADD COLUMN routable INTEGER NOT NULL DEFAULT 0;
ALTER TABLE transitions ADD COLUMN detail TEXT CHECK (detail IS NULL OR json_valid(detail));
ALTER TABLE runs ADD COLUMN trainer TEXT CHECK (trainer IS NULL OR json_valid(trainer));
ALTER TABLE runs ADD COLUMN borrow TEXT CHECK (borrow IS NULL OR json_valid(borrow));
ALTER TABLE runs ADD COLUMN rollout TEXT CHECK (rollout IS NULL OR json_valid(rollout));
"""

# The run's engine profile (pearlctl profile): what the planner predicts with.
MIGRATION_4 = """
ALTER TABLE runs ADD COLUMN profile TEXT CHECK (profile IS NULL OR json_valid(profile));
"""

# The host an allocation's agent runs on (its workers' URLs must name it or the allocation's node).
MIGRATION_5 = """
ALTER TABLE allocations ADD COLUMN agent_host TEXT;
"""

# Elastic growth (pearlctl.daemon.elastic): how many tasks the daemon wants a pool to hold, the back-off
# that holds growth after a task was cancelled for pending too long (until when, and its length: the next
# one doubles it), and when the pool asked an allocation to drain before its scancel.
MIGRATION_6 = """
ALTER TABLE pools ADD COLUMN wanted INTEGER CHECK (wanted IS NULL OR wanted >= 0);
ALTER TABLE pools ADD COLUMN backoff_until REAL;
ALTER TABLE pools ADD COLUMN backoff_s REAL;
ALTER TABLE allocations ADD COLUMN drain_requested_at REAL;
"""

# The predictor's running correction (pearlctl.planner.correct): ratios per batch shape, and the batch being
# watched (its prediction, when and on which GPUs it was made).
MIGRATION_7 = """
ALTER TABLE runs ADD COLUMN predictor TEXT CHECK (predictor IS NULL OR json_valid(predictor));
"""

# One daemon for thousands of GPUs: an agent's heartbeat reads only its own allocation's GPUs.
MIGRATION_8 = """
CREATE INDEX gpus_by_allocation ON gpus (allocation_id);
"""

# A worker's cold start as its agent measured it (process start to first healthy answer): the daemon's estimate
# of a start before any START step was journaled (pearlctl.daemon.policy_view, PolicyInputs.costs); and the
# judge's own engine profile (`pearlctl profile --judge`), beside the policy's.
MIGRATION_9 = """
ALTER TABLE workers ADD COLUMN ready_s REAL CHECK (ready_s IS NULL OR ready_s >= 0);
ALTER TABLE runs ADD COLUMN judge_profile TEXT CHECK (judge_profile IS NULL OR json_valid(judge_profile));
"""

# A GPU parks one worker of each model: the policy's (``worker_id``) and the judge's (``parked_judge_id``), so that a
# GPU shifting between them puts the leaving engine to sleep and wakes the other (pearlctl.daemon.effects). A judge
# parked by an older pearlctl in ``worker_id`` moves to its own column.
MIGRATION_10 = """
ALTER TABLE gpus ADD COLUMN parked_judge_id INTEGER REFERENCES workers(id);
UPDATE gpus SET parked_judge_id = worker_id, worker_id = NULL
    WHERE worker_id IN (SELECT id FROM workers WHERE role = 'REWARD');
"""

MIGRATIONS: tuple[str, ...] = (
    MIGRATION_1,
    MIGRATION_2,
    MIGRATION_3,
    MIGRATION_4,
    MIGRATION_5,
    MIGRATION_6,
    MIGRATION_7,
    MIGRATION_8,
    MIGRATION_9,
    MIGRATION_10,
)

SCHEMA_VERSION = len(MIGRATIONS)

# Columns holding JSON text: encoded on write, decoded on read by the Store.
# The runs table's two report columns, named by what writes them: the trainer hook's latest report (phase, wait,
# weights) and the rollout driver's progress. Read as ``run[TRAINER_REPORT]``; written as ``update_fields(...,
# trainer=...)``. (Their names happen to be pool kinds' names; they are columns, not pools.)
TRAINER_REPORT = "trainer"
ROLLOUT_PROGRESS = "rollout"
JSON_COLUMNS: Mapping[str, frozenset[str]] = {
    "runs": frozenset({"spec", TRAINER_REPORT, "borrow", ROLLOUT_PROGRESS, "profile", "predictor", "judge_profile"}),
    "transitions": frozenset({"gpu_ids", "detail"}),
    "workers": frozenset({"gpu_idx"}),
    "steps": frozenset({"detail"}),
    "journal": frozenset({"data"}),
}
