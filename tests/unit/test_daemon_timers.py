"""The daemon's three timers (pearlctl/daemon/main.py): the lease renewer, the Slurm poller and the control
loop, each on its own thread, and what a slow, failing or deposed one does to the others.

A real ``Daemon`` runs in a thread (its control API on 127.0.0.1, its Store on a real SQLite file in
tmp_path); the one fake is the backend, at the seam the watcher polls through (``poll(job_ids)``):

- defect 3a: a poll that blocks longer than the lease's TTL does not cost the daemon its lease — the
  renewer keeps renewing and the control loop keeps ticking while the poller waits;
- defect 3b: a deposed daemon cannot write (the poller's fold and the journal raise StaleEpoch at the old
  epoch), and the running daemon notices and stops (``run()`` raises DaemonRefused);
- defect 1: a poll that moves an allocation (RUNNING -> PREEMPTING) while its agent heartbeats at 10 Hz
  through ``Agents.heartbeat`` neither fails nor stops the daemon;
- a tick that raises is journaled once ("tick error"), counted, and the loop goes on ("tick recovered").
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.daemon import main as daemon_main
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.main import Daemon, DaemonRefused, DaemonSettings
from pearlctl.ops.watcher import Poll, apply_poll
from pearlctl.slurm.records import JobRecord
from pearlctl.state.errors import StaleEpoch
from pearlctl.state.store import Store, run_lease_name
from tests import factories

RUN = "r"
JOB = "100"
NODE = "n1"


class FakeBackend:
    """The scheduler at the watcher's seam: answers ``poll`` with the run's one task, RUNNING on ``n1``
    (or preempted once ``preempt_at`` is set); ``block_s``: how long the next polls take."""

    name = "fake"

    def __init__(self):
        self.started_at = time.time() - 60
        self.preempt_at: float | None = None
        self.block_s = 0.0
        self.release = threading.Event()  # ends a blocked poll early (teardown)
        self.polls = 0
        self.blocking = threading.Event()  # set while a poll blocks

    def poll(self, job_ids: list[str]) -> list[JobRecord]:
        self.polls += 1
        if self.block_s:
            self.blocking.set()
            self.release.wait(self.block_s)
            self.blocking.clear()
        return [
            JobRecord(
                job_id=j,
                array_task_id=0,
                state="RUNNING",
                nodes=(NODE,),
                start_time=self.started_at,
                preempt_time=self.preempt_at,
                source="fake",
            )
            for j in job_ids
        ]

    def partitions(self):
        return {}

    def submit(self, req, script):
        raise AssertionError("the daemon never submits")

    def find_by_name(self, job_name):
        return []

    def cancel(self, job_ids):
        raise AssertionError("the daemon never cancels")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Run "r": one trainer allocation (2 GPUs), submitted as job 100 (PENDING), the run ACTIVE."""
    path = tmp_path / "state.db"
    with Store.open(path) as store:
        spec = {"poll_interval_s": 0.2, "router": {"enabled": False}}  # the data plane has tests of its own
        pools = [factories.pool("trainer", "TRAIN", gpus_per_node=2, run_id=RUN)]
        factories.create_run(store, tmp_path / "run", pools, run_id=RUN, spec=spec, backend="local")
        store.set_state("runs", RUN, expect="CREATED", to="SUBMITTING", event="t")
        alloc = store.fleet.allocations(RUN)[0]
        store.set_state("allocations", alloc.id, expect="REQUESTED", to="PENDING", event="t", job_id=JOB)
        store.set_state("runs", RUN, expect="SUBMITTING", to="ACTIVE", event="t")
    return path


