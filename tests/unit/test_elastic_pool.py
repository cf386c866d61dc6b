"""The elastic pool (pearlctl.daemon.elastic) against a fake cluster at the one seam, the Backend: growth
within [nodes, max_nodes], crash safety between sbatch and the state write, the pending bound with its
back-off, drain before scancel, requeues, and the status view. State is a real SQLite store, the watcher
folds the fake cluster's answers as it folds Slurm's, and the clock is the test's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.backends import BackendError
from pearlctl.config import parse_spec
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.elastic import ElasticPool
from pearlctl.daemon.elastic_grow import SUBMIT_SETTLE_S
from pearlctl.daemon.elastic_state import elastic_view
from pearlctl.ops.launcher import cancel, grow_request, launch
from pearlctl.ops.watcher import sync_run
from pearlctl.slurm.client import SlurmClient
from pearlctl.slurm.records import JobRecord
from pearlctl.slurm.runner import CommandResult
from pearlctl.slurm.script import render_script
from pearlctl.state.store import Store

NODES, MAX_NODES, PENDING_S, NOTICE_S = 1, 3, 60.0, 20


class Crash(BaseException):
    """The daemon dies here (a BaseException, so nothing in pearlctl catches it)."""


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class FakeCluster:
    """A Slurm that runs at most ``capacity`` elastic tasks (others wait PENDING); the trainer always runs."""

    name = "slurm"

    def __init__(self, clock: Clock, capacity: int = 10):
        self.clock, self.capacity = clock, capacity
        self.tasks: dict[tuple[str, int], dict] = {}
        self.next_id = 100
        self.scripts: list[str] = []
        self.cancelled_tasks: list[tuple[str, int]] = []
        self.crash: str | None = None  # "before" or "after" an sbatch
        self.fail: str | None = None  # an sbatch error

    def submit(self, req, script):
        if self.crash == "before":
            self.crash = None
            raise Crash()
        if self.fail:
            raise BackendError(self.fail)
        job_id = str(self.next_id)
        self.next_id += 1
        for t in range(req.first_task, req.first_task + req.array_size):
            self.tasks[(job_id, t)] = {"name": req.job_name, "state": "PENDING", "restarts": 0}
        self.scripts.append(script)
        self.schedule()
        if self.crash == "after":
            self.crash = None
            raise Crash()
        return job_id

    def add(self, name: str, task: int = 7) -> str:
        """A task submitted behind pearlctl's back under ``name`` (or by a crashed daemon)."""
        job_id = str(self.next_id)
        self.next_id += 1
        self.tasks[(job_id, task)] = {"name": name, "state": "PENDING", "restarts": 0}
        self.schedule()
        return job_id

    def schedule(self) -> None:
        busy = sum(1 for t in self.tasks.values() if t["state"] == "RUNNING" and t["name"].endswith(".elastic"))
        for (_, task), t in sorted(self.tasks.items()):
            if t["state"] != "PENDING":
                continue
            if t["name"].endswith(".elastic"):
                if busy >= self.capacity:
                    continue
                busy += 1
            t.update(state="RUNNING", node=f"gpu{len(self.tasks)}_{task}", start=self.clock())

    def record(self, key, t) -> JobRecord:
        running = t["state"] == "RUNNING"
        return JobRecord(
            job_id=key[0],
            array_task_id=key[1],
            state=t["state"],
            name=t["name"],
            nodes=(t["node"],) if running else (),
            gpus={t["node"]: (0, 1)} if running else {},
            restarts=t["restarts"],
            preempt_time=t.get("preempt"),
            start_time=t.get("start") if running else None,
            reason="Resources" if t["state"] == "PENDING" else "",
        )

    def find_by_name(self, name):
        return [self.record(k, t) for k, t in self.tasks.items() if t["name"] == name]

    def poll(self, job_ids):
        return [self.record(k, t) for k, t in self.tasks.items() if k[0] in job_ids]

    def cancel(self, job_ids):
        for (job_id, _), t in self.tasks.items():
            if job_id in job_ids and t["state"] in ("PENDING", "RUNNING"):
                t["state"] = "CANCELLED"
        self.schedule()

    def cancel_tasks(self, tasks):
        self.cancelled_tasks += tasks
        for key in tasks:
            if self.tasks[key]["state"] in ("PENDING", "RUNNING"):
                self.tasks[key]["state"] = "CANCELLED"
        self.schedule()

    def live(self, name_end=".elastic") -> list[tuple[str, int]]:
        return sorted(
            k for k, t in self.tasks.items() if t["name"].endswith(name_end) and t["state"] in ("PENDING", "RUNNING")
        )


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def env(tmp_path: Path, clock: Clock):
    """A launched run: trainer (1 task) and elastic pool (nodes 1, max 3) on the fake cluster."""
    (tmp_path / "m").mkdir()
    data = {
        "run": {"name": "r", "model": "m", "run_dir": "run"},
        "pools": {
            "trainer": {"nodes": 1, "gpus_per_node": 1},
            "elastic": {
                "nodes": NODES,
                "max_nodes": MAX_NODES,
                "gpus_per_node": 2,
                "partition": "preempt",
                "pending_timeout_s": PENDING_S,
                "preempt_notice_s": NOTICE_S,
            },
        },
    }
    spec = parse_spec(data, tmp_path / "r.toml", ("never",))
    cluster = FakeCluster(clock)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        run_id = launch(spec, store, cluster).run_id
        sync_run(store, cluster, run_id)
        yield store, cluster, run_id


