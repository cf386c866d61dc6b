"""When the daemon judges an agent LOST (pearlctl/daemon/liveness.py, ``check_agents``): after one loss window of
silence, but never in the grace after the daemon's address was published (agents must find a new daemon first),
and with a stall of the daemon itself forgiven (its checks came late, so heartbeats may have waited on it) — while
an agent that really died is still found. A real SQLite state, a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.daemon.controller import Controller
from pearlctl.daemon.liveness import SEEN_WRITE_S
from pearlctl.state.store import Store
from tests.conftest import FakeClock, running_run

T0 = 1_000_000.0
HEARTBEAT_S = 1.0  # the loss window is then 2 s (lost_after 2), the takeover grace 3 s


@pytest.fixture
def run(tmp_path: Path):
    clock = FakeClock(T0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        running_run(store, tmp_path, pool="trainer", role="TRAIN", nodes=1)
        (a,) = store.fleet.allocations("r")
        controller = Controller(store, "r", None, heartbeat_s=HEARTBEAT_S, clock=clock)
        yield store, controller, clock, a.id


def heard(store: Store, alloc: int, clock: FakeClock) -> None:
    store.update_fields("allocations", alloc, agent_seen_at=clock.now)


def gpu_state(store: Store) -> str:
    (g,) = store.fleet.gpus("r")
    return g.state


def test_no_agent_is_judged_before_a_loss_window_and_a_heartbeat_after_the_address_is_published(run):
    store, controller, clock, alloc = run
    heard(store, alloc, clock)  # its last heartbeat went to the daemon before
    clock.now += 30  # the new daemon took 30 s to start its router and publish its address
    controller.liveness.published()
    for _ in range(5):  # 2.5 s: inside the 3-s grace, the agent's 32-s silence says nothing yet
        clock.now += 0.5
        assert controller.liveness.check_agents() == []
    clock.now += 0.5
    assert controller.liveness.check_agents() == [alloc] and gpu_state(store) == "LOST"


def test_a_stall_of_the_daemon_is_forgiven_and_a_dead_agent_is_still_found(run):
    store, controller, clock, alloc = run
    controller.liveness.published()
    clock.now += 5  # past the grace, checked every 0.5 s, the agent heard every second
    for i in range(8):
        if i % 2 == 0:
            heard(store, alloc, clock)
        assert controller.liveness.check_agents() == []
        clock.now += 0.5
    heard(store, alloc, clock)
    clock.now += 3.5  # the daemon was held up 3.5 s (a slow tick): the agent's heartbeats waited on it
    assert controller.liveness.check_agents() == [] and gpu_state(store) == "UP"
    # the agent is dead from here: nothing is heard, and it is found once its silence passes window + stall
    lost_at = None
    while lost_at is None and clock.now < T0 + 60:
        clock.now += 0.5
        if controller.liveness.check_agents():
            lost_at = clock.now
    assert lost_at is not None and gpu_state(store) == "LOST"
    last_heard = store.fleet.allocations("r")[0].agent_seen_at
    assert 3.5 + 0.5 < lost_at - last_heard <= 2.0 + 3.5 + 0.5  # found after the forgiven window, not later


def test_without_a_stall_an_agent_silent_past_the_window_is_lost_at_the_next_check(run):
    store, controller, clock, alloc = run
    controller.liveness.published()
    clock.now += 5
    heard(store, alloc, clock)
    for _ in range(3):  # up to 1.5 s of silence: inside the 2-s window
        clock.now += 0.5
        assert controller.liveness.check_agents() == []
    clock.now += 0.5  # 2 s: a whole window of silence
    assert controller.liveness.check_agents() == [alloc]


def test_an_agent_heard_through_the_controller_is_never_lost_while_nothing_else_changes(run):
    """The loss check reads the allocations from a cache that only a change of the rows refreshes; heartbeat
    times are bookkeeping, written each check without such a change. The times it judges by must be the ones
    just written, not the cached ones: an agent heard every second for a minute is never LOST."""
    store, controller, clock, alloc = run
    controller.liveness.published()
    clock.now += 5
    for _ in range(120):
        controller.liveness.heard(alloc)
        assert controller.liveness.check_agents() == []
        clock.now += 0.5
        assert controller.liveness.check_agents() == []
        clock.now += 0.5
    assert gpu_state(store) == "UP"
    written = store.fleet.allocations("r")[0].agent_seen_at
    assert clock.now - 1.0 - SEEN_WRITE_S <= written <= clock.now - 1.0  # state has it, at most that late
    for _ in range(2):  # then it dies (last heard 1 s ago): found after one window of silence (2 s)
        assert controller.liveness.check_agents() == []
        clock.now += 0.5
    assert controller.liveness.check_agents() == [alloc]


def test_heartbeat_times_reach_state_at_most_every_seen_write_s_and_the_loss_check_reads_memory(run):
    store, controller, clock, alloc = run
    controller.liveness.published()
    clock.now += 5
    first = clock.now
    controller.liveness.heard(alloc)
    controller.liveness.check_agents()
    assert store.fleet.allocations("r")[0].agent_seen_at == first  # the first check writes
    while clock.now < first + SEEN_WRITE_S - 0.5:
        clock.now += 0.5
        controller.liveness.heard(alloc)
        assert controller.liveness.check_agents() == []
        assert store.fleet.allocations("r")[0].agent_seen_at == first  # not again before SEEN_WRITE_S
    clock.now = first + SEEN_WRITE_S
    controller.liveness.heard(alloc)
    controller.liveness.check_agents()
    assert store.fleet.allocations("r")[0].agent_seen_at == first + SEEN_WRITE_S
    # heard once more (in memory only), then silent: judged from that heartbeat, not state's older time
    last = clock.now + 0.5
    clock.now = last
    controller.liveness.heard(alloc)
    window = controller.liveness.loss_window_s
    while clock.now + 0.5 < last + window:  # checks half a second apart (no stall of the daemon to forgive)
        clock.now += 0.5
        assert controller.liveness.check_agents() == []
    clock.now = last + window - 0.1
    assert store.fleet.allocations("r")[0].agent_seen_at == first + SEEN_WRITE_S < clock.now - window
    assert controller.liveness.check_agents() == []  # state's time alone would have it LOST now
    clock.now = last + window + 0.1
    assert controller.liveness.check_agents() == [alloc]
