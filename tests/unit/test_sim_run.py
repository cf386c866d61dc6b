"""Every shipped scenario runs under the shipped policies (the daemon's own modules), the oracle is never
beaten, `pearlctl simulate --json` prints the documented shape, leaves are paid as the live system pays them
(the agent's drain on a preemption notice, a hard kill without one, the abort before a move), and the trainer
reports its wait as the live training loop does."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pearlctl.planner.model import Move, MoveKind, Plan, Role
from pearlctl.policies import known_policies
from pearlctl.sim import report
from pearlctl.sim import scenario as sc
from pearlctl.sim.compare import compare
from pearlctl.sim.engine import W_OFF, W_ROLLOUT
from pearlctl.sim.migration import ABORT_S
from pearlctl.sim.run import Sim, drain_s, run_policy

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


# -- leaves as the live system pays them ------------------------------------------------------------------


def test_the_drain_window_is_the_agents():
    # PEARL_DRAIN_TIMEOUT_S = notice - 5 (pearlctl/slurm/script.py); the agent keeps min(5 s, 25 %) of it
    # for the abort and the stop (pearlctl/agent/workers.py)
    assert drain_s(30.0) == pytest.approx(20.0)
    assert drain_s(120.0) == pytest.approx(110.0)
    assert drain_s(0.0) > 0.0  # no notice: the drain would end after the GPU is gone (a hard kill)


def _bursty(**availability) -> sc.Scenario:
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml").with_overrides(steps=1)
    quiet = {"grant_interval_s": 0.0, "reclaim_interval_s": 0.0, "lifetime_s": 0.0}
    return replace(s, availability=replace(s.availability, **(quiet | availability)))


def test_a_preempted_worker_drains_from_its_notice_and_stops_at_the_end_of_the_drain():
    s = _bursty(initial_gpus=8)
    sim = Sim(s, "test", lambda snap: None)
    sim._availability(0.0)
    elastic = [g for g in sim.gpus if g.pool == "elastic" and g.present]
    for g in elastic:
        g.role = Role.ROLLOUT
    sim.gpus[elastic[0].id].ends_at = 100.0  # what a preemption notice at t = 70 sets, and:
    sim.gpus[elastic[0].id].abort_at = 70.0 + drain_s(30.0)
    k = elastic[0].id // sim.gpw
    sim.roles.refresh(75.0)
    assert sim.engine.w_role[k] == W_ROLLOUT and not sim.engine.w_admit[k]  # draining: serves, takes nothing new
    assert sim.engine.w_admit[elastic[1].id // sim.gpw]
    sim.roles.refresh(90.0)
    assert sim.engine.w_role[k] == W_OFF  # aborted what was left and stopped
    assert sim.roles.counts["TRANSITION"] == 1


@pytest.mark.parametrize("notice_s, hard", [(30.0, False), (0.0, True)])
def test_a_preemption_with_notice_is_graceful_and_one_without_is_a_hard_kill(notice_s, hard):
    # eight elastic GPUs from the start, preempted mid-batch while their workers decode first turns
    s = _bursty(
        events=(sc.AvailabilityEvent(at_s=0.0, grant=8), sc.AvailabilityEvent(at_s=120.0, preempt=8)),
        notice_s=notice_s,
    )
    r = run_policy(s, "elastic")
    assert r.finished and r.preemptions == 8
    if hard:
        assert r.engine["killed"] > 0 and r.engine["lost_tokens"] > 0 and r.engine["aborted"] == 0
    else:
        assert r.engine["aborted"] > 0 and r.engine["killed"] == 0 and r.engine["lost_tokens"] == 0


def test_a_worker_leaving_its_role_pays_the_abort_before_its_own_transition():
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml").with_overrides(steps=1)
    c = s.profile.costs
    sim = Sim(s, "test", lambda snap: None)
    sim._availability(0.0)
    lent, rollout = sim.gpus[0], sim.gpus[s.cluster.trainer_gpus]
    lent.role, lent.borrowed = Role.ROLLOUT, True
    assert sim.moves.apply(Move(lent.id, MoveKind.RETURN, Role.ROLLOUT, Role.TRAIN, 0.0), 10.0)
    assert lent.busy_until == pytest.approx(10.0 + ABORT_S + c.sleep_s + c.reload_s)
    assert sim.moves.apply(Move(rollout.id, MoveKind.RETIRE, Role.ROLLOUT, Role.IDLE, 0.0), 10.0)
    assert rollout.busy_until == pytest.approx(10.0 + ABORT_S + c.sleep_s)


def test_a_plans_switches_run_one_group_at_a_time_as_the_daemon_runs_them():
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml").with_overrides(steps=1)
    sim = Sim(s, "test", lambda snap: None)
    sim._availability(0.0)
    rollout = [g for g in sim.gpus if g.pool == "rollout" and g.present]
    half = len(rollout) // sim.gpw // 2 * sim.gpw  # whole workers: a prefill half and a decode half
    first, second = rollout[:half], rollout[half:]
    assert first and second
    for g in rollout:
        g.role = Role.ROLLOUT
    moves = [Move(g.id, MoveKind.SWITCH, Role.ROLLOUT, Role.PREFILL, 0.0) for g in first]
    moves += [Move(g.id, MoveKind.SWITCH, Role.ROLLOUT, Role.DECODE, 0.0) for g in second]
    sim.decide = lambda snap: Plan(None, tuple(moves), 0.0, 0.0, 0.0, why="scripted")  # type: ignore[arg-type]
    sim.moves.control(10.0)
    switch_s = ABORT_S + s.profile.costs.role_switch_s
    assert all(g.role is Role.PREFILL and g.busy_until == pytest.approx(10.0 + switch_s) for g in first)
    assert all(g.role is Role.ROLLOUT and g.busy_until <= 10.0 for g in second)  # waits, serving meanwhile
    assert sim.moves.next_switch(10.0 + switch_s / 2) == 0
    assert sim.moves.next_switch(10.0 + switch_s) == len(second)  # the first node's switch ended: the next one
    assert all(g.role is Role.DECODE and g.busy_until == pytest.approx(10.0 + 2 * switch_s) for g in second)


def test_the_sync_trainer_reports_its_wait_from_the_end_of_its_step():
    # examples/grpo/train.py reports "waiting" right after its step, with a moving average of its past waits:
    # the weight sync and the next batch's launch are inside that wait
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml")
    sim = Sim(s, "test", lambda snap: None)
    sim.trained = sim.launched = 3  # step 3 trained; the weight sync runs, batch 4 not launched yet
    sim.wait_ema, sim.waiting_since = 200.0, 1000.0
    view = sim.view.trainer(1004.0)
    assert view.phase == "waiting" and view.wait_left_s == pytest.approx(196.0)


# -- the rollout driver's join wait -----------------------------------------------------------------------


def test_the_sim_and_the_live_driver_wait_as_long_for_joining_workers():
    from pearlctl.router.client import JOIN_WAIT_S

    assert sc.JOIN_WAIT_S == JOIN_WAIT_S
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml")
    assert s.training.join_wait_s == JOIN_WAIT_S


def _lending(join_wait_s: float, joins_at: float) -> tuple[Sim, int]:
    """A synchronous batch due at t = 0 while two trainer GPUs (one worker) are being lent until ``joins_at``."""
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml").with_overrides(steps=1)
    sim = Sim(replace(s, training=replace(s.training, join_wait_s=join_wait_s)), "test", lambda snap: None)
    for g in sim.gpus[: sim.gpw]:
        g.role, g.borrowed, g.busy_until = Role.ROLLOUT, True, joins_at
    return sim, sim.gpus[0].id // sim.gpw


def _launch_time(sim: Sim, until: float = 60.0) -> float | None:
    t = 0.0
    while t < until:
        sim._trainer(t)
        if sim.launched:
            return t
        t += sim.scenario.tick_s
    return None


@pytest.mark.parametrize(
    "join_wait_s, joins_at, launch_at",
    [(15.0, 3.0, 3.0), (15.0, 40.0, 15.0), (0.0, 3.0, 0.0)],
    ids=["joins-in-time", "bounded", "off"],
)
def test_the_driver_launches_a_due_batch_once_joining_workers_serve_within_join_wait_s(
    join_wait_s, joins_at, launch_at
):
    # examples/grpo/rollout.py waits (pearlctl/router/client.py, wait_for_joining) while the daemon reports
    # workers joining, at most join_wait_s: the same for every policy, it is the driver's behaviour
    sim, _ = _lending(join_wait_s, joins_at)
    assert sim.joining(0.0) == 1
    assert _launch_time(sim) == pytest.approx(launch_at)


def test_a_worker_that_joined_before_the_launch_takes_first_turns():
    # the router's ring holds the joined worker when the batch's requests go out; one that joins after the
    # launch gets sessions only at their next turns (docs/simulator.md, routing)
    for join_wait_s, expect_first_turns in ((15.0, True), (0.0, False)):
        sim, k = _lending(join_wait_s, 3.0)
        t = 0.0
        while t <= 3.0:
            sim._trainer(t)
            if sim.gpus_changed or t >= sim.roles.next_expiry:
                sim.roles.refresh(t)
            sim.engine.step(t, sim.scenario.tick_s)
            t += sim.scenario.tick_s
        e = sim.engine
        first = ((e.run_w[: sim.batch] == k) | (e.disp_w[: sim.batch] == k)).any()
        assert bool(first) is expect_first_turns, join_wait_s
