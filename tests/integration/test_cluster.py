"""The local Slurm cluster itself: shape, partitions, GPU arrays, accounting."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the fixture's type; conftest is not importable as a module
    from conftest import SlurmCluster


def test_cluster_has_4_nodes_with_8_gpus_and_4_partitions(slurm_cluster: SlurmCluster) -> None:
    nodes = slurm_cluster.run("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %G %T").stdout.split("\n")
    rows = sorted(line.split() for line in nodes if line.strip())
    assert [r[0] for r in rows] == ["gpu1", "gpu2", "gpu3", "gpu4"]
    assert all(r[1] == "gpu:8" for r in rows), rows
    assert all(r[2] in {"idle", "mixed", "allocated"} for r in rows), rows

    parts = {}
    for line in slurm_cluster.run("scontrol", "show", "partition", "-o").stdout.splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        parts[f["PartitionName"]] = f
    assert set(parts) == {"debug", "preempt", "preempt0", "high"}
    assert (parts["debug"]["Default"], parts["debug"]["PriorityTier"], parts["debug"]["PreemptMode"]) == (
        "YES",
        "1",
        "OFF",
    )
    assert (parts["preempt"]["PriorityTier"], parts["preempt"]["PreemptMode"], parts["preempt"]["GraceTime"]) == (
        "1",
        "REQUEUE",
        "10",
    )
    # preempt0: the same preemptible partition with no grace, a hard kill the moment a high job needs the node
    assert (parts["preempt0"]["PriorityTier"], parts["preempt0"]["PreemptMode"], parts["preempt0"]["GraceTime"]) == (
        "1",
        "REQUEUE",
        "0",
    )
    assert (parts["high"]["PriorityTier"], parts["high"]["PreemptMode"]) == ("10", "OFF")
    assert all(p["TotalNodes"] == "4" and "gres/gpu=32" in p["TRES"] for p in parts.values()), parts


def test_gpu_array_tasks_see_their_gpus(slurm_cluster: SlurmCluster) -> None:
    slurm_cluster.cancel_all()
    out = slurm_cluster.new_shared_dir("gpu-array")
    script = (
        "#!/bin/bash\n"
        f"f={out}/task-$SLURM_ARRAY_TASK_ID.txt\n"
        'echo "$SLURMD_NODENAME|$CUDA_VISIBLE_DEVICES|$SLURM_JOB_GPUS|$SLURM_ARRAY_JOB_ID|$SLURM_JOB_ID" > $f.tmp\n'
        "mv $f.tmp $f\n"
    )
    (out / "job.sh").write_text(script)
    job = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--array=0-1",
        "--gres=gpu:2",
        "-J",
        "gpu-array",
        "-o",
        f"{out}/%A_%a.out",
        str(out / "job.sh"),
    ).stdout.strip()
    assert job.isdigit(), job

    states = slurm_cluster.wait_job_states(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=60)
    assert set(states.values()) == {"COMPLETED"}, states
    seen = {}
    for task in (0, 1):
        node, cuda, job_gpus, array_job, _ = (out / f"task-{task}.txt").read_text().strip().split("|")
        assert array_job == job
        assert node.startswith("gpu")
        gpus = cuda.split(",")
        assert len(gpus) == 2 and all(g.isdigit() for g in gpus), cuda
        assert job_gpus == cuda  # no cgroups: indices are not renumbered
        seen[task] = (node, cuda)
    assert len(seen) == 2

    # slurmdbd accounting is on: sacct knows both tasks (it may lag the job end by a moment)
    want = [[f"{job}_0", "COMPLETED"], [f"{job}_1", "COMPLETED"]]
    rows = slurm_cluster.accounting(job, "JobID,State", lambda rows: sorted(rows) == want)
    assert sorted(rows) == want
