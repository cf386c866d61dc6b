"""Crash matrix for the transitions a policy's plan makes on rollout and elastic pools — retire (parking the
worker asleep, or stopping it), wake, switch (ROLLOUT → PREFILL) and start: the daemon dies at every step
boundary of each (before intent, after intent, after effect, after done); a new daemon over the same state
converges, starts no engine twice, and never lets a worker drain while the router still routes to it.

The daemon's own objects (controller, executor, effects, the policy loop) run for real against a real SQLite
state; a "crash" drops them all and builds new ones. The agent and the router's membership are simulated at
their seams (the heartbeat handler; the set of URLs the router routes to, synced from state one tick late).
The real-process version: tests/engines/test_crash_matrix_daemon.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.daemon.transitions import PLANS, PlanKind, TransitionDetail
from pearlctl.state.store import Store
from tests import factories
from tests.crash_harness import POINTS, Clock, Restarts, SimAgent, SimRouter, crash_once

# One GPU of a rollout pool goes through every kind: parked, woken, switched to prefill, retired (stopped),
# started again. (kind, plan, from_role, to_role)
CYCLE = (
    ("retire", "retire_sleep", "ROLLOUT", "IDLE"),
    ("wake", "wake", "IDLE", "ROLLOUT"),
    ("switch", "switch", "ROLLOUT", "PREFILL"),
    ("retire", "retire", "PREFILL", "IDLE"),
    ("start", "start", "IDLE", "ROLLOUT"),
)
CASES = [(plan, k, p) for _, plan, _, _ in CYCLE for k in PLANS[plan] for p in POINTS]


@pytest.fixture
def world(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    factories.create_run(store, tmp_path, [factories.pool("rollout", "ROLLOUT")], spec_path="r.toml")
    alloc = store.fleet.allocations("r")[0]
    factories.submit(store, alloc.id, "8")
    factories.start(store, alloc.id, "gpu2")
    yield store, alloc.id
    store.close()


def test_crash_matrix_covers_every_step_of_every_pool_transition():
    kinds = {plan for _, plan, _, _ in CYCLE}
    assert kinds == {"retire_sleep", "wake", "switch", "retire", "start"}
    assert len(CASES) == sum(len(PLANS[p]) for _, p, _, _ in CYCLE) * len(POINTS)


@pytest.mark.parametrize("plan,step,point", CASES, ids=[f"{c}-{k}-{p}" for c, k, p in CASES])
def test_daemon_crash_at_every_pool_transition_step_converges(world, plan, step, point):
    store, alloc_id = world
    clock, router = Clock(), SimRouter()
    agent = SimAgent(router, host="gpu2")
    crash_at, fired = crash_once(store, point, step, plan)
    register = {"job_id": "8", "task_id": 0, "node": "gpu2", "gpus": [0], "pid": 1}
    daemon = Restarts(store, alloc_id, clock, register, router=router, crash_at=crash_at)
    gpu = store.fleet.gpus("r")[0].id

    def tick(d) -> None:
        agent.tick(d)
        router.sync(store)

    def loop(until) -> None:
        daemon.run_until(tick, until)

    # the pool's worker comes up at launch (its GPU's default role), routable once READY
    loop(lambda: any(w.routable for w in store.fleet.workers("r")))
    for kind, cycle_plan, from_role, to_role in CYCLE:
        with daemon.daemon.controller.lock:
            detail = TransitionDetail(plan=PlanKind(cycle_plan))
            tid = daemon.daemon.executor.plan(kind, [gpu], detail=detail, from_role=from_role, to_role=to_role)
        loop(lambda tid=tid: store.transitions.get(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
        assert store.transitions.get(tid).state == "DONE", cycle_plan
        assert store.fleet.gpu(gpu).role == to_role
    loop(lambda: router.urls)  # the last start's worker is routed to
    assert fired and daemon.crashes == 1, "the crash point was never reached"

    # no engine started twice: rollout-0 at launch and once more by the final start (the wake woke the
    # parked one); prefill-0 once, by the switch
    assert agent.starts == {"rollout-0": 2, "prefill-0": 1}
    # every worker that drained (for a retire, a switch) had left the router first
    assert agent.drained_while_routed == []
    # converged: one ROLLOUT worker serving and routed, nothing parked
    live = [w for w in store.fleet.workers("r") if w.state not in ("STOPPED", "FAILED", "LOST")]
    assert [(w.role, w.state, w.routable) for w in live] == [("ROLLOUT", "READY", 1)]
    assert store.fleet.gpu(gpu).worker_id is None
    events = [j["event"] for j in store.journal.read("r")]
    assert "effect re-issued after restart" in events or point in ("before_intent", "after_done")


def test_every_plan_kind_is_crashed_at_every_step_boundary_by_one_of_the_matrices():
    """A new plan kind (docs/architecture.md, "Adding a transition kind") needs a crash case: this matrix's
    cycle or the trainer's (tests/unit/test_crash_matrix.py) must run it."""
    from tests.unit.test_crash_matrix import CYCLES

    assert {*CYCLES, *(plan for _, plan, _, _ in CYCLE), *(plan for _, _, plan in PARKED_SHIFTS)} == set(PlanKind)


