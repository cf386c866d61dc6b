"""The daemon carries out a policy's whole plan: every move on rollout and elastic pools becomes a journaled
transition (grouped per allocation, kind and roles), and ``borrow --dry-run`` shows all of it. The policy
is a real policy file loaded by name from ``$PEARL_POLICY_PATH``; the daemon's objects run for real against
a real SQLite state."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor, PlanKind, TransitionDetail
from pearlctl.state.rows import Transition
from pearlctl.state.store import Store
from tests import factories

NOW = 1_000_000.0

# a policy that wants two of the three serving GPUs, disaggregated: one prefilling, one decoding
POLICY = """
from pearlctl.planner import plan
from pearlctl.planner.model import Mode, Target

def decide(snapshot):
    target = Target(Mode.DISAGGREGATED, rollout_gpus=2, prefill_gpus=1, elastic=1)
    planned = plan.make(snapshot, target, why="scripted: two GPUs, prefill + decode")
    return None if planned.empty else planned
"""


@pytest.fixture
def run(tmp_path: Path, monkeypatch):
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "scripted.py").write_text(textwrap.dedent(POLICY))
    monkeypatch.setenv("PEARL_POLICY_PATH", str(tmp_path / "policies"))
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        pools = [factories.pool(n, "ROLLOUT", nodes=k) for n, k in (("rollout", 2), ("elastic", 1))]
        factories.create_run(store, tmp_path, pools, policy="scripted")
        store.update_fields("runs", "r", borrow={"policy": "scripted", "max_gpus": None, "keep_warm": True})
        for i, a in enumerate(factories.run_all(store)):
            store.fleet.upsert_node_gpus("r", a.id, f"n{i}", [0], "ROLLOUT")
        ex = Executor(store, DaemonEffects(store, "r", None), run_id="r", epoch=None, clock=lambda: NOW)
        controller = Controller(store, "r", None, clock=lambda: NOW)
        controller.borrowing = Borrowing(store, ex, "r", clock=lambda: NOW)
        yield store, controller


def test_the_daemon_runs_every_move_of_the_plan_as_a_transition(run):
    store, controller = run
    with controller.lock:
        controller.borrowing.tick()
    made = store.transitions.all("r")
    pools = {a.id: a.pool_id for a in store.fleet.allocations("r")}
    names = {p["id"]: p["name"] for p in store.runs.pools("r")}
    gpus = {g.id: g for g in store.fleet.gpus("r")}
    seen = sorted(
        (t.kind, (t.detail or {}).get("plan"), names[pools[gpus[t.gpu_ids[0]].allocation_id]],
         t.from_role, t.to_role, len(t.gpu_ids))
        for t in made
    )  # fmt: skip
    # three serving GPUs, the target keeps two, one prefilling and one decoding: a rollout GPU retires (its
    # worker parked: workers are kept warm), the two that stay switch roles — the elastic one included
    assert [s[0] for s in seen] == ["retire", "switch", "switch"], seen
    retire, *switches = seen
    assert retire[1:3] == ("retire_sleep", "rollout") and retire[3:] == ("ROLLOUT", "IDLE", 1)
    assert sorted(s[4] for s in switches) == ["DECODE", "PREFILL"]
    assert {s[2] for s in switches} == {"rollout", "elastic"}
    assert all((t.detail or {}).get("why", "").startswith("scripted") for t in made)
    assert all(t.state == "PLANNED" for t in made)
    with controller.lock:
        controller.borrowing.tick()  # the next tick starts the retire and one switch; the other switch waits
    states = {(t.kind, t.state) for t in store.transitions.all("r")}
    assert states == {("retire", "DONE"), ("switch", "RUNNING"), ("switch", "PLANNED")}, states  # no worker: done
    assert len(store.transitions.all("r")) == 3  # and plans nothing new while they move


def _switches(store: Store) -> list[Transition]:
    return sorted((t for t in store.transitions.all("r") if t.kind == "switch"), key=lambda t: t.id)


def test_a_plans_switches_run_one_at_a_time_so_the_other_workers_keep_serving(run):
    store, controller = run
    with controller.lock:
        controller.borrowing.tick()
        controller.borrowing.tick()
    first, second = _switches(store)
    assert (first.state, second.state) == ("RUNNING", "PLANNED")
    for _ in range(3):  # the first one still moves (its worker has not drained): the second keeps waiting
        with controller.lock:
            controller.borrowing.tick()
        assert [t.state for t in _switches(store)] == ["RUNNING", "PLANNED"]
    store.set_state("transitions", first.id, expect="RUNNING", to="DONE", event="test: the switch completed")
    with controller.lock:
        controller.borrowing.tick()
    assert [t.state for t in _switches(store)] == ["DONE", "RUNNING"]  # now the second one goes


def test_when_a_switch_of_a_plan_fails_its_waiting_switches_are_dropped(run):
    store, controller = run
    with controller.lock:
        controller.borrowing.tick()
        controller.borrowing.tick()
    first, second = _switches(store)
    store.set_state("transitions", first.id, expect="RUNNING", to="FAILED", event="test: a step was held")
    with controller.lock:
        controller.borrowing.tick()
    dropped = store.transitions.get(second.id)
    assert dropped.state == "ROLLED_BACK" and store.transitions.steps(second.id) == []  # never started
    why = [j for j in store.journal.read("r") if j["entity"] == "transitions" and j["entity_id"] == str(second.id)]
    assert any("earlier switch of its plan" in str(j["data"]) for j in why), why


def test_dry_run_prints_the_whole_plan_and_changes_nothing(run):
    store, controller = run
    answer = controller.operator.borrow(parse(bodies.Borrow, {"policy": "scripted", "dry_run": True}))
    whole = answer["whole_plan"]
    assert sorted(m["kind"] for m in whole["moves"]) == ["retire", "switch", "switch"]
    assert sorted(t["plan"] for t in whole["transitions"]) == ["retire_sleep", "switch", "switch"]
    assert whole["why"].startswith("scripted")
    assert store.transitions.all("r") == []


def test_a_retired_rollout_worker_is_parked_asleep_and_woken_by_the_next_plan(run):
    store, controller = run
    alloc = store.fleet.allocations("r")[0]
    gpu = next(g for g in store.fleet.gpus("r") if g.allocation_id == alloc.id)
    worker = store.fleet.add_worker(run_id="r", allocation_id=alloc.id, role="ROLLOUT", engine="vllm")
    store.update_fields("workers", worker, worker_key="rollout-0", gpu_idx=[0], url="http://n0:9000")
    store.set_state("workers", worker, expect="STARTING", to="READY", event="t")
    ex = controller.borrowing.executor
    detail = TransitionDetail(plan=PlanKind.RETIRE_SLEEP)
    tid = ex.plan("retire", [gpu.id], detail=detail, from_role="ROLLOUT", to_role="IDLE")
    ex.advance(tid)  # DEREGISTER done at once (no router); DRAIN issued: the GPU is IDLE, the worker parked
    assert store.fleet.gpu(gpu.id).role == "IDLE"
    assert store.fleet.gpu(gpu.id).worker_id == worker
    desired = controller.desired.of(alloc.id)
    assert [(d.key, d.state) for d in desired] == [("rollout-0", "SLEEPING")]
    for to in ("DRAINING", "SLEEPING"):  # its agent drains it and puts it to sleep
        store.set_state("workers", worker, expect=store.fleet.worker(worker).state, to=to, event="t")
    snapshot = controller.borrowing.inputs.snapshot(NOW)
    slot = next(g for g in snapshot.gpus if g.id == gpu.id)
    assert slot.parked and slot.role == "IDLE"  # the planner sees a wake, not a cold start


@pytest.mark.parametrize(
    "policy,work,wanted",
    [
        ("elastic", True, 3),  # uses every elastic GPU it can get: the pool grows to max_nodes
        ("static", True, 1),  # uses none: the pool stays at its launch size
        ("elastic", False, 1),  # the batch ended: back to the launch size, whatever the policy
    ],
)
def test_the_elastic_pool_is_sized_by_the_policys_what_if_plan(run, policy, work, wanted):
    store, controller = run
    if work:
        store.update_fields("runs", "r", rollout={"queued": 40, "generating": 8, "tool_wait": 0})
    settings = {"policy": policy, "max_gpus": None, "keep_warm": True}
    got, why = controller.borrowing.elastic_wanted(NOW, running=1, low=1, high=3, gpus_per_node=1, settings=settings)
    assert got == wanted, why
    assert store.transitions.all("r") == []  # a what-if changes nothing


def test_a_new_process_under_a_known_worker_key_gets_a_row_of_its_own(run):
    """A requeued allocation's agent starts its worker again under the same key: the old row (LOST, its
    process gone with the old run) ends, and the new process is a new worker — never taken for the old one
    'still serving'."""
    store, controller = run
    alloc = store.fleet.allocations("r")[0]

    def report(pid: int, state: str) -> None:
        body = {"allocation_id": alloc.id, "workers": [
            {"key": "rollout-0", "role": "ROLLOUT", "engine": "vllm", "gpus": [0], "state": state,
             "url": f"http://n0:{pid}", "pid": pid}]}  # fmt: skip
        controller.agents.heartbeat(parse(bodies.Heartbeat, body), alloc.id)

    report(100, "READY")
    old = next(w for w in store.fleet.workers("r") if w.worker_key == "rollout-0")
    store.set_state("workers", old.id, expect="READY", to="LOST", event="agent silent")
    report(200, "STARTING")
    rows = {w.id: w for w in store.fleet.workers("r")}
    assert rows[old.id].state == "STOPPED" and rows[old.id].worker_key == f"rollout-0#{old.id}"
    new = next(w for w in rows.values() if w.worker_key == "rollout-0")
    assert new.id != old.id and new.pid == 200 and new.state == "STARTING"
    events = [j["event"] for j in store.journal.read("r") if j["entity"] == "workers" and j["entity_id"] == str(old.id)]
    assert "replaced by a new process" in events
    # the same process reporting again (a daemon restart, an agent back after a pause) keeps its row
    report(200, "READY")
    assert next(w for w in store.fleet.workers("r") if w.worker_key == "rollout-0").id == new.id


def test_a_worker_judged_lost_while_starting_is_starting_again_when_its_agent_reports(run):
    """A busy host delays an agent's reports past the loss window while its worker starts: the daemon marks
    the worker LOST; the agent's next report (same process, still starting) brings it back to STARTING —
    not an 'unexpected report' on every heartbeat until the worker is READY."""
    store, controller = run
    alloc = store.fleet.allocations("r")[0]

    def report(state: str) -> None:
        body = {"allocation_id": alloc.id, "workers": [
            {"key": "rollout-0", "role": "ROLLOUT", "engine": "vllm", "gpus": [0], "state": state,
             "url": "http://n0:9000", "pid": 100}]}  # fmt: skip
        controller.agents.heartbeat(parse(bodies.Heartbeat, body), alloc.id)

    report("STARTING")
    worker = next(w for w in store.fleet.workers("r") if w.worker_key == "rollout-0")
    store.set_state("workers", worker.id, expect="STARTING", to="LOST", event="agent silent")
    report("STARTING")
    assert store.fleet.worker(worker.id).state == "STARTING"
    report("READY")
    assert store.fleet.worker(worker.id).state == "READY"
    mine = [j for j in store.journal.read("r") if j["entity"] == "workers" and j["entity_id"] == str(worker.id)]
    assert "unexpected report" not in [j["event"] for j in mine]
