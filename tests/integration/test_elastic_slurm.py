"""Elastic growth and shrink on the real local Slurm cluster (4 nodes x 8 fake GPUs).

The run is launched with the real CLI; the test drives ``ElasticPool`` as the daemon's Slurm thread does
(``resize`` / ``reconcile`` after each ``sync_run``), against the real SlurmBackend. Tasks run a plain sleep
instead of an agent: a worker an agent would report is written into state where a drain must wait for it.
Every time assertion uses state's timestamps (journal rows, Slurm's start and end times), not the wall
time of subprocesses.
"""

from __future__ import annotations

import sys

import pytest

from pearlctl.backends.slurm import SlurmBackend
from pearlctl.daemon.elastic import ElasticPool
from pearlctl.ops.watcher import sync_run
from pearlctl.state.store import Store
from tests.conftest import Pearlctl, wait_for, write_spec

pytestmark = pytest.mark.timeout(600)

# Like an agent, the payload outlives the preemption notice (USR2): Slurm requeues it at the grace time's end.
SLEEP = (
    f'["{sys.executable}", "-c", '
    '"import signal, time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); time.sleep(3600)"]'
)


def pools(*, gpus: int, max_nodes: int, pending_timeout_s: int = 300) -> str:
    return f"""
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 1
command = {SLEEP}
[pools.elastic]
partition = "preempt"
nodes = 1
max_nodes = {max_nodes}
gpus_per_node = {gpus}
pending_timeout_s = {pending_timeout_s}
preempt_notice_s = 30
command = {SLEEP}
"""


class Crash(BaseException):
    pass


class CrashAfterSubmit:
    """The real backend, except that the process dies right after its first sbatch returns."""

    def __init__(self, backend):
        self.backend, self.name = backend, backend.name

    def submit(self, req, script):
        self.backend.submit(req, script)
        raise Crash()

    def __getattr__(self, attr):
        return getattr(self.backend, attr)


@pytest.fixture
def launched(slurm_cluster, tmp_path, model_dir, request):
    slurm_cluster.cancel_all()
    name, spec_pools = request.param
    d = slurm_cluster.new_shared_dir("elastic")
    spec = write_spec(
        d / f"{name}.toml", name=name, model=model_dir, run_dir=d / "run", pools=spec_pools, backend="slurm", poll=1
    )
    pc = Pearlctl(tmp_path / "state", slurm_cluster.env)
    pc("launch", str(spec), "--wait", "--timeout", "60")
    store = Store.open(tmp_path / "state" / "state.db")
    run_id = store.runs.find(name)["id"]
    yield pc, store, run_id
    store.close()
    pc("cancel", name, check=None)
    slurm_cluster.cancel_all()


def elastic(store, run_id):
    return [a for a in store.fleet.allocations(run_id) if a.pool == "elastic"]


def journal_ts(store, run_id, alloc_id, event):
    return next(j["ts"] for j in store.journal.read(run_id) if j["entity_id"] == str(alloc_id) and j["event"] == event)


def squeue_tasks(slurm_cluster, run_id):
    """`squeue` (not --json: the plain command honours -n) lists the pool's live tasks as JOB_TASK STATE."""
    out = slurm_cluster.run("squeue", "-h", "-r", "-n", f"pearl.{run_id}.elastic", "-o", "%i %T").stdout
    return sorted(tuple(line.split()) for line in out.splitlines() if line.strip())