def pool_of(env, clock) -> ElasticPool:
    store, cluster, run_id = env
    return ElasticPool(store, cluster, run_id, epoch=None, clock=clock)


def elastic(store, run_id) -> list[dict]:
    return [a for a in store.fleet.allocations(run_id) if a.pool == "elastic"]


def states(store, run_id) -> list[tuple[int, str]]:
    return [(a.array_index, a.state) for a in elastic(store, run_id)]


def events(store, run_id, alloc_id) -> list[str]:
    return [
        j["event"]
        for j in store.journal.read(run_id)
        if j["entity"] == "allocations" and j["entity_id"] == str(alloc_id)
    ]


def test_growth_submits_one_task_arrays_under_the_pool_name_and_never_past_max_nodes(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    assert pool.resize(10, "the plan wants 10") == MAX_NODES  # clamped
    sync_run(store, cluster, run_id)
    assert states(store, run_id) == [(0, "RUNNING"), (1, "RUNNING"), (2, "RUNNING")]
    added = cluster.scripts[2:]  # after the trainer's and the elastic pool's launch scripts
    assert len(added) == 2
    for index, script in zip((1, 2), added, strict=True):
        assert f"#SBATCH --array={index}\n" in script
        assert f"#SBATCH --job-name=pearl.{run_id}.elastic\n" in script
        assert "#SBATCH --partition=preempt\n" in script and "#SBATCH --requeue\n" in script
        assert "jobs/worker.sh" in script
    # the same wrapper and environment as the pool's launch: only the array line differs
    launched = cluster.scripts[1]
    assert added[0].replace("--array=1", "--array=0-0") == launched
    # every task is (its own job id, its index); each was written REQUESTED before its sbatch
    rows = elastic(store, run_id)
    assert len({(a.job_id, a.array_index) for a in rows}) == 3 and len({a.job_id for a in rows}) == 3
    assert events(store, run_id, rows[1].id)[:2] == ["elastic grow", "submitted"]
    wanted = [j for j in store.journal.read(run_id) if j["event"] == "elastic wanted"]
    assert [(j["data"]["asked"], j["data"]["fields"]["wanted"], j["data"]["why"]) for j in wanted] == [
        (10, 3, "the plan wants 10")
    ]
    # asking again changes nothing
    pool.resize(5, "again")
    pool.reconcile()
    assert len(cluster.scripts) == 4 and len(cluster.live()) == 3
    # a fresh daemon wants no more than max_nodes either
    pool_of(env, clock).reconcile()
    assert len(cluster.live()) == 3


def test_a_crash_between_sbatch_and_the_state_write_is_adopted_by_name_never_submitted_twice(env, clock):
    store, cluster, run_id = env
    cluster.crash = "after"
    with pytest.raises(Crash):
        pool_of(env, clock).resize(2, "grow")
    assert len(cluster.live()) == 2  # the task was submitted ...
    row = elastic(store, run_id)[1]
    assert (row.state, row.job_id) == ("REQUESTED", None)  # ... and state never learned its id
    restarted = pool_of(env, clock)  # a new daemon, at once: the task is found under the pool's job name
    restarted.reconcile()
    row = store.fleet.allocation(row.id)
    assert row.state == "PENDING" and (row.job_id, 1) in cluster.live()
    assert "adopted" in events(store, run_id, row.id)
    restarted.reconcile()
    sync_run(store, cluster, run_id)
    assert len(cluster.scripts) == 3 and states(store, run_id) == [(0, "RUNNING"), (1, "RUNNING")]


def test_a_crash_before_sbatch_is_submitted_once_after_the_settle_time(env, clock):
    store, cluster, run_id = env
    cluster.crash = "before"
    with pytest.raises(Crash):
        pool_of(env, clock).resize(2, "grow")
    assert len(cluster.scripts) == 2 and states(store, run_id)[1] == (1, "REQUESTED")
    restarted = pool_of(env, clock)
    restarted.reconcile()  # a crashed daemon's sbatch might still be in flight: not yet
    assert len(cluster.scripts) == 2
    clock.t += SUBMIT_SETTLE_S
    restarted.reconcile()
    restarted.reconcile()
    assert len(cluster.scripts) == 3 and len(cluster.live()) == 2
    assert states(store, run_id) == [(0, "RUNNING"), (1, "PENDING")]


def test_max_nodes_counts_tasks_found_by_name_that_state_does_not_know(env, clock):
    store, cluster, run_id = env
    cluster.add(f"pearl.{run_id}.elastic", task=9)  # e.g. by hand, under the pool's name
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    assert len(cluster.live()) == 3 and len(cluster.scripts) == 3  # only one more: the stray takes a place
    grow = next(j for j in store.journal.read(run_id) if j["event"] == "elastic grow")
    assert grow["data"]["unknown_tasks"] == 1


def test_pending_tasks_are_cancelled_after_the_bound_and_growth_backs_off(env, clock):
    store, cluster, run_id = env
    cluster.capacity = 1  # the launch's task holds the only place
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    sync_run(store, cluster, run_id)
    assert states(store, run_id) == [(0, "RUNNING"), (1, "PENDING"), (2, "PENDING")]
    clock.t += PENDING_S - 1
    sync_run(store, cluster, run_id)
    pool.reconcile()
    assert cluster.cancelled_tasks == []
    clock.t += 1
    pool.reconcile()
    added = elastic(store, run_id)[1:]
    assert sorted(cluster.cancelled_tasks) == sorted((a.job_id, a.array_index) for a in added)
    for a in added:  # journaled: the timeout (with how long it pended), then the scancel
        evs = events(store, run_id, a.id)
        assert evs.index("elastic pending timeout") < evs.index("elastic scancel")
    timeout = next(j for j in store.journal.read(run_id) if j["event"] == "elastic pending timeout")
    assert timeout["data"]["pending_s"] == PENDING_S and timeout["data"]["pending_timeout_s"] == PENDING_S
    assert store.runs.pools(run_id)[1]["backoff_until"] == clock.t + PENDING_S
    sync_run(store, cluster, run_id)
    assert states(store, run_id)[1:] == [(1, "ENDED"), (2, "ENDED")]
    # backing off: nothing is submitted while it lasts, and that is journaled once
    for _ in range(3):
        clock.t += 10
        pool.reconcile()
    assert len(cluster.scripts) == 4
    assert [j["event"] for j in store.journal.read(run_id)].count("elastic grow held") == 1
    # after it, growth tries again; a second timeout doubles the back-off
    clock.t += PENDING_S
    pool.reconcile()
    assert len(cluster.scripts) == 6
    sync_run(store, cluster, run_id)
    clock.t += PENDING_S
    pool.reconcile()
    assert len(cluster.cancelled_tasks) == 4
    assert store.runs.pools(run_id)[1]["backoff_s"] == 2 * PENDING_S
    # the launch's task (the pool's floor) is never cancelled for pending, however long it waits
    assert all(index >= NODES for _, index in cluster.cancelled_tasks)


def test_the_launch_tasks_are_the_floor_and_wait_as_long_as_slurm_makes_them(env, clock):
    store, cluster, run_id = env
    cluster.tasks[(elastic(store, run_id)[0].job_id, 0)]["state"] = "PENDING"
    cluster.capacity = 0
    sync_run(store, cluster, run_id)
    clock.t += 10 * PENDING_S
    pool = pool_of(env, clock)
    pool.reconcile()
    assert cluster.cancelled_tasks == [] and states(store, run_id) == [(0, "PENDING")]


def test_a_started_task_resets_the_back_off_length(env, clock):
    store, cluster, run_id = env
    cluster.capacity = 1
    pool = pool_of(env, clock)
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    clock.t += PENDING_S
    pool.reconcile()
    assert store.runs.pools(run_id)[1]["backoff_s"] == PENDING_S
    clock.t += PENDING_S
    cluster.capacity = 2
    pool.reconcile()  # back-off over: submits again, and this time the task starts
    sync_run(store, cluster, run_id)
    pool.reconcile()
    assert store.runs.pools(run_id)[1]["backoff_s"] is None
    assert "elastic back-off reset" in [j["event"] for j in store.journal.read(run_id)]


def _serve(store, run_id, alloc_id, key="rollout-0") -> int:
    """A READY, routable vLLM worker on the allocation, as its agent's heartbeat would record it."""
    wid = store.fleet.add_worker(run_id=run_id, allocation_id=alloc_id, role="ROLLOUT", engine="vllm")
    store.update_fields("workers", wid, worker_key=key, gpu_idx=[0, 1], routable=1)
    store.set_state("workers", wid, expect="STARTING", to="READY", event="agent reported")
    return wid


def test_shrink_drains_before_scancel_and_never_below_nodes(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    sync_run(store, cluster, run_id)
    a0, a1, a2 = elastic(store, run_id)
    worker = _serve(store, run_id, a2.id)
    controller = Controller(store, run_id, 0)
    assert [w.role for w in controller.desired.of(a2.id)] == ["ROLLOUT"]

    pool.resize(0, "the batch ended")  # clamped to nodes: two tasks go, the newest first
    assert store.runs.pools(run_id)[1]["wanted"] == NODES
    # a1 serves nothing: scancelled at once; a2 drains: out of routing, GPUs DRAINING, no worker desired
    assert cluster.cancelled_tasks == [(a1.job_id, 1)]
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a2.id} == {"DRAINING"}
    assert store.fleet.worker(worker).routable == 0
    assert controller.desired.of(a2.id) == []
    clock.t += 5
    pool.reconcile()
    assert (a2.job_id, 2) not in cluster.cancelled_tasks  # its worker still serves
    # the agent drains and stops it (what it does when no worker is desired), then the task is scancelled
    store.set_state("workers", worker, expect="READY", to="DRAINING", event="agent reported")
    pool.reconcile()
    assert (a2.job_id, 2) not in cluster.cancelled_tasks
    store.set_state("workers", worker, expect="DRAINING", to="STOPPED", event="agent reported")
    pool.reconcile()
    assert cluster.cancelled_tasks == [(a1.job_id, 1), (a2.job_id, 2)]
    sync_run(store, cluster, run_id)
    assert states(store, run_id) == [(0, "RUNNING"), (1, "ENDED"), (2, "ENDED")]
    for a in (a1, a2):
        evs = events(store, run_id, a.id)
        assert evs.index("elastic drain") < evs.index("elastic scancel") < evs.index("ended")
    scancel = next(
        j for j in store.journal.read(run_id) if j["event"] == "elastic scancel" and j["entity_id"] == str(a2.id)
    )
    assert scancel["data"]["why"] == "drained" and scancel["data"]["drain_s"] == 5
    # never below nodes
    pool.resize(0, "again")
    pool.reconcile()
    assert states(store, run_id)[0] == (0, "RUNNING") and len(cluster.cancelled_tasks) == 2


def test_a_drain_that_does_not_finish_is_scancelled_after_the_notice(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    _serve(store, run_id, a1.id)
    pool.resize(1, "shrink")
    clock.t += NOTICE_S - 1
    pool.reconcile()
    assert cluster.cancelled_tasks == []
    clock.t += 1
    pool.reconcile()
    assert cluster.cancelled_tasks == [(a1.job_id, 1)]
    scancel = next(j for j in store.journal.read(run_id) if j["event"] == "elastic scancel")
    assert scancel["data"]["why"] == f"drain took longer than {NOTICE_S}s" and scancel["data"]["workers_left"]


def test_a_task_with_a_preemption_notice_is_dropped_first_and_a_drain_is_taken_back_if_wanted_again(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    sync_run(store, cluster, run_id)
    a0, a1, a2 = elastic(store, run_id)
    for a in (a0, a1, a2):
        _serve(store, run_id, a.id)
    cluster.tasks[(a0.job_id, 0)]["preempt"] = clock.t  # Slurm signalled a preemption of the oldest
    sync_run(store, cluster, run_id)
    assert states(store, run_id)[0] == (0, "PREEMPTING")
    pool.resize(1, "shrink")
    drained = {a.array_index for a in elastic(store, run_id) if a.drain_requested_at}
    assert drained == {0, 2}  # the preempted one, then the newest
    # wanted again before the drain ended: the running one is taken back, nothing is submitted
    pool.resize(2, "grow again")
    assert {a.array_index for a in elastic(store, run_id) if a.drain_requested_at} == {0}
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a2.id} == {"UP"}
    assert "elastic undrain" in events(store, run_id, a2.id) and len(cluster.scripts) == 4


def test_a_requeued_added_task_rejoins_without_a_replacement(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    task = cluster.tasks[(a1.job_id, 1)]
    task["preempt"] = clock.t
    sync_run(store, cluster, run_id)
    task.update(state="PENDING", restarts=1, preempt=None)  # Slurm requeued it
    sync_run(store, cluster, run_id)
    pool.reconcile()
    assert store.fleet.allocation(a1.id).state == "PENDING"
    assert len(cluster.scripts) == 3  # it still counts: no replacement is submitted
    clock.t += 15
    task.update(state="RUNNING", start=clock.t)
    sync_run(store, cluster, run_id)
    pool.reconcile()
    a1 = store.fleet.allocation(a1.id)
    assert (a1.state, a1.restarts) == ("RUNNING", 1) and len(cluster.scripts) == 3
    assert [e for e in events(store, run_id, a1.id) if e in ("preempted", "requeued", "started")] == [
        "started",
        "preempted",
        "requeued",
        "started",
    ]
    history = elastic_view(store, run_id)["history"]
    assert [(h["running"], h["pending"], h["preempting"]) for h in history][-2:] == [(1, 1, 0), (2, 0, 0)]


def test_a_failed_sbatch_ends_its_row_and_backs_off(env, clock):
    store, cluster, run_id = env
    cluster.fail = "sbatch: error: QOSMaxSubmitJobPerUserLimit"
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    assert states(store, run_id)[1:] == [(1, "ENDED"), (2, "ENDED")]
    failed = [j for j in store.journal.read(run_id) if j["event"] == "elastic submit failed"]
    assert len(failed) == 2 and "QOSMaxSubmitJobPerUserLimit" in failed[0]["data"]["error"]
    backoff = next(j for j in store.journal.read(run_id) if j["event"] == "elastic back-off")
    assert "sbatch failed" in backoff["data"]["why"]
    cluster.fail = None
    pool.reconcile()
    assert len(cluster.scripts) == 2  # backing off
    clock.t += PENDING_S
    pool.reconcile()
    assert len(cluster.live()) == 3 and states(store, run_id)[3:] == [(3, "PENDING"), (4, "PENDING")]


def test_nothing_grows_once_the_run_is_cancelled_and_cancel_ends_added_tasks(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    sync_run(store, cluster, run_id)
    assert cancel(store, cluster, run_id, timeout=1, interval=0) is True
    assert cluster.live() == [] and {a.state for a in elastic(store, run_id)} == {"ENDED"}
    pool.resize(3, "grow")
    pool.reconcile()
    assert len(cluster.scripts) == 4 and cluster.live() == []


def test_a_submit_that_lands_after_a_cancel_is_taken_back(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    real_submit = cluster.submit

    def submit_while_cancelling(req, script):
        job_id = real_submit(req, script)
        cancel(store, cluster, run_id, timeout=0, interval=0)  # the user cancels while sbatch runs
        return job_id

    cluster.submit = submit_while_cancelling
    pool.resize(2, "grow")
    assert cluster.live() == []  # the task submitted after the cancel was cancelled too
    assert any(j["event"] == "elastic submitted too late" for j in store.journal.read(run_id))


def test_view_shows_size_wanted_tasks_and_history(env, clock):
    store, cluster, run_id = env
    cluster.capacity = 2
    pool = pool_of(env, clock)
    pool.resize(3, "grow")
    sync_run(store, cluster, run_id)
    pool.reconcile()
    view = pool.view()
    assert {k: view[k] for k in ("min", "max", "wanted", "size", "running", "pending", "draining")} == {
        "min": 1, "max": 3, "wanted": 3, "size": 3, "running": 2, "pending": 1, "draining": 0,
    }  # fmt: skip
    assert len(view["tasks"]) == 3
    pending = [t for t in view["tasks"] if t["state"] == "PENDING"]
    assert len(pending) == 1 and pending[0]["added"] and pending[0]["pending_since"] == clock.t
    assert view["pending_timeout_s"] == PENDING_S and view["job_name"] == f"pearl.{run_id}.elastic"
    assert view["history"][0]["size"] == 1 and view["history"][-1]["size"] == 3
    assert all(h["ts"] for h in view["history"])


def test_a_pool_without_an_elastic_pool_does_nothing(tmp_path, clock):
    (tmp_path / "m").mkdir()
    data = {
        "run": {"name": "r", "model": "m", "run_dir": "run"},
        "pools": {"trainer": {"nodes": 1, "gpus_per_node": 1}, "rollout": {"nodes": 1, "gpus_per_node": 1}},
    }
    cluster = FakeCluster(clock)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        run_id = launch(parse_spec(data, tmp_path / "r.toml", ("never",)), store, cluster).run_id
        pool = ElasticPool(store, cluster, run_id, epoch=None, clock=clock)
        assert not pool.enabled and pool.resize(3, "x") is None and pool.view() is None
        pool.reconcile()
        assert len(cluster.scripts) == 2


def test_grow_request_is_the_pools_launch_request_for_one_task(env):
    store, _, run_id = env
    req = grow_request(store.runs.get(run_id), "elastic", 4)
    assert (req.first_task, req.array_size, req.pool, req.partition, req.requeue) == (4, 1, "elastic", "preempt", True)
    assert "#SBATCH --array=4\n" in render_script(req)
    with pytest.raises(ValueError, match="index must be >= 1"):
        grow_request(store.runs.get(run_id), "elastic", 0)
    with pytest.raises(KeyError, match="no pool 'rollout'"):
        grow_request(store.runs.get(run_id), "rollout", 1)


class Recorder:
    def __init__(self, rc=0, stderr=""):
        self.argv, self.rc, self.stderr = [], rc, stderr

    def run(self, argv, *, timeout, input=None):
        self.argv.append(argv)
        return CommandResult(tuple(argv), self.rc, "", self.stderr)


def test_single_tasks_are_cancelled_with_one_scancel_of_job_task_ids():
    runner = Recorder()
    SlurmClient(runner).cancel_tasks([("123", 4), ("125", 7)])
    assert runner.argv == [["scancel", "123_4", "125_7"]]
    SlurmClient(Recorder(rc=1, stderr="scancel: error: Invalid job id 123_4")).cancel_tasks([("123", 4)])
    with pytest.raises(Exception, match="Access/permission denied"):
        SlurmClient(Recorder(rc=1, stderr="Access/permission denied")).cancel_tasks([("123", 4)])


def test_heartbeat_of_a_drained_agent_keeps_its_gpus_draining(env, clock):
    """The controller brings LOST GPUs back UP when their agent reports again; a drained task's step keeps
    them DRAINING, so its workers are not wanted back."""
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    _serve(store, run_id, a1.id)
    pool.resize(1, "shrink")
    for g in store.fleet.gpus(run_id):  # the agent went silent, then reports again: the controller's edges
        if g.allocation_id == a1.id:
            store.set_state("gpus", g.id, expect="DRAINING", to="LOST", event="agent silent")
            store.set_state("gpus", g.id, expect="LOST", to="UP", event="agent reporting again")
    controller = Controller(store, run_id, 0)
    body = bodies.Heartbeat(allocation_id=a1.id, workers=[])
    controller.agents.heartbeat(body, a1.id)
    pool.reconcile()
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a1.id} == {"DRAINING"}
    assert controller.desired.of(a1.id) == []


def test_a_scancelled_task_that_vanishes_from_slurm_ends_and_frees_its_place(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    pool.resize(1, "shrink")
    assert cluster.cancelled_tasks == [(a1.job_id, 1)]
    del cluster.tasks[(a1.job_id, 1)]  # purged (MinJobAge) before a poll saw its end, and no sacct
    sync_run(store, cluster, run_id)
    assert store.fleet.allocation(a1.id).state == "LOST"
    pool_of(env, clock).reconcile()  # a restarted daemon knows it from the journal's scancel
    a1 = store.fleet.allocation(a1.id)
    assert a1.state == "ENDED" and events(store, run_id, a1.id)[-1] == "elastic cancelled"
    pool.resize(2, "grow again")
    assert len(cluster.live()) == 2


def test_with_a_router_a_leaving_tasks_workers_drain_only_once_the_router_no_longer_routes_to_them(env, clock):
    store, cluster, run_id = env
    routed: set[str] = set()
    pool = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, routed=lambda: set(routed))
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    worker = _serve(store, run_id, a1.id)
    store.update_fields("workers", worker, url="http://gpu3_1:9000")
    routed.add("http://gpu3_1:9000")
    controller = Controller(store, run_id, 0)

    pool.resize(1, "the batch ended")
    # out of routing in state at once, but the GPUs stay UP (the worker is still desired) while the router
    # may still send it requests
    assert store.fleet.worker(worker).routable == 0
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a1.id} == {"UP"}
    assert [w.role for w in controller.desired.of(a1.id)] == ["ROLLOUT"]
    # a heartbeat of the still-READY worker does not make it routable again
    controller.agents.heartbeat(
        parse(bodies.Heartbeat, {"allocation_id": a1.id, "workers": [
            {"key": "rollout-0", "role": "ROLLOUT", "engine": "vllm", "gpus": [0], "state": "READY",
             "url": "http://gpu3_1:9000"}]}),
        a1.id,
    )  # fmt: skip
    assert store.fleet.worker(worker).routable == 0
    pool.reconcile()
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a1.id} == {"UP"}
    routed.clear()  # the router removed it
    pool.reconcile()
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a1.id} == {"DRAINING"}
    assert controller.desired.of(a1.id) == []


# -- the fault hook: a daemon that dies where a grow's or a shrink's effect is in doubt --------------------
# (the real daemon is SIGKILLed at the same points by tests/engines/test_crash_matrix_elastic.py)


def crash_at(point: str, step: str):
    """A fault as pearlctl.daemon.main.fault_from_env makes one, raising Crash instead of a SIGKILL."""

    def fault(at: str, key: str) -> None:
        if at == point and key.endswith(":" + step):
            raise Crash(key)

    return fault


def test_a_crash_after_the_grow_intent_is_submitted_once_by_the_next_daemon(env, clock):
    store, cluster, run_id = env
    crashing = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, fault=crash_at("after_intent", "GROW"))
    with pytest.raises(Crash) as died:
        crashing.resize(2, "grow")
    row = elastic(store, run_id)[1]
    assert str(died.value) == f"elastic:{row.id}:GROW"
    assert (row.state, row.job_id) == ("REQUESTED", None) and len(cluster.scripts) == 2  # nothing submitted
    restarted = pool_of(env, clock)
    restarted.reconcile()  # the dead daemon's sbatch could still be in flight: not yet
    assert len(cluster.scripts) == 2 and len(elastic(store, run_id)) == 2  # and no second row either
    clock.t += SUBMIT_SETTLE_S
    restarted.reconcile()
    restarted.reconcile()
    sync_run(store, cluster, run_id)
    assert len(cluster.scripts) == 3 and states(store, run_id) == [(0, "RUNNING"), (1, "RUNNING")]
    assert events(store, run_id, row.id)[:2] == ["elastic grow", "submitted"]


