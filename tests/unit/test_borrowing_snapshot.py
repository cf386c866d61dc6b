"""The daemon's side of the policies: the planner Snapshot built from state, the Work of a progress report,
the live execution of a plan's borrow moves, and the refusals (a predicting policy without a profile, a
malformed work report)."""

from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import ControlError, Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.policy_view import work_from_progress
from pearlctl.daemon.transitions import Executor
from pearlctl.planner.model import Role
from pearlctl.state.store import Store
from tests.conftest import create_serving_run, create_trainer_run

NOW = 1_000_000.0


@pytest.fixture
def daemon(tmp_path: Path):
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        alloc = create_trainer_run(store, tmp_path, job_id="1")
        store.fleet.upsert_node_gpus("r", alloc.id, "gpu1", [0, 1], "TRAIN")
        # run "q": the same trainer pool plus a rollout pool of one GPU, for tests that need a serving worker
        create_serving_run(store, tmp_path)
        ex = Executor(store, DaemonEffects(store, "r", None), run_id="r", epoch=None, clock=lambda: NOW)
        controller = Controller(store, "r", None, clock=lambda: NOW)
        controller.borrowing = Borrowing(store, ex, "r", clock=lambda: NOW)
        yield store, controller


def waiting(store, wait_s: float) -> None:
    store.update_fields("runs", "r", epoch=None, trainer={"phase": "waiting", "expected_wait_s": wait_s,
                                                           "phase_since": NOW, "reported_at": NOW})  # fmt: skip


def test_snapshot_reflects_state(daemon):
    store, c = daemon
    waiting(store, 120.0)
    store.update_fields("runs", "r", epoch=None, borrow={"policy": "greedy", "max_gpus": 1})
    s = c.borrowing.inputs.snapshot(NOW)
    assert [(g.pool, g.role, g.borrowed) for g in s.gpus] == [("trainer", Role.TRAIN, False)] * 2
    assert s.trainer.phase == "waiting" and s.trainer.wait_left_s == pytest.approx(120.0)
    assert s.max_lend == 1 and s.profile.name == "unmeasured" and s.work.empty


def test_greedy_lends_through_the_planner_only_when_the_wait_pays(daemon):
    store, c = daemon
    store.update_fields("runs", "r", epoch=None, borrow={"policy": "greedy", "max_gpus": 1})
    waiting(store, 10.0)  # shorter than a cold borrow (25 s) plus a return: nothing
    assert c.borrowing.plan_borrow(NOW) is None
    waiting(store, 120.0)
    plan = c.borrowing.plan_borrow(NOW)
    assert plan["plan"] == "borrow" and len(plan["gpu_ids"]) == 1 and plan["return_deadline"] == NOW + 120.0
    c.borrowing.tick()
    borrows = [t for t in store.transitions.all("r") if t.kind == "borrow"]
    assert len(borrows) == 1 and list(borrows[0].gpu_ids) == plan["gpu_ids"]


def test_work_from_progress_counts_and_details():
    w = work_from_progress({"queued": 3, "generating": 2, "tool_wait": 4, "work": {"turns_left": 1.5}})
    assert w.trajectories == 9 and w.tool_waiting == 4 and w.turns_left == 1.5
    assert work_from_progress({}).empty


def test_a_malformed_work_report_is_refused_and_changes_nothing(daemon):
    store, c = daemon
    with pytest.raises(bodies.ValidationError, match=r"unknown field\(s\) \['turns'\]; known: .*turns_left"):
        parse(bodies.Progress, {"queued": 1, "work": {"turns": 2}})
    with pytest.raises(bodies.ValidationError, match=r"work.tool_latency_s\n.*greater than or equal to 0"):
        parse(bodies.Progress, {"queued": 1, "work": {"tool_latency_s": -1}})
    assert store.runs.get("r").get("rollout") is None


def test_pearl_needs_a_profile(daemon):
    store, c = daemon
    with pytest.raises(ControlError, match="pearlctl profile RUN"):
        c.operator.borrow(parse(bodies.Borrow, {"policy": "pearl"}))
    assert store.runs.get("r")["policy"] == "greedy"  # unchanged