@pytest.mark.parametrize("launched", [("grow", pools(gpus=2, max_nodes=3))], indirect=True)
def test_the_pool_grows_from_one_task_to_three_and_shrinks_back_draining_first(launched, slurm_cluster):
    pc, store, run_id = launched
    backend = SlurmBackend()

    # the daemon dies right after the first added task's sbatch: a new one adopts it by name, never twice
    with pytest.raises(Crash):
        ElasticPool(store, CrashAfterSubmit(backend), run_id, epoch=None).resize(2, "the plan wants 2")
    assert [(a.state, a.job_id) for a in elastic(store, run_id)][1] == ("REQUESTED", None)
    pool = ElasticPool(store, backend, run_id, epoch=None)
    pool.resize(3, "the plan wants 3")

    def all_running():
        sync_run(store, backend, run_id)
        pool.reconcile()
        tasks = elastic(store, run_id)
        return tasks if [a.state for a in tasks] == ["RUNNING"] * 3 else None

    a0, a1, a2 = wait_for(all_running, 60)
    assert "adopted" in [j["event"] for j in store.journal.read(run_id) if j["entity_id"] == str(a1.id)]
    assert squeue_tasks(slurm_cluster, run_id) == sorted(
        [(f"{a.job_id}_{a.array_index}", "RUNNING") for a in (a0, a1, a2)]
    )
    assert len({a.job_id for a in (a0, a1, a2)}) == 3  # two one-task arrays added, each submitted once
    script = slurm_cluster.run("scontrol", "show", "job", "-o", a2.job_id).stdout
    assert "Partition=preempt" in script and "ArrayTaskId=2" in script and f"JobName=pearl.{run_id}.elastic" in script

    # an agent on the newest task reports a serving worker: its drain must wait for it
    worker = store.fleet.add_worker(run_id=run_id, allocation_id=a2.id, role="ROLLOUT", engine="vllm")
    store.update_fields("workers", worker, worker_key="rollout-0", routable=1)
    store.set_state("workers", worker, expect="STARTING", to="READY", event="agent reported")

    pool.resize(1, "the batch ended")

    def ended(alloc_id):
        sync_run(store, backend, run_id)
        return store.fleet.allocation(alloc_id).state == "ENDED"

    wait_for(lambda: ended(a1.id), 30)  # it served nothing: scancelled at once
    pool.reconcile()
    assert store.fleet.allocation(a2.id).state == "RUNNING"  # still draining: its worker serves
    assert {g.state for g in store.fleet.gpus(run_id) if g.allocation_id == a2.id} == {"DRAINING"}
    assert store.fleet.worker(worker).routable == 0
    assert (f"{a2.job_id}_2", "RUNNING") in squeue_tasks(slurm_cluster, run_id)
    # the agent drains and stops it; the next pass scancels that task alone
    store.set_state("workers", worker, expect="READY", to="DRAINING", event="agent reported")
    store.set_state("workers", worker, expect="DRAINING", to="STOPPED", event="agent reported")

    def shrunk():
        pool.reconcile()
        sync_run(store, backend, run_id)
        tasks = elastic(store, run_id)
        return tasks if [a.state for a in tasks] == ["RUNNING", "ENDED", "ENDED"] else None

    tasks = wait_for(shrunk, 60)
    assert squeue_tasks(slurm_cluster, run_id) == [(f"{a0.job_id}_0", "RUNNING")]
    for a in tasks[1:]:
        assert a.slurm_state.startswith("CANCELLED")
        drained = journal_ts(store, run_id, a.id, "elastic drain")
        scancelled = journal_ts(store, run_id, a.id, "elastic scancel")
        assert drained <= scancelled <= journal_ts(store, run_id, a.id, "ended")
        assert a.ended_at >= int(scancelled)  # Slurm's end time (whole seconds) follows the scancel
    # a2 was scancelled only once its worker had stopped
    stopped = next(
        j["ts"] for j in store.journal.read(run_id) if j["entity"] == "workers" and j["to_state"] == "STOPPED"
    )
    assert journal_ts(store, run_id, a2.id, "elastic scancel") >= stopped
    pool.reconcile()
    view = pool.view()
    assert (view["size"], view["running"], view["wanted"]) == (1, 1, 1)
    sizes = [h["size"] for h in view["history"]]
    assert sizes[0] == 1 and max(sizes) == 3 and sizes[-1] == 1
    status = pc.json("status", "grow")["elastic"]
    assert status["size"] == 1 and [h["size"] for h in status["history"]] == sizes


