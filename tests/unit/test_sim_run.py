"""Every shipped scenario runs under the shipped policies (the daemon's own modules), the oracle is never
beaten, and `pearlctl simulate --json` prints the documented shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pearlctl.home import known_policies
from pearlctl.sim import report
from pearlctl.sim import scenario as sc
from pearlctl.sim.run import compare

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "examples/scenarios").glob("*.toml"))
POLICIES = ["static", "elastic", "pearl", "oracle"]
SHIPPED = [*known_policies(), "oracle"]  # the oracle bound holds against every shipped policy
# One RL step each keeps the whole file to seconds; the benchmark runs the scenarios' own step counts.
STEPS = 1


@pytest.fixture(scope="module", params=SCENARIOS, ids=lambda p: p.stem)
def compared(request):
    s = sc.load(request.param).with_overrides(steps=STEPS)
    return s, compare(s, SHIPPED)


def test_every_shipped_scenario_runs_every_policy_to_the_end(compared):
    s, results = compared
    for name, r in results.items():
        assert r.finished, name
        assert r.steps == STEPS and r.samples == STEPS * s.workload.batch_size
        assert r.samples_per_s > 0 and r.sim_time_s > 0


def test_no_policy_beats_the_oracle(compared):
    _, results = compared
    bound = results["oracle"].samples_per_s
    for name, r in results.items():
        assert r.samples_per_s <= bound * (1 + 1e-9), f"{name} {r.samples_per_s} > oracle {bound}"
    assert results["oracle"].trainer_delay_s == 0


def test_gpu_seconds_add_up_to_the_gpus_present(compared):
    s, results = compared
    fixed = s.cluster.trainer_gpus + s.cluster.rollout_gpus
    for r in results.values():
        total = sum(r.gpu_seconds_by_role.values())
        # fixed pools for the whole run, plus whatever elastic capacity was granted meanwhile
        assert total >= fixed * r.sim_time_s * 0.99
        assert total <= (fixed + s.cluster.elastic_gpus) * (r.sim_time_s + s.tick_s * 2)


def test_report_shape_and_ratios(compared):
    s, results = compared
    doc = report.to_json(s, {k: v for k, v in results.items() if k in POLICIES})
    assert set(doc["policies"]) == set(POLICIES)
    for p in doc["policies"].values():
        assert {"samples_per_s", "steps_per_hour", "trainer_delay_s", "transitions", "gpu_seconds_by_role"} <= set(p)
    assert {"pearl/static", "pearl/elastic", "pearl/oracle", "static/oracle"} <= set(doc["ratios"])


def test_the_cli_prints_one_json_object(tmp_path):
    png = tmp_path / "t.png"
    proc = subprocess.run(
        [sys.executable, "-m", "pearlctl", "simulate", str(REPO / "examples/scenarios/short-steps-8b.toml"),
         "--compare", "static,pearl,oracle", "--steps", "1", "--json", "--timeline", str(png)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) >= {"policies", "ratios"}
    assert set(doc["policies"]) == {"static", "pearl", "oracle"}
    assert isinstance(doc["policies"]["pearl"]["samples_per_s"], float)
    assert isinstance(doc["policies"]["pearl"]["transitions"], int)
    assert "pearl/static" in doc["ratios"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "no-such-policy"], "no policy 'no-such-policy'; known:"),
        ([], "give exactly one of --policy NAME or --compare"),
        (["--compare", "static,static"], "distinct policy names"),
        (["--policy", "static", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_the_cli_rejects_bad_input_with_exit_2(args, message):
    from typer.testing import CliRunner

    from pearlctl.cli import app

    result = CliRunner().invoke(app, ["simulate", str(REPO / "examples/scenarios/short-steps-8b.toml"), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_a_bad_scenario_exits_2_naming_the_key(tmp_path):
    from typer.testing import CliRunner

    from pearlctl.cli import app

    bad = tmp_path / "bad.toml"
    text = (REPO / "examples/scenarios/short-steps-8b.toml").read_text().replace("group_size", "group_sz")
    bad.write_text(text.replace("../profiles/", f"{REPO}/examples/profiles/"))
    result = CliRunner().invoke(app, ["simulate", str(bad), "--policy", "static"])
    assert result.exit_code == 2
    assert "unknown key(s) group_sz" in " ".join(result.output.split())
