"""What lets one daemon hear 512 agents a second (pearlctl/daemon/agents.py, pearlctl/daemon/liveness.py,
pearlctl/daemon/desired.py, pearlctl/daemon/longpoll.py, pearlctl/state/store.py): a heartbeat that repeats its
last report to unchanged state is answered from memory, and any change to what its answer derives from is folded
in again; heartbeat times are written once per check, in one transaction; a held long poll is answered early only
when its own allocation's desired workers change, and never misses a change made between its answer and its
hold; an agent whose request waits is alive. A real SQLite state, a fake clock; the event loop is asyncio's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.longpoll import LongPolls
from pearlctl.state.store import Store
from tests.conftest import FakeClock, running_run

T0 = 1_000_000.0


@pytest.fixture
def run(tmp_path: Path):
    clock = FakeClock(T0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        running_run(store, tmp_path, pool="rollout", role="ROLLOUT", nodes=3)
        controller = Controller(store, "r", None, heartbeat_s=1.0, clock=clock)
        yield store, controller, clock, [a.id for a in store.fleet.allocations("r")]


def beat(controller: Controller, alloc: int, workers: list[dict]) -> dict:
    body = bodies.Heartbeat.model_validate_json(json.dumps({"allocation_id": alloc, "workers": workers}))
    return controller.agents.heartbeat(body, alloc)


def ready(store: Store, alloc: int, answer: dict) -> list[dict]:
    node = store.fleet.allocation(alloc).node
    return [
        {**{k: w[k] for k in ("key", "role", "engine", "gpus")}, "state": "READY", "pid": 7, "url": f"http://{node}:80"}
        for w in answer["desired"]
    ]


def test_a_repeated_report_is_answered_from_memory_and_a_change_to_its_allocation_is_folded_in(run):
    store, controller, clock, (a, b, _) = run
    report = ready(store, a, beat(controller, a, []))
    beat(controller, a, report)  # the worker is created READY
    folded = controller.agents.heartbeats["folded"]
    revision = store.revision
    first = beat(controller, a, report)
    for _ in range(5):
        assert beat(controller, a, report) == first
    assert controller.agents.heartbeats["folded"] == folded  # none of the six looked at state again
    assert controller.agents.heartbeats["remembered"] == 6
    assert store.revision == revision  # and none wrote anything

    # another allocation changing does not make it fold
    beat(controller, b, ready(store, b, beat(controller, b, [])))
    folded = controller.agents.heartbeats["folded"]
    beat(controller, a, report)
    assert controller.agents.heartbeats["folded"] == folded

    # its own GPU changing does: the answer follows the state at once
    (gpu,) = store.fleet.gpus("r", allocation_id=a)
    store.update_fields("gpus", gpu.id, event="role set", role="IDLE")
    assert beat(controller, a, report)["desired"] == []
    assert controller.agents.heartbeats["folded"] == folded + 1

    # and so does a new weight export (the desired vLLM worker's weights)
    store.update_fields("gpus", gpu.id, event="role set", role="ROLLOUT")
    beat(controller, a, report)
    store.update_fields("runs", "r", trainer={"weight_version": "7", "weights_path": "/w/7"})
    (worker,) = beat(controller, a, report)["desired"]
    assert worker["weights"] == {"version": "7", "path": "/w/7"}


def test_an_allocation_with_lent_gpus_is_always_folded(run):
    store, controller, clock, (a, _, _) = run
    (gpu,) = store.fleet.gpus("r", allocation_id=a)
    store.update_fields("gpus", gpu.id, borrowed=1, return_deadline=T0 + 60)
    report = ready(store, a, beat(controller, a, []))
    beat(controller, a, report)
    folded = controller.agents.heartbeats["folded"]
    for _ in range(3):
        assert beat(controller, a, report)["desired"][0]["return_deadline"] == T0 + 60
    assert controller.agents.heartbeats["folded"] == folded + 3


def test_heartbeat_times_are_written_once_per_check_in_one_transaction(run):
    store, controller, clock, allocs = run
    for a in allocs:
        beat(controller, a, [])
    clock.advance(0.4)
    for a in allocs:
        beat(controller, a, [])
    assert all(x.agent_seen_at is None for x in store.fleet.allocations("r"))  # nothing written per heartbeat
    revision = store.revision
    controller.liveness.check_agents()
    assert [x.agent_seen_at for x in store.fleet.allocations("r")] == [T0 + 0.4] * 3
    assert store.revision == revision  # bookkeeping: held long polls are not woken for it
    # an older time never overwrites a newer one, and a requeued (PENDING) task's time is not brought back
    store.fleet.record_agents_seen("r", {allocs[0]: T0})
    store.set_state("allocations", allocs[1], expect="RUNNING", to="PENDING", event="requeued", agent_seen_at=None)
    store.fleet.record_agents_seen("r", {allocs[1]: T0 + 1})
    seen = {x.id: x.agent_seen_at for x in store.fleet.allocations("r")}
    assert seen[allocs[0]] == T0 + 0.4 and seen[allocs[1]] is None


def test_an_agent_whose_request_waits_is_not_lost(run):
    store, controller, clock, (a, b, c) = run
    for x in (a, b, c):
        beat(controller, x, [])
    controller.liveness.published()
    clock.advance(controller.liveness.takeover_grace_s + 1)
    with controller.liveness.arrived(a):  # a's heartbeat waits for a thread, the lock or a change, for a long time
        clock.advance(controller.liveness.loss_window_s * 3)
        controller.liveness.check_agents()
        controller.liveness.check_agents()
    lost = {g.allocation_id for g in store.fleet.gpus("r") if g.state == "LOST"}
    assert lost == {b, c}


def test_the_gpu_and_worker_reads_of_a_whole_run_follow_every_write(run, tmp_path: Path):
    store, controller, clock, (a, b, _) = run
    before = store.fleet.gpus("r")
    assert store.fleet.gpus("r") == before
    (gpu,) = store.fleet.gpus("r", allocation_id=a)
    store.update_fields("gpus", gpu.id, event="role set", role="IDLE")  # this connection's write
    assert [g.role for g in store.fleet.gpus("r") if g.id == gpu.id] == ["IDLE"]
    with Store.open(tmp_path / "s.db", clock=clock) as other:  # another connection's write
        other.update_fields("gpus", gpu.id, event="role set", role="DECODE")
    assert [g.role for g in store.fleet.gpus("r") if g.id == gpu.id] == ["DECODE"]
    rows = store.fleet.gpus("r")
    with pytest.raises(dataclasses.FrozenInstanceError):  # rows are values: the cache hands out the same ones
        rows[0].role = "scribbled"
    assert store.fleet.gpus("r") == rows and "scribbled" not in {g.role for g in rows}


def test_an_allocations_fingerprint_is_read_once_while_nothing_changes_and_follows_every_write(run, tmp_path: Path):
    """``store.fleet.fingerprint`` (a repeated heartbeat's check, in the event loop): one query for the first
    ask, none while the database is unchanged (its reader's statements counted), a new value after this store's
    write and after another connection's."""
    store, controller, clock, (a, b, _) = run
    first = store.fleet.fingerprint(a)
    conn, _lock = store.fleet._fingerprint_reader()
    selects: list[str] = []
    conn.set_trace_callback(lambda sql: selects.append(sql) if sql.lstrip().startswith("SELECT") else None)
    assert [store.fleet.fingerprint(a) for _ in range(5)] == [first] * 5 and selects == []
    (gpu,) = store.fleet.gpus("r", allocation_id=a)
    store.update_fields("gpus", gpu.id, event="role set", role="IDLE")  # this connection's write
    second = store.fleet.fingerprint(a)
    assert second != first and len(selects) == 1
    with Store.open(tmp_path / "s.db", clock=clock) as other:  # another connection's write
        other.update_fields("gpus", gpu.id, event="role set", role="DECODE")
    assert store.fleet.fingerprint(a) not in (first, second) and len(selects) == 2
    assert store.fleet.fingerprint(b) is not None and store.fleet.fingerprint(10**6) is None


# -- long polls in the event loop ---------------------------------------------------------------------------
def test_a_held_poll_ends_at_its_deadline_when_nothing_changes():
    async def main():
        polls = LongPolls()
        polls.loop = asyncio.get_running_loop()
        held = asyncio.create_task(polls.hold(1, "h1", polls.passes, 0.2))
        await asyncio.sleep(0.05)
        threading.Thread(target=polls.publish, args=({1: ([], "h1"), 2: ([], "h2")},)).start()  # the same
        started = asyncio.get_running_loop().time()
        assert await held is None
        return asyncio.get_running_loop().time() - started

    assert 0.1 < asyncio.run(main()) < 1.0


def test_a_change_answers_only_the_polls_of_its_allocation_at_once():
    async def main():
        polls = LongPolls()
        polls.loop = asyncio.get_running_loop()
        one = asyncio.create_task(polls.hold(1, "h1", polls.passes, 5.0))
        two = asyncio.create_task(polls.hold(2, "h2", polls.passes, 0.3))
        await asyncio.sleep(0.05)
        threading.Thread(target=polls.publish, args=({1: (["new"], "h1b"), 2: ([], "h2")},)).start()
        assert await asyncio.wait_for(one, 1.0) == (["new"], "h1b")
        assert await two is None

    asyncio.run(main())


def test_a_change_published_between_an_answer_and_its_hold_is_not_missed():
    async def main():
        polls = LongPolls()
        polls.loop = asyncio.get_running_loop()
        answered_after = polls.passes  # the answer was made here...
        polls.publish({1: (["new"], "h1b")})  # ...a pass disagreeing with it came before the hold
        return await asyncio.wait_for(polls.hold(1, "h1", answered_after, 5.0), 1.0)

    assert asyncio.run(main()) == (["new"], "h1b")


def test_notify_publishes_only_when_state_changed(run):
    store, controller, clock, (a, _, _) = run
    controller.desired.notify()
    passes = controller.long_polls.passes
    controller.desired.notify()
    controller.trainer.rollout_progress(bodies.Progress(queued=3))  # bookkeeping
    controller.desired.notify()
    assert controller.long_polls.passes == passes
    (gpu,) = store.fleet.gpus("r", allocation_id=a)
    store.update_fields("gpus", gpu.id, event="role set", role="IDLE")
    controller.desired.notify()
    assert controller.long_polls.passes == passes + 1
    _, latest = controller.long_polls._latest
    assert latest[a][0] == [] and set(latest) == {x.id for x in store.fleet.allocations("r")}
