"""The daemon and agents on the real local Slurm cluster: auth, one daemon per run, registration,
agent loss, a daemon restart that kills no worker, and the daemon run as a Slurm job."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest

from pearlctl.cli.render import slurm_id
from pearlctl.host.runfiles import read_address, read_secret
from tests.conftest import Pearlctl, alive, wait_for, write_spec

HEARTBEAT_S = 1.0

# No vLLM here: the rollout pool asks for no GPU (so no rollout worker) and the trainer's worker is a
# plain long-running command. Engines are covered by tests/engines and the end-to-end test.
POOLS = f"""
[pools.trainer]
partition = "debug"
nodes = 2
gpus_per_node = 2
train_command = ["{sys.executable}", "-c", "import time; time.sleep(3600)"]
[pools.rollout]
partition = "debug"
nodes = 1
gpus_per_node = 0
"""


@pytest.fixture
def run(slurm_cluster, tmp_path, model_dir):
    slurm_cluster.cancel_all()
    d = slurm_cluster.new_shared_dir("daemon")
    spec = write_spec(d / "d.toml", name="d", model=model_dir, run_dir=d / "run", pools=POOLS, backend="slurm", poll=10)
    pc = Pearlctl(tmp_path / "state", slurm_cluster.env)
    pc("launch", str(spec), "--wait", "--timeout", "60")
    yield pc, d / "run"
    address = read_address(d / "run")
    if address:
        try:
            os.kill(address["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    slurm_cluster.cancel_all()


def api(run_dir, path, *, token=None, run_id=None):
    address = read_address(run_dir)
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if run_id is not None:
        headers["X-Pearl-Run"] = run_id
    return httpx.get(address["url"] + path, headers=headers, timeout=5)


def start_daemon(pc):
    out = pc("daemon", "d", "--heartbeat-s", str(HEARTBEAT_S), "--lease-ttl-s", "30", "--json")
    return json.loads(out.stdout)


def test_auth_lease_registration_loss_and_restart(run, slurm_cluster):
    pc, run_dir = run
    address = start_daemon(pc)
    run_id = pc.json("status", "d")["run"]["id"]
    secret = read_secret(run_dir)
    assert oct((run_dir / ".pearl" / "secret").stat().st_mode & 0o777) == "0o600"

    # auth: no token, wrong token, wrong run are refused; the right ones get through
    assert api(run_dir, "/v1/health").status_code == 401
    assert api(run_dir, "/v1/health", token="x" * 43, run_id=run_id).status_code == 401
    assert api(run_dir, "/v1/health", token=secret, run_id="another-run").status_code == 403
    ok = api(run_dir, "/v1/health", token=secret, run_id=run_id)
    assert ok.status_code == 200 and ok.json()["epoch"] == address["epoch"]
    assert secret not in (run_dir / "logs" / "daemon.log").read_text()

    # metrics need the token too, and come from state
    assert api(run_dir, "/metrics").status_code == 401
    metrics = api(run_dir, "/metrics", token=secret, run_id=run_id)
    assert metrics.status_code == 200 and "pearl_gpus" in metrics.text and "pearl_transition_seconds" in metrics.text

    # borrowing is asked of the daemon: a bad policy is refused with the valid ones; a dry run changes nothing
    bad = pc("borrow", "d", "--policy", "yolo", check=2)
    assert "no policy 'yolo'" in bad.stderr and "greedy" in bad.stderr
    dry = json.loads(pc("borrow", "d", "--policy", "greedy", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and dry["plan"] is None and dry["view"]["phase"] is None  # no trainer report yet
    assert pc.json("status", "d")["run"]["policy"] == "never"
    assert json.loads(pc("return", "d", "--json").stdout)["lent_gpus"] == []

    # one daemon per run
    second = pc("daemon", "d", check=5)
    assert "a daemon already runs for run" in second.stderr

    # every agent registers; the trainer agents run their TRAIN worker
    def workers_ready():
        doc = pc.json("status", "d")
        ready = [w for w in doc["workers"] if w["state"] == "READY" and w["role"] == "TRAIN"]
        return doc if len(ready) == 2 else None

    doc = wait_for(workers_ready, 30)
    assert all(a["agent_seen_at"] for a in doc["allocations"])
    pids = {w["pid"] for w in doc["workers"]}

    # a daemon restart kills no worker: SIGKILL the daemon, start another, the same processes report
    os.kill(address["pid"], signal.SIGKILL)
    time.sleep(2 * HEARTBEAT_S)
    assert all(alive(p) for p in pids)
    restarted_at = time.time()
    new = _try_start(pc)  # at once: the killed holder's process is gone, so its lease is broken
    assert new and new["epoch"] > address["epoch"]
    assert any(j["event"] == "lease.broken" for j in pc.json("journal", "d"))

    def reattached():  # every agent heard by the new daemon (its times reach state at most every 5 s)
        doc = pc.json("status", "d")
        seen = [a["agent_seen_at"] or 0 for a in doc["allocations"]]
        return doc if min(seen) > restarted_at else None

    doc = wait_for(reattached, 15)
    assert {w["pid"] for w in doc["workers"] if w["state"] == "READY"} == pids

    trainers = [a for a in doc["allocations"] if a["pool"] == "trainer"]

    def gpus_and_workers(alloc_id):
        doc = pc.json("status", "d")
        gpus = {g["state"] for g in doc["gpus"] if g["allocation_id"] == alloc_id}
        workers = {w["state"] for w in doc["workers"] if w["allocation_id"] == alloc_id}
        return gpus, workers

    # agent lost hard (SIGKILL, as when its node dies): GPUs and workers LOST within two heartbeats,
    # and its trainer process does not outlive it
    victim = trainers[0]
    victim_worker = next(w["pid"] for w in doc["workers"] if w["allocation_id"] == victim["id"])
    os.kill(victim["agent_pid"], signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: gpus_and_workers(victim["id"]) == ({"LOST"}, {"LOST"}), 15, every=0.25)
    # timed from the state's own timestamps: when the daemon wrote LOST, not when a status call saw it
    victim_gpus = {str(g["id"]) for g in doc["gpus"] if g["allocation_id"] == victim["id"]}
    lost_at = max(
        j["ts"]
        for j in pc.json("journal", "d")
        if j["entity"] == "gpus" and j["entity_id"] in victim_gpus and j["to_state"] == "LOST"
    )
    print(f"agent loss recorded {lost_at - killed_at:.2f}s after SIGKILL (heartbeat {HEARTBEAT_S}s)")
    # + one check tick (0.5 s) and what the check and its writes wait for on a loaded 2-core machine (3.1 s was
    # seen there twice against a bound of 3.0)
    assert lost_at - killed_at <= 2 * HEARTBEAT_S + 1.5
    wait_for(lambda: not alive(victim_worker), 5)

    # the job cancelled (scancel): the other node's agent stops its worker and says it is leaving; its GPUs
    # leave the plan at once (GONE: nothing about them is unknown, so not LOST), the worker is STOPPED, and
    # Slurm's end is recorded a poll later. A trainer of 2 nodes is one job of 2 nodes (not an array of two
    # tasks, whose `scancel 5_1` would stop one node): cancelling it cancels both, the victim's already LOST
    other = trainers[1]
    assert slurm_id(other, doc["pools"]) == str(other["job_id"])
    slurm_cluster.run("scancel", slurm_id(other, doc["pools"]))
    cancelled_at = time.time()
    wait_for(lambda: gpus_and_workers(other["id"]) == ({"GONE"}, {"STOPPED"}), 15, every=0.25)
    other_gpus = {str(g["id"]) for g in doc["gpus"] if g["allocation_id"] == other["id"]}
    gone_at = max(
        j["ts"]
        for j in pc.json("journal", "d")
        if j["entity"] == "gpus" and j["entity_id"] in other_gpus and j["to_state"] == "GONE"
    )
    assert gone_at - cancelled_at <= 2 * HEARTBEAT_S + 1.5


def _try_start(pc):
    out = pc("daemon", "d", "--heartbeat-s", str(HEARTBEAT_S), "--lease-ttl-s", "30", "--json", check=None)
    return json.loads(out.stdout) if out.returncode == 0 else None


def test_daemon_as_a_slurm_job(run, slurm_cluster):
    pc, run_dir = run
    out = pc("daemon", "d", "--slurm", "--partition", "debug", "--heartbeat-s", "1", "--json", "--timeout", "60")
    address = json.loads(out.stdout)
    job_id = address["slurm_job_id"]
    run_id = pc.json("status", "d")["run"]["id"]
    squeue = slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%j %T %b").stdout.split()
    assert squeue[:2] == [f"pearl.{run_id}.daemon", "RUNNING"]  # its own small job, without a GPU
    assert "gpu" not in squeue[2]
    assert (run_dir / "logs" / f"daemon-{job_id}.log").exists()

    # a second daemon job for the run is refused before it reaches Slurm
    again = pc("daemon", "d", "--slurm", "--partition", "debug", check=5)
    assert "already" in again.stderr

    # the agents found it through the run directory and report to it
    def registered():
        doc = pc.json("status", "d")
        ready = [w for w in doc["workers"] if w["state"] == "READY" and w["role"] == "TRAIN"]
        return doc if len(ready) == 2 and all(a["agent_seen_at"] for a in doc["allocations"]) else None

    wait_for(registered, 30)

    # cancelling the run ends the daemon's job too, and the daemon stops cleanly (SIGTERM, lease released)
    pc("cancel", "d")
    slurm_cluster.wait_job_states(job_id, {"CANCELLED", "COMPLETED"}, timeout=30)
    wait_for(lambda: not alive(address["pid"]), 15)
    events = [j["event"] for j in pc.json("journal", "d")]
    log_tail = (run_dir / "logs" / f"daemon-{job_id}.log").read_text()[-3000:]
    assert "daemon stopped" in events and "lease.released" in events, log_tail
    assert "SIGTERM received: stopping" in log_tail and "stop recorded" in log_tail, log_tail
