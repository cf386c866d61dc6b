"""The Store on real temporary SQLite databases: every edge of every machine walked through
``set_state``, compare-and-set refusals, the append-only journal, migrations, read-only connections,
GPU registration and leases with fencing (clock injected)."""

from __future__ import annotations

import hashlib
import itertools
import sqlite3
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearlctl.state import db as state_db
from pearlctl.state.db import connect
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
)
from pearlctl.state.machines import MACHINES
from pearlctl.state.schema import SCHEMA_VERSION
from pearlctl.state.store import Store, run_lease_name
from tests.conftest import FakeClock

TABLES = tuple(MACHINES)
EDGES = [(table, old, new) for table in TABLES for (old, new) in MACHINES[table].edges]
NON_EDGES = [
    (table, old, new)
    for table in TABLES
    for old in MACHINES[table].states
    for new in MACHINES[table].states
    if (old, new) not in MACHINES[table].edges
]
STATES = [(table, state) for table in TABLES for state in MACHINES[table].states]


_names = itertools.count()


def new_run(store: Store, *, nodes: int = 1, gpus_per_node: int = 2) -> str:
    n = next(_names)
    run_id = f"run-{n:04d}"
    store.runs.create(
        run_id=run_id,
        name=f"name-{n:04d}",
        spec={"model": "tiny", "n": n},
        spec_path=f"/specs/{n}.toml",
        run_dir=f"/runs/{n}",
        backend="local",
        policy="greedy",
        pools=[
            {"name": "trainer", "kind": "trainer", "role": "TRAIN", "nodes": nodes,
             "gpus_per_node": gpus_per_node, "job_name": f"pearl-{n}-trainer", "partition": "gpu"},
        ],
    )  # fmt: skip
    return run_id


def path_to(table: str, state: str) -> list[str]:
    """Shortest list of states from the table's initial state to ``state`` (both included)."""
    m = MACHINES[table]
    parents: dict[str, str | None] = {m.initial: None}
    todo = deque([m.initial])
    while todo:
        cur = todo.popleft()
        for nxt in m.next_states(cur):
            if nxt not in parents:
                parents[nxt] = cur
                todo.append(nxt)
    route = [state]
    while (parent := parents[route[-1]]) is not None:
        route.append(parent)
    return route[::-1]


def new_row(store: Store, table: str) -> int | str:
    """A fresh row of ``table`` in its initial state, created through the Store's own API."""
    run_id = new_run(store)
    if table == "runs":
        return run_id
    allocation_id = store.fleet.allocations(run_id)[0].id
    if table == "allocations":
        return allocation_id
    if table == "workers":
        return store.fleet.add_worker(run_id=run_id, allocation_id=allocation_id, role="ROLLOUT", engine="vllm")
    store.fleet.upsert_node_gpus(run_id, allocation_id, "node-a", [0, 1], "TRAIN")
    gpu_ids = [g.id for g in store.fleet.gpus(run_id)]
    if table == "gpus":
        return gpu_ids[0]
    transition_id = store.transitions.add(
        run_id=run_id, kind="borrow", from_role="TRAIN", to_role="ROLLOUT", gpu_ids=gpu_ids
    )
    if table == "transitions":
        return transition_id
    return store.transitions.add_step(
        transition_id=transition_id, seq=0, kind="OFFLOAD", idempotency_key=f"{transition_id}:0:offload"
    )


def row_in(store: Store, table: str, state: str) -> int | str:
    """A fresh row walked to ``state`` along the shortest path of legal edges (set_state only)."""
    row_id = new_row(store, table)
    route = path_to(table, state)
    for old, new in itertools.pairwise(route):
        store.set_state(table, row_id, expect=old, to=new, event=f"walk.{new.lower()}")
    assert row_of(store, table, row_id)["state"] == state
    return row_id


def row_of(store: Store, table: str, row_id: int | str) -> dict:
    """Any table's row as a dict (a typed row's ``to_dict``): the state-machine cases below walk every table."""
    row = store.get(table, row_id)
    return row if isinstance(row, dict) else row.to_dict()