def test_a_crash_after_the_grow_submit_is_adopted_by_the_next_daemon(env, clock):
    store, cluster, run_id = env
    crashing = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, fault=crash_at("after_effect", "GROW"))
    with pytest.raises(Crash):
        crashing.resize(2, "grow")
    row = elastic(store, run_id)[1]
    assert (row.state, row.job_id) == ("REQUESTED", None) and len(cluster.live()) == 2  # submitted, unknown
    restarted = pool_of(env, clock)
    restarted.reconcile()  # at once: found under the pool's job name
    clock.t += SUBMIT_SETTLE_S  # and never submitted again, however long after
    restarted.reconcile()
    sync_run(store, cluster, run_id)
    assert len(cluster.scripts) == 3 and states(store, run_id) == [(0, "RUNNING"), (1, "RUNNING")]
    assert events(store, run_id, row.id)[:2] == ["elastic grow", "adopted"]


def test_a_crash_after_the_drain_request_drains_through_the_router_and_scancels_once(env, clock):
    store, cluster, run_id = env
    routed: set[str] = set()
    pool = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, routed=lambda: set(routed))
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    worker = _serve(store, run_id, a1.id)
    store.update_fields("workers", worker, url="http://gpu3_1:9000")
    routed.add("http://gpu3_1:9000")
    crashing = ElasticPool(
        store, cluster, run_id, epoch=None, clock=clock, routed=lambda: set(routed),
        fault=crash_at("after_intent", "SHRINK"),
    )  # fmt: skip
    with pytest.raises(Crash) as died:
        crashing.resize(1, "the batch ended")
    assert str(died.value) == f"elastic:{a1.id}:SHRINK"
    assert store.fleet.allocation(a1.id).drain_requested_at is not None
    assert store.fleet.worker(worker).routable == 1  # died before taking the workers out of routing

    restarted = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, routed=lambda: set(routed))
    restarted.reconcile()
    # out of routing in state; the GPUs stay UP (the worker serves on) while the router still routes to it
    assert store.fleet.worker(worker).routable == 0
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a1.id} == {"UP"}
    routed.clear()
    restarted.reconcile()
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a1.id} == {"DRAINING"}
    assert cluster.cancelled_tasks == []  # its worker still runs
    store.set_state("workers", worker, expect="READY", to="STOPPED", event="agent reported")
    restarted.reconcile()
    sync_run(store, cluster, run_id)
    restarted.reconcile()
    assert cluster.cancelled_tasks == [(a1.job_id, 1)] and len(cluster.scripts) == 3
    assert states(store, run_id) == [(0, "RUNNING"), (1, "ENDED")]
    evs = events(store, run_id, a1.id)
    assert evs.count("elastic drain") == 1 and evs.index("elastic drain") < evs.index("elastic scancel")


