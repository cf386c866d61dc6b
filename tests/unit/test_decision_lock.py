"""The daemon's decision lock (pearlctl.daemon.decision_lock): reentrant, and a long hold is logged once, naming
where it was taken, at most one line per interval."""

from __future__ import annotations

import threading

from pearlctl.daemon.decision_lock import DecisionLock
from tests.conftest import FakeClock


def fold(lock: DecisionLock, clock: FakeClock, held_s: float) -> None:
    with lock:
        with lock:  # reentrant: only the outermost hold is timed
            clock.advance(held_s)


def test_a_long_hold_is_logged_with_where_it_was_taken_once_per_interval(caplog):
    caplog.set_level("WARNING", logger="pearlctl.daemon")
    clock = FakeClock()
    lock = DecisionLock(slow_s=0.1, log_every_s=10.0, clock=clock)
    fold(lock, clock, 0.05)
    assert lock.slow_holds == 0 and not caplog.messages
    fold(lock, clock, 0.4)
    assert lock.slow_holds == 1
    assert caplog.messages == ["decision lock held 400 ms by fold"]
    fold(lock, clock, 0.2)
    fold(lock, clock, 0.9)  # within the interval: counted, kept for the next line
    assert lock.slow_holds == 3 and len(caplog.messages) == 1
    clock.advance(10)
    fold(lock, clock, 0.15)
    assert caplog.messages[-1] == (
        "decision lock held 900 ms by fold (the longest of 3 holds of 100 ms or more since the last such line)"
    )


def test_a_long_holds_line_says_how_many_commits_of_state_it_made_and_how_long_they_took(caplog, tmp_path):
    from pearlctl.state.store import Store

    caplog.set_level("WARNING", logger="pearlctl.daemon")
    clock = FakeClock()
    store = Store.open(tmp_path / "state.db")
    seen: list[float] = []
    store.on_commit = seen.append
    lock = DecisionLock(slow_s=0.1, clock=clock, commits=store.commits_on_this_thread)
    with lock:
        for i in range(3):
            store.leases.acquire(f"k{i}", "me", 60)
        clock.advance(0.3)
    assert len(seen) == 3 and all(s >= 0 for s in seen)
    here = test_a_long_holds_line_says_how_many_commits_of_state_it_made_and_how_long_they_took.__name__
    disk = f"(3 commits of state, {1000 * sum(seen):.0f} ms in them)"
    assert caplog.messages == [f"decision lock held 300 ms by {here} {disk}"]
    # another thread's commits are its own
    other = threading.Thread(target=lambda: store.leases.acquire("other", "me", 60))
    other.start()
    other.join(5)
    assert store.commits_on_this_thread()[0] == 3 and len(seen) == 4
    store.close()


def test_it_excludes_other_threads_while_held():
    lock = DecisionLock()
    inside = threading.Event()
    release = threading.Event()

    def holder():
        with lock:
            inside.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    inside.wait(5)
    assert not lock.acquire(timeout=0.05)
    release.set()
    t.join(5)
    assert lock.acquire(timeout=1)
    lock.release()