def last_journal_id(store: Store) -> int:
    rows = store.journal.read()
    return rows[-1]["id"] if rows else 0


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One database for the many per-edge cases; every case works on rows of its own fresh run."""
    with Store.open(tmp_path_factory.mktemp("state") / "state.db") as store:
        yield store


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store.open(tmp_path / "nested" / "state.db", clock=clock) as store:
        yield store


# ---------------------------------------------------------------------------- the whole graph


@pytest.mark.parametrize(("table", "old", "new"), EDGES)
def test_every_edge_writes_row_and_journal(shared: Store, table: str, old: str, new: str) -> None:
    row_id = row_in(shared, table, old)
    before = row_of(shared, table, row_id)
    since = last_journal_id(shared)

    version = shared.set_state(
        table, row_id, expect=old, to=new, event="test.edge", expect_version=before["version"],
        data={"why": "edge walk"},
    )  # fmt: skip

    after = row_of(shared, table, row_id)
    assert (after["state"], after["version"]) == (new, before["version"] + 1) and version == after["version"]
    assert after["updated_at"] >= before["updated_at"]
    (entry,) = shared.journal.read(since_id=since)
    run_id = row_id if table == "runs" else None
    assert entry["entity"] == table and entry["entity_id"] == str(row_id) and entry["event"] == "test.edge"
    assert (entry["from_state"], entry["to_state"]) == (old, new)
    assert entry["data"] == {"why": "edge walk"} and entry["epoch"] is None
    assert run_id is None or entry["run_id"] == run_id


@pytest.mark.parametrize(("table", "old", "new"), NON_EDGES)
def test_every_non_edge_is_refused_and_writes_nothing(shared: Store, table: str, old: str, new: str) -> None:
    row_id = row_in(shared, table, old)
    before = row_of(shared, table, row_id)
    since = last_journal_id(shared)

    with pytest.raises(IllegalTransition) as refused:
        shared.set_state(table, row_id, expect=old, to=new, event="test.non_edge")

    assert refused.value.allowed == tuple(str(s) for s in MACHINES[table].next_states(old))
    assert row_of(shared, table, row_id) == before
    assert shared.journal.read(since_id=since) == []


@pytest.mark.parametrize(("table", "state"), STATES)
def test_every_state_reachable_through_the_store(shared: Store, table: str, state: str) -> None:
    row_id = row_in(shared, table, state)
    route = path_to(table, state)
    assert row_of(shared, table, row_id)["version"] == len(route)
    entries = [e for e in shared.journal.read() if e["entity"] == table and e["entity_id"] == str(row_id)]
    assert [e["to_state"] for e in entries if e["to_state"]] == route  # creation + one row per edge


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=st.sampled_from(TABLES), data=st.data())
def test_random_walks_keep_the_journal_a_faithful_history(shared: Store, table: str, data: st.DataObject) -> None:
    m = MACHINES[table]
    row_id = new_row(shared, table)
    state = m.initial
    for _ in range(data.draw(st.integers(0, 12), label="steps")):
        target = data.draw(st.sampled_from(list(m.states)), label="target")
        if (state, target) in m.edges:
            shared.set_state(table, row_id, expect=state, to=target, event="walk")
            state = target
        else:
            with pytest.raises(IllegalTransition):
                shared.set_state(table, row_id, expect=state, to=target, event="walk")
    row = row_of(shared, table, row_id)
    entries = [e for e in shared.journal.read() if e["entity"] == table and e["entity_id"] == str(row_id)]
    transitions = [e for e in entries if e["to_state"] is not None]
    assert row["state"] == state == transitions[-1]["to_state"]
    assert row["version"] == len(transitions)
    for prev, nxt in itertools.pairwise(transitions):
        assert nxt["from_state"] == prev["to_state"]


# ---------------------------------------------------------------------------- compare-and-set


def test_stale_version_is_refused_and_writes_nothing(store: Store) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    version = store.set_state("allocations", allocation_id, expect="REQUESTED", to="PENDING", event="sbatch")
    before, since = store.fleet.allocation(allocation_id), last_journal_id(store)

    with pytest.raises(StaleWrite) as refused:
        store.set_state(
            "allocations", allocation_id, expect="PENDING", to="RUNNING", event="started",
            expect_version=version - 1, node="n1",
        )  # fmt: skip

    err = refused.value
    assert (err.current_state, err.current_version, err.expected_version) == ("PENDING", version, version - 1)
    assert f"PENDING v{version}" in str(err)
    assert store.fleet.allocation(allocation_id) == before and store.journal.read(since_id=since) == []


def test_wrong_expected_state_is_refused_and_writes_nothing(store: Store) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    before, since = store.fleet.allocation(allocation_id), last_journal_id(store)

    with pytest.raises(StaleWrite, match="expected RUNNING, but it is REQUESTED v1"):
        store.set_state("allocations", allocation_id, expect="RUNNING", to="ENDED", event="ended")

    assert store.fleet.allocation(allocation_id) == before and store.journal.read(since_id=since) == []


def test_set_state_writes_fields_and_journals_them(store: Store, clock: FakeClock) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    clock.advance(5)
    store.set_state(
        "allocations", allocation_id, expect="REQUESTED", to="PENDING", event="sbatch",
        data={"argv": ["sbatch", "x"]}, job_id="123_0", slurm_state="PENDING",
    )  # fmt: skip
    row = store.fleet.allocations(run_id)[0]
    assert (row.job_id, row.slurm_state, row.updated_at, row.pool) == (
        "123_0",
        "PENDING",
        1005.0,
        "trainer",
    )
    assert store.journal.read()[-1]["data"] == {
        "argv": ["sbatch", "x"],
        "fields": {"job_id": "123_0", "slurm_state": "PENDING"},
    }


def test_missing_row_and_bad_fields_are_refused(store: Store) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    with pytest.raises(NotFound):
        store.set_state("allocations", 9999, expect="REQUESTED", to="PENDING", event="x")
    with pytest.raises(InvalidWrite, match="no column nod"):
        store.set_state("allocations", allocation_id, expect="REQUESTED", to="PENDING", event="x", nod="n1")
    for managed in ("state", "version"):
        with pytest.raises(InvalidWrite, match="set_state"):
            store.update_fields("allocations", allocation_id, **{managed: "RUNNING"})
    with pytest.raises(InvalidWrite):
        store.update_fields("journal", 1, event="x")
    with pytest.raises(InvalidWrite):
        store.update_fields("allocations", allocation_id)  # nothing to write
    assert store.fleet.allocation(allocation_id).version == 1


def test_a_gpus_role_is_never_written_without_its_journal_row(store: Store) -> None:
    run_id = new_run(store)
    allocation = store.fleet.allocations(run_id)[0]
    store.fleet.upsert_node_gpus(run_id, allocation.id, "n1", [0], "ROLLOUT")
    (gpu,) = store.fleet.gpus(run_id)
    with pytest.raises(InvalidWrite, match="journal row"):
        store.update_fields("gpus", gpu.id, role="PREFILL")
    assert store.fleet.gpus(run_id)[0].role == "ROLLOUT"
    since = last_journal_id(store)
    store.update_fields("gpus", gpu.id, event="role set", role="PREFILL")
    assert store.fleet.gpus(run_id)[0].role == "PREFILL"
    assert [j["event"] for j in store.journal.read() if j["id"] > since] == ["role set"]


def test_update_fields_bumps_version_and_is_idempotent(store: Store) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    since = last_journal_id(store)

    v = store.update_fields("allocations", allocation_id, event="slurm.seen", job_id="77_0", restarts=1)
    again = store.update_fields("allocations", allocation_id, event="slurm.seen", job_id="77_0", restarts=1)
    quiet = store.update_fields("allocations", allocation_id, node="n9")  # no event: no journal row
    pool_version = store.update_fields("pools", store.runs.pools(run_id)[0]["id"], job_id="77")

    assert (v, again, quiet, pool_version) == (2, 2, 3, None)
    row = store.fleet.allocation(allocation_id)
    assert (row.job_id, row.restarts, row.node, row.state) == ("77_0", 1, "n9", "REQUESTED")
    (entry,) = store.journal.read(since_id=since)
    assert entry["event"] == "slurm.seen" and entry["data"] == {"fields": {"job_id": "77_0", "restarts": 1}}
    assert store.runs.pools(run_id)[0]["job_id"] == "77"
    store.update_fields("runs", run_id, last_poll_at=1234.5)
    assert store.runs.get(run_id)["last_poll_at"] == 1234.5


# ---------------------------------------------------------------------------- runs and reads


def test_create_run_writes_run_pools_allocations_and_journal(store: Store) -> None:
    store.runs.create(
        run_id="r1", name="demo", spec={"pools": {"trainer": 2}}, spec_path="/s.toml", run_dir="/rd",
        backend="slurm", policy="cost-aware",
        pools=[
            {"name": "trainer", "kind": "trainer", "role": "TRAIN", "nodes": 2, "gpus_per_node": 8,
             "job_name": "pearl-demo-trainer"},
            {"name": "spot", "kind": "elastic", "role": "ROLLOUT", "nodes": 3, "gpus_per_node": 4,
             "job_name": "pearl-demo-spot", "partition": "preempt"},
        ],
    )  # fmt: skip
    run = store.runs.get("r1")
    assert (run["state"], run["version"], run["spec"], run["backend"]) == (
        "CREATED",
        1,
        {"pools": {"trainer": 2}},
        "slurm",
    )
    assert store.runs.find("demo") == run == store.runs.find("r1") and store.runs.find("nope") is None
    assert [r["id"] for r in store.runs.all()] == ["r1"]
    pools = store.runs.pools("r1")
    assert [(p["name"], p["partition"], p["job_id"]) for p in pools] == [
        ("trainer", None, None),
        ("spot", "preempt", None),
    ]
    allocations = store.fleet.allocations("r1")
    assert [(a.pool, a.array_index, a.state, a.version) for a in allocations] == [
        ("trainer", 0, "REQUESTED", 1), ("trainer", 1, "REQUESTED", 1),
        ("spot", 0, "REQUESTED", 1), ("spot", 1, "REQUESTED", 1), ("spot", 2, "REQUESTED", 1),
    ]  # fmt: skip
    events = [(e["entity"], e["event"], e["to_state"]) for e in store.journal.read(run_id="r1")]
    assert events[0] == ("runs", "run.created", "CREATED")
    assert events[1:] == [("allocations", "allocation.requested", "REQUESTED")] * 5
    assert len(store.journal.read(run_id="r1", since_id=2, limit=2)) == 2


def test_duplicate_run_and_invalid_pools_write_nothing(store: Store) -> None:
    run_id = new_run(store)
    name = store.runs.get(run_id)["name"]
    since = last_journal_id(store)
    pool = {
        "name": "p",
        "kind": "rollout",
        "role": "ROLLOUT",
        "nodes": 1,
        "gpus_per_node": 1,
        "job_name": "j",
    }
    common: dict[str, Any] = {
        "spec": {},
        "spec_path": None,
        "run_dir": None,
        "backend": "local",
        "policy": None,
    }
    with pytest.raises(DuplicateRun, match=name):
        store.runs.create(run_id="other", name=name, pools=[pool], **common)
    with pytest.raises(DuplicateRun):
        store.runs.create(run_id=run_id, name="fresh", pools=[pool], **common)
    with pytest.raises(InvalidWrite, match="kind"):
        store.runs.create(run_id="x", name="x", pools=[{**pool, "kind": "spot"}], **common)
    with pytest.raises(InvalidWrite, match="role"):
        store.runs.create(run_id="x", name="x", pools=[{**pool, "role": "TRAINER"}], **common)
    with pytest.raises(InvalidWrite, match="missing"):
        store.runs.create(run_id="x", name="x", pools=[{"name": "p"}], **common)
    with pytest.raises(InvalidWrite, match="backend"):
        store.runs.create(run_id="x", name="x", pools=[pool], **{**common, "backend": "k8s"})
    assert [r["id"] for r in store.runs.all()] == [run_id] and store.journal.read(since_id=since) == []
    with pytest.raises(NotFound):
        store.runs.get("x")


def test_workers_transitions_and_steps(store: Store) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    store.fleet.upsert_node_gpus(run_id, allocation_id, "node-a", [0, 1], "TRAIN")
    gpu_ids = [g.id for g in store.fleet.gpus(run_id)]
    worker_id = store.fleet.add_worker(
        run_id=run_id, allocation_id=allocation_id, role="ROLLOUT", engine="vllm", url="http://n:8000"
    )
    transition_id = store.transitions.add(
        run_id=run_id, kind="borrow", from_role="TRAIN", to_role="ROLLOUT", gpu_ids=[gpu_ids[1], gpu_ids[0]]
    )
    step_id = store.transitions.add_step(
        transition_id=transition_id, seq=0, kind="OFFLOAD", idempotency_key="k0", detail={"ranks": [0, 1]}
    )
    assert [(w.id, w.state, w.url) for w in store.fleet.workers(run_id)] == [(worker_id, "STARTING", "http://n:8000")]
    (transition,) = store.transitions.all(run_id)
    assert (transition.state, transition.gpu_ids) == ("PLANNED", tuple(sorted(gpu_ids)))
    assert [(s.id, s.state, s.detail) for s in store.transitions.steps(transition_id)] == [
        (step_id, "INTENT", {"ranks": [0, 1]})
    ]
    store.set_state("steps", step_id, expect="INTENT", to="DONE", event="done", detail={"ranks": [0, 1], "ok": True})
    assert store.transitions.steps(transition_id)[0].detail == {"ranks": [0, 1], "ok": True}
    with pytest.raises(DuplicateStep):
        store.transitions.add_step(transition_id=transition_id, seq=1, kind="RELOAD", idempotency_key="k0")
    with pytest.raises(DuplicateStep):
        store.transitions.add_step(transition_id=transition_id, seq=0, kind="RELOAD", idempotency_key="k1")
    with pytest.raises(InvalidWrite, match="step kind"):
        store.transitions.add_step(transition_id=transition_id, seq=1, kind="REBOOT", idempotency_key="k1")
    with pytest.raises(InvalidWrite, match="no GPUs"):
        store.transitions.add(run_id=run_id, kind="borrow", from_role="TRAIN", to_role="ROLLOUT", gpu_ids=[999])
    store.set_state("transitions", transition_id, expect="PLANNED", to="RUNNING", event="go")
    store.set_state("transitions", transition_id, expect="RUNNING", to="DONE", event="done")
    with pytest.raises(InvalidWrite, match="DONE"):
        store.transitions.add_step(transition_id=transition_id, seq=1, kind="VERIFY", idempotency_key="k1")


def test_transition_and_step_queries_read_only_what_is_asked(store: Store) -> None:
    runs = [new_run(store), new_run(store)]
    gpu = {}
    for run_id in runs:
        allocation_id = store.fleet.allocations(run_id)[0].id
        store.fleet.upsert_node_gpus(run_id, allocation_id, "node-a", [0], "TRAIN")
        gpu[run_id] = store.fleet.gpus(run_id)[0].id
    made: dict[str, list[int]] = {r: [] for r in runs}
    for i in range(8):  # per run: borrow, return, borrow, ... ; every step DONE but the last transition's
        for run_id in runs:
            kind = ("borrow", "return")[i % 2]
            roles = ("TRAIN", "ROLLOUT")[:: 1 if kind == "borrow" else -1]
            tid = store.transitions.add(
                run_id=run_id, kind=kind, from_role=roles[0], to_role=roles[1], gpu_ids=[gpu[run_id]]
            )
            made[run_id].append(tid)
            store.set_state("transitions", tid, expect="PLANNED", to="RUNNING", event="go")
            for seq, step in enumerate(("OFFLOAD", "START") if kind == "borrow" else ("STOP", "RELOAD")):
                sid = store.transitions.add_step(
                    transition_id=tid, seq=seq, kind=step, idempotency_key=f"{run_id}:{tid}:{seq}"
                )
                if i < 7:
                    store.set_state("steps", sid, expect="INTENT", to="DONE", event="done")
            if i < 7:
                store.set_state("transitions", tid, expect="RUNNING", to="DONE", event="done")
    a, b = runs
    assert [t.id for t in store.transitions.all(a)] == made[a]  # the whole history, oldest first
    assert [t.id for t in store.transitions.open(a)] == made[a][-1:]
    assert [t.id for t in store.transitions.all(a, states=("DONE",), kind="borrow", last=2)] == made[a][4:7:2]
    assert [t.id for t in store.transitions.all(a, last=3)] == made[a][-3:]
    assert store.transitions.all(a, kind="switch") == []
    step = store.transitions.step_by_key(a, f"{a}:{made[a][0]}:1")
    assert (step.transition_id, step.kind) == (made[a][0], "START")
    assert store.transitions.step_by_key(b, f"{a}:{made[a][0]}:1") is None  # another run's key is not this run's step
    recent = store.transitions.recent_steps(a, state="DONE", per_kind=2)
    assert [(s.kind, s.transition_id) for s in recent] == sorted(
        [(k, t) for k, ts in (("OFFLOAD", made[a][4:7:2]), ("START", made[a][4:7:2]),
                              ("STOP", made[a][3:6:2]), ("RELOAD", made[a][3:6:2])) for t in ts],
        key=lambda kt: next(s.id for s in store.transitions.steps(kt[1]) if s.kind == kt[0]),
    )  # fmt: skip
    assert all(s.state == "DONE" for s in recent)


# ---------------------------------------------------------------------------- node and GPU registration


def test_upsert_node_gpus(store: Store) -> None:
    run_id = new_run(store, nodes=2)
    a0, a1 = (a.id for a in store.fleet.allocations(run_id))
    store.fleet.upsert_node_gpus(run_id, a0, "node-a", [0, 1, 2], "TRAIN")
    since = last_journal_id(store)
    store.fleet.upsert_node_gpus(run_id, a0, "node-a", [2, 1, 0], "TRAIN")
    assert store.journal.read(since_id=since) == []  # idempotent

    def view() -> list[tuple[Any, ...]]:
        return [(g.allocation_id, g.node, g.idx, g.state, g.role) for g in store.fleet.gpus(run_id)]

    store.fleet.upsert_node_gpus(run_id, a0, "node-a", [0, 1], "TRAIN")  # index 2 disappeared
    assert view() == [
        (a0, "node-a", 0, "UP", "TRAIN"),
        (a0, "node-a", 1, "UP", "TRAIN"),
        (a0, "node-a", 2, "GONE", "TRAIN"),
    ]

    gpu1, gpu2 = store.fleet.gpus(run_id)[1:]
    store.update_fields("gpus", gpu1.id, event="role set", role="ROLLOUT", borrowed=1, return_deadline=2000.0)
    store.set_state("gpus", gpu1.id, expect="UP", to="LOST", event="heartbeat.missed")
    # a GPU that went while lent (its job preempted and requeued): the lending ended with the allocation
    store.update_fields("gpus", gpu2.id, event="role set", role="ROLLOUT", borrowed=1, return_deadline=2000.0)
    # requeued elsewhere: 0 moves, 1 comes back from LOST keeping its borrowed role, 2 comes back fresh
    store.fleet.upsert_node_gpus(run_id, a0, "node-b", [0, 1, 2], "TRAIN")
    assert view() == [
        (a0, "node-b", 0, "UP", "TRAIN"),
        (a0, "node-b", 1, "UP", "ROLLOUT"),
        (a0, "node-b", 2, "UP", "TRAIN"),
    ]
    lending = [(g.borrowed, g.return_deadline) for g in store.fleet.gpus(run_id)]
    assert lending == [(0, None), (1, 2000.0), (0, None)]  # the fresh one is no longer lent
    events = [e["event"] for e in store.journal.read(since_id=since) if e["entity"] == "gpus"]
    assert events.count("gpu.moved") == 1 and events.count("gpu.gone") == 1

    store.fleet.upsert_node_gpus(run_id, a1, "node-c", [0], "TRAIN")
    assert [n["name"] for n in store.runs.nodes(run_id)] == ["node-a", "node-b", "node-c"]
    with pytest.raises(NotFound):
        store.fleet.upsert_node_gpus("run-other", a1, "node-c", [0], "TRAIN")
    with pytest.raises(InvalidWrite):
        store.fleet.upsert_node_gpus(run_id, a1, "node-c", [0, 0], "TRAIN")
    with pytest.raises(InvalidWrite):
        store.fleet.upsert_node_gpus(run_id, a1, "node-c", [0], "GPU")


# ---------------------------------------------------------------------------- the journal, schema, read-only


def test_journal_is_append_only_in_sql(store: Store, tmp_path: Path) -> None:
    journal_id = store.journal_event(None, "daemon", "d1", "daemon.started", data={"pid": 1}, epoch=3)
    assert store.journal.read()[-1] == {
        "id": journal_id, "ts": 1000.0, "run_id": None, "entity": "daemon", "entity_id": "d1",
        "event": "daemon.started", "from_state": None, "to_state": None, "epoch": 3, "data": {"pid": 1},
    }  # fmt: skip
    raw = sqlite3.connect(tmp_path / "nested" / "state.db")
    try:
        with pytest.raises(sqlite3.IntegrityError, match="journal is append-only"):
            raw.execute("UPDATE journal SET event = 'forged'")
        with pytest.raises(sqlite3.IntegrityError, match="journal is append-only"):
            raw.execute("DELETE FROM journal")
    finally:
        raw.close()
    assert store.journal.read()[-1]["event"] == "daemon.started"


def test_connect_sets_pragmas_and_migrates_once(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.db"
    db = connect(path)
    pragmas = {p: db.conn.execute(f"PRAGMA {p}").fetchone()[0] for p in
               ("journal_mode", "synchronous", "foreign_keys", "busy_timeout", "user_version")}  # fmt: skip
    assert pragmas == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1, "busy_timeout": 10000,
                       "user_version": SCHEMA_VERSION}  # fmt: skip
    db.close()
    db = connect(path)  # second open: nothing to migrate, nothing fails
    assert {"runs", "pools", "allocations", "nodes", "gpus", "workers", "transitions", "steps", "journal",
            "leases"} <= set(db.table_names())  # fmt: skip
    db.close()


def test_schema_from_newer_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    connect(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    raw.close()
    for readonly in (False, True):
        with pytest.raises(IncompatibleSchema, match=rf"(?i)schema version {SCHEMA_VERSION + 5}.*upgrade pearlctl"):
            Store.open(path, readonly=readonly)


def test_failed_migration_leaves_previous_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.db"
    connect(path).close()
    broken = "CREATE TABLE half_done (x INTEGER);\nINSERT INTO no_such_table VALUES (1);\n"
    monkeypatch.setattr(state_db, "MIGRATIONS", (*state_db.MIGRATIONS, broken))
    monkeypatch.setattr(state_db, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        connect(path)
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert raw.execute("SELECT count(*) FROM sqlite_master WHERE name = 'half_done'").fetchone()[0] == 0
    finally:
        raw.close()


def test_readonly_store_reads_and_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with Store.open(path) as writer:
        run_id = new_run(writer)
        allocation_id = writer.fleet.allocations(run_id)[0].id
    digest = hashlib.sha256(path.read_bytes()).hexdigest()

    with Store.open(path, readonly=True) as reader:
        assert reader.runs.get(run_id)["state"] == "CREATED" and len(reader.fleet.allocations(run_id)) == 1
        with pytest.raises(ReadOnlyStore):
            reader.set_state("allocations", allocation_id, expect="REQUESTED", to="PENDING", event="x")
        with pytest.raises(ReadOnlyStore):
            reader.update_fields("allocations", allocation_id, node="n")
        with pytest.raises(ReadOnlyStore):
            reader.leases.acquire("run:x", "me", 10)
        with pytest.raises(ReadOnlyStore):
            reader.journal_event(run_id, "runs", run_id, "x")
    ro = connect(path, readonly=True)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ro.conn.execute("INSERT INTO leases VALUES ('x', 'y', 1, 1.0)")
    finally:
        ro.close()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    with Store.open(path, readonly=True) as reader:
        assert reader.runs.find(run_id) is not None
        assert reader.health() == {
            "integrity": "ok", "journal_mode": "wal", "schema_version": SCHEMA_VERSION, "runs": 1,
            "journal_rows": 2,
        }  # fmt: skip

    missing = tmp_path / "missing" / "state.db"
    with pytest.raises(NotFound):
        Store.open(missing, readonly=True)
    assert not missing.parent.exists()


# ---------------------------------------------------------------------------- leases and fencing


def test_lease_acquire_renew_takeover_release(store: Store, clock: FakeClock) -> None:
    name = "daemon"
    assert store.leases.acquire(name, "a", ttl_s=10) == 1
    assert store.leases.acquire(name, "b", ttl_s=10) is None
    clock.advance(5)
    assert store.leases.acquire(name, "a", ttl_s=10) == 1  # same holder: renewed, same epoch
    assert store.leases.get(name) == {"name": name, "holder": "a", "epoch": 1, "expires_at": 1015.0}
    clock.advance(9)
    assert store.leases.renew(name, "a", 1, ttl_s=10) is True
    assert store.leases.renew(name, "b", 1, ttl_s=10) is False
    assert store.leases.renew(name, "a", 0, ttl_s=10) is False
    clock.advance(10)  # expires_at == now: expired
    assert store.leases.renew(name, "a", 1, ttl_s=10) is False  # lapsed: must acquire again
    assert store.leases.acquire(name, "b", ttl_s=10) == 2  # takeover bumps the epoch
    assert store.leases.acquire(name, "a", ttl_s=10) is None
    store.leases.release(name, "a")  # not the holder: no effect
    assert store.leases.get(name)["holder"] == "b" and store.leases.acquire(name, "a", ttl_s=10) is None
    store.leases.release(name, "b")
    assert store.leases.acquire(name, "b", ttl_s=10) == 3  # epochs never go back, even for the same holder
    assert store.leases.get("nope") is None
    events = [(e["event"], e["epoch"]) for e in store.journal.read() if e["entity"] == "leases"]
    assert events == [
        ("lease.acquired", 1),
        ("lease.acquired", 2),
        ("lease.released", None),
        ("lease.acquired", 3),
    ]


def test_epoch_fencing(store: Store, clock: FakeClock) -> None:
    run_id = new_run(store)
    allocation_id = store.fleet.allocations(run_id)[0].id
    # no lease yet: the epoch is only recorded
    store.set_state("allocations", allocation_id, expect="REQUESTED", to="PENDING", event="sbatch", epoch=7)
    assert store.journal.read()[-1]["epoch"] == 7

    lease = run_lease_name(run_id)
    old = store.leases.acquire(lease, "daemon-1", ttl_s=30)
    clock.advance(31)
    new = store.leases.acquire(lease, "daemon-2", ttl_s=30)
    assert (old, new) == (1, 2)
    before, since = store.fleet.allocation(allocation_id), last_journal_id(store)

    with pytest.raises(StaleEpoch, match="epoch 2.*epoch 1") as refused:
        store.set_state("allocations", allocation_id, expect="PENDING", to="RUNNING", event="started", epoch=old)
    assert (refused.value.epoch, refused.value.current_epoch) == (1, 2)
    with pytest.raises(StaleEpoch):
        store.update_fields("allocations", allocation_id, node="n1", epoch=old)
    with pytest.raises(StaleEpoch):
        store.fleet.add_worker(run_id=run_id, allocation_id=allocation_id, role="ROLLOUT", engine="vllm", epoch=old)
    with pytest.raises(StaleEpoch):
        store.fleet.upsert_node_gpus(run_id, allocation_id, "n1", [0], "TRAIN", epoch=old)
    assert store.fleet.allocation(allocation_id) == before and store.journal.read(since_id=since) == []

    store.set_state("allocations", allocation_id, expect="PENDING", to="RUNNING", event="started", epoch=new)
    assert store.journal.read()[-1]["epoch"] == new


# -- atomic: several guarded writes, one commit ---------------------------------------------------------------
def _gpu_states(store: Store, run_id: str) -> list[str]:
    return [g.state for g in store.fleet.gpus(run_id)]


def test_atomic_commits_its_writes_once_and_together(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    run_id = new_run(store)
    alloc = store.fleet.allocations(run_id)[0].id
    store.fleet.upsert_node_gpus(run_id, alloc, "node-a", [0, 1], "TRAIN")
    gpus = store.fleet.gpus(run_id)
    outside = Store.open(tmp_path / "state.db", readonly=True)
    commits = store.commits_on_this_thread()[0]
    with store.atomic():
        for g in gpus:
            store.set_state("gpus", g.id, expect=g.state, to="DRAINING", event="drain")
            # this thread reads its own writes at once (the cached whole-run read is refreshed)...
        assert _gpu_states(store, run_id) == ["DRAINING", "DRAINING"]
        # ...another connection sees none of them before the block ends
        assert _gpu_states(outside, run_id) == [g.state for g in gpus]
        assert store.commits_on_this_thread()[0] == commits
    assert store.commits_on_this_thread()[0] == commits + 1
    assert _gpu_states(outside, run_id) == ["DRAINING", "DRAINING"]
    assert [j["event"] for j in store.journal.read(run_id)][-2:] == ["drain", "drain"]  # each write still journals
    outside.close()
    store.close()


def test_a_refused_write_inside_atomic_undoes_only_itself(store: Store) -> None:
    run_id = new_run(store)
    alloc = store.fleet.allocations(run_id)[0].id
    store.fleet.upsert_node_gpus(run_id, alloc, "node-a", [0, 1], "TRAIN")
    first, second = store.fleet.gpus(run_id)
    with store.atomic():
        store.set_state("gpus", first.id, expect=first.state, to="DRAINING", event="drain")
        with pytest.raises(StaleWrite):
            store.set_state("gpus", second.id, expect="DRAINING", to="GONE", event="gone")
        with store.atomic():  # a nested block joins the outer one
            store.set_state("gpus", second.id, expect=second.state, to="DRAINING", event="drain")
    assert _gpu_states(store, run_id) == ["DRAINING", "DRAINING"]
    assert "gone" not in [j["event"] for j in store.journal.read(run_id)]


def test_an_error_leaving_atomic_rolls_every_write_back(store: Store) -> None:
    run_id = new_run(store)
    alloc = store.fleet.allocations(run_id)[0].id
    store.fleet.upsert_node_gpus(run_id, alloc, "node-a", [0, 1], "TRAIN")
    before, journal = _gpu_states(store, run_id), len(store.journal.read(run_id))
    with pytest.raises(RuntimeError, match="midway"), store.atomic():
        for g in store.fleet.gpus(run_id):
            store.set_state("gpus", g.id, expect=g.state, to="DRAINING", event="drain")
        assert _gpu_states(store, run_id) == ["DRAINING", "DRAINING"]  # read, and cached, inside the block
        raise RuntimeError("midway")
    assert _gpu_states(store, run_id) == before  # not the rows cached inside the rolled-back block
    assert len(store.journal.read(run_id)) == journal
    store.set_state(
        "gpus", store.fleet.gpus(run_id)[0].id, expect=before[0], to="DRAINING", event="drain"
    )  # writable again


def test_an_atomic_block_that_writes_nothing_is_not_counted_as_a_commit(store: Store) -> None:
    seen: list[float] = []
    store.on_commit = seen.append
    commits = store.commits_on_this_thread()[0]
    with store.atomic():
        pass
    assert store.commits_on_this_thread()[0] == commits and seen == []
    run_id = new_run(store)  # the store is writable after it
    assert store.runs.get(run_id)["id"] == run_id


def test_a_judge_parked_by_an_older_pearlctl_moves_to_its_own_place(tmp_path: Path, monkeypatch) -> None:
    """Schema version 10 parks one worker per model: a judge an older database parked in ``gpus.worker_id`` moves to
    ``parked_judge_id``; a parked policy worker stays where it was."""
    from tests import factories

    path = tmp_path / "state.db"
    monkeypatch.setattr(state_db, "MIGRATIONS", state_db.MIGRATIONS[:9])
    monkeypatch.setattr(state_db, "SCHEMA_VERSION", 9)
    with Store.open(path) as old:
        factories.create_run(old, tmp_path, [factories.pool("rollout", "ROLLOUT", gpus_per_node=2)])
        alloc = old.fleet.allocations("r")[0]
        factories.submit(old, alloc.id, "8")
        factories.start(old, alloc.id, "gpu2")
        old.fleet.upsert_node_gpus("r", alloc.id, "gpu2", [0, 1], "IDLE")
        judge = old.fleet.add_worker(run_id="r", allocation_id=alloc.id, role="REWARD", engine="vllm")
        policy = old.fleet.add_worker(run_id="r", allocation_id=alloc.id, role="ROLLOUT", engine="vllm")
        g0, g1 = sorted(old.fleet.gpus("r"), key=lambda g: g.idx)
        old.update_fields("gpus", g0.id, worker_id=judge)
        old.update_fields("gpus", g1.id, worker_id=policy)
    monkeypatch.undo()
    with Store.open(path) as new:
        g0, g1 = sorted(new.fleet.gpus("r"), key=lambda g: g.idx)
        assert (g0.worker_id, g0.parked_judge_id, g0.parked_for("REWARD")) == (None, judge, judge)
        assert (g1.worker_id, g1.parked_judge_id, g1.parked_for("ROLLOUT")) == (policy, None, policy)
