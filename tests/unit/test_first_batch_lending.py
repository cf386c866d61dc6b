"""The first batch's lending, live (pearlctl/daemon/borrowing.py), at the seam of a fake clock and no agents:

- a trainer that waits and reported no expected wait (none measured yet: the first batch) gets the planner's
  prediction of the batch in flight as its wait, when the run has a measured profile; a borrow is planned on
  it, its return deadline the decision time plus that prediction;
- without a measured profile (UNMEASURED) that wait is unknown and nothing is lent on it;
- once the rollout driver reports no work left after the trainer began waiting (its batch is complete: it
  trains next), a lent GPU goes back at the next tick although its deadline is still ahead, whatever the
  policy; a wait that began after the work emptied (the next batch is not launched yet) is not such a batch.

The run is test_borrowing_snapshot.py's "q": a trainer pool of 2 GPUs and a rollout pool of one serving GPU.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor
from pearlctl.planner import budget, plan, view
from pearlctl.planner import profile as profiles
from pearlctl.planner.predict import predict
from pearlctl.state.rows import Transition
from pearlctl.state.store import Store
from tests.conftest import REPO, FakeClock, create_serving_run

T0 = 1_000_000.0
# a batch of long multi-turn trajectories: far longer than a cold borrow and a return on the H100 profile
WORK = {"trajectories": 512, "turns_left": 8, "turns_left_max": 20, "decode_tokens_per_turn": 400,
        "decode_tokens_per_turn_max": 2000, "prefill_tokens_per_turn": 300, "context_tokens": 4000,
        "tool_latency_s": 5.0, "tool_latency_max_s": 30.0}  # fmt: skip


@pytest.fixture
def run(tmp_path: Path):
    clock = FakeClock(T0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        create_serving_run(store, tmp_path)
        ex = Executor(store, DaemonEffects(store, "q", None), run_id="q", epoch=None, clock=clock)
        c = Controller(store, "q", None, clock=clock)
        c.borrowing = Borrowing(store, ex, "q", clock=clock)
        yield SimpleNamespace(store=store, clock=clock, c=c, b=c.borrowing)


def measured(run) -> None:
    prof = profiles.load(REPO / "examples/profiles/qwen3-8b-h100.toml")
    run.c.operator.set_profile(parse(bodies.ProfileBody, {"profile": profiles.to_dict(prof)}))


def waiting(run, since: float, wait_s: float | None = None) -> None:
    """The trainer's report: it waits since ``since`` (a new step), with no expected wait by default."""
    report = {"phase": "waiting", "step": 1, "phase_since": since, "reported_at": since}
    if wait_s is not None:
        report["expected_wait_s"] = wait_s
    run.store.update_fields("runs", "q", epoch=None, trainer=report)


def progress(run, work: dict | None) -> None:
    """The rollout driver's report: ``work`` in flight, or none left."""
    body = {"queued": 0, "generating": work["trajectories"], "work": work} if work else {"queued": 0, "work": {}}
    run.c.trainer.rollout_progress(parse(bodies.Progress, body))


def lend(run, deadline: float) -> dict:
    """The state a DONE borrow leaves: a trainer GPU lent (serving), due back at ``deadline``."""
    gpu = next(g for g in run.store.fleet.gpus("q") if g.pool == "trainer")
    run.store.update_fields("gpus", gpu.id, epoch=None, borrowed=1, return_deadline=deadline)
    return gpu


def returns(run) -> list[Transition]:
    return [t for t in run.store.transitions.all("q") if t.kind == "return"]


@pytest.mark.parametrize("policy", ["pearl", "greedy"])
def test_an_unknown_first_wait_is_the_prediction_and_the_borrow_is_due_back_when_it_ends(run, policy):
    measured(run)
    run.c.operator.borrow(parse(bodies.Borrow, {"policy": policy}))
    waiting(run, T0)
    progress(run, WORK)
    run.clock.now = T0 + 3.0
    s = run.b.inputs.snapshot(run.clock.now)
    expected = predict(s.work, plan.current_deployment(s), s.profile).seconds
    assert s.trainer.wait_predicted and not s.trainer.wait_known and not s.trainer.batch_ready
    assert s.trainer.wait_left_s == pytest.approx(expected) and expected > 60.0
    borrow = run.b.plan_borrow(run.clock.now)
    assert borrow is not None and borrow["view"]["wait_from"] == "prediction"
    assert borrow["return_deadline"] == pytest.approx(run.clock.now + expected)
    run.b.tick()  # the daemon plans that borrow, its deadline the same
    planned = [t for t in run.store.transitions.all("q") if t.kind == "borrow"]
    assert len(planned) == 1 and list(planned[0].gpu_ids) == borrow["gpu_ids"]
    assert planned[0].detail["return_deadline"] == pytest.approx(run.clock.now + expected)
    assert planned[0].detail["wait_from"] == "prediction"