def test_pearl_runs_live_from_the_stored_profile_and_the_reported_work(daemon):
    """`borrow --policy pearl`: the daemon's own snapshot, the run's profile and the driver's work report
    decide — a big batch with long tool calls makes borrowing both trainer GPUs pay; one short trajectory
    left on a serving rollout worker does not pay for a cold start."""
    from pearlctl.planner import profile as profiles
    from tests.conftest import REPO

    store, _ = daemon
    ex = Executor(store, DaemonEffects(store, "q", None), run_id="q", epoch=None, clock=lambda: NOW)
    c = Controller(store, "q", None, clock=lambda: NOW)
    c.borrowing = Borrowing(store, ex, "q", clock=lambda: NOW)
    prof = profiles.load(REPO / "examples/profiles/qwen3-8b-h100.toml")
    c.operator.set_profile(parse(bodies.ProfileBody, {"profile": profiles.to_dict(prof)}))
    c.operator.borrow(parse(bodies.Borrow, {"policy": "pearl"}))
    store.update_fields("runs", "q", epoch=None, trainer={"phase": "waiting", "expected_wait_s": 3600.0,
                                                           "phase_since": NOW, "reported_at": NOW})  # fmt: skip
    big = {"trajectories": 512, "turns_left": 8, "turns_left_max": 20, "decode_tokens_per_turn": 400,
           "decode_tokens_per_turn_max": 2000, "prefill_tokens_per_turn": 300, "context_tokens": 4000,
           "tool_latency_s": 5.0, "tool_latency_max_s": 30.0}  # fmt: skip
    c.trainer.rollout_progress(parse(bodies.Progress, {"queued": 0, "generating": 512, "tool_wait": 0, "work": big}))
    plan = c.borrowing.plan_borrow(NOW)
    assert plan is not None and plan["policy"] == "pearl" and len(plan["gpu_ids"]) == 2
    assert plan["predicted_s"][1] < plan["predicted_s"][0]

    tail = dict(big, trajectories=1, turns_left=1, turns_left_max=1, decode_tokens_per_turn=10,
                decode_tokens_per_turn_max=10, tool_latency_s=0.0, tool_latency_max_s=0.0)  # fmt: skip
    c.trainer.rollout_progress(parse(bodies.Progress, {"queued": 0, "generating": 1, "tool_wait": 0, "work": tail}))
    assert c.borrowing.plan_borrow(NOW) is None


def test_a_trainer_released_with_nothing_lent_and_nothing_moving_is_asked_to_reclaim(daemon):
    """A release nobody wants any more (a held release carried out after its borrow was rolled back) must not
    leave the trainer blocked: the daemon answers it with a reclaim, and journals the ack."""
    store, c = daemon
    phase = {"phase": "waiting", "step": 3, "released": True}
    answer = c.trainer.phase(parse(bodies.TrainerPhase, phase))
    assert answer["command"] == "reclaim" and answer["command_id"].startswith("orphan-reclaim:")
    c.trainer.ack(parse(bodies.Ack, {"command_id": answer["command_id"], "result": {"ok": True, "command": "reclaim"}}))
    assert [j["event"] for j in store.journal.read("r")][-1] == "trainer reclaimed (orphan)"
    # not released, or released while a GPU is lent: no such command
    assert c.trainer.phase(parse(bodies.TrainerPhase, dict(phase, released=False)))["command"] is None
    gpu = next(g for g in store.fleet.gpus("r"))
    store.update_fields("gpus", gpu.id, borrowed=1, return_deadline=NOW + 60)
    assert c.trainer.phase(parse(bodies.TrainerPhase, phase))["command"] is None
    # an ack for a command nobody issued is still a 404
    with pytest.raises(ControlError, match="no step"):
        c.trainer.ack(parse(bodies.Ack, {"command_id": "9:9:OFFLOAD", "result": {"ok": True}}))
