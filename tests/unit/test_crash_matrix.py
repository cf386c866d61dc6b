"""Crash matrix: the daemon dies at every step boundary of a borrow and of a return (before intent,
after intent, after effect, after done); a new daemon over the same state converges, starts no engine
twice, and the trainer gets its GPUs back. The daemon's own objects (controller, executor, effects,
borrowing) run for real against a real SQLite state; a "crash" drops them all mid-step and builds new
ones, as a restart does. Agents and the trainer are simulated at the HTTP-handler seam, counting every
engine start and every command they carry out. (tests/integration/test_borrow_e2e.py kills the real
daemon process with real engines.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.transitions import PLANS
from pearlctl.state.store import Store
from tests.conftest import create_trainer_run
from tests.crash_harness import POINTS, Clock, Daemon, Restarts, SimAgent, crash_once

# Four transitions in a row: a cold borrow, a return that parks the vLLM worker asleep, a warm borrow that
# wakes it, and a return that stops it. The daemon dies once, at one step boundary of one of them.
CYCLES = ("borrow", "return_sleep", "borrow_warm", "return")
CASES = [(c, k, p) for c in CYCLES for k in PLANS[c] for p in POINTS]


class SimTrainer:
    """The trainer hook: reports waiting with a long expected wait, carries out each command id once."""

    def __init__(self):
        self.released = False
        self.done: dict[str, dict] = {}
        self.carried_out: list[str] = []

    def tick(self, daemon: Daemon) -> None:
        answer = daemon.controller.trainer.phase(
            parse(
                bodies.TrainerPhase,
                {"phase": "waiting", "step": 1, "expected_wait_s": 600.0, "released": self.released},
            )
        )
        if answer.get("command") is None:
            return
        cid = answer["command_id"]
        if cid not in self.done:  # like TrainerHook: a repeated command id gets its first answer again
            self.carried_out.append(cid)
            self.released = answer["command"] == "release"
            self.done[cid] = {"ok": True, "command": answer["command"]}
        daemon.controller.trainer.ack(parse(bodies.Ack, {"command_id": cid, "result": self.done[cid]}))


@pytest.fixture
def world(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    alloc = create_trainer_run(store, tmp_path, job_id="7")
    store.set_state("allocations", alloc.id, expect="PENDING", to="RUNNING", event="t", node="gpu1")
    store.update_fields("runs", "r", borrow={"policy": "greedy", "max_gpus": 1})
    yield store, alloc.id
    store.close()


def run_until(store, alloc_id, clock, agent, trainer, *, crash_at, done, limit=200):
    """A daemon (restarted at each crash) with the trainer's agent on gpu1, run until ``done(store)``: the
    number of crashes."""
    register = {"job_id": "7", "task_id": 0, "node": "gpu1", "gpus": [0, 1], "pid": 1}
    daemon = Restarts(store, alloc_id, clock, register, crash_at=crash_at)

    def tick(d) -> None:
        trainer.tick(d)
        agent.tick(d)

    daemon.run_until(tick, lambda: done(store), limit)
    return daemon.crashes


def transitions(store, kind):
    return [t for t in store.transitions.all("r") if t.kind == kind]


@pytest.mark.parametrize("cycle,step,point", CASES, ids=[f"{c}-{k}-{p}" for c, k, p in CASES])
def test_daemon_crash_at_every_step_boundary_converges(world, cycle, step, point):
    store, alloc_id = world
    clock, agent, trainer = Clock(), SimAgent(), SimTrainer()
    crash_at, fired = crash_once(store, point, step, cycle)

    def completed(kind, n):
        return lambda store: sum(t.state == "DONE" for t in transitions(store, kind)) >= n

    crashes = 0
    for n, (cycle_plan, settings) in enumerate(
        [
            ("borrow", {"policy": "greedy", "max_gpus": 1, "keep_warm": True}),
            ("return_sleep", {"policy": "never", "max_gpus": None, "keep_warm": True}),
            ("borrow_warm", {"policy": "greedy", "max_gpus": 1, "keep_warm": True}),
            ("return", {"policy": "never", "max_gpus": None, "keep_warm": False}),
        ]
    ):
        store.update_fields("runs", "r", borrow=settings)
        kind = "borrow" if cycle_plan.startswith("borrow") else "return"
        crashes += run_until(
            store, alloc_id, clock, agent, trainer, crash_at=crash_at, done=completed(kind, n // 2 + 1)
        )
        last = transitions(store, kind)[-1]
        assert (last.detail or {}).get("plan") == cycle_plan
    assert fired and crashes == 1, "the crash point was never reached"

    # converged: two borrows and two returns completed, and nothing is lent or parked any more
    assert [t.state for t in transitions(store, "borrow")] == ["DONE", "DONE"]
    assert [t.state for t in transitions(store, "return")] == ["DONE", "DONE"]
    gpus = store.fleet.gpus("r")
    assert not any(g.borrowed for g in gpus) and {g.role for g in gpus} == {"TRAIN"}
    assert all(g.worker_id is None for g in gpus)
    # no engine started twice: one vLLM start for two borrows (the second woke it), one trainer worker
    assert agent.starts == {"rollout-0": 1, "train-0": 1}
    # the trainer released and reclaimed once per transition, and has its GPUs back
    assert [c.split(":")[-1] for c in trainer.carried_out] == ["OFFLOAD", "RELOAD", "OFFLOAD", "RELOAD"]
    assert not trainer.released
    # the journal tells what happened
    events = [j["event"] for j in store.journal.read("r")]
    if point in ("after_intent", "after_effect"):
        assert "effect re-issued after restart" in events


# A trainer GPU lent to the run's judge (a borrow to REWARD) and taken back (the return the daemon makes at once with
# borrowing off): every step boundary of both. The judge's worker is told the judge's model.
JUDGE_CYCLE = ("borrow", "return_sleep")
JUDGE_CASES = [(c, k, p) for c in JUDGE_CYCLE for k in PLANS[c] for p in POINTS]


@pytest.mark.parametrize("cycle,step,point", JUDGE_CASES, ids=[f"judge-{c}-{k}-{p}" for c, k, p in JUDGE_CASES])
def test_daemon_crash_at_every_step_of_a_loan_to_the_judge_converges(world, cycle, step, point):
    from pearlctl.daemon.transitions import BorrowDetail, PlanKind

    store, alloc_id = world
    store.update_fields(
        "runs",
        "r",
        spec={"model": "/m/policy", "pools": {"trainer": {}, "reward": {"model": "/m/judge"}}},
        borrow={"policy": "never", "max_gpus": None, "keep_warm": True},  # the daemon returns what is lent at once
    )
    clock, agent, trainer = Clock(), SimAgent(), SimTrainer()
    crash_at, fired = crash_once(store, point, step, cycle)
    register = {"job_id": "7", "task_id": 0, "node": "gpu1", "gpus": [0, 1], "pid": 1}
    planner = Restarts(store, alloc_id, clock, register).daemon  # its agent registered: the trainer's GPUs in state
    gpu = store.fleet.gpus("r")[0].id
    with planner.controller.lock:
        detail = BorrowDetail(plan=PlanKind.BORROW, return_deadline=clock.t + 600.0)
        planner.executor.plan("borrow", [gpu], detail=detail, to_role="REWARD")
    crashes = run_until(
        store, alloc_id, clock, agent, trainer, crash_at=crash_at,
        done=lambda s: [t.state for t in s.transitions.all("r")] == ["DONE", "DONE"],
    )  # fmt: skip
    assert fired and crashes == 1, "the crash point was never reached"
    borrow, back = store.transitions.all("r")
    assert (borrow.kind, borrow.to_role, back.kind, back.from_role) == ("borrow", "REWARD", "return", "REWARD")
    # no engine started twice: the judge once, with the judge's model; the trainer's worker once
    assert agent.starts == {"reward-0": 1, "train-0": 1} and agent.models["reward-0"] == "/m/judge"
    # the trainer released and reclaimed once, and has its GPUs back
    assert [c.split(":")[-1] for c in trainer.carried_out] == ["OFFLOAD", "RELOAD"] and not trainer.released
    g = store.fleet.gpu(gpu)
    assert (g.role, g.borrowed) == ("TRAIN", 0)
