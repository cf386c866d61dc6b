"""The predictor corrects itself: a finished batch's measured time against the completion predicted at its
start goes into a per-shape ratio (pearlctl.planner.correct) that the daemon's snapshots apply to every
prediction (``Profile.time_scale``). Pure parts directly; the daemon's watch with its real objects over a
real SQLite state, progress reports through the controller, and a clock the test moves."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.cli.render import status_tables
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor, PlanKind, TransitionDetail
from pearlctl.planner import correct
from pearlctl.planner import profile as profiles
from pearlctl.planner.model import Deployment, Mode, Work
from pearlctl.planner.predict import completion_s, predict
from pearlctl.planner.profile import DecodeModel, Profile, ProfileError
from pearlctl.state.store import Store
from pearlctl.state.views import run_document
from tests.conftest import FakeClock, running_run

PROFILE = Profile(
    name="p",
    model="m",
    hardware="h",
    decode=DecodeModel(weights_s=0.01, seq_s=1e-4, kv_s_per_token=1e-8),
    prefill_tok_s=10_000,
    kv_capacity_tokens=1_000_000,
)
WORK = {
    "trajectories": 32,
    "turns_left": 3,
    "turns_left_max": 3,
    "decode_tokens_per_turn": 64,
    "decode_tokens_per_turn_max": 64,
    "prefill_tokens_per_turn": 32,
    "context_tokens": 64,
    "tool_latency_s": 1.0,
    "tool_latency_max_s": 1.0,
}


# -- pure --------------------------------------------------------------------------------------------------


def test_a_quiet_batch_sets_its_shapes_correction_and_unseen_shapes_take_the_overall_one():
    # spread 0 (fixed tool latencies): the batch counts with NOISE_FLOOR only, against the PRIOR_SD of a shape
    # not seen yet, so it moves the correction almost all the way
    state, check = correct.learn(None, "a", predicted_s=10.0, measured_s=13.0)
    assert check is not None and check.ratio == pytest.approx(1.3)
    assert 1.28 < correct.factor(state, "a") < 1.3 and check.corrected == correct.factor(state, "a")
    state, check = correct.learn(state, "a", predicted_s=10.0, measured_s=12.0)
    assert 1.2 < correct.factor(state, "a") < 1.25  # the later batch weighs more: the ratio may drift
    assert state["shapes"]["a"]["batches"] == 2
    assert correct.factor(state, "b") == pytest.approx(state["all"]["ratio"])  # an unseen shape
    assert correct.factor(None, "b") == 1.0
    state, _ = correct.learn(state, "b", predicted_s=10.0, measured_s=10.0 * state["all"]["ratio"])
    assert correct.factor(state, "b") == pytest.approx(state["all"]["ratio"], rel=1e-3)  # its prior: the overall


def test_a_batch_whose_straggler_spreads_moves_the_correction_less_but_the_correction_still_converges():
    quiet, _ = correct.learn(None, "a", predicted_s=10.0, measured_s=7.0)
    noisy, _ = correct.learn(None, "a", predicted_s=10.0, measured_s=7.0, spread=0.25)
    assert correct.factor(quiet, "a") < correct.factor(noisy, "a") < 1.0
    assert correct.factor(noisy, "a") > 0.8  # a 30%-short batch of a 25%-spread shape: under half the way
    for _ in range(30):  # the same ratio again and again: the evidence adds up
        noisy, _ = correct.learn(noisy, "a", predicted_s=10.0, measured_s=7.0, spread=0.25)
    assert correct.factor(noisy, "a") == pytest.approx(0.7, rel=0.02)
    assert correct.learn(None, "a", 10.0, 7.0, spread=math.nan)[0] == quiet  # no spread known: quiet


def test_a_wild_batch_moves_the_correction_at_most_to_the_clamp_and_short_ones_teach_nothing():
    state, check = correct.learn(None, "a", predicted_s=10.0, measured_s=1000.0)  # stalled by an outage
    assert check.ratio == correct.MAX_RATIO
    same, none = correct.learn(state, "a", predicted_s=0.2, measured_s=5.0)
    assert none is None and same == state
    assert correct.learn(state, "a", predicted_s=math.inf, measured_s=5.0)[1] is None


SPREADING = {"tool_latency_s": 1.0, "tool_latency_max_s": 4.6}  # exponential tools: p99 = 4.6 means


def _watched(work: Work, at: float = 100.0) -> tuple[dict, float, float]:
    """A state watching a batch of ``work`` on two colocated workers from its first report at ``at``; the
    prediction's seconds and the straggler's expected tools."""
    p = predict(work, Deployment(Mode.COLOCATED, decode=2), PROFILE)
    w = correct.watch(p, correct.shape(work, 2), at, [1, 2], work.trajectories)
    return {"watch": w, "batch_since": at}, p.seconds, p.straggler_tools_s


def test_a_straggler_bound_batch_is_learned_without_its_tools_luck():
    state, predicted, tools_s = _watched(Work(**{**WORK, **SPREADING}))
    assert tools_s > 0 and state["watch"]["tools_s"] == pytest.approx(tools_s)
    # the straggler drew 3 s more tools than expected: the batch ran 3 s long by luck alone, and counts as
    # predicted, as a batch of fixed tools would (NOISE_FLOOR only)
    after, check = correct.finish(state, 100.0 + predicted + 3.0, correct.Tools(tools_s + 3.0))
    assert check.ratio == pytest.approx(1.0) and check.measured_s == pytest.approx(predicted)
    quiet, _ = correct.learn(None, check.shape, predicted, predicted)
    assert correct.factor(after, check.shape) == pytest.approx(correct.factor(quiet, check.shape))
    # a straggler that drew fast tools: the batch was short by luck, and counts as predicted too
    _, check = correct.finish(state, 100.0 + predicted - 1.0, correct.Tools(tools_s - 1.0))
    assert check.ratio == pytest.approx(1.0)
    # what is not the tools' luck is learned: 2 s more than predicted beside a straggler of expected tools
    _, check = correct.finish(state, 100.0 + predicted + 2.0, correct.Tools(tools_s))
    assert check.measured_s == pytest.approx(predicted + 2.0)
    # a report of tools longer than the batch itself takes out no more than the batch's time allows
    _, check = correct.finish(state, 100.0 + predicted, correct.Tools(predicted + 3.0))
    assert check.measured_s == pytest.approx(predicted - (predicted - tools_s))


def test_tools_luck_is_left_in_a_batch_set_by_its_throughput_or_watched_from_its_middle():
    lucky = correct.Tools(slowest_s=20.0)
    state, predicted, _ = _watched(Work(**WORK))  # fixed tools, 16 trajectories a worker: throughput-bound
    assert state["watch"]["tools_s"] is None
    assert correct.finish(state, 100.0 + 2 * predicted, lucky)[1].ratio == pytest.approx(2.0)
    state, predicted, _ = _watched(Work(**{**WORK, **SPREADING}))
    state["batch_since"] = 99.0  # the watch began after the batch's first report: its tools are not all watched
    assert correct.finish(state, 100.0 + 2 * predicted, lucky)[1].ratio == pytest.approx(2.0)


def test_a_slowest_sum_the_modelled_law_would_not_draw_is_no_luck_and_stays_in():
    state, predicted, tools_s = _watched(Work(**{**WORK, **SPREADING}))
    sd = state["watch"]["spread"] * predicted  # the straggler's standard deviation
    # a tail far heavier than the shifted exponential the predictor models (a lognormal's, say), or calls far
    # slower than reported: the slowest sum is 4 standard deviations above the expected maximum; it stays in
    heavy = correct.Tools(slowest_s=tools_s + 4 * sd)
    assert correct.finish(state, 100.0 + predicted + 4 * sd, heavy)[1].measured_s == pytest.approx(predicted + 4 * sd)
    within = correct.Tools(slowest_s=tools_s + 2.9 * sd)
    assert correct.finish(state, 100.0 + predicted + 2.9 * sd, within)[1].measured_s == pytest.approx(predicted)


def test_a_batch_that_began_at_time_zero_is_measured_from_then():
    # (a simulation's first batch starts at t = 0): a watch begun late in it covers too little of it to learn from
    state, predicted, _ = _watched(Work(**{**WORK, **SPREADING}), at=215.0)
    state["batch_since"] = 0.0
    assert correct.finish(state, 258.0)[1] is None


def test_shapes_bucket_trajectories_per_worker_tokens_and_tool_latency():
    w = Work(**WORK)
    assert correct.shape(w, 1) != correct.shape(w, 8)  # per worker
    assert correct.shape(w, 2) == correct.shape(replace(w, trajectories=34), 2)  # same order of magnitude
    assert correct.shape(w, 1) != correct.shape(replace(w, decode_tokens_per_turn=512), 1)
    assert correct.shape(w, 1) != correct.shape(replace(w, tool_latency_s=10.0), 1)


def test_time_scale_multiplies_every_predicted_time():
    w, dep = Work(**WORK), Deployment(Mode.COLOCATED, decode=2)
    plain, scaled = predict(w, dep, PROFILE), predict(w, dep, replace(PROFILE, time_scale=1.25))
    assert scaled.seconds == pytest.approx(1.25 * plain.seconds)
    assert scaled.turn_s == pytest.approx(1.25 * plain.turn_s)
    assert scaled.phases_s == pytest.approx(tuple(1.25 * p for p in plain.phases_s))
    assert scaled.batch == plain.batch  # a time, not the engine's batch


def test_a_profile_file_neither_carries_nor_sets_the_correction():
    doc = profiles.to_dict(replace(PROFILE, time_scale=2.0))
    assert "time_scale" not in doc["profile"]
    doc["profile"]["time_scale"] = 2.0
    with pytest.raises(ProfileError, match="unknown key.*time_scale"):
        profiles.from_dict(doc)
    with pytest.raises(ProfileError, match="time_scale"):
        replace(PROFILE, time_scale=0.0)


# -- the daemon's watch --------------------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path):
    clock = FakeClock(1_000_000.0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        running_run(store, tmp_path, pool="rollout", role="ROLLOUT", nodes=2)
        ex = Executor(store, DaemonEffects(store, "r", None), run_id="r", epoch=None, clock=clock)
        controller = Controller(store, "r", None, clock=clock)
        controller.borrowing = Borrowing(store, ex, "r", clock=clock)
        controller.operator.set_profile(parse(bodies.ProfileBody, {"profile": profiles.to_dict(PROFILE)}))
        yield store, controller, clock


def report(controller: Controller, trajectories: int, tools: dict | None = None, **changes: float) -> None:
    work = {**WORK, **changes, "trajectories": trajectories} if trajectories else None
    body = {"generating": trajectories, "work": work, "tools": tools}
    controller.trainer.rollout_progress(parse(bodies.Progress, body))


def tick(controller: Controller) -> None:
    with controller.lock:
        controller.borrowing.tick()


def checks(store: Store) -> list[dict]:
    return [j["data"] for j in store.journal.read("r") if j["event"] == "prediction checked"]


def test_a_finished_batch_is_checked_against_its_prediction_and_corrects_the_next(run):
    store, controller, clock = run
    expected = completion_s(Work(**WORK), Deployment(Mode.COLOCATED, decode=2), PROFILE)
    for _ in range(2):
        t0 = clock.now
        report(controller, 32)
        tick(controller)
        watch = store.runs.get("r")["predictor"]["watch"]
        assert watch["since"] == t0 and watch["predicted_s"] == pytest.approx(expected)
        clock.now += 5.0
        report(controller, 20)  # the batch goes on: the watch stays
        tick(controller)
        assert store.runs.get("r")["predictor"]["watch"]["since"] == t0
        clock.now = t0 + 1.3 * expected  # the batch took 30% longer than predicted
        report(controller, 0)
        tick(controller)
        assert store.runs.get("r")["predictor"]["watch"] is None
        clock.now += 10.0
    done = checks(store)
    assert len(done) == 2 and all(c["ratio"] == pytest.approx(1.3) for c in done)
    report(controller, 32)
    snap = controller.borrowing.inputs.snapshot(clock.now)
    assert snap.profile.time_scale == pytest.approx(1.3, rel=5e-3)  # the shape seen twice: its ratio
    assert completion_s(snap.work, Deployment(Mode.COLOCATED, decode=2), snap.profile) == pytest.approx(
        snap.profile.time_scale * expected
    )


def test_the_watch_keeps_the_spread_its_prediction_expects_and_a_spreading_batch_teaches_less(run):
    # exponential tools (p99 = 4.6 means): the straggler's draws spread the batch's completion
    store, controller, clock = run
    spreading = {"tool_latency_s": 1.0, "tool_latency_max_s": 4.6}
    expected = predict(Work(**{**WORK, **spreading}), Deployment(Mode.COLOCATED, decode=2), PROFILE)
    assert expected.spread > 0.1
    t0 = clock.now
    report(controller, 32, **spreading)
    tick(controller)
    watch = store.runs.get("r")["predictor"]["watch"]
    assert watch["spread"] == pytest.approx(expected.spread) and watch["predicted_s"] == pytest.approx(expected.seconds)
    clock.now = t0 + 1.3 * expected.seconds
    report(controller, 0)
    tick(controller)
    (check,) = checks(store)
    quiet, _ = correct.learn(None, check["shape"], 10.0, 13.0)  # the same ratio from a batch of fixed tools
    assert check["ratio"] == pytest.approx(1.3) and 1.0 < check["corrected"] < correct.factor(quiet, check["shape"])
    assert check["corrected"] == pytest.approx(
        correct.factor(correct.learn(None, check["shape"], 10.0, 13.0, spread=expected.spread)[0], check["shape"])
    )


def test_the_batchs_last_report_carries_its_tool_times_and_the_daemon_takes_their_luck_out(run):
    store, controller, clock = run
    expected = predict(Work(**{**WORK, **SPREADING}), Deployment(Mode.COLOCATED, decode=2), PROFILE)
    t0 = clock.now
    report(controller, 32, **SPREADING)
    tick(controller)
    clock.now = t0 + expected.seconds + 4.0  # 4 s late, all of it the straggler's tool draws
    report(controller, 0, tools={"slowest_s": expected.straggler_tools_s + 4.0})
    tick(controller)
    (check,) = checks(store)
    assert check["ratio"] == pytest.approx(1.0) and check["measured_s"] == pytest.approx(expected.seconds)


def test_a_change_of_serving_gpus_mid_batch_is_not_counted_as_prediction_error(run):
    store, controller, clock = run
    report(controller, 32)
    tick(controller)
    first = store.runs.get("r")["predictor"]["watch"]
    gpu = store.fleet.gpus("r")[0].id
    retire = TransitionDetail(plan=PlanKind.RETIRE)
    tid = controller.borrowing.executor.plan("retire", [gpu], detail=retire, from_role="ROLLOUT")
    clock.now += 3.0
    report(controller, 30)
    with controller.lock:
        controller.borrowing.check_prediction()
    assert store.runs.get("r")["predictor"]["watch"] is None  # a transition is open: no watch
    store.set_state("transitions", tid, expect="PLANNED", to="ROLLED_BACK", event="test: dropped")
    store.update_fields("gpus", gpu, event="role set", role="IDLE")
    clock.now += 2.0
    report(controller, 28)
    with controller.lock:
        controller.borrowing.check_prediction()
    second = store.runs.get("r")["predictor"]["watch"]
    assert second["since"] == clock.now and len(second["gpus"]) == len(first["gpus"]) - 1
    one_worker = completion_s(Work(**{**WORK, "trajectories": 28}), Deployment(Mode.COLOCATED, decode=1), PROFILE)
    assert second["predicted_s"] == pytest.approx(one_worker)  # the new report, on the GPUs serving now
    clock.now += 20.0
    report(controller, 0)
    with controller.lock:
        controller.borrowing.check_prediction()
    (c,) = checks(store)
    assert c["measured_s"] == pytest.approx(20.0)  # from the stable watch, not the batch's start


def test_a_watch_that_saw_only_the_batchs_tail_teaches_nothing(run):
    store, controller, clock = run
    report(controller, 32)
    gpu = store.fleet.gpus("r")[0].id
    retire = TransitionDetail(plan=PlanKind.RETIRE)
    tid = controller.borrowing.executor.plan("retire", [gpu], detail=retire, from_role="ROLLOUT")
    with controller.lock:  # a transition is open from the batch's start: no watch
        controller.borrowing.check_prediction()
    assert store.runs.get("r")["predictor"].get("watch") is None
    clock.now += 30.0
    store.set_state("transitions", tid, expect="PLANNED", to="ROLLED_BACK", event="test: dropped")
    store.update_fields("gpus", gpu, event="role set", role="IDLE")
    report(controller, 4)  # the tail: a watch starts here
    with controller.lock:
        controller.borrowing.check_prediction()
    assert store.runs.get("r")["predictor"]["watch"]["since"] == clock.now
    clock.now += 5.0
    report(controller, 0)
    with controller.lock:
        controller.borrowing.check_prediction()
    assert checks(store) == []  # 5 s of a 35-s batch: below correct.MIN_COVER
    assert store.runs.get("r")["predictor"]["batch_since"] is None


def test_status_says_how_far_batches_were_from_their_prediction(run):
    store, controller, clock = run
    report(controller, 32)
    tick(controller)
    clock.now += 100.0
    report(controller, 0)
    tick(controller)
    doc = run_document(store, "r")
    ratio = doc["run"]["predictor"]["all"]["ratio"]
    console = Console(width=200, record=True)
    console.print(status_tables(doc))
    assert f"predictor: batches took {ratio:.2f}x the predicted time (1 checked, 1 shape(s))" in console.export_text()


def test_the_trainers_wait_counts_down_once_as_the_hook_reports_what_is_left(run):
    """TrainerHook.wait_until reports, each poll, the wait *left*: the snapshot takes it from that report, not
    again from the start of the wait (which would count the elapsed time twice)."""
    store, controller, clock = run

    def phase(left: float) -> None:
        controller.trainer.phase(parse(bodies.TrainerPhase, {"phase": "waiting", "step": 3, "expected_wait_s": left}))

    phase(100.0)  # the wait begins: 100 s expected
    clock.now += 30.0
    phase(70.0)  # the hook's next poll: 70 s left
    clock.now += 10.0
    assert controller.borrowing.inputs.snapshot(clock.now).trainer.wait_left_s == pytest.approx(60.0)


def test_with_nothing_serving_mid_batch_no_watch_is_kept_and_nothing_fails(run):
    """Every serving GPU gone while work is in flight (the run ending, a pool lost): the prediction is infinite,
    so there is nothing to watch — and an infinite number is no JSON the state could store."""
    store, controller, clock = run
    report(controller, 32)
    tick(controller)
    assert store.runs.get("r")["predictor"]["watch"] is not None
    for g in store.fleet.gpus("r"):
        store.update_fields("gpus", g.id, event="role set", role="IDLE")
    clock.now += 2.0
    report(controller, 30)
    with controller.lock:
        controller.borrowing.check_prediction()  # raised sqlite3.IntegrityError (json_valid) before
    assert store.runs.get("r")["predictor"]["watch"] is None