class Running:
    """A Daemon's ``run()`` in a thread: what it raised, if anything, and its controller."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.error: BaseException | None = None
        self.controller = None
        self.thread = threading.Thread(target=self._run, name="test-daemon", daemon=True)

    def _run(self) -> None:
        try:
            self.daemon.run()
        except BaseException as exc:  # recorded for the test to assert on
            self.error = exc


@contextmanager
def running(
    db: Path, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch, **settings
) -> Iterator[tuple[Running, Store]]:
    """Start a Daemon on its own Store; yield it once it serves and has ticked; stop it on the way out."""
    created = []

    class Recorded(daemon_main.Controller):  # the daemon makes its controller inside run(): keep a handle
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            created.append(self)

    monkeypatch.setattr(daemon_main, "Controller", Recorded)
    store = Store.open(db)
    daemon = Daemon(
        store,
        backend,
        RUN,
        DaemonSettings(host="127.0.0.1", port=0, heartbeat_s=2.0, tick_s=0.1, **settings),
    )
    r = Running(daemon)
    r.thread.start()
    try:
        wait(lambda: daemon.url is not None and created and daemon.stats.ticks > 0, 15, "the daemon serves and ticks")
        r.controller = created[0]
        yield r, store
    finally:
        daemon.stopping.set()
        backend.release.set()
        r.thread.join(15)
        assert not r.thread.is_alive(), "the daemon did not stop"
        store.close()


def wait(fn, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s")


def events(db: Path, name: str | None = None) -> list[dict]:
    with Store.open(db, readonly=True) as reader:
        return [j for j in reader.journal.read(RUN) if name is None or j["event"] == name]


def allocation_state(db: Path) -> str:
    with Store.open(db, readonly=True) as reader:
        return reader.fleet.allocations(RUN)[0].state


# -- defect 3a ------------------------------------------------------------------------------------------------
def test_a_poll_blocking_longer_than_the_lease_ttl_does_not_lose_the_lease(db, monkeypatch):
    backend = FakeBackend()
    backend.block_s = 10.0  # a frozen slurmctld: far longer than the 3 s lease
    with running(db, backend, monkeypatch, lease_ttl_s=3.0) as (r, store):
        d = r.daemon
        wait(backend.blocking.is_set, 5, "the poll blocks")
        blocked_at = time.monotonic()
        renewals, ticks = d.stats.lease_renewals, d.stats.ticks
        time.sleep(12.0 - (time.monotonic() - blocked_at))
        assert r.thread.is_alive() and r.error is None, r.error
        assert not d.stopping.is_set() and d.deposed is None
        lease = store.leases.get(run_lease_name(RUN))
        assert lease["epoch"] == d.epoch and lease["holder"] == d.holder and lease["expires_at"] > time.time()
        # renewed every ttl/6 = 0.5 s on its own thread while the poll blocked: ~20 times in 10 s
        assert d.stats.lease_renewals - renewals >= 12, d.stats
        # the control loop ticked meanwhile, every tick_s = 0.1 s (not once per poll)
        assert d.stats.ticks - ticks >= 30, d.stats
        assert backend.polls >= 2  # the blocked poll returned after 10 s and the poller went on
        assert not events(db, "tick error") and not events(db, "poll error")
    assert r.error is None
    assert "daemon stopped" in [j["event"] for j in events(db)]


# -- defect 3b ------------------------------------------------------------------------------------------------
def test_a_deposed_daemon_cannot_write_and_stops(db, monkeypatch):
    backend = FakeBackend()
    with running(db, backend, monkeypatch, lease_ttl_s=3.0) as (r, store):
        d = r.daemon
        old = d.epoch
        wait(lambda: allocation_state(db) == "RUNNING", 10, "the first poll is folded")
        name = run_lease_name(RUN)
        with Store.open(db) as other:  # another daemon takes over: the lease is broken, then taken at epoch + 1
            assert other.leases.break_held(name, d.holder, old, "test: presumed dead")
            new = other.leases.acquire(name, "elsewhere:1", 30.0)
            assert new == old + 1
            poll = Poll(frozenset({JOB}), tuple(backend.poll([JOB])))
            # the old epoch is fenced everywhere: the poller's fold and the journal alike
            with pytest.raises(StaleEpoch):
                apply_poll(store, RUN, poll, epoch=old)
            with pytest.raises(StaleEpoch):
                store.journal_event(RUN, "runs", RUN, "written by a deposed daemon", epoch=old)
            assert not events(db, "written by a deposed daemon")
            # the running daemon notices (its renewer at the latest, ttl/6 = 0.5 s) and stops
            r.thread.join(5)
            assert not r.thread.is_alive(), "the deposed daemon is still running"
            assert isinstance(r.error, DaemonRefused), r.error
            assert d.deposed and d.stopping.is_set()
            lease = other.leases.get(name)
            assert (lease["holder"], lease["epoch"]) == ("elsewhere:1", new)  # it did not take the lease back
            assert "daemon stopped" not in [j["event"] for j in events(db)]  # a deposed daemon writes nothing


# -- defect 1 -------------------------------------------------------------------------------------------------
def test_a_preemption_seen_while_the_agent_heartbeats_at_10hz_does_not_stop_the_daemon(db, monkeypatch):
    backend = FakeBackend()
    with running(db, backend, monkeypatch) as (r, store):
        d = r.daemon
        wait(lambda: allocation_state(db) == "RUNNING", 10, "the first poll is folded (started)")
        alloc_id = store.fleet.allocations(RUN)[0].id
        body = bodies.parse(bodies.Heartbeat, {"allocation_id": alloc_id})
        stop, beats, errors = threading.Event(), [], []

        def agent():
            while not stop.is_set():
                try:
                    beats.append(r.controller.agents.heartbeat(body, alloc_id))
                except Exception as exc:  # the test asserts there is none
                    errors.append(exc)
                stop.wait(0.1)

        beater = threading.Thread(target=agent, daemon=True)
        beater.start()
        try:
            time.sleep(1.0)
            backend.block_s = 0.3  # a poll slow enough that heartbeats move the row while it runs
            backend.preempt_at = time.time()  # Slurm signals the preemption
            wait(lambda: allocation_state(db) == "PREEMPTING", 10, "the allocation reaches PREEMPTING")
            time.sleep(2.0)  # more polls and heartbeats on the PREEMPTING row
        finally:
            stop.set()
            beater.join(5)
        assert not errors, errors
        assert len(beats) >= 20
        assert r.thread.is_alive() and r.error is None and not d.stopping.is_set()
        assert allocation_state(db) == "PREEMPTING"
        assert [j["event"] for j in events(db) if j["to_state"] == "PREEMPTING"] == ["preempted"]
        with Store.open(db, readonly=True) as reader:
            assert {g.state for g in reader.fleet.gpus(RUN)} == {"DRAINING"}
        assert d.stats.poll_errors == 0 and d.stats.tick_errors == 0
        assert not events(db, "tick error") and not events(db, "poll error")
    assert r.error is None


# -- a failing tick -------------------------------------------------------------------------------------------
def test_a_tick_that_raises_is_journaled_once_counted_and_the_loop_goes_on(db, monkeypatch):
    real_tick = Borrowing.tick
    calls = {"n": 0}

    def flaky_tick(self, lock=None, mark=lambda phase: None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom: a bug in one tick")
        return real_tick(self, lock, mark)

    monkeypatch.setattr(Borrowing, "tick", flaky_tick)
    backend = FakeBackend()
    with running(db, backend, monkeypatch) as (r, store):
        d = r.daemon
        wait(lambda: calls["n"] > 3, 10, "the loop ticks past the failing tick")
        wait(lambda: events(db, "tick recovered"), 5, "the next good tick journals its recovery")
        ticks = d.stats.ticks
        wait(lambda: d.stats.ticks >= ticks + 10, 5, "the loop keeps ticking")
        errors = events(db, "tick error")
        assert len(errors) == 1 and "RuntimeError: boom: a bug in one tick" in errors[0]["data"]["error"]
        assert d.stats.tick_errors == 1
        recovered = events(db, "tick recovered")
        assert len(recovered) == 1 and recovered[0]["id"] > errors[0]["id"]
        assert errors[0]["epoch"] == d.epoch
        assert r.thread.is_alive() and r.error is None and not d.stopping.is_set()
    assert r.error is None


# -- a slow tick ----------------------------------------------------------------------------------------------
def test_a_slow_tick_is_logged_with_its_phases_and_its_threads_cpu(db, monkeypatch, caplog):
    """A tick of 100 ms or more (pearlctl.daemon.slowlog) names where its time went: here it waited 0.3 s for the
    decision lock, held by another thread (as a heartbeat's fold would) — a wait, not CPU; every tick's CPU time is
    in its histogram."""
    caplog.set_level("WARNING", logger="pearlctl.daemon")
    with running(db, FakeBackend(), monkeypatch) as (r, store):
        d = r.daemon
        for _ in range(10):  # three slow ticks in a row (a loaded host may start a tick only after a hold): one line
            if d.stats.slow_ticks >= 3:
                break
            with r.controller.lock:
                time.sleep(0.3)
            time.sleep(0.15)
        wait(lambda: d.stats.slow_ticks >= 3, 5, "the slow ticks are counted")
        ticks = d.stats.ticks
    assert sum("slow tick" in m for m in caplog.messages) == 1, caplog.messages  # one line per LOG_EVERY_S
    line = next(m for m in caplog.messages if "slow tick" in m)
    took = int(line.split("slow tick: ")[1].split(" ms")[0])
    cpu = int(line.split("its thread's CPU ")[1].split(" ms")[0])
    assert took >= 150 and cpu < took / 2, line  # the tick began within its 0.1-s interval of the hold
    assert all(phase in line for phase in ("check_agents", "lock wait", "transitions")), line
    assert " commits of state, " in line and line.endswith(" ms in them)"), line  # what of it was the disk
    counted = next(s for s in d.stats.tick_cpu.collect()[0].samples if s.name.endswith("_count"))
    assert counted.value >= ticks


# -- the collector ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("own_process", [True, False])
def test_the_daemons_own_process_settles_its_heap_once_from_its_control_loop(db, monkeypatch, own_process):
    """``pearlctl daemon --foreground`` (``own_process``) settles the collector once, from its control loop after
    its first tick; a daemon hosted by another process (these tests) leaves that process's collector alone."""
    settled: list[str] = []  # the thread each call came from (the stand-in keeps this process's collector as is)
    monkeypatch.setattr(daemon_main, "settle_heap", lambda: settled.append(threading.current_thread().name))
    with running(db, FakeBackend(), monkeypatch, own_process=own_process) as (r, _store):
        wait(lambda: r.daemon.stats.ticks >= 5, 10, "five ticks")
    assert settled == (["test-daemon"] if own_process else [])


def test_settle_heap_freezes_what_is_alive_and_sets_the_daemons_thresholds():
    """In a fresh interpreter (the test process's collector is left alone): after ``settle_heap`` the objects
    alive are frozen and the thresholds are ``GC_THRESHOLDS``."""
    code = (
        "import gc; from pearlctl.daemon.main import GC_THRESHOLDS, settle_heap; "
        "assert gc.get_freeze_count() == 0; settle_heap(); "
        "print(gc.get_freeze_count() > 1000, gc.get_threshold() == GC_THRESHOLDS)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out
