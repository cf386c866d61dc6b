"""The transition executor against real state, with scripted effects at the seam."""

from pathlib import Path

import pytest

from pearlctl.daemon.transitions import PLANS, ROLLBACK_SEQ, Executor, Outcome
from pearlctl.state.store import Store
from tests.conftest import create_trainer_run


class Script:
    """Effects whose probes answer from a table the test controls; records every issue."""

    def __init__(self):
        self.issued: list[str] = []
        self.answers: dict[str, str] = {}

    def do(self, kind, transition, key):
        self.issued.append(key)

    def probe(self, kind, transition, key):
        return self.answers.get(kind, Outcome.PENDING)


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(tmp_path / "s.db") as s:
        alloc = create_trainer_run(s, tmp_path, job_id="1")
        s.fleet.upsert_node_gpus("r", alloc.id, "gpu1", [0, 1], "TRAIN")
        yield s


def gpu_ids(store):
    return [g.id for g in store.fleet.gpus("r")]


def kinds(store, tid):
    return [(s.seq, s.kind, s.state) for s in sorted(store.transitions.steps(tid), key=lambda s: s.seq)]


def test_borrow_runs_its_steps_in_order_each_issued_once(store):
    fx = Script()
    ex = Executor(store, fx, run_id="r", epoch=None)
    tid = ex.plan("borrow", gpu_ids(store))
    assert ex.advance(tid) == "RUNNING" and fx.issued == [f"{tid}:0:OFFLOAD"]
    ex.advance(tid)
    assert fx.issued == [f"{tid}:0:OFFLOAD"]  # pending: not issued again
    fx.answers = {"OFFLOAD": Outcome.DONE, "START": Outcome.DONE}
    assert ex.advance(tid) == "RUNNING"  # VERIFY pending
    fx.answers.update(VERIFY=Outcome.DONE, REGISTER=Outcome.DONE)
    assert ex.advance(tid) == "DONE"
    assert fx.issued == [f"{tid}:{i}:{k}" for i, k in enumerate(PLANS["borrow"])]
    assert [k for _, k, st in kinds(store, tid) if st == "DONE"] == list(PLANS["borrow"])


def test_a_failed_borrow_step_rolls_back_through_the_return_steps(store):
    fx = Script()
    ex = Executor(store, fx, run_id="r", epoch=None)
    tid = ex.plan("borrow", gpu_ids(store))
    fx.answers = {"OFFLOAD": Outcome.DONE, "START": Outcome.FAILED}
    assert ex.advance(tid) == "ROLLING_BACK"
    assert kinds(store, tid)[:2] == [(0, "OFFLOAD", "DONE"), (1, "START", "FAILED")]
    fx.answers = dict.fromkeys(PLANS["return"], Outcome.DONE)
    assert ex.advance(tid) == "ROLLED_BACK"
    assert [(s, k) for s, k, _ in kinds(store, tid)][2:] == [
        (ROLLBACK_SEQ + i, k) for i, k in enumerate(PLANS["return"])
    ]


def test_after_a_crash_intent_steps_are_probed_and_reissued_once_under_the_same_key(store):
    fx = Script()
    tid = Executor(store, fx, run_id="r", epoch=None).plan("borrow", gpu_ids(store))
    Executor(store, fx, run_id="r", epoch=None).advance(tid)  # INTENT written, effect issued, then "crash"
    restarted = Executor(store, fx, run_id="r", epoch=None)
    restarted.advance(tid)
    restarted.advance(tid)
    assert fx.issued == [f"{tid}:0:OFFLOAD", f"{tid}:0:OFFLOAD"]  # re-issued once by the new process
    events = [j["event"] for j in store.journal.read("r") if j["entity"] == "steps"]
    assert "effect re-issued after restart" in events
    fx.answers = {"OFFLOAD": Outcome.DONE}
    restarted.advance(tid)
    assert kinds(store, tid)[0] == (0, "OFFLOAD", "DONE")


def test_a_step_without_effect_in_time_fails(store):
    now = [1000.0]
    fx = Script()
    ex = Executor(store, fx, run_id="r", epoch=None, step_timeout_s=5, clock=lambda: now[0])
    tid = ex.plan("return", gpu_ids(store))
    ex.advance(tid)
    now[0] += 6
    assert ex.advance(tid) == "FAILED"  # a failed return is not compensated: a person must look
    assert kinds(store, tid) == [(0, "DEREGISTER", "FAILED")]


def test_abort_rolls_a_running_borrow_back(store):
    fx = Script()
    ex = Executor(store, fx, run_id="r", epoch=None)
    tid = ex.plan("borrow", gpu_ids(store))
    ex.advance(tid)
    ex.abort(tid, "return deadline")
    assert kinds(store, tid) == [(0, "OFFLOAD", "FAILED")]  # the pending release is superseded
    fx.answers = dict.fromkeys(PLANS["return"], Outcome.DONE)
    assert ex.advance(tid) == "ROLLED_BACK"


def test_a_transitions_detail_is_typed_by_its_kind_and_stored_as_the_fields_set(store):
    """A transition's detail is its kind's model (``DETAILS``: a borrow's carries its deadline and where its wait
    came from, a return's its deadline, the others neither): written as a JSON object of the fields set, read
    back typed (plan kinds as ``PlanKind``), unknown keys of an older row ignored; the steps it runs follow its
    ``plan``. A detail of another kind's model is refused before anything is written."""
    from dataclasses import replace

    from pearlctl.daemon.transitions import BorrowDetail, PlanKind, ReturnDetail, TransitionDetail, current_plan

    ex = Executor(store, Script(), run_id="r", epoch=None)
    detail = BorrowDetail(plan=PlanKind.BORROW_WARM, rollback=PlanKind.RETURN_SLEEP, return_deadline=5.0)
    tid = ex.plan("borrow", gpu_ids(store), detail=detail)
    row = store.transitions.get(tid)
    assert row.detail == {"plan": "borrow_warm", "rollback": "return_sleep", "return_deadline": 5.0}
    assert TransitionDetail.of(row) == detail and TransitionDetail.of(row).plan is PlanKind.BORROW_WARM
    assert current_plan(row) == PLANS["borrow_warm"]
    older = replace(row, detail={"why": "x", "from_an_older_daemon": 1})
    assert TransitionDetail.of(older) == BorrowDetail(why="x")
    assert TransitionDetail.of(replace(row, detail=None)) == BorrowDetail()
    assert TransitionDetail.of(replace(row, kind="return", detail={"return_deadline": 7.0})) == ReturnDetail(
        return_deadline=7.0
    )
    start = TransitionDetail.of(replace(row, kind="start", detail={"return_deadline": 7.0, "why": "w"}))
    assert type(start) is TransitionDetail and start == TransitionDetail(why="w") and start.return_deadline is None
    before = len(store.transitions.all("r"))
    with pytest.raises(TypeError, match="BorrowDetail"):
        ex.plan("borrow", gpu_ids(store), detail=TransitionDetail(why="untyped"))
    assert len(store.transitions.all("r")) == before
