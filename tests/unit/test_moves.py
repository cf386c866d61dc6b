"""Operator moves (``POST /v1/moves``, ``pearlctl move``): what the controller refuses, naming why, and
that an accepted move is a transition the daemon carries out like a policy's — through a whole cycle of a
rollout GPU (switch to prefill and back, retire parked, wake, retire, start) with no engine started twice
and no worker drained while routed.

The daemon's objects run for real against a real SQLite state; the agent and the router's membership are
simulated at their seams (tests/unit/test_crash_matrix_pools.py: SimAgent, SimRouter)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.controller import ControlError
from pearlctl.daemon.transitions import PLANS, PlanKind
from pearlctl.state.store import Store
from tests import factories
from tests.crash_harness import Clock, Daemon, SimAgent, SimRouter


@pytest.fixture
def world(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    pools = [factories.pool("trainer", "TRAIN"), factories.pool("rollout", "ROLLOUT")]
    factories.create_run(store, tmp_path, pools, spec_path="r.toml")
    for a, job, node in zip(store.fleet.allocations("r"), ("7", "8"), ("gpu1", "gpu2"), strict=True):
        factories.submit(store, a.id, job)
        factories.start(store, a.id, node)
    clock, router = Clock(), SimRouter()
    rollout = next(a for a in store.fleet.allocations("r") if a.pool == "rollout")
    daemon = Daemon(store, rollout.id, 1, clock, router)
    for job, node in (("7", "gpu1"), ("8", "gpu2")):
        daemon.controller.agents.register(
            parse(bodies.Register, {"job_id": job, "task_id": 0, "node": node, "gpus": [0], "pid": 1})
        )
    agent = SimAgent(router, host="gpu2")

    def loop(until) -> None:
        for _ in range(100):
            agent.tick(daemon)
            router.sync(store)
            with daemon.controller.lock:
                daemon.borrowing.tick()
            clock.t += 1.0
            if until():
                return
        raise AssertionError("did not converge")

    loop(lambda: any(w.routable for w in store.fleet.workers("r")))
    yield store, daemon, agent, loop
    store.close()


def move(daemon: Daemon, kind: str, *gpus: str | int, role: str | None = None, keep_warm: bool = False) -> dict:
    refs = [{"id": g} if isinstance(g, int) else {"node": g.split(":")[0], "index": int(g.split(":")[1])} for g in gpus]
    body = parse(bodies.Move, {"kind": kind, "gpus": refs, "role": role, "keep_warm": keep_warm})
    return daemon.controller.operator.move(body)


def test_a_rollout_gpu_goes_through_every_move_and_back(world):
    store, daemon, agent, loop = world
    cycle = [
        ("switch", "PREFILL", False, "switch", "ROLLOUT", "PREFILL"),
        ("switch", "ROLLOUT", False, "switch", "PREFILL", "ROLLOUT"),
        ("retire", None, True, "retire_sleep", "ROLLOUT", "IDLE"),
        ("wake", None, False, "wake", "IDLE", "ROLLOUT"),
        ("retire", None, False, "retire", "ROLLOUT", "IDLE"),
        ("start", "DECODE", False, "start", "IDLE", "DECODE"),
    ]
    gpu = next(g for g in store.fleet.gpus("r") if g.pool == "rollout")
    for kind, role, keep_warm, plan, from_role, to_role in cycle:
        answer = move(daemon, kind, "gpu2:0", role=role, keep_warm=keep_warm)
        assert (answer["plan"], answer["from_role"], answer["to_role"]) == (plan, from_role, to_role)
        assert answer["gpus"] == ["gpu2:0"] and answer["policy"] == "never"
        tid = answer["transition_id"]
        loop(lambda tid=tid: store.transitions.get(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
        t = store.transitions.get(tid)
        assert t.state == "DONE" and t.detail["by"] == "operator", t
        assert store.fleet.gpu(gpu.id).role == to_role
    loop(lambda: any(w.role == "DECODE" and w.routable for w in store.fleet.workers("r")))
    # one start per worker a move brought up: the launch's rollout-0, prefill-0 by the first switch, a new
    # rollout-0 by the switch back, none by the wake (it woke the parked one), decode-0 by the start
    assert agent.starts == {"rollout-0": 2, "prefill-0": 1, "decode-0": 1}
    assert agent.drained_while_routed == []


@pytest.mark.parametrize(
    "kind,gpus,role,status,says",
    [
        ("retire", ["gpu1:0"], None, 400, "trainer GPU"),
        ("switch", ["gpu9:0"], "PREFILL", 404, "has no GPU gpu9:0"),
        ("start", ["gpu2:0"], None, 400, "serve ROLLOUT"),
        ("wake", ["gpu2:0"], None, 400, "serve ROLLOUT"),
        ("switch", ["gpu2:0"], "ROLLOUT", 400, "already serve ROLLOUT"),
        ("retire", ["gpu1:0", "gpu2:0"], None, 400, "trainer GPU"),
    ],
)
def test_a_move_that_does_not_fit_is_refused_naming_why(world, kind, gpus, role, status, says):
    store, daemon, _, _ = world
    before = len(store.transitions.all("r"))
    with pytest.raises(ControlError) as exc:
        move(daemon, kind, *gpus, role=role)
    assert exc.value.status == status and says in str(exc.value), str(exc.value)
    assert len(store.transitions.all("r")) == before  # nothing planned


def test_wake_needs_a_parked_worker_and_start_refuses_one(world):
    store, daemon, _, loop = world
    tid = move(daemon, "retire", "gpu2:0")["transition_id"]  # stopped, not parked
    loop(lambda: store.transitions.get(tid).state == "DONE")
    with pytest.raises(ControlError, match="no ROLLOUT worker is parked asleep"):
        move(daemon, "wake", "gpu2:0")
    with pytest.raises(ControlError, match="are IDLE: nothing serves there to retire"):
        move(daemon, "retire", "gpu2:0")
    tid = move(daemon, "start", "gpu2:0")["transition_id"]
    loop(lambda: store.transitions.get(tid).state == "DONE")
    tid = move(daemon, "retire", "gpu2:0", keep_warm=True)["transition_id"]
    loop(lambda: store.transitions.get(tid).state == "DONE")
    with pytest.raises(ControlError, match="wake it instead"):
        move(daemon, "start", "gpu2:0")


def test_one_plan_at_a_time_a_second_move_is_a_conflict(world):
    store, daemon, _, _ = world
    first = move(daemon, "switch", "gpu2:0", role="DECODE")
    with pytest.raises(ControlError) as exc:
        move(daemon, "retire", "gpu2:0")
    assert exc.value.status == 409 and f"transition {first['transition_id']}" in str(exc.value)


def test_gpus_are_named_by_node_and_index_or_by_id_and_an_ambiguous_name_asks_for_the_id(world):
    store, daemon, _, loop = world
    rollout = next(g for g in store.fleet.gpus("r") if g.pool == "rollout")
    trainer = next(g for g in store.fleet.gpus("r") if g.pool == "trainer")
    answer = move(daemon, "switch", rollout.id, role="DECODE")
    assert answer["gpus"] == ["gpu2:0"] and answer["to_role"] == "DECODE"
    loop(lambda: store.transitions.get(answer["transition_id"]).state == "DONE")
    with pytest.raises(ControlError, match="is a trainer GPU"):
        move(daemon, "retire", trainer.id)
    with pytest.raises(ControlError, match="has no GPU id 999"):
        move(daemon, "retire", 999)
    # a second rollout allocation on the same node and index (as the local backend gives): the name fits both
    pool_id = store.fleet.allocations("r")[1].pool_id
    extra = store.fleet.add_allocation("r", pool_id, event="t")
    store.set_state("allocations", extra.id, expect="REQUESTED", to="PENDING", event="t", job_id="9")
    store.set_state("allocations", extra.id, expect="PENDING", to="RUNNING", event="t", node="gpu2")
    daemon.controller.agents.register(
        parse(bodies.Register, {"job_id": "9", "task_id": extra.array_index, "node": "gpu2", "gpus": [0], "pid": 2})
    )
    with pytest.raises(ControlError, match="fits several GPUs: id .* name one by its id"):
        move(daemon, "retire", "gpu2:0")


def test_a_rollout_gpu_shifts_to_the_judge_and_back_and_only_a_run_with_a_judge_may(world):
    """A switch to REWARD needs the run's judge (a reward pool and its model): refused by name without one, and
    nothing planned. With one, the rollout GPU serves the judge's model (its agent is told the model, which is not
    its pool's) in a worker of role REWARD, and a switch back serves the policy again with its own pool's model;
    each is one transition carried out to DONE, and the GPU's role change is journaled by the step that made it."""
    store, daemon, agent, loop = world
    with pytest.raises(ControlError, match=r"run r has no judge: .*add \[pools.reward\] with its model") as err:
        move(daemon, "switch", "gpu2:0", role="REWARD")
    assert err.value.status == 422 and store.transitions.all("r") == []
    spec = {"model": "/m/policy", "pools": {"reward": {"model": "/m/judge", "engine_args": {"max_model_len": 64}}}}
    store.update_fields("runs", "r", spec=spec)
    rollout = next(a for a in store.fleet.allocations("r") if a.pool == "rollout").id
    gpu = next(g for g in store.fleet.gpus("r") if g.pool == "rollout")
    for role, model in (("REWARD", "/m/judge"), ("ROLLOUT", None)):
        answer = move(daemon, "switch", "gpu2:0", role=role)
        assert (answer["plan"], answer["to_role"]) == ("switch", role)
        tid = answer["transition_id"]
        loop(lambda tid=tid: store.transitions.get(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
        assert store.transitions.get(tid).state == "DONE"
        assert store.fleet.gpu(gpu.id).role == role
        (want,) = daemon.controller.desired.of(rollout)
        assert (want.role, want.model) == (role, model)
        serving = [w for w in store.fleet.workers("r") if w.allocation_id == rollout and w.state == "READY"]
        assert [(w.role, w.routable) for w in serving] == [(role, 1)]
        journal = store.journal.read("r")
        roles = [j for j in journal if j["entity"] == "gpus" and str(j["entity_id"]) == str(gpu.id)]
        assert roles and roles[-1]["data"]["step"].startswith(f"{tid}:")  # the role change is journaled by its step
        # what the shift cost: its completion's row has its seconds and each step's
        (done,) = [
            j
            for j in journal
            if j["entity"] == "transitions" and j["entity_id"] == str(tid) and j["to_state"] == "DONE"
        ]
        assert list(done["data"]["steps"]) == [f"{i}:{k}" for i, k in enumerate(PLANS[PlanKind.SWITCH])]
        assert done["data"]["seconds"] >= max(done["data"]["steps"].values()) > 0
    # the timeline rebuilt from the journal draws the GPU as the judge between the two shifts
    from pearlctl.ops.timeline import reconstruct

    gpus = [dict(g.to_dict()) for g in store.fleet.gpus("r")]
    spans = reconstruct(store.journal.read("r"), gpus, start=0.0, end=time.time()).gpus[gpu.id]
    assert [s.category for s in spans if s.category != "TRANSITION"][-3:] == ["ROLLOUT", "REWARD", "ROLLOUT"]


def test_a_shift_with_keep_warm_parks_the_leaving_engine_and_a_shift_back_wakes_it(world):
    """Between the policy and the judge, ``keep_warm`` parks the leaving worker asleep on the GPU (switch_sleep);
    a shift to a role whose worker sleeps there wakes it (switch_wake), parking the leaving one in its turn. After
    three shifts each engine was started once, and the GPU holds the one it does not serve, asleep."""
    store, daemon, agent, loop = world
    spec = {"model": "/m/policy", "pools": {"reward": {"model": "/m/judge"}}}
    store.update_fields("runs", "r", spec=spec)
    gpu = next(g for g in store.fleet.gpus("r") if g.pool == "rollout").id
    for role, keep_warm, plan in (
        ("REWARD", True, "switch_sleep"),
        ("ROLLOUT", False, "switch_wake"),
        ("REWARD", False, "switch_wake"),
    ):
        answer = move(daemon, "switch", gpu, role=role, keep_warm=keep_warm)
        assert answer["plan"] == plan, role
        tid = answer["transition_id"]
        loop(lambda tid=tid: store.transitions.get(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
        assert store.transitions.get(tid).state == "DONE"
    assert agent.starts == {"rollout-0": 1, "reward-0": 1}
    g = store.fleet.gpu(gpu)
    parked = store.fleet.worker(g.worker_id)
    assert (g.role, parked.role, parked.state, g.parked_judge_id) == ("REWARD", "ROLLOUT", "SLEEPING", None)
    with pytest.raises(ControlError, match="already serve REWARD"):
        move(daemon, "switch", gpu, role="REWARD")
