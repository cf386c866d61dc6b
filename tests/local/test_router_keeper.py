"""The daemon's router keeper against the real gateway and real vllm-router (pearlctl.router), with small
stand-in workers that answer ``/health``: membership follows state's routable workers, a DEREGISTER is
proven only once the router no longer routes to the worker, and a router that dies is started again with
its membership rebuilt from state. (Real vLLM workers behind the router: tests/engines/test_router_engine.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.routing import RouterKeeper
from pearlctl.daemon.transitions import Executor
from pearlctl.router import service
from pearlctl.state.store import Store
from tests import factories
from tests.conftest import wait_for


def _health(request):
    return JSONResponse({})


def _models(request):
    return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


@pytest.fixture
def workers():
    """Two stand-in workers on loopback: URL list."""
    app = Starlette(routes=[Route("/health", _health), Route("/v1/models", _models)])
    servers, urls = [], []
    for _ in range(2):
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        urls.append(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}")
        servers.append(server)
    yield urls
    for s in servers:
        s.should_exit = True


@pytest.fixture
def world(tmp_path: Path, workers):
    store = Store.open(tmp_path / "s.db")
    factories.create_run(store, tmp_path, [factories.pool("rollout", "ROLLOUT", gpus_per_node=2)], backend="local")
    alloc = store.fleet.allocations("r")[0]
    store.fleet.upsert_node_gpus("r", alloc.id, "n1", [0, 1], "ROLLOUT")
    ids = []
    for i, url in enumerate(workers):
        wid = store.fleet.add_worker(run_id="r", allocation_id=alloc.id, role="ROLLOUT", engine="vllm", url=url)
        store.update_fields("workers", wid, worker_key=f"rollout-{i}", gpu_idx=[i], routable=1, weight_version="3")
        store.set_state("workers", wid, expect="STARTING", to="READY", event="t")
        ids.append(wid)
    events: list[tuple[str, dict]] = []
    keeper = RouterKeeper(store, "r", str(tmp_path), journal=lambda e, d: events.append((e, d)), host="127.0.0.1")
    yield store, keeper, ids, workers, events
    if keeper.record is not None:
        service.stop(keeper.record, run_dir=str(tmp_path))
    store.close()


def test_membership_follows_state_and_is_rebuilt_after_the_router_dies(world):
    store, keeper, ids, urls, events = world
    keeper.sync_once()
    assert keeper.routed() == set(urls)
    assert [e for e, _ in events] == ["router started", "router membership"]
    assert sorted(events[1][1]["added"]) == sorted(urls)

    # a worker is taken out (what DEREGISTER writes): the router stops routing to it on the next pass
    store.update_fields("workers", ids[0], routable=0)
    keeper.sync_once()
    assert keeper.routed() == {urls[1]}
    assert events[-1] == ("router membership", {"added": [], "removed": [urls[0]], "members": 1})

    # the gateway is killed: the next pass (after the process check interval) starts a new one, given the
    # routable set from state at once
    record = keeper.record
    os.killpg(record.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while service.same_process(record.pid, record.start_ticks) and time.monotonic() < deadline:
        time.sleep(0.05)
    keeper._checked_at = 0.0  # do not wait out CHECK_PROCESS_S
    keeper.sync_once()
    assert keeper.record.pid != record.pid
    assert keeper.record.port == record.port  # the same address for clients
    keeper.sync_once()
    assert keeper.routed() == {urls[1]}
    assert "router restarted" in [e for e, _ in events]


def test_deregister_is_proven_only_when_the_router_no_longer_routes_to_the_worker(world):
    store, keeper, ids, urls, _ = world
    keeper.sync_once()
    effects = DaemonEffects(store, "r", None, router=keeper.routed)
    ex = Executor(store, effects, run_id="r", epoch=None)
    gpu = next(g for g in store.fleet.gpus("r") if g.idx == 0)
    tid = ex.plan("retire", [gpu.id], from_role="ROLLOUT", to_role="IDLE")
    ex.advance(tid)
    step = store.transitions.steps(tid)[0]
    assert step.kind == "DEREGISTER" and step.state == "INTENT"  # state says so; the router not yet
    assert not store.fleet.worker(ids[0]).routable
    keeper.sync_once()
    ex.advance(tid)
    assert store.transitions.steps(tid)[0].state == "DONE"
    assert urls[0] not in keeper.routed()


def test_cancel_stops_the_router_a_gone_daemon_left_behind(tmp_path: Path):
    """The gateway outlives its daemon by design; `pearlctl cancel` of the run stops it (no daemon runs)."""
    from tests.conftest import Pearlctl
    from tests.local.test_cli_errors import create_run

    run_dir = tmp_path / "run"
    create_run(tmp_path / "state", run_dir, active=True)
    record = service.start(run_dir, "127.0.0.1", 0)
    assert service.same_process(record.pid, record.start_ticks)
    proc = Pearlctl(tmp_path / "state")("cancel", "r", check=None)
    assert proc.returncode == 0, proc.stderr
    assert f"stopped the run's router (pid {record.pid}" in proc.stderr
    assert not service.same_process(record.pid, record.start_ticks)
    assert service.read_record(run_dir) is None


def test_a_deregister_wakes_the_keeper_and_the_routers_answer_wakes_the_control_loop(world):
    store, keeper, ids, urls, _ = world
    keeper.sync_once()
    keeper.every_s = 60.0  # on its timer alone, the keeper would sync again in a minute
    changed = threading.Event()
    keeper.on_change = changed.set  # the daemon's: its control loop looks at once
    stopping = threading.Event()
    loop = threading.Thread(target=keeper.loop, args=(stopping, lambda: None, lambda e: None), daemon=True)
    loop.start()
    time.sleep(0.3)  # its first pass is done: it waits on the timer
    effects = DaemonEffects(store, "r", None, router=keeper.routed, router_wake=keeper.wake)
    ex = Executor(store, effects, run_id="r", epoch=None)
    gpu = next(g for g in store.fleet.gpus("r") if g.idx == 0)
    tid = ex.plan("retire", [gpu.id], from_role="ROLLOUT", to_role="IDLE")
    ex.advance(tid)
    intent = store.transitions.steps(tid)[0]
    assert intent.kind == "DEREGISTER" and intent.state == "INTENT"
    assert changed.wait(10), "the router's changed membership did not wake the control loop"
    ex.advance(tid)
    done = store.transitions.steps(tid)[0]
    assert done.state == "DONE" and urls[0] not in keeper.routed()
    assert done.updated_at - intent.updated_at < 5.0  # one round trip to the router, not the 60-s timer
    stopping.set()
    keeper.wake()
    loop.join(5)
    assert not loop.is_alive()


def _process_state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T for stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_gateway_too_busy_to_answer_health_stays_the_runs_and_membership_goes_on(world):
    """A gateway that lives but does not answer /health in time (here: stopped with SIGSTOP; under a batch of
    thousands of turns, slow) is not a gateway to replace: the keeper keeps it (no start is tried, which the
    live process would refuse), and once it answers again the membership change made meanwhile reaches it."""
    store, keeper, ids, urls, events = world
    keeper.sync_once()
    record = keeper.record
    os.kill(record.pid, signal.SIGSTOP)
    try:
        # stopped (state "T"), not only signalled: on a busy machine the kernel may not have stopped it yet
        wait_for(lambda: _process_state(record.pid) == "T", 10, every=0.01)
        keeper._checked_at = 0.0
        assert keeper.ensure_running() is record  # kept, not restarted and no RouterStartError
        store.update_fields("workers", ids[0], routable=0)
    finally:
        os.kill(record.pid, signal.SIGCONT)
    keeper.sync_once()
    assert keeper.record.pid == record.pid and keeper.routed() == {urls[1]}
    assert "router restarted" not in [e for e, _ in events]


def test_a_deregister_waits_for_a_membership_change_in_flight_that_routes_to_the_worker(world):
    """A change the keeper sent before a DEREGISTER's effect (state then still wanted the worker) may put the worker
    back into the router when it is answered: until it is, the worker is not proven out. (Seen live at 64 GPUs: a
    change held 30 s by other workers' adds re-added a worker after its return had drained it and put it to sleep;
    the router sent it 41 turns that then waited in a sleeping engine.)"""
    store, keeper, ids, urls, _ = world
    keeper.sync_once()
    store.update_fields("workers", ids[0], routable=0)
    keeper.sync_once()
    assert keeper.routed() == {urls[1]}
    store.update_fields("workers", ids[0], routable=1)  # wanted again (a worker reported back after a silence)
    record = keeper.record
    os.kill(record.pid, signal.SIGSTOP)  # the change below waits for the gateway, as one behind slow adds does
    try:
        syncing = threading.Thread(target=keeper.sync_once, daemon=True)
        syncing.start()
        deadline = time.monotonic() + 10
        while urls[0] not in keeper.may_route() and time.monotonic() < deadline:
            time.sleep(0.02)
        effects = DaemonEffects(store, "r", None, router=keeper.routed, router_may_route=keeper.may_route)
        ex = Executor(store, effects, run_id="r", epoch=None)
        gpu = next(g for g in store.fleet.gpus("r") if g.idx == 0)
        tid = ex.plan("retire", [gpu.id], from_role="ROLLOUT", to_role="IDLE")
        ex.advance(tid)  # DEREGISTER's effect: state says not routable; the router has not answered the change
        assert urls[0] not in keeper.routed()  # what the router last said: the old probe proved DEREGISTER here
        assert store.transitions.steps(tid)[0].state == "INTENT"
    finally:
        os.kill(record.pid, signal.SIGCONT)
    syncing.join(30)
    assert urls[0] in keeper.routed()  # the change in flight did route to it again
    ex.advance(tid)
    assert store.transitions.steps(tid)[0].state == "INTENT"
    keeper.sync_once()  # the next change takes it out: now it is proven
    ex.advance(tid)
    assert store.transitions.steps(tid)[0].state == "DONE" and urls[0] not in keeper.routed()