def test_a_crash_after_the_scancel_is_not_scancelled_again_and_nothing_is_submitted(env, clock):
    store, cluster, run_id = env
    pool = pool_of(env, clock)
    pool.resize(2, "grow")
    sync_run(store, cluster, run_id)
    a1 = elastic(store, run_id)[1]
    crashing = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, fault=crash_at("after_effect", "SHRINK"))
    with pytest.raises(Crash) as died:
        crashing.resize(1, "the batch ended")  # no worker on it: drained at once, then scancelled
    assert str(died.value) == f"elastic:{a1.id}:SHRINK"
    assert cluster.cancelled_tasks == [(a1.job_id, 1)]
    assert store.fleet.allocation(a1.id).state == "RUNNING"  # the end is not folded yet
    # the next daemon polls first (as its Slurm thread does), then reconciles: the task ended, nothing more
    sync_run(store, cluster, run_id)
    restarted = pool_of(env, clock)
    restarted.reconcile()
    restarted.reconcile()
    assert cluster.cancelled_tasks == [(a1.job_id, 1)] and len(cluster.scripts) == 3
    assert states(store, run_id) == [(0, "RUNNING"), (1, "ENDED")]
    assert store.runs.pools(run_id)[1]["wanted"] == 1 and restarted.view()["size"] == 1
    evs = events(store, run_id, a1.id)
    assert evs.count("elastic scancel") == 1 and evs.index("elastic scancel") < evs.index("ended")


def test_the_fault_hook_is_called_at_the_four_boundaries_with_the_allocations_key(env, clock):
    store, cluster, run_id = env
    calls: list[tuple[str, str]] = []
    pool = ElasticPool(store, cluster, run_id, epoch=None, clock=clock, fault=lambda at, key: calls.append((at, key)))
    pool.resize(2, "grow")
    a1 = elastic(store, run_id)[1]
    sync_run(store, cluster, run_id)
    pool.resize(1, "shrink")
    key = f"elastic:{a1.id}"
    assert calls == [
        ("after_intent", f"{key}:GROW"),
        ("after_effect", f"{key}:GROW"),
        ("after_intent", f"{key}:SHRINK"),
        ("after_effect", f"{key}:SHRINK"),
    ]
