"""`simulate --sweep` and `profile --slurm` refuse bad input with exit 2 and a message naming what is wrong,
before anything is submitted; the sweep's merge aggregates per scenario x policy across seeds."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pearlctl.cli import app
from tests.conftest import REPO

SHORT = str(REPO / "examples/scenarios/short-steps-8b.toml")
BURSTY = str(REPO / "examples/scenarios/bursty-elastic-8b.toml")


def _invoke(tmp_path, monkeypatch, *args):
    monkeypatch.setenv("PEARL_STATE_DIR", str(tmp_path / "state"))
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([SHORT, "--sweep", "--compare", "static,nosuchpolicy"], "nosuchpolicy"),
        ([SHORT, "/nonexistent/scenario.toml", "--sweep", "--policy", "static"], "cannot read scenario"),
        ([SHORT, "--sweep"], "give exactly one of --policy NAME or --compare a,b,c"),
        ([SHORT, "--sweep", "--policy", "static", "--seeds", "1,x"], "--seeds must be distinct non-negative"),
        ([SHORT, "--sweep", "--policy", "static", "--seeds", "1,1"], "--seeds must be distinct non-negative"),
        ([SHORT, "--sweep", "--policy", "static", "--seed", "3"], "with --sweep use --seeds"),
        ([SHORT, "--sweep", "--policy", "static", "--timeline", "x.png"], "not with --sweep"),
        ([SHORT, "--sweep", "--policy", "static", "--executor", "k8s"], "--executor must be auto, slurm or local"),
        ([SHORT, "--sweep", "--policy", "static", "--time", "soon"], "--time: must be"),
        ([SHORT, "--sweep", "--policy", "static", "--partition", "a b"], "--partition: must be"),
        ([SHORT, SHORT, "--sweep", "--policy", "static"], "two scenarios are named short-steps-8b"),
        ([SHORT, "--policy", "static", "--seeds", "1,2"], "--seeds only go with --sweep"),
        ([SHORT, "--policy", "static", "--executor", "local"], "--executor only go with --sweep"),
        ([SHORT, BURSTY, "--policy", "static"], "give one SCENARIO.toml (several only with --sweep), got 2"),
    ],
)
def test_simulate_sweep_rejects_bad_input_with_exit_2(tmp_path, monkeypatch, args, message):
    code, output = _invoke(tmp_path, monkeypatch, "simulate", *args)
    assert code == 2, output
    assert message in output
    assert not (tmp_path / "state" / "submitit").exists()  # nothing was submitted


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slurm", "--worker", "http://x:1"], "not with --worker"),
        (["--slurm", "--time", "soon"], "--time: must be"),
        (["--slurm", "--nodelist", "a;b"], "--nodelist: must be"),
        (["--partition", "debug"], "only go with --slurm"),
        (["--gpus", "2"], "only go with --slurm"),
    ],
)
def test_profile_slurm_rejects_bad_input_with_exit_2(tmp_path, monkeypatch, args, message):
    code, output = _invoke(tmp_path, monkeypatch, "profile", "somerun", *args)
    assert code == 2, output
    assert message in output


def test_merge_takes_mean_and_spread_per_scenario_and_policy():
    from pearlctl.ops import sweep
    from pearlctl.sim.run import RunResult
    from pearlctl.sim.scenario import load

    def result(policy: str, samples: int) -> RunResult:
        return RunResult(policy, "s", True, 100.0, 2, samples, 0.0, 1, 0, {}, 1, 0, {"ROLLOUT": 3600.0}, [], {})

    scenario = load(SHORT)
    tasks = sweep.tasks_of([scenario], [1, 2], ["static", "pearl"])
    assert [(t.scenario.seed, t.policy) for t in tasks] == [(1, "static"), (1, "pearl"), (2, "static"), (2, "pearl")]
    doc = sweep.merge(tasks, [result("static", 100), result("pearl", 200), result("static", 300), result("pearl", 300)])
    row = doc["scenarios"]["short-steps-8b"]
    assert row["seeds"] == [1, 2] and doc["policies"] == ["static", "pearl"]
    assert row["policies"]["static"]["n"] == 2
    assert row["policies"]["static"]["samples_per_s"] == {"mean": 2.0, "sd": 1.4142, "min": 1.0, "max": 3.0}
    assert row["policies"]["pearl"]["rollout_gpu_h"]["mean"] == 1.0
    # pearl/static per seed: 2.0 and 1.0
    assert row["ratios"]["pearl/static"] == {"mean": 1.5, "sd": 0.7071, "min": 1.0, "max": 2.0}
    assert set(row["runs"]) == {"1", "2"} and row["runs"]["2"]["seed"] == 2
    # default seeds: the scenario's own and the next two
    assert [t.scenario.seed for t in sweep.tasks_of([scenario], None, ["static"])] == [
        scenario.seed + i for i in range(3)
    ]
