"""A run with ``engine = "paced"`` on the local Slurm cluster: the real launcher, daemon, agents, gateway and
vllm-router, and the reference rollout driver, with the paced engine (pearlctl/agent/engines/paced.py) in the
rollout workers' place. Every episode completes through the run's one endpoint, the workers are paced engines
started by their agents, and `status` and `doctor` say the run is paced."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.integration.test_elastic_e2e import ROLLOUT2
from tests.integration.test_elastic_e2e import make_run as make_run  # the fixture

pytestmark = pytest.mark.timeout(600)

PROFILE = REPO / "tests" / "data" / "paced-fast.toml"


def test_a_paced_run_serves_every_episode_and_says_it_is_paced(make_run):
    run = make_run("paced", ROLLOUT2, trainer=False, steps=1, paced=True)  # one step: no trainer publishes weights
    run.start_driver(steps=1, prompts=16, group=4, tool_s=0.2, max_tokens=64)
    assert run.finish_driver(240) == 0, run.driver_log()
    assert run.completed() == run.expected == 64

    # the workers are paced engines, each started by its node's agent (its log names it and its profile)
    logs = sorted((run.run_dir / "logs").glob("vllm-*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        text = log.read_text()
        assert "-m pearlctl.agent.engines.paced" in text and f"profile {PROFILE}" in text, text[-2000:]
    workers = [w for w in run.workers() if w.role == "ROLLOUT"]
    assert len(workers) == 2 and all(w.state == "READY" for w in workers), workers
    assert run.gateway_stats()["completed"] >= 2 * 64  # two turns an episode, all through the run's endpoint

    doc = run.status()
    assert doc["run"]["spec"]["engine"] == "paced" and doc["run"]["spec"]["engine_profile"] == str(PROFILE)
    assert "engine paced (no model)" in run.pc("status", "paced").stdout
    checks = {c["name"]: c for c in json.loads(run.pc("doctor", "--json", check=None).stdout)}
    assert checks["paced runs"]["status"] == "warn" and "paced" in checks["paced runs"]["detail"]
