"""The daemon's side of the policies: the planner Snapshot built from state, the Work of a progress report,
the live execution of a plan's borrow moves, and the refusals (a predicting policy without a profile, a
malformed work report)."""

from pathlib import Path

import pytest

from pearlctl.daemon.borrowing import Borrowing, work_from_progress
from pearlctl.daemon.controller import ControlError, Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor
from pearlctl.planner.model import Role
from pearlctl.state.store import Store
from tests.conftest import create_trainer_run

NOW = 1_000_000.0


@pytest.fixture
def daemon(tmp_path: Path):
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        alloc = create_trainer_run(store, tmp_path, job_id="1")
        store.upsert_node_gpus("r", alloc["id"], "gpu1", [0, 1], "TRAIN")
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
    s = c.borrowing.snapshot(NOW)
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
    borrows = [t for t in store.transitions("r") if t["kind"] == "borrow"]
    assert len(borrows) == 1 and borrows[0]["gpu_ids"] == plan["gpu_ids"]


def test_work_from_progress_counts_and_details():
    w = work_from_progress({"queued": 3, "generating": 2, "tool_wait": 4, "work": {"turns_left": 1.5}})
    assert w.trajectories == 9 and w.tool_waiting == 4 and w.turns_left == 1.5
    assert work_from_progress({}).empty


def test_a_malformed_work_report_is_refused_and_changes_nothing(daemon):
    store, c = daemon
    with pytest.raises(ControlError, match=r"unknown field\(s\) \['turns'\]; known: .*turns_left"):
        c.rollout_progress({"queued": 1, "work": {"turns": 2}})
    with pytest.raises(ControlError, match="work.tool_latency_s must be a finite number >= 0"):
        c.rollout_progress({"queued": 1, "work": {"tool_latency_s": -1}})
    assert store.get_run("r").get("rollout") is None


def test_pearl_needs_a_profile(daemon):
    store, c = daemon
    with pytest.raises(ControlError, match="pearlctl profile RUN"):
        c.borrow({"policy": "pearl"})
    assert store.get_run("r")["policy"] == "greedy"  # unchanged