# A rollout GPU shifted to the run's judge and back (a switch to REWARD, and from it): every step boundary of each
# direction. The judge's worker is told the reward pool's model; the policy's, after, its pool's own.
SHIFTS = (("ROLLOUT", "REWARD", PlanKind.SWITCH), ("REWARD", "ROLLOUT", PlanKind.SWITCH))
SHIFT_CASES = [(to, k, p) for _, to, _ in SHIFTS for k in PLANS[PlanKind.SWITCH] for p in POINTS]
JUDGE_SPEC = {"model": "/m/policy", "pools": {"rollout": {}, "reward": {"model": "/m/judge"}}}
# The same shifts with the leaving engine parked asleep (workers kept warm): the policy parks and the judge starts
# (switch_sleep), the judge parks and the policy wakes, the policy parks and the judge wakes (switch_wake twice) —
# one GPU holding a parked policy worker and a parked judge in turn. Every step boundary of both plans.
PARKED_SHIFTS = (
    ("ROLLOUT", "REWARD", PlanKind.SWITCH_SLEEP),
    ("REWARD", "ROLLOUT", PlanKind.SWITCH_WAKE),
    ("ROLLOUT", "REWARD", PlanKind.SWITCH_WAKE),
)
PARKED_CASES = [
    (plan, k, p) for plan in (PlanKind.SWITCH_SLEEP, PlanKind.SWITCH_WAKE) for k in PLANS[plan] for p in POINTS
]


def shifted(world, shifts, crash_at, fired, check=lambda store, gpu, from_role, to: None) -> tuple:
    """Run ``shifts`` ((from, to, plan) each) on the rollout GPU of a run with a judge, the daemon crashing once where
    ``crash_at`` says and restarting; each shift DONE with the GPU in its new role (and ``check`` holding). The
    store and the simulated agent, once the last shift's worker is routed."""
    store, alloc_id = world
    store.update_fields("runs", "r", spec=JUDGE_SPEC)
    clock, router = Clock(), SimRouter()
    agent = SimAgent(router, host="gpu2")
    register = {"job_id": "8", "task_id": 0, "node": "gpu2", "gpus": [0], "pid": 1}
    daemon = Restarts(store, alloc_id, clock, register, router=router, crash_at=crash_at)
    gpu = store.fleet.gpus("r")[0].id

    def loop(until) -> None:
        daemon.run_until(lambda d: (agent.tick(d), router.sync(store)), until)

    loop(lambda: any(w.routable for w in store.fleet.workers("r")))
    for from_role, to, plan in shifts:
        with daemon.daemon.controller.lock:
            detail = TransitionDetail(plan=plan)
            tid = daemon.daemon.executor.plan("switch", [gpu], detail=detail, from_role=from_role, to_role=to)
        loop(lambda tid=tid: store.transitions.get(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
        assert store.transitions.get(tid).state == "DONE", (plan, to)
        assert store.fleet.gpu(gpu).role == to
        check(store, gpu, from_role, to)
    loop(lambda: router.urls)
    assert fired and daemon.crashes == 1, "the crash point was never reached"
    assert agent.drained_while_routed == []  # every worker that drained had left the router first
    return store, agent


def _converged(store, point: str, want: list[tuple]) -> None:
    live = [w for w in store.fleet.workers("r") if w.state not in ("STOPPED", "FAILED", "LOST")]
    assert sorted((w.role, w.state, w.routable) for w in live) == want
    events = [j["event"] for j in store.journal.read("r")]
    assert "effect re-issued after restart" in events or point in ("before_intent", "after_done")


@pytest.mark.parametrize("to_role,step,point", SHIFT_CASES, ids=[f"to_{t}-{k}-{p}" for t, k, p in SHIFT_CASES])
def test_daemon_crash_at_every_step_of_a_shift_between_the_policy_and_the_judge_converges(world, to_role, step, point):
    crash_at, fired = crash_once(world[0], point, step, "switch", to_role)
    store, agent = shifted(world, SHIFTS, crash_at, fired)
    # no engine started twice: the policy's worker at launch and after the shift back, the judge's once, with the
    # judge's model (the rollout pool's agent serves the policy's of its own)
    assert agent.starts == {"rollout-0": 2, "reward-0": 1}
    assert agent.models == {"rollout-0": None, "reward-0": "/m/judge"}
    _converged(store, point, [("ROLLOUT", "READY", 1)])


def _parked_beside(store, gpu: int, from_role: str, to: str) -> None:
    """The leaving engine sleeps on the GPU in its model's place; the coming one serves, no longer parked."""
    g = store.fleet.gpu(gpu)
    parked = store.fleet.worker(g.parked_for(from_role))
    assert (g.role, parked.role, parked.state) == (to, from_role, "SLEEPING")
    assert g.parked_for(to) is None


@pytest.mark.parametrize("plan,step,point", PARKED_CASES, ids=[f"{c}-{k}-{p}" for c, k, p in PARKED_CASES])
def test_daemon_crash_at_every_step_of_a_shift_that_parks_the_leaving_engine_converges(world, plan, step, point):
    crash_at, fired = crash_once(world[0], point, step, plan)
    store, agent = shifted(world, PARKED_SHIFTS, crash_at, fired, check=_parked_beside)
    # no engine started twice: the policy's worker at launch (then parked and woken), the judge's once (then parked
    # and woken); nothing was stopped
    assert agent.starts == {"rollout-0": 1, "reward-0": 1}
    assert agent.models == {"rollout-0": None, "reward-0": "/m/judge"}
    _converged(store, point, [("REWARD", "READY", 1), ("ROLLOUT", "SLEEPING", 0)])
