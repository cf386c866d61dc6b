"""A real Slurm preemption with the daemon running and every agent heartbeating at 10 Hz.

The elastic task runs a worker on the paced engine (docs/paced.md: what is checked here is the daemon's and the
agent's; the agent draining a real vLLM worker is tests/engines/test_pd_switch_daemon.py's). A
high-priority job preempts it: Slurm signals the batch shell, the agent drains the worker within the pool's notice
while it keeps reporting, and the task is requeued and runs again. The daemon must stay up through it (the Slurm
poller and the heartbeats both move the allocation's row), and the GPU and worker states must say what happened —
no LOST (LOST means lost), no flapping back to UP while draining.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.state.store import Store
from tests.conftest import REPO, Pearlctl, alive, wait_for, write_spec
from tests.engines.conftest import PACED_RUN

pytestmark = pytest.mark.timeout(900)

# Three trainer nodes (a plain long-running command, no engine) fill three nodes; the elastic task holds the
# fourth node's 8 GPUs with one worker, so a high-priority 8-GPU job can only preempt it. (PACED_RUN: keys of
# [run], which write_spec's pools follow.)
POOLS = (
    PACED_RUN
    + f"""
[pools.trainer]
partition = "debug"
nodes = 3
gpus_per_node = 8
train_command = ["{sys.executable}", "-c", "import time; time.sleep(3600)"]
[pools.elastic]
partition = "preempt"
nodes = 1
gpus_per_node = 8
preempt_notice_s = 10
engine_args = {{ max_model_len = 512 }}
"""
)


@pytest.fixture
def run(slurm_cluster, tmp_path):
    slurm_cluster.cancel_all()
    d = slurm_cluster.new_shared_dir("pre10hz")
    spec = write_spec(
        d / "p.toml", name="p", model=REPO / "examples/models/tiny", run_dir=d / "run", pools=POOLS,
        backend="slurm", poll=1,
    )  # fmt: skip
    pc = Pearlctl(tmp_path / "state", slurm_cluster.env)
    pc("launch", str(spec), "--wait", "--timeout", "60")
    yield pc, d / "run", tmp_path / "state" / "state.db"
    address = read_address(d / "run")
    if address and alive(address["pid"]):
        os.kill(address["pid"], signal.SIGTERM)
    slurm_cluster.cancel_all()


def test_preemption_while_agents_heartbeat_at_10hz(run, slurm_cluster):
    pc, run_dir, db = run
    daemon = json.loads(pc("daemon", "p", "--heartbeat-s", "0.1", "--json").stdout)

    def elastic_ready():
        doc = pc.json("status", "p")
        alloc = next(a for a in doc["allocations"] if a["pool"] == "elastic")
        ready = [w for w in doc["workers"] if w["allocation_id"] == alloc["id"] and w["state"] == "READY"]
        return (alloc, ready[0]) if ready and ready[0]["routable"] else None

    alloc, worker = wait_for(elastic_ready, 240, every=1)
    high = slurm_cluster.run(
        "sbatch", "--parsable", "-p", "high", "-N1", "--gres=gpu:8", "-o", "/dev/null", "--wrap", "sleep 600"
    ).stdout.strip()

    def requeued():
        doc = pc.json("status", "p")
        a = next(a for a in doc["allocations"] if a["id"] == alloc["id"])
        return a if a["state"] == "PENDING" and a["restarts"] == 1 else None

    wait_for(requeued, 120, every=0.5)
    assert alive(daemon["pid"]), "the daemon stopped during the preemption"
    slurm_cluster.run("scancel", high)
    wait_for(lambda: _running_again(pc, alloc["id"]), 120)
    assert alive(daemon["pid"]) and read_address(run_dir)["epoch"] == daemon["epoch"]

    with Store.open(db, readonly=True) as store:
        run_id = alloc["run_id"]
        journal = store.journal.read(run_id)
        gpus = {g.id for g in store.fleet.gpus(run_id) if g.allocation_id == alloc["id"]}
    # LOST means lost: nothing of this run was marked LOST, and the daemon never failed a tick
    assert not [j for j in journal if j["to_state"] == "LOST"], [j for j in journal if j["to_state"] == "LOST"]
    assert not [j for j in journal if j["event"] == "tick error"]
    # each GPU of the preempted task: UP -> DRAINING (notice) -> GONE (it left), then UP again after the requeue
    for gid in gpus:
        edges = [(j["from_state"], j["to_state"]) for j in journal
                 if j["entity"] == "gpus" and j["entity_id"] == str(gid) and j["to_state"]]  # fmt: skip
        assert edges[:3] == [(None, "UP"), ("UP", "DRAINING"), ("DRAINING", "GONE")], edges
        assert all(e != ("DRAINING", "UP") for e in edges), edges
    # the worker drained and stopped, and left routing (DRAINING is never routed) as soon as the notice
    # reached its agent: before Slurm's own view of the preemption reached the daemon's poll
    wid = str(worker["id"])
    w_edges = [(j["from_state"], j["to_state"], j["ts"]) for j in journal
               if j["entity"] == "workers" and j["entity_id"] == wid and j["to_state"]]  # fmt: skip
    assert [e[:2] for e in w_edges][-2:] == [("READY", "DRAINING"), ("DRAINING", "STOPPED")], w_edges
    preempted = next(j["ts"] for j in journal if j["event"] == "preempted" and j["entity_id"] == str(alloc["id"]))
    assert w_edges[-2][2] <= preempted + 1.0, (w_edges, preempted)
    print(json.dumps({"gpu_edges": edges, "worker_edges": [e[:2] for e in w_edges]}))


def _running_again(pc: Pearlctl, alloc_id: int) -> dict | None:
    doc = pc.json("status", "p")
    a = next(a for a in doc["allocations"] if a["id"] == alloc_id)
    return a if a["state"] == "RUNNING" and a["restarts"] == 1 else None
