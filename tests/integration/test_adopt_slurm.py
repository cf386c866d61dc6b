"""A launch that crashed between `sbatch` and recording the job id is finished by launching again:
the submitted job is found by name and adopted, never submitted twice (real Slurm)."""

from __future__ import annotations

import pytest

from pearlctl import policies
from pearlctl.backends.slurm import SlurmBackend
from pearlctl.config import load_spec
from pearlctl.ops.launcher import launch
from pearlctl.slurm.client import SlurmClient
from pearlctl.state.store import Store
from tests.conftest import write_spec

POOLS = """
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 1
[pools.rollout]
partition = "debug"
nodes = 2
gpus_per_node = 1
"""


class Crash(Exception):
    """Stands for the launching process dying."""


class CrashAfterFirstSubmit:
    """The real Slurm backend, except that the process 'dies' right after the first sbatch returns."""

    def __init__(self, real: SlurmBackend):
        self.real, self.name, self.submitted = real, real.name, []

    def submit(self, req, script):
        self.submitted.append(self.real.submit(req, script))
        raise Crash(f"died after submitting {req.pool}")

    def __getattr__(self, item):
        return getattr(self.real, item)


def test_relaunch_adopts_the_job_a_crashed_launch_submitted(slurm_cluster, tmp_path, model_dir):
    slurm_cluster.cancel_all()
    d = slurm_cluster.new_shared_dir("adopt")
    spec = load_spec(
        write_spec(d / "adopt.toml", name="adopt", model=model_dir, run_dir=d / "run", pools=POOLS, backend="slurm"),
        policies.known_policies(),
    )
    real = SlurmBackend()
    with Store.open(tmp_path / "state.db") as store:
        crashing = CrashAfterFirstSubmit(real)
        with pytest.raises(Crash):
            launch(spec, store, crashing)
        (orphan,) = crashing.submitted
        run = store.runs.find("adopt")
        assert run["state"] == "SUBMITTING"
        assert {p["name"]: p["job_id"] for p in store.runs.pools(run["id"])} == {"trainer": None, "rollout": None}

        result = launch(spec, store, real)
        assert result.run_id == run["id"]
        assert result.adopted == ["trainer"] and result.job_ids["trainer"] == orphan
        assert store.runs.get(run["id"])["state"] == "ACTIVE"
        assert {a.state for a in store.fleet.allocations(run["id"])} == {"PENDING"}

    names = [r.name for r in SlurmClient().queue() if r.name.startswith(f"pearl.{run['id']}.")]
    trainer_tasks = [n for n in names if n.endswith(".trainer")]
    assert len(trainer_tasks) == 1, names  # one array task, submitted once
    slurm_cluster.cancel_all()
