"""Launch bookkeeping with a scripted backend at the seam: intent first, ids after, clean failure."""

from pathlib import Path

import pytest

from pearlctl.backends import BackendError
from pearlctl.config import parse_spec
from pearlctl.ops.launcher import LaunchError, launch
from pearlctl.slurm.client import SlurmClient, SlurmError
from pearlctl.slurm.runner import CommandResult
from pearlctl.state.store import Store


class ScriptedBackend:
    name = "slurm"

    def __init__(self, fail_on: str | None = None):
        self.fail_on, self.submitted, self.cancelled = fail_on, [], []

    def submit(self, req, script):
        if req.pool == self.fail_on:
            raise BackendError("sbatch: error: QOSMaxGRESPerUser")
        self.submitted.append(req.pool)
        return str(100 + len(self.submitted))

    def cancel(self, job_ids):
        self.cancelled += job_ids


def spec(tmp_path: Path):
    (tmp_path / "m").mkdir()
    data = {
        "run": {"name": "r", "model": "m", "run_dir": "run"},
        "pools": {"trainer": {"nodes": 1, "gpus_per_node": 1}, "rollout": {"nodes": 2, "gpus_per_node": 1}},
    }
    return parse_spec(data, tmp_path / "r.toml", ("never",))


def test_launch_records_intent_then_job_ids(tmp_path):
    backend = ScriptedBackend()
    with Store.open(tmp_path / "s.db") as store:
        result = launch(spec(tmp_path), store, backend)
        assert result.job_ids == {"trainer": "101", "rollout": "102"}
        assert store.runs.get(result.run_id)["state"] == "ACTIVE"
        allocs = store.fleet.allocations(result.run_id)
        assert sorted((a.pool, a.array_index, a.job_id, a.state) for a in allocs) == [
            ("rollout", 0, "102", "PENDING"),
            ("rollout", 1, "102", "PENDING"),
            ("trainer", 0, "101", "PENDING"),
        ]
        # the journal shows every allocation REQUESTED (intent) before it was submitted
        created = [j for j in store.journal.read(result.run_id) if j["entity"] == "allocations"]
        assert [j["to_state"] for j in created][:3] == ["REQUESTED"] * 3
    assert (tmp_path / "run" / "jobs" / "rollout.sbatch").read_text().count("--array=0-1") == 1


def test_failed_submission_cancels_what_was_submitted_and_ends_consistently(tmp_path):
    backend = ScriptedBackend(fail_on="rollout")
    with Store.open(tmp_path / "s.db") as store:
        with pytest.raises(LaunchError) as info:
            launch(spec(tmp_path), store, backend)
        assert info.value.exit_code == 3 and "QOSMaxGRESPerUser" in str(info.value)
        assert backend.cancelled == ["101"]
        run = store.runs.find("r")
        assert run["state"] == "FAILED"
        assert {a.state for a in store.fleet.allocations(run["id"])} == {"ENDED"}


class FailingRunner:
    def run(self, argv, *, timeout, input=None):
        return CommandResult(tuple(argv), 1, "", "sbatch: error: invalid partition specified: nope")


def test_slurm_errors_name_the_command_and_what_slurm_said():
    with pytest.raises(SlurmError) as info:
        SlurmClient(FailingRunner()).submit("#!/bin/bash\n", workdir="/tmp")
    assert "sbatch --parsable" in str(info.value) and "invalid partition specified: nope" in str(info.value)