def test_without_a_measured_profile_an_unknown_wait_lends_nothing(run):
    run.c.operator.borrow(parse(bodies.Borrow, {"policy": "greedy"}))
    waiting(run, T0)
    progress(run, WORK)
    s = run.b.inputs.snapshot(T0 + 3.0)
    assert s.profile.name == "unmeasured" and not s.trainer.wait_known and not s.trainer.wait_predicted
    assert s.trainer.wait_left_s == 0.0
    assert run.b.plan_borrow(T0 + 3.0) is None
    run.clock.now = T0 + 3.0
    run.b.tick()
    assert run.store.transitions.all("q") == []
    # the same batch with a hint from the user (PEARL_FIRST_WAIT_S): lent on the hint
    waiting(run, T0, wait_s=600.0)
    assert run.b.plan_borrow(T0 + 3.0)["return_deadline"] == pytest.approx(T0 + 600.0)


@pytest.mark.parametrize("policy", ["pearl", "greedy"])
@pytest.mark.parametrize("wait_s", [None, 900.0])  # predicted (the first batch), or reported: longer than it took
def test_a_lent_gpu_goes_back_when_the_trainers_batch_is_complete_before_its_deadline(run, policy, wait_s):
    measured(run)
    run.c.operator.borrow(parse(bodies.Borrow, {"policy": policy}))
    waiting(run, T0, wait_s)
    progress(run, WORK)
    deadline = T0 + 900.0
    gpu = lend(run, deadline)
    run.clock.now = T0 + 60.0
    run.b.tick()
    assert returns(run) == []  # the batch runs on: the lent GPU serves
    progress(run, None)  # the driver: no work left — the batch the trainer waits for is complete
    assert run.store.runs.get("q")["rollout"]["emptied_at"] == T0 + 60.0
    s = run.b.inputs.snapshot(run.clock.now)
    assert s.trainer.batch_ready and s.trainer.phase == "waiting"
    lent = next(g for g in s.gpus if g.id == gpu.id)
    assert budget.must_return(s, lent) and view.lendable(s) == []
    run.clock.now = T0 + 60.5  # the next tick: back although its deadline is 840 s ahead
    run.b.tick()
    [back] = returns(run)
    assert back.gpu_ids == (gpu.id,) and back.detail["why"] == "the trainer's batch is complete"
    assert back.detail["return_deadline"] == deadline and run.clock.now < deadline


def test_a_wait_that_began_after_the_work_emptied_is_for_the_next_batch_and_keeps_lent_gpus(run):
    """Between batches of a synchronous loop the trainer reports its next wait at the end of its step, before
    the driver launches the batch: that is not a complete batch (a policy may lend ahead into it)."""
    run.c.operator.borrow(parse(bodies.Borrow, {"policy": "greedy"}))
    waiting(run, T0, wait_s=300.0)
    progress(run, WORK)
    run.clock.now = T0 + 50.0
    progress(run, None)  # batch 1 ended at T0 + 50
    waiting(run, T0 + 70.0, wait_s=300.0)  # the trainer trained, and waits for batch 2 from T0 + 70
    run.store.update_fields("runs", "q", epoch=None, trainer=dict(run.store.runs.get("q")["trainer"], step=2))
    lend(run, T0 + 70.0 + 300.0)
    run.clock.now = T0 + 75.0
    progress(run, None)  # still nothing in flight: the emptying is kept from T0 + 50
    assert run.store.runs.get("q")["rollout"]["emptied_at"] == T0 + 50.0
    assert not run.b.inputs.snapshot(run.clock.now).trainer.batch_ready
    run.b.tick()
    assert returns(run) == []
    progress(run, WORK)  # batch 2 launched: in flight again
    assert run.store.runs.get("q")["rollout"]["emptied_at"] is None


def test_the_snapshot_keeps_the_latest_batchs_work_as_it_began_for_decisions_between_batches(run):
    """``Snapshot.last_batch``: the driver's first report with work after none; kept while the batch runs down
    and between batches (when ``work`` is empty), replaced when the next batch begins."""
    assert run.b.inputs.snapshot(T0).last_batch.empty  # no batch seen yet
    progress(run, WORK)
    progress(run, dict(WORK, trajectories=100, turns_left=2))  # the batch runs down
    s = run.b.inputs.snapshot(T0)
    assert s.work.trajectories == 100 and s.last_batch.trajectories == 512 and s.last_batch.turns_left == 8
    progress(run, None)  # between batches: nothing in flight, the batch as it began is kept
    s = run.b.inputs.snapshot(T0)
    assert s.work.empty and s.last_batch.trajectories == 512
    progress(run, dict(WORK, trajectories=256))  # the next batch
    assert run.b.inputs.snapshot(T0).last_batch.trajectories == 256
