"""The watcher folds scheduler records into the allocation state machine (fake backend at the seam)."""

from pathlib import Path

import pytest

from pearlctl.ops.watcher import maybe_sync, sync_run
from pearlctl.slurm.records import JobRecord
from pearlctl.state.store import Store
from tests import factories


class RecordedBackend:
    """Answers polls with whatever the test put in ``records``; counts polls."""

    name = "fake"

    def __init__(self):
        self.records: list[JobRecord] = []
        self.polls = 0

    def poll(self, job_ids):
        self.polls += 1
        return [r for r in self.records if r.job_id in job_ids]


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(tmp_path / "state.db") as s:
        pools = [factories.pool("elastic", "ROLLOUT", nodes=2, gpus_per_node=2, run_id="r-1", partition="preempt")]
        factories.create_run(s, tmp_path, pools, run_id="r-1", spec={"poll_interval_s": 5}, spec_path="r.toml")
        run = s.runs.get("r-1")
        s.set_state("runs", "r-1", expect="CREATED", to="SUBMITTING", event="t", expect_version=run["version"])
        for a in s.fleet.allocations("r-1"):
            s.set_state("allocations", a.id, expect="REQUESTED", to="PENDING", event="submitted", job_id="100")
        run = s.runs.get("r-1")
        s.set_state("runs", "r-1", expect="SUBMITTING", to="ACTIVE", event="t", expect_version=run["version"])
        yield s


def rec(task, state, **kw):
    return JobRecord(job_id="100", array_task_id=task, state=state, **kw)


def states(store):
    return [a.state for a in sorted(store.fleet.allocations("r-1"), key=lambda a: a.array_index)]


def events(store):
    return [(j["entity"], j["event"], j["to_state"]) for j in store.journal.read("r-1") if j["entity"] == "allocations"]


def test_pending_range_then_running_registers_nodes_and_gpus(store):
    backend = RecordedBackend()
    backend.records = [
        JobRecord(job_id="100", array_task_id=None, state="PENDING", reason="Resources", pending_tasks=(0, 1))
    ]
    sync_run(store, backend, "r-1")
    assert states(store) == ["PENDING", "PENDING"]
    assert {a.reason for a in store.fleet.allocations("r-1")} == {"Resources"}
    backend.records = [
        rec(0, "RUNNING", nodes=("gpu1",), gpus={"gpu1": (2, 3)}, start_time=1000.0),
        rec(1, "RUNNING", nodes=("gpu2",), gpus={"gpu2": (0, 1)}, start_time=1000.0),
    ]
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING"]
    gpus = {(g.node, g.idx): (g.role, g.state) for g in store.fleet.gpus("r-1")}
    assert gpus == {
        ("gpu1", 2): ("ROLLOUT", "UP"),
        ("gpu1", 3): ("ROLLOUT", "UP"),
        ("gpu2", 0): ("ROLLOUT", "UP"),
        ("gpu2", 1): ("ROLLOUT", "UP"),
    }


def test_preemption_is_recorded_as_preempting_then_requeued_then_running(store):
    backend = RecordedBackend()
    backend.records = [
        rec(0, "RUNNING", nodes=("gpu1",), start_time=1000.0),
        rec(1, "RUNNING", nodes=("gpu2",), start_time=1000.0),
    ]
    sync_run(store, backend, "r-1")
    backend.records[1] = rec(1, "RUNNING", nodes=("gpu2",), start_time=1000.0, preempt_time=1010.0)
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "PREEMPTING"]
    assert [g.state for g in store.fleet.gpus("r-1") if g.node == "gpu2"] == ["DRAINING", "DRAINING"]
    backend.records[1] = rec(1, "PENDING", reason="BeginTime", restarts=1, preempt_time=1010.0)
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "PENDING"]
    backend.records[1] = rec(1, "RUNNING", nodes=("gpu3",), start_time=1030.0, restarts=1, preempt_time=1010.0)
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING"]
    a1 = [a for a in store.fleet.allocations("r-1") if a.array_index == 1][0]
    assert a1.restarts == 1 and a1.node == "gpu3"
    assert [e for e in events(store) if e[1] in ("preempted", "requeued", "started")][-3:] == [
        ("allocations", "preempted", "PREEMPTING"),
        ("allocations", "requeued", "PENDING"),
        ("allocations", "started", "RUNNING"),
    ]


def test_requeue_missed_between_polls_is_journaled_from_the_restart_count(store):
    backend = RecordedBackend()
    backend.records = [
        rec(0, "RUNNING", nodes=("gpu1",), start_time=1000.0),
        rec(1, "RUNNING", nodes=("gpu2",), start_time=1000.0),
    ]
    sync_run(store, backend, "r-1")
    backend.records[0] = rec(0, "RUNNING", nodes=("gpu4",), start_time=1050.0, restarts=1, preempt_time=1010.0)
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING"]
    tail = [e[1] for e in events(store)][-2:]
    assert tail == ["requeued", "started"]


def test_vanished_jobs_become_lost_and_ended_jobs_end_the_run(store):
    backend = RecordedBackend()
    backend.records = [rec(0, "RUNNING", nodes=("gpu1",)), rec(1, "COMPLETED", exit_code="0:0")]
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "ENDED"]
    backend.records = [rec(1, "COMPLETED")]
    sync_run(store, backend, "r-1")
    assert states(store) == ["LOST", "ENDED"]
    assert [g.state for g in store.fleet.gpus("r-1") if g.node == "gpu1"] == ["LOST", "LOST"]
    backend.records = [rec(0, "FAILED"), rec(1, "COMPLETED")]
    sync_run(store, backend, "r-1")
    assert states(store) == ["ENDED", "ENDED"]
    assert store.runs.get("r-1")["state"] == "ENDED"


