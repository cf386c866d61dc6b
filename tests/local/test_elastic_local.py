"""Elastic growth and shrink on the local backend: real process groups, real state, no Slurm.

The run is launched with the real CLI; the test then drives ``ElasticPool`` as the daemon's Slurm thread
would (the daemon's wiring is not needed for what is tested here: the backend's half of growth and shrink).
Tasks run a plain long sleep instead of an agent, so a drained task has no worker to wait for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pearlctl.backends.local import LocalBackend
from pearlctl.daemon.elastic import ElasticPool
from pearlctl.ops.watcher import sync_run
from pearlctl.slurm.script import SubmitRequest
from pearlctl.state.store import Store
from tests.conftest import alive, wait_for, write_spec

SLEEP = f'["{sys.executable}", "-c", "import time; time.sleep(600)"]'
POOLS = f"""
[pools.trainer]
nodes = 1
gpus_per_node = 1
command = {SLEEP}
[pools.elastic]
nodes = 1
max_nodes = 3
gpus_per_node = 0
command = {SLEEP}
"""


def task_pid(state_dir: Path, job_id: str, task: int) -> int:
    return int((state_dir / "local-jobs" / job_id / f"task-{task}.pid").read_text().split()[0])


def test_the_elastic_pool_grows_to_three_tasks_and_shrinks_back_on_the_local_backend(pearlctl, tmp_path, model_dir):
    spec = write_spec(tmp_path / "e.toml", name="e", model=model_dir, run_dir=tmp_path / "run", pools=POOLS)
    launched = json.loads(pearlctl("launch", str(spec), "--backend", "local", "--wait", "--json").stdout)
    state_dir = tmp_path / "state"
    try:
        with Store.open(state_dir / "state.db") as store:
            run_id = launched["run_id"]
            backend = LocalBackend(state_dir, kill_wait_s=2)
            pool = ElasticPool(store, backend, run_id, epoch=None)
            assert pool.resize(3, "the plan wants 3") == 3
            sync_run(store, backend, run_id)
            tasks = [a for a in store.fleet.allocations(run_id) if a.pool == "elastic"]
            assert [(a.array_index, a.state) for a in tasks] == [(0, "RUNNING"), (1, "RUNNING"), (2, "RUNNING")]
            assert len({a.job_id for a in tasks}) == 3  # each added task is its own one-task job
            pids = {a.array_index: task_pid(state_dir, a.job_id, a.array_index) for a in tasks}
            assert all(alive(p) for p in pids.values())
            # the same wrapper, with the added task's own index: its log and its start line name job_index
            for a in tasks[1:]:
                log = tmp_path / "run" / "logs" / f"elastic-{a.job_id}_{a.array_index}.log"
                wait_for(lambda log=log: log.exists() and "pearl-worker" in log.read_text(), 10, every=0.1)
                assert f"task={a.job_id}_{a.array_index}" in log.read_text()

            assert pool.resize(1, "the batch ended") == 1
            sync_run(store, backend, run_id)
            pool.reconcile()  # as the daemon's Slurm thread does after each poll's fold
            tasks = [a for a in store.fleet.allocations(run_id) if a.pool == "elastic"]
            assert [(a.array_index, a.state, a.slurm_state) for a in tasks] == [
                (0, "RUNNING", "RUNNING"),
                (1, "ENDED", "CANCELLED"),
                (2, "ENDED", "CANCELLED"),
            ]
            assert alive(pids[0]) and not alive(pids[1]) and not alive(pids[2])
            for a in tasks[1:]:
                evs = [j["event"] for j in store.journal.read(run_id) if j["entity_id"] == str(a.id)]
                assert evs.index("elastic drain") < evs.index("elastic scancel") < evs.index("ended"), evs
            sizes = [h["size"] for h in pool.view()["history"]]
            assert sizes[0] == 1 and 3 in sizes and sizes[-1] == 1
    finally:
        pearlctl("cancel", "e")
    doc = pearlctl.json("status", "e")
    assert doc["run"]["state"] == "CANCELLED" and {a["state"] for a in doc["allocations"]} == {"ENDED"}
    assert doc["elastic"]["size"] == 0 and [h["size"] for h in doc["elastic"]["history"]][-1] == 1


def test_cancelling_one_task_of_a_local_job_leaves_the_others_running(tmp_path):
    backend = LocalBackend(tmp_path / "state", kill_wait_s=2)
    req = SubmitRequest(
        run_id="r-1",
        pool="elastic",
        role="ROLLOUT",
        array_size=2,
        gpus_per_node=0,
        run_dir=str(tmp_path / "run"),
        model="m",
        python=sys.executable,
        worker_script="/bin/true",
        command=("sleep", "600"),
    )
    script = "#!/bin/bash\nsleep 600\n"
    job = backend.submit(req, script)
    added = backend.submit(SubmitRequest(**{**req.__dict__, "array_size": 1, "first_task": 5}), script)
    assert [(r.array_task_id, r.state) for r in backend.poll([job, added])] == [
        (0, "RUNNING"),
        (1, "RUNNING"),
        (5, "RUNNING"),
    ]
    assert {r.name for r in backend.find_by_name("pearl.r-1.elastic")} == {"pearl.r-1.elastic"}
    backend.cancel_tasks([(job, 1), (added, 5), ("local-nothere", 3)])
    assert [(r.array_task_id, r.state) for r in backend.poll([job, added])] == [
        (0, "RUNNING"),
        (1, "CANCELLED"),
        (5, "CANCELLED"),
    ]
    backend.cancel([job])
    assert [r.state for r in backend.poll([job])] == ["CANCELLED", "CANCELLED"]
