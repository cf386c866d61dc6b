"""The simulator keeps the predictor's running correction as the live daemon does (pearlctl.planner.correct,
pearlctl/daemon/borrowing.py ``check_prediction`` and ``snapshot``): a watch from the last stable set of serving
GPUs, learned at the batch's end, and a snapshot whose profile's ``time_scale`` is the correction for the work's
shape. The trainer's ETA is the simulated trainer's own (examples/grpo/train.py) once it measured a wait; before
that, the planner's prediction of the batch in flight (pearlctl.planner.plan.expect_wait), as the daemon's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.planner import correct, plan
from pearlctl.planner.model import Move, MoveKind, Role
from pearlctl.planner.predict import completion_s
from pearlctl.sim import scenario as sc
from pearlctl.sim.correction import serving_workers
from pearlctl.sim.run import Sim, run_policy

REPO = Path(__file__).resolve().parents[2]


def _sim(name: str = "short-steps-8b", steps: int = 1, first_wait_s: float | None = None, **kw) -> Sim:
    """A scenario's simulation; its trainer's first expected wait unknown unless ``first_wait_s`` is given."""
    s = sc.load(REPO / f"examples/scenarios/{name}.toml").with_overrides(steps=steps, first_wait_s=first_wait_s)
    return Sim(s, "test", lambda snap: None, **kw)


def _until(sim: Sim, done, t: float = 0.0, limit: float = 600.0) -> float:
    while not done() and t < limit:
        sim.tick(t, sim.scenario.tick_s)
        t += sim.scenario.tick_s
    assert done(), "the condition never came"
    return t


def test_a_watch_starts_on_a_stable_set_of_serving_gpus_and_learns_at_the_batchs_end():
    sim = _sim()
    _until(sim, lambda: sim.launched == 1 and sim.correction.predictor.get("watch"))
    watch = sim.correction.predictor["watch"]
    snap = sim.view.snapshot(watch["since"], corrected=False)
    work = sim.view.work()
    assert watch["gpus"] == tuple(g.id for g in sim.gpus if g.role in (Role.ROLLOUT,))
    assert watch["predicted_s"] == pytest.approx(
        completion_s(work, plan.current_deployment(snap), sim.profile), rel=1e-9
    )
    assert watch["shape"] == correct.shape(work, serving_workers(snap.gpus, sim.gpw))
    start = watch["since"]
    t = _until(sim, lambda: sim.correction.checks, start)
    check = sim.correction.checks[0]
    measured = t - sim.scenario.tick_s - start  # to the first moment without work
    # less the straggler's tool luck, from the batch's tool calls as a driver timing them reports them
    slowest = sim.engine.slowest_tools(0, sim.batch)
    assert watch["tools_s"] is not None and watch["since"] == 0.0  # a straggler-bound batch watched from its start
    luck = correct.tool_luck(watch["tools_s"], watch["spread"] * watch["predicted_s"], slowest, measured)
    assert luck is not None and luck != 0
    assert check.measured_s == pytest.approx(measured - luck)
    assert check.predicted_s == watch["predicted_s"] and check.shape == watch["shape"]
    assert sim.correction.predictor["watch"] is None and sim.correction.predictor["all"]["batches"] == 1


def test_a_change_of_the_serving_gpus_drops_the_watch():
    sim = _sim()
    _until(sim, lambda: sim.correction.predictor.get("watch"))
    rollout = next(g for g in sim.gpus if g.pool == "rollout")
    t = sim.correction.predictor["watch"]["since"] + 1.0
    assert sim.moves.apply(Move(rollout.id, MoveKind.RETIRE, Role.ROLLOUT, Role.IDLE, 0.0), t)
    sim.correction.check(t)
    assert sim.correction.predictor["watch"] is None  # a transition is open
    sim.correction.check(rollout.busy_until)
    assert sim.correction.predictor["watch"]["gpus"] == sim.roles.serving_ids(rollout.busy_until)  # a new stable set
    assert rollout.id not in sim.correction.predictor["watch"]["gpus"]


def test_the_policy_sees_predictions_scaled_by_the_correction_for_the_works_shape():
    sim = _sim()
    _until(sim, lambda: sim.launched == 1)
    work = sim.view.work()
    snap = sim.view.snapshot(1.0)
    key = correct.shape(work, serving_workers(snap.gpus, sim.gpw))
    assert snap.profile.time_scale == 1.0  # nothing learned yet
    sim.correction.predictor = {"shapes": {key: {"ratio": 1.4, "batches": 2}}, "all": {"ratio": 0.8, "batches": 3}}
    assert sim.view.snapshot(1.0).profile.time_scale == 1.4
    sim.correction.predictor = {"shapes": {}, "all": {"ratio": 0.8, "batches": 3}}
    assert sim.view.snapshot(1.0).profile.time_scale == 0.8  # an unseen shape takes the overall ratio
    off = _sim(correction=False)
    off.correction.predictor = sim.correction.predictor
    assert off.view.snapshot(1.0).profile.time_scale == 1.0


def test_without_the_correction_nothing_is_learned():
    s = sc.load(REPO / "examples/scenarios/short-steps-8b.toml").with_overrides(steps=2)
    on, off = run_policy(s, "pearl"), run_policy(s, "pearl", correction=False)
    assert on.predictor_checks == 2 and on.predictor_ratio is not None
    assert off.predictor_checks == 0 and off.predictor_ratio is None


def test_before_its_first_measured_wait_the_lending_horizon_is_the_predicted_batch():
    # examples/grpo/train.py reports no ETA before it measured a wait (no PEARL_FIRST_WAIT_S): the snapshot's wait is
    # then the planner's own prediction of the batch in flight on the GPUs serving now (plan.expect_wait), as the
    # daemon's; once a wait was measured, the trainer's moving average, never the predictor.
    for name in ("short-steps-8b", "agentic-coding-8b"):  # sync and async
        sim = _sim(name)
        sim.engine.launch(0, sim.batch, 0.0)
        sim.launched = 1
        sim.roles.refresh(0.0)
        view = sim.view.trainer(5.0)
        assert view.phase == "waiting" and not view.wait_known
        snap = sim.view.snapshot(5.0)
        expected = completion_s(snap.work, plan.current_deployment(snap), snap.profile)
        assert snap.trainer.wait_predicted and snap.trainer.wait_left_s == pytest.approx(expected)
        assert expected > 10.0  # a whole batch ahead (short-steps: about 15 s)
        sim.wait_ema, sim.waiting_since = 120.0, 2.0
        measured = sim.view.snapshot(5.0).trainer
        assert measured.wait_known and not measured.wait_predicted
        assert measured.wait_left_s == pytest.approx(117.0)
        assert sim.view.trainer(500.0).wait_left_s == 0.0  # later than expected: floored, as the hook does
        # with PEARL_FIRST_WAIT_S (a user's hint, the scenario's first_wait_s), that is its ETA before any measured wait
        sim = _sim(name, first_wait_s=300.0)
        sim.engine.launch(0, sim.batch, 0.0)
        sim.launched = 1
        assert sim.view.snapshot(5.0).trainer.wait_left_s == pytest.approx(295.0)
    # with no work in flight nothing is predicted: nothing is lent on an unknown wait
    sim = _sim()
    assert sim.view.snapshot(0.0).trainer.wait_left_s == 0.0


def test_no_shipped_scenario_gives_a_first_wait_and_an_override_sets_or_unsets_it():
    for path in sorted((REPO / "examples/scenarios").glob("*.toml")):
        s = sc.load(path)
        assert s.training.first_wait_s is None, path.name  # no shipped or gated number leans on a hint
        hinted = s.with_overrides(first_wait_s=300.0)
        assert hinted.training.first_wait_s == 300.0
        assert hinted.with_overrides(steps=1).training.first_wait_s == 300.0
        assert hinted.with_overrides(first_wait_s=None).training.first_wait_s is None


def test_the_trainer_averages_its_waits_as_the_training_loop_does():
    sim = _sim(steps=3, first_wait_s=50.0)
    waits, t, before = [], 0.0, None
    while sim.trained < 3:
        sim.tick(t, sim.scenario.tick_s)
        t += sim.scenario.tick_s
        if before is None and sim.training_until is not None:  # a step starts: the wait it measured ends
            waits.append(max(sim.completed_at[sim.trained] - sim.waiting_since, 0.0))
        before = sim.training_until
    assert len(waits) == 3
    ema = 50.0  # from the first expected wait (PEARL_FIRST_WAIT_S)
    for w in waits:
        ema = 0.7 * ema + 0.3 * w
    assert sim.wait_ema == pytest.approx(ema)


def test_between_batches_the_snapshot_carries_the_latest_batchs_work_as_it_began():
    """``Snapshot.last_batch``, as the daemon keeps it from the driver's first report with work after none: the
    work at the batch's launch, kept while it runs down and between batches."""
    sim = _sim(steps=2)
    assert sim.view.snapshot(0.0).last_batch.empty  # before any batch
    t = _until(sim, lambda: sim.launched == 1)
    began = sim.view.work()
    assert not began.empty and sim.view.snapshot(t).last_batch == began
    t = _until(sim, lambda: not sim.engine.busy(), t)  # the batch ran down: nothing in flight
    s = sim.view.snapshot(t)
    assert s.work.empty and s.last_batch == began