def test_unknown_slurm_state_is_kept_not_crashed_on(store):
    backend = RecordedBackend()
    backend.records = [rec(0, "RUNNING", nodes=("gpu1",)), rec(1, "RUNNING", nodes=("gpu2",))]
    sync_run(store, backend, "r-1")
    backend.records[0] = rec(0, "WEIRD_NEW_STATE", nodes=("gpu1",))
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING"]
    assert ("allocations", "unknown_slurm_state", None) in events(store)


def test_maybe_sync_polls_at_most_once_per_interval_across_holders(store):
    backend = RecordedBackend()
    backend.records = [rec(0, "RUNNING", nodes=("gpu1",)), rec(1, "RUNNING", nodes=("gpu2",))]
    assert maybe_sync(store, backend, store.runs.get("r-1"), holder="shell-a").polled
    for holder in ("shell-a", "shell-b", "shell-c"):
        assert not maybe_sync(store, backend, store.runs.get("r-1"), holder=holder).polled
    assert backend.polls == 1


def test_no_poll_while_a_daemon_holds_the_run(store):
    backend = RecordedBackend()
    assert store.leases.acquire("run:r-1", "daemon", 30.0) is not None
    assert not maybe_sync(store, backend, store.runs.get("r-1"), holder="shell").polled
    assert backend.polls == 0


def test_a_task_added_to_a_pool_is_polled_and_folded_like_a_launched_one(store):
    """An elastic pool's added task is its own one-task array (job 200, task 2): the same poll asks about it,
    a pending record of it (one task, or a range) fits it, its preemption and requeue are recorded, and
    cancelling it alone leaves the launched tasks running."""
    pool_id = store.runs.pools("r-1")[0]["id"]
    added = store.fleet.add_allocation("r-1", pool_id, event="elastic grow", data={"why": "test"})
    assert added.array_index == 2 and added.state == "REQUESTED"
    store.set_state("allocations", added.id, expect="REQUESTED", to="PENDING", event="submitted", job_id="200")
    backend = RecordedBackend()
    launched = [rec(0, "RUNNING", nodes=("gpu1",), start_time=1000.0), rec(1, "RUNNING", nodes=("gpu2",))]
    backend.records = [*launched, JobRecord(job_id="200", array_task_id=None, state="PENDING", pending_tasks=(2,))]
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING", "PENDING"]

    def task2(state, **kw):
        return JobRecord(job_id="200", array_task_id=2, state=state, **kw)

    backend.records = [*launched, task2("RUNNING", nodes=("gpu3",), gpus={"gpu3": (0, 1)}, start_time=1010.0)]
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING", "RUNNING"]
    assert sorted(g.idx for g in store.fleet.gpus("r-1") if g.allocation_id == added.id) == [0, 1]
    backend.records[2] = task2("RUNNING", nodes=("gpu3",), start_time=1010.0, preempt_time=1020.0)
    sync_run(store, backend, "r-1")
    backend.records[2] = task2("PENDING", reason="BeginTime", restarts=1)
    sync_run(store, backend, "r-1")
    backend.records[2] = task2("RUNNING", nodes=("gpu4",), start_time=1050.0, restarts=1)
    sync_run(store, backend, "r-1")
    a2 = store.fleet.allocation(added.id)
    assert (a2.state, a2.node, a2.restarts) == ("RUNNING", "gpu4", 1)
    backend.records[2] = task2("CANCELLED")
    sync_run(store, backend, "r-1")
    assert states(store) == ["RUNNING", "RUNNING", "ENDED"]
    assert store.runs.get("r-1")["state"] == "ACTIVE"
    assert [e[1] for e in events(store) if e[1] in ("started", "preempted", "requeued", "ended")][-5:] == [
        "started",
        "preempted",
        "requeued",
        "started",
        "ended",
    ]


def test_a_pending_task_cancelled_before_it_ran_ends_instead_of_vanishing(store):
    """Slurm 22.05 (measured on the bundled cluster): `scancel 200_2` of a one-task array that never ran
    leaves squeue a record of the whole job (no task id, empty task string, CANCELLED), and sacct shows
    it as `200_[2]`. Both end the task."""
    pool_id = store.runs.pools("r-1")[0]["id"]
    for job_id, record in (
        ("200", JobRecord(job_id="200", array_task_id=None, state="CANCELLED", source="squeue")),
        ("201", JobRecord(job_id="201", array_task_id=None, state="CANCELLED", pending_tasks=(3,), source="sacct")),
    ):
        added = store.fleet.add_allocation("r-1", pool_id)
        store.set_state("allocations", added.id, expect="REQUESTED", to="PENDING", event="submitted", job_id=job_id)
        backend = RecordedBackend()
        backend.records = [rec(0, "RUNNING", nodes=("gpu1",)), rec(1, "RUNNING", nodes=("gpu2",)), record]
        sync_run(store, backend, "r-1")
        a = store.fleet.allocation(added.id)
        assert (a.state, a.slurm_state) == ("ENDED", "CANCELLED"), a
    assert states(store) == ["RUNNING", "RUNNING", "ENDED", "ENDED"]
