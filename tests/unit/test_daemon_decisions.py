"""The control loop asks the policy only when its answer may have changed (pearlctl/daemon/borrowing.py, module
doc): with a fake clock, a tick whose inputs are unchanged skips the decision; a changed input (the trainer's
report, the rollout driver's work, the borrowing settings, a GPU's state) decides; so does the clock, once
``REDECIDE_S`` passed since the last decision, and on every tick while a lent GPU's return is near.

The policy is a stub that counts its calls and plans nothing (so that no tick opens a transition, which would
stop the loop from deciding at all); the run is the one of tests/unit/test_borrowing_snapshot.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon import borrowing as borrowing_module
from pearlctl.daemon.borrowing import REDECIDE_S, Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor
from pearlctl.state.store import Store
from tests.conftest import create_trainer_run

T0 = 1_000_000.0


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop(tmp_path: Path, monkeypatch):
    clock = Clock(T0)
    calls: list[float] = []  # the snapshot's ``now`` of every decision

    def decide(snapshot):
        calls.append(snapshot.now)
        return None

    monkeypatch.setattr(borrowing_module, "load_policy", lambda name: SimpleNamespace(decide=decide))
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        alloc = create_trainer_run(store, tmp_path, job_id="1")
        store.fleet.upsert_node_gpus("r", alloc.id, "gpu1", [0, 1], "TRAIN")
        ex = Executor(store, DaemonEffects(store, "r", None), run_id="r", epoch=None, clock=clock)
        controller = Controller(store, "r", None, clock=clock)
        controller.borrowing = Borrowing(store, ex, "r", clock=clock)
        waiting(store, T0, 30.0)
        yield SimpleNamespace(store=store, clock=clock, calls=calls, c=controller, b=controller.borrowing)


def waiting(store, since: float, wait_s: float) -> None:
    store.update_fields("runs", "r", epoch=None, trainer={"phase": "waiting", "expected_wait_s": wait_s,
                                                           "phase_since": since, "reported_at": since})  # fmt: skip


def tick(loop, at: float) -> int:
    """One tick at ``T0 + at``; the decisions made so far."""
    loop.clock.now = T0 + at
    loop.b.tick()
    return len(loop.calls)


def test_unchanged_inputs_skip_the_decision_while_the_clock_moves(loop):
    assert tick(loop, 0.0) == 1
    # the trainer's wait left shrinks with the clock (the snapshot differs), its report does not
    assert [tick(loop, t) for t in (0.5, 1.0, 2.5, REDECIDE_S - 0.1)] == [1, 1, 1, 1]
    assert loop.b.decisions == 1 and loop.b.skipped == 4
    assert loop.calls == [T0]


def test_a_changed_input_decides(loop):
    assert tick(loop, 0.0) == 1
    waiting(loop.store, T0 + 0.4, 30.0)  # a new trainer report: it waits until later
    assert tick(loop, 0.5) == 2
    assert tick(loop, 1.0) == 2
    work = {"trajectories": 8, "turns_left": 2, "decode_tokens_per_turn": 100}
    loop.c.trainer.rollout_progress(parse(bodies.Progress, {"queued": 8, "work": work}))
    assert tick(loop, 1.5) == 3
    # a report whose work is the same (the counts the planner does not read moved on) decides nothing
    loop.c.trainer.rollout_progress(parse(bodies.Progress, {"queued": 8, "done": 5, "tokens": 900, "work": work}))
    assert tick(loop, 2.0) == 3
    loop.store.update_fields("runs", "r", epoch=None, borrow={"policy": "greedy", "max_gpus": 1})
    assert tick(loop, 2.5) == 4
    gpu = loop.store.fleet.gpus("r")[0]
    loop.store.set_state("gpus", gpu.id, expect=gpu.state, to="LOST", event="agent silent")
    assert tick(loop, 3.0) == 5
    assert tick(loop, 3.5) == 5


def test_the_clock_alone_decides_again_after_redecide_s(loop):
    assert tick(loop, 0.0) == 1
    assert tick(loop, REDECIDE_S - 0.5) == 1
    assert tick(loop, REDECIDE_S) == 2  # counted from the last decision
    assert tick(loop, REDECIDE_S + 0.5) == 2
    assert tick(loop, 2 * REDECIDE_S) == 3
    assert loop.calls == [T0, T0 + REDECIDE_S, T0 + 2 * REDECIDE_S]


def test_a_lent_gpu_near_its_return_is_decided_on_every_tick(loop):
    gpu = loop.store.fleet.gpus("r")[0]
    deadline = T0 + 100.0
    loop.store.update_fields("gpus", gpu.id, borrowed=1, return_deadline=deadline)
    assert tick(loop, 10.0) == 1
    assert tick(loop, 10.5) == 1  # far from its return: skipped
    # within REDECIDE_S of when the return must start (the return's running cost and the slack before the
    # deadline): every tick asks the policy, until the tick's own deadline rule returns the GPU
    start_by = deadline - loop.b.inputs.cost("return") - borrowing_module.RETURN_SLACK_S - T0
    decided = [tick(loop, t) for t in (start_by - REDECIDE_S + 0.1, start_by - REDECIDE_S + 0.6, start_by)]
    assert decided == [2, 3, 4]


def test_a_tick_that_fails_after_deciding_decides_again(loop, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("carrying the plan out failed")

    monkeypatch.setattr(loop.b, "_carry_out", fail)
    with pytest.raises(RuntimeError):
        tick(loop, 0.0)
    with pytest.raises(RuntimeError):
        tick(loop, 0.5)  # the failed decision is not remembered: the same inputs are decided again
    assert len(loop.calls) == 2
    monkeypatch.undo()


def held_elsewhere(lock) -> bool:
    """Whether another thread finds ``lock`` held (it cannot take it within a second)."""
    import threading

    took = threading.Event()

    def take():
        with lock:
            took.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    return not took.wait(1.0)


def test_the_policy_decides_with_the_decision_lock_released(loop, monkeypatch):
    held: list[bool] = []

    def decide(snapshot):
        held.append(held_elsewhere(loop.c.lock))
        return None

    monkeypatch.setattr(borrowing_module, "load_policy", lambda name: SimpleNamespace(decide=decide))
    loop.b.tick(loop.c.lock)
    assert held == [False] and loop.b.decisions == 1 and loop.b.redecided == 0


def test_a_decision_whose_inputs_changed_while_it_was_made_is_made_again(loop, monkeypatch):
    """A report folded while the policy decides (off the lock) changes the snapshot's inputs: that decision is
    dropped and the policy decides again on the new ones, which are the ones carried out (the next tick, with
    nothing changed, skips)."""
    waits: list[float] = []

    def decide(snapshot):
        waits.append(snapshot.trainer.wait_left_s)
        if len(waits) == 1:
            waiting(loop.store, T0, 60.0)  # the trainer's new report lands meanwhile
        return None

    monkeypatch.setattr(borrowing_module, "load_policy", lambda name: SimpleNamespace(decide=decide))
    loop.b.tick(loop.c.lock)
    assert waits == [30.0, 60.0] and loop.b.decisions == 2 and loop.b.redecided == 1
    loop.clock.now = T0 + 0.5
    loop.b.tick(loop.c.lock)
    assert loop.b.decisions == 2 and loop.b.skipped == 1  # the second decision's inputs were remembered


def test_inputs_that_keep_changing_end_in_a_decision_under_the_lock(loop, monkeypatch):
    held: list[bool] = []

    def decide(snapshot):
        held.append(held_elsewhere(loop.c.lock))
        waiting(loop.store, T0, 30.0 + len(held))  # every decision sees a new report come in
        return None

    monkeypatch.setattr(borrowing_module, "load_policy", lambda name: SimpleNamespace(decide=decide))
    loop.b.tick(loop.c.lock)
    assert held == [False] * borrowing_module.DECIDE_TRIES + [True]
    assert loop.b.redecided == borrowing_module.DECIDE_TRIES
