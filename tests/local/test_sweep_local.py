"""`pearlctl simulate --sweep --executor local` without Slurm: submitit's LocalExecutor runs every scenario x
seed x policy as its own process, the merged table has every scenario x policy with n = the seeds, and each
seed's numbers equal an in-process `compare` of the same scenario and seed (deterministic). Without
--folder, submitit's folder under the state directory is removed once the results are read."""

from __future__ import annotations

import json

from pearlctl.sim import report
from pearlctl.sim.compare import compare
from pearlctl.sim.scenario import load
from tests.conftest import REPO, Pearlctl

SCENARIOS = [REPO / "examples/scenarios/short-steps-8b.toml", REPO / "examples/scenarios/bursty-elastic-8b.toml"]
POLICIES = ["static", "elastic"]
SEEDS = [1, 2]
STEPS = 1


def in_process(path, seed: int) -> dict:
    scenario = load(path).with_overrides(steps=STEPS, seed=seed)
    return json.loads(json.dumps(report.to_json(scenario, compare(scenario, POLICIES, workers=1))))


def check_merged(doc: dict) -> None:
    assert doc["policies"] == POLICIES
    assert set(doc["scenarios"]) == {load(p).name for p in SCENARIOS}
    for path in SCENARIOS:
        row = doc["scenarios"][load(path).name]
        assert row["seeds"] == SEEDS and row["steps"] == STEPS
        for p in POLICIES:
            assert row["policies"][p]["n"] == len(SEEDS)
        for seed in SEEDS:
            assert row["runs"][str(seed)] == in_process(path, seed)
        values = [row["runs"][str(s)]["policies"]["static"]["samples_per_s"] for s in SEEDS]
        assert row["policies"]["static"]["samples_per_s"]["mean"] == round(sum(values) / len(values), 4)
        assert "static/elastic" in row["ratios"]


def test_sweep_on_the_local_executor(tmp_path):
    pc = Pearlctl(tmp_path / "state")
    args = ["simulate", *map(str, SCENARIOS), "--sweep", "--compare", ",".join(POLICIES)]
    args += ["--seeds", ",".join(map(str, SEEDS)), "--steps", str(STEPS), "--executor", "local"]
    proc = pc(*args, "--json", timeout=240)
    doc = json.loads(proc.stdout)
    assert doc["sweep"]["executor"] == "local" and doc["sweep"]["tasks"] == 8 and doc["sweep"]["folder"] is None
    check_merged(doc)
    assert list((tmp_path / "state" / "submitit").iterdir()) == []  # the default folder was removed

    # the table: one row per scenario x policy, with the seeds' count, and the ratios per scenario
    table = pc(*args, "--folder", str(tmp_path / "kept"), timeout=240).stdout
    for name in ("short-steps-8b", "bursty-elastic-8b"):
        assert sum(1 for line in table.splitlines() if name in line and ("static" in line or "elastic" in line)) >= 2
        assert f"{name} (seeds 1, 2): static/elastic" in table
    assert f"submitit files: {tmp_path / 'kept'}" in table
    assert len(list((tmp_path / "kept").glob("*_result.pkl"))) == 8  # --folder: kept, one result per task


def test_a_failing_task_exits_3_and_keeps_the_folder(tmp_path):
    """A task that raises on its node: exit 3, the traceback's last lines and the kept folder named."""
    pc = Pearlctl(tmp_path / "state", {"PEARL_POLICY_PATH": str(tmp_path / "policies")})
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "boom.py").write_text(
        "def decide(snapshot, **kw):\n    raise RuntimeError('boom on purpose')\n"
    )
    proc = pc("simulate", str(SCENARIOS[0]), "--sweep", "--policy", "boom", "--seeds", "1", "--steps", "1",
              "--executor", "local", check=3, timeout=120)  # fmt: skip
    assert "boom on purpose" in proc.stderr and "the job files are kept in" in proc.stderr
    assert any((tmp_path / "state" / "submitit").iterdir())
