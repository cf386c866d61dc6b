"""Crash matrix for the transitions a policy's plan makes on rollout and elastic pools — retire (parking the
worker asleep, or stopping it), wake, switch (ROLLOUT → PREFILL) and start: the daemon dies at every step
boundary of each (before intent, after intent, after effect, after done); a new daemon over the same state
converges, starts no engine twice, and never lets a worker drain while the router still routes to it.

The daemon's own objects (controller, executor, effects, the policy loop) run for real against a real SQLite
state; a "crash" drops them all and builds new ones. The agent and the router's membership are simulated at
their seams (the heartbeat handler; the set of URLs the router routes to, synced from state one tick late).
The real-process version: tests/engines/test_crash_matrix_daemon.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import PLANS, Executor, PlanKind, TransitionDetail
from pearlctl.state.store import Store
from tests.unit.test_crash_matrix import Clock, Crash

POINTS = ("before_intent", "after_intent", "after_effect", "after_done")
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


class SimRouter:
    """The router's membership, synced from state's routable workers one tick late (as the daemon's
    membership sync does)."""

    def __init__(self):
        self.urls: set[str] = set()

    def sync(self, store: Store) -> None:
        self.urls = {w.url for w in store.workers("r") if w.routable and w.state == "READY" and w.url}

    def view(self) -> set[str]:
        return set(self.urls)


class SimAgent:
    """The rollout allocation's agent: starts what desired state adds (counted), parks and wakes, stops
    what it drops — and records any worker it had to drain while the router still routed to it."""

    def __init__(self, router: SimRouter):
        self.router = router
        self.running: dict[str, dict] = {}
        self.starts: dict[str, int] = {}
        self.drained_while_routed: list[str] = []

    def tick(self, daemon: Daemon) -> None:
        report = [dict(w) for w in self.running.values()]
        answer = daemon.controller.agents.heartbeat(
            parse(bodies.Heartbeat, {"allocation_id": daemon.alloc_id, "workers": report}), daemon.alloc_id
        )
        for w in self.running.values():
            if w["state"] == "STARTING":
                w["state"] = "READY"
        self.running = {k: w for k, w in self.running.items() if w["state"] != "STOPPED"}
        wanted = {d["key"]: d for d in answer["desired"]}
        for key, d in wanted.items():
            w = self.running.get(key)
            if d["state"] == "SLEEPING":
                if w is not None and w["state"] != "SLEEPING":
                    self._leaving(w)
                    w["state"] = "SLEEPING"
            elif w is None:
                self.starts[key] = self.starts.get(key, 0) + 1
                self.running[key] = {
                    "key": key,
                    "role": d["role"],
                    "engine": d["engine"],
                    "gpus": d["gpus"],
                    "state": "STARTING",
                    "url": f"http://gpu2:{9000 + sum(self.starts.values())}",
                }
            elif w["state"] == "SLEEPING":
                w["state"] = "READY"
        for key, w in self.running.items():
            if key not in wanted and w["state"] != "STOPPED":
                self._leaving(w)
                w["state"] = "STOPPED"

    def _leaving(self, w: dict) -> None:
        if w["state"] == "READY" and w["url"] in self.router.urls:
            self.drained_while_routed.append(w["key"])


class Daemon:
    def __init__(self, store: Store, alloc_id: int, epoch: int, clock: Clock, router: SimRouter, crash_at=None):
        self.alloc_id = alloc_id
        self.controller = Controller(store, "r", epoch, clock=clock)
        effects = DaemonEffects(store, "r", epoch, router=router.view)
        self.executor = Executor(store, effects, run_id="r", epoch=epoch, clock=clock)
        self.controller.borrowing = self.borrowing = Borrowing(store, self.executor, "r", clock=clock)
        if crash_at is not None:
            self.executor.fault = crash_at


@pytest.fixture
def world(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    store.create_run(
        run_id="r",
        name="r",
        spec={},
        spec_path="r.toml",
        run_dir=str(tmp_path),
        backend="slurm",
        policy="never",
        pools=[
            {
                "name": "rollout",
                "kind": "rollout",
                "role": "ROLLOUT",
                "partition": None,
                "nodes": 1,
                "gpus_per_node": 1,
                "job_name": "pearl.r.rollout",
            }
        ],
    )
    alloc = store.allocations("r")[0]
    store.set_state("allocations", alloc.id, expect="REQUESTED", to="PENDING", event="t", job_id="8")
    store.set_state("allocations", alloc.id, expect="PENDING", to="RUNNING", event="t", node="gpu2")
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
    agent = SimAgent(router)
    fired: list[str] = []

    def crash_at(at, key):
        tid, _, step_kind = key.split(":")
        detail = store.transition(int(tid)).detail or {}
        if not fired and at == point and step_kind == step and detail.get("plan") == plan:
            fired.append(key)
            raise Crash(key)

    epochs = itertools.count(1)
    daemon = Daemon(store, alloc_id, next(epochs), clock, router, crash_at)
    daemon.controller.agents.register(
        parse(bodies.Register, {"job_id": "8", "task_id": 0, "node": "gpu2", "gpus": [0], "pid": 1})
    )
    gpu = store.gpus("r")[0].id
    crashes = 0

    def loop(until) -> None:
        nonlocal daemon, crashes
        for _ in range(200):
            try:
                agent.tick(daemon)
                router.sync(store)
                with daemon.controller.lock:
                    daemon.borrowing.tick()
            except Crash:
                crashes += 1
                daemon = Daemon(store, alloc_id, next(epochs), clock, router)  # restarted: memory is gone
            clock.t += 1.0
            if until():
                return
        raise AssertionError("did not converge")

    # the pool's worker comes up at launch (its GPU's default role), routable once READY
    loop(lambda: any(w.routable for w in store.workers("r")))
    for kind, cycle_plan, from_role, to_role in CYCLE:
        with daemon.controller.lock:
            detail = TransitionDetail(plan=PlanKind(cycle_plan))
            tid = daemon.executor.plan(kind, [gpu], detail=detail, from_role=from_role, to_role=to_role)
        loop(lambda tid=tid: store.transition(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
        assert store.transition(tid).state == "DONE", cycle_plan
        assert store.gpu(gpu).role == to_role
    loop(lambda: router.urls)  # the last start's worker is routed to
    assert fired and crashes == 1, "the crash point was never reached"

    # no engine started twice: rollout-0 at launch and once more by the final start (the wake woke the
    # parked one); prefill-0 once, by the switch
    assert agent.starts == {"rollout-0": 2, "prefill-0": 1}
    # every worker that drained (for a retire, a switch) had left the router first
    assert agent.drained_while_routed == []
    # converged: one ROLLOUT worker serving and routed, nothing parked
    live = [w for w in store.workers("r") if w.state not in ("STOPPED", "FAILED", "LOST")]
    assert [(w.role, w.state, w.routable) for w in live] == [("ROLLOUT", "READY", 1)]
    assert store.gpu(gpu).worker_id is None
    events = [j["event"] for j in store.journal("r")]
    assert "effect re-issued after restart" in events or point in ("before_intent", "after_done")


def test_every_plan_kind_is_crashed_at_every_step_boundary_by_one_of_the_matrices():
    """A new plan kind (docs/architecture.md, "Adding a transition kind") needs a crash case: this matrix's
    cycle or the trainer's (tests/unit/test_crash_matrix.py) must run it."""
    from tests.unit.test_crash_matrix import CYCLES

    assert {*CYCLES, *(plan for _, plan, _, _ in CYCLE)} == set(PlanKind)
