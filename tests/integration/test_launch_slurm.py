"""pearlctl against the real local Slurm cluster: launch arrays, see them run, preempt one, cancel."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pearlctl.state.store import Store
from tests.conftest import Pearlctl, wait_for, write_spec

POLL_S = 2.0

MIXED = """
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 2
[pools.rollout]
partition = "debug"
nodes = 2
gpus_per_node = 2
[pools.elastic]
partition = "preempt"
nodes = 2
gpus_per_node = 2
"""

# Fills the cluster: one non-preemptible trainer node and three preemptible elastic nodes.
FULL = """
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 8
[pools.elastic]
partition = "preempt"
nodes = 3
gpus_per_node = 8
preempt_notice_s = 30
"""


@pytest.fixture
def pc(tmp_path, cluster) -> Pearlctl:
    return Pearlctl(tmp_path / "state", cluster.env)


def spec(cluster, model_dir, name, pools) -> Path:
    d = cluster.new_shared_dir(name)
    return write_spec(
        d / f"{name}.toml", name=name, model=model_dir, run_dir=d / "run", pools=pools, backend="slurm", poll=POLL_S
    )


def test_dry_run_prints_array_scripts_validated_against_sinfo(pc, cluster, model_dir):
    out = pc("launch", str(spec(cluster, model_dir, "dry", MIXED)), "--dry-run")
    assert out.stdout.count("#SBATCH --array=") == 3
    assert "#SBATCH --array=0-1" in out.stdout and "#SBATCH --partition=preempt" in out.stdout
    assert "#SBATCH --requeue" in out.stdout and "#SBATCH --signal=B:USR2@60" in out.stdout
    assert cluster.active_jobs() == []
    bad = spec(
        cluster,
        model_dir,
        "badpart",
        MIXED.replace('"preempt"', '"preemptible"').replace(
            "gpus_per_node = 2\n[pools.rollout]", "gpus_per_node = 16\n[pools.rollout]"
        ),
    )
    err = pc("launch", str(bad), check=2).stderr
    assert "pools.elastic.partition" in err and "debug, high, preempt" in err
    assert "pools.trainer.gpus_per_node" in err and "at most 8" in err
    assert cluster.active_jobs() == []


def test_launch_runs_arrays_status_shows_slurm_state_then_cancel(pc, cluster, model_dir):
    launched = json.loads(
        pc("launch", str(spec(cluster, model_dir, "mixed", MIXED)), "--wait", "--timeout", "60", "--json").stdout
    )
    assert launched["backend"] == "slurm" and launched["running"] is True
    job_ids = set(launched["job_ids"].values())
    assert len(job_ids) == 3 and set(cluster.active_jobs()) >= job_ids
    doc = pc.json("status", "mixed")
    assert set(doc) >= {"run", "pools", "allocations", "gpus", "workers", "transitions"}
    allocs = doc["allocations"]
    assert len(allocs) == 5 and {(a["state"], a["slurm_state"]) for a in allocs} == {("RUNNING", "RUNNING")}
    assert all(a["node"] in {"gpu1", "gpu2", "gpu3", "gpu4"} for a in allocs)
    gpus = [g for g in doc["gpus"] if g["state"] == "UP"]
    assert len(gpus) == 10
    assert {g["role"] for g in gpus if g["pool"] == "trainer"} == {"TRAIN"}
    assert {g["role"] for g in gpus if g["pool"] != "trainer"} == {"ROLLOUT"}
    # device indices come from Slurm's GRES detail, not from counting
    per_alloc = {}
    for g in gpus:
        per_alloc.setdefault(g["allocation_id"], []).append(g["idx"])
    assert all(len(v) == 2 for v in per_alloc.values())

    # several shells asking at once never see "database is locked"
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda _: pc("status", "mixed", "--json", check=None), range(6)))
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]

    assert "CANCELLED" in pc("cancel", "mixed").stdout
    doc = pc.json("status", "mixed")
    assert doc["run"]["state"] == "CANCELLED"
    assert {a["state"] for a in doc["allocations"]} == {"ENDED"}
    assert not set(cluster.active_jobs()) & job_ids


def test_a_real_preemption_shows_up_within_two_poll_intervals(pc, cluster, model_dir, tmp_path):
    path = spec(cluster, model_dir, "pre", FULL)
    pc("launch", str(path), "--wait", "--timeout", "60")
    doc = pc.json("status", "pre")
    assert {a["state"] for a in doc["allocations"]} == {"RUNNING"}

    high = cluster.run(
        "sbatch", "--parsable", "-p", "high", "-N1", "--gres=gpu:8", "-o", "/dev/null", "--wrap", "sleep 600"
    ).stdout.strip()

    def preempting():
        d = pc.json("status", "pre")
        return [(a, time.time()) for a in d["allocations"] if a["state"] == "PREEMPTING"]

    (alloc, seen_at), *_ = wait_for(preempting, timeout=30, every=0.3)
    assert alloc["pool"] == "elastic"
    # Measured from state, not from this test's CLI calls (each one several CPU-bound seconds on a busy
    # machine): the journal row of the poll that saw it against Slurm's PreemptTime, which is whole seconds.
    (seen,) = [
        r
        for r in pc.json("journal", "pre")
        if r["entity"] == "allocations" and r["entity_id"] == str(alloc["id"]) and r["to_state"] == "PREEMPTING"
    ]
    lag = seen["ts"] - alloc["preempted_at"]
    print(f"preemption journaled {lag:.2f}s after Slurm's PreemptTime (poll interval {POLL_S}s)")
    assert lag <= 2 * POLL_S + 1, f"preemption journaled {lag:.1f}s after Slurm's PreemptTime"

    # after GraceTime the task is requeued (PENDING, restart 1); once the high job leaves it runs again
    def requeued():
        d = pc.json("status", "pre")
        return [a for a in d["allocations"] if a["id"] == alloc["id"] and a["state"] == "PENDING"]

    (pending,) = wait_for(requeued, timeout=40)
    assert pending["restarts"] == 1
    cluster.run("scancel", high)

    def rerunning():
        d = pc.json("status", "pre")
        return [a for a in d["allocations"] if a["id"] == alloc["id"] and a["state"] == "RUNNING"]

    (again,) = wait_for(rerunning, timeout=60)
    assert again["restarts"] == 1

    with Store.open(tmp_path / "state" / "state.db", readonly=True) as store:
        events = [
            j["event"]
            for j in store.journal.read(alloc["run_id"])
            if j["entity"] == "allocations" and str(j["entity_id"]) == str(alloc["id"])
        ]
    assert events[-4:] == ["started", "preempted", "requeued", "started"], events

    # the batch shell got the preemption signal and the agent drained
    logs = "".join(p.read_text() for p in (path.parent / "run" / "logs").glob("elastic-*.log"))
    assert "got USR2" in logs and '"event": "drain"' in logs
    pc("cancel", "pre")