@pytest.mark.parametrize(
    "launched", [("pend", pools(gpus=8, max_nodes=2, pending_timeout_s=10))], indirect=True
)  # fmt: skip
def test_a_task_pending_past_the_bound_is_cancelled_and_growth_backs_off(launched, slurm_cluster):
    pc, store, run_id = launched
    backend = SlurmBackend()
    # the trainer holds one GPU of a node, the launched elastic task a whole node: fill the other two
    filler = slurm_cluster.run(
        "sbatch", "--parsable", "-p", "debug", "-N1", "--gres=gpu:8", "--array=0-1", "-o", "/dev/null",
        "--wrap", "sleep 600",
    ).stdout.strip()  # fmt: skip
    slurm_cluster.wait_job_states(filler, {"RUNNING"}, timeout=30)
    pool = ElasticPool(store, backend, run_id, epoch=None)
    pool.resize(2, "the plan wants 2")
    added = elastic(store, run_id)[1]

    def cancelled():
        sync_run(store, backend, run_id)
        pool.reconcile()
        a = store.fleet.allocation(added.id)
        return a if a.state == "ENDED" else None

    a = wait_for(cancelled, 60, every=1)
    assert a.slurm_state.startswith("CANCELLED") and a.started_at is None  # it never ran
    submitted = journal_ts(store, run_id, a.id, "submitted")
    timed_out = journal_ts(store, run_id, a.id, "elastic pending timeout")
    assert 10 <= timed_out - submitted <= 10 + 3  # the bound, plus at most a poll interval and a pass
    assert timed_out <= journal_ts(store, run_id, a.id, "elastic scancel")
    until = store.runs.pools(run_id)[1]["backoff_until"]
    assert until == pytest.approx(timed_out + 10, abs=0.5)

    # backing off: nothing is submitted until it is over, however often the daemon asks
    def retried():
        sync_run(store, backend, run_id)
        pool.reconcile()
        rows = elastic(store, run_id)
        return rows[-1] if rows[-1].id != a.id else None

    retried = wait_for(retried, 30, every=0.5)
    grown = journal_ts(store, run_id, retried.id, "elastic grow")
    assert grown >= until  # not one sbatch during the back-off
    assert [j["event"] for j in store.journal.read(run_id)].count("elastic grow held") == 1
    assert retried.array_index == 2 and retried.state == "PENDING"
    view = pc.json("status", "pend")["elastic"]
    assert view["pending"] == 1 and view["running"] == 1 and view["size"] == 2


@pytest.mark.parametrize("launched", [("requeue", pools(gpus=8, max_nodes=2))], indirect=True)
def test_a_preempted_added_task_is_requeued_and_rejoins_without_a_replacement(launched, slurm_cluster):
    pc, store, run_id = launched
    backend = SlurmBackend()
    pool = ElasticPool(store, backend, run_id, epoch=None)
    pool.resize(2, "the plan wants 2")

    def added(state, restarts=0):
        sync_run(store, backend, run_id)
        pool.reconcile()
        a = elastic(store, run_id)[1]
        return a if (a.state, a.restarts) == (state, restarts) else None

    a1 = wait_for(lambda: added("RUNNING"), 30)
    # the fourth node is taken; a high-priority job wants the added task's node: Slurm preempts that task
    busy = {a.node for a in store.fleet.allocations(run_id)}
    free = sorted({"gpu1", "gpu2", "gpu3", "gpu4"} - busy)
    filler = slurm_cluster.run(
        "sbatch", "--parsable", "-p", "debug", "-N1", "--gres=gpu:8", f"--nodelist={free[0]}", "-o", "/dev/null",
        "--wrap", "sleep 600",
    ).stdout.strip()  # fmt: skip
    slurm_cluster.wait_job_states(filler, {"RUNNING"}, timeout=30)
    high = slurm_cluster.run(
        "sbatch", "--parsable", "-p", "high", "-N1", "--gres=gpu:8", f"--nodelist={a1.node}", "-o", "/dev/null",
        "--wrap", "sleep 600",
    ).stdout.strip()  # fmt: skip
    wait_for(lambda: added("PENDING", 1), 90)  # preempted, then requeued: still one of the pool's tasks
    slurm_cluster.run("scancel", high)
    a1 = wait_for(lambda: added("RUNNING", 1), 90)
    assert len(elastic(store, run_id)) == 2  # no replacement was ever submitted
    events = [j["event"] for j in store.journal.read(run_id) if j["entity_id"] == str(a1.id)]
    assert [e for e in events if e in ("started", "preempted", "requeued")] == [
        "started",
        "preempted",
        "requeued",
        "started",
    ]
    assert "elastic pending timeout" not in events
    history = [(h["running"], h["preempting"], h["pending"]) for h in pool.view()["history"]]
    assert (1, 1, 0) in history and (1, 0, 1) in history and history[-1] == (2, 0, 0)
