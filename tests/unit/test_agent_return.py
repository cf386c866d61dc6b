"""The agent's own return of lent GPUs (pearlctl.agent.reconciler.Reconciler), at its one seam: the worker
handle. A worker on lent trainer GPUs whose ``return_by`` has passed is stopped, the node-local return file
is written for the trainer (after the stop, never before), the return is queued for the daemon, and the
same lending is never served again — even when a stale desired state still lists it."""

from __future__ import annotations

import json
import threading
import time

import pytest

from pearlctl.agent.identity import Identity
from pearlctl.agent.reconciler import Reconciler


class Handle:
    """A worker handle whose stop takes a moment; records what happened and when."""

    def __init__(self, key: str, gpus: tuple[int, ...]):
        self.key, self.role, self.engine, self.gpus = key, "ROLLOUT", "vllm", gpus
        self.stopped_at: float | None = None
        self.stop_budget: float | None = None
        self.done = threading.Event()

    def start(self) -> None: ...

    def state(self) -> str:
        return "STOPPED" if self.stopped_at else "READY"

    def stop(self, drain_timeout: float) -> None:
        self.stop_budget = drain_timeout
        time.sleep(0.2)
        self.stopped_at = time.time()
        self.done.set()

    def report(self) -> dict:
        return {
            "key": self.key,
            "role": self.role,
            "engine": self.engine,
            "gpus": list(self.gpus),
            "state": self.state(),
        }


@pytest.fixture
def reconciler(tmp_path, monkeypatch):
    monkeypatch.setenv("PEARL_NODE_DIR", str(tmp_path / "node"))
    me = Identity(run_id="r", pool="trainer", role="TRAIN", job_id="7", task_id=0, node="n1", gpus=(0, 1), restarts=0)
    r = Reconciler(me, str(tmp_path), env={"PEARL_MODEL": "m"}, drain_timeout=30.0)
    made: list[str] = []

    def make(want):
        made.append(want["key"])
        return Handle(want["key"], tuple(want["gpus"]))

    r._make = make
    return r, made


def lent(now: float, *, by: float, deadline: float) -> list[dict]:
    return [
        {"key": "train-0", "role": "TRAIN", "engine": "deepspeed", "gpus": [0, 1], "state": "RUNNING"},
        {"key": "rollout-1", "role": "ROLLOUT", "engine": "vllm", "gpus": [1], "state": "RUNNING",
         "return_deadline": deadline, "return_by": by},
    ]  # fmt: skip


def test_a_lent_worker_past_its_return_by_is_stopped_then_the_trainer_is_told_on_the_node(reconciler):
    r, made = reconciler
    now = time.time()
    r.apply(lent(now, by=now + 30, deadline=now + 40), now=now)
    assert made == ["train-0", "rollout-1"]
    assert r.return_lent(now + 10) == []  # not yet: return_by is ahead
    handle = r.workers["rollout-1"]

    assert r.return_lent(now + 26, early_s=3.0) == []  # before return_by, less the time it took to notice
    assert r.return_lent(now + 27.5, early_s=3.0) == ["rollout-1"]
    assert r.return_lent(now + 32) == []  # once per lending
    assert handle.done.wait(5)
    deadline = time.monotonic() + 5
    while not r.return_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    doc = json.loads(r.return_file.read_text())
    assert doc["worker_key"] == "rollout-1" and doc["gpus"] == [1] and doc["how"] == "stopped"
    assert doc["deadline"] == now + 40 and doc["returned_at"] >= handle.stopped_at  # written after the stop
    assert handle.stop_budget <= 40 - 27.5 - 1.0  # the stop fits in what is left before the deadline
    (report,) = r.take_self_returns()
    assert report == {"gpus": [1], "worker_key": "rollout-1", "deadline": now + 40, "how": "stopped",
                      "at": doc["returned_at"]}  # fmt: skip
    assert "train-0" in r.workers  # the trainer keeps running: it reclaims from the file


def test_a_returned_lending_is_not_served_again_from_a_stale_desired_state(reconciler):
    r, made = reconciler
    now = time.time()
    desired = lent(now, by=now + 1, deadline=now + 5)
    r.apply(desired, now=now)
    r.return_lent(now + 2)
    r.apply(desired, now=now + 3)  # the daemon is back and has not planned the return yet
    assert made == ["train-0", "rollout-1"]  # no second vLLM on the returned GPU
    r.apply(desired, now=now + 6)  # nor after its deadline, whoever asks
    assert made == ["train-0", "rollout-1"]
    # the daemon's return done (it saw the worker STOPPED), a later lending (a new deadline) is served again
    r.retiring["rollout-1"].done.wait(5)
    r.delivered(r.report())
    r.apply(lent(now, by=now + 100, deadline=now + 110), now=now + 7)
    assert made == ["train-0", "rollout-1", "rollout-1"]


def test_without_the_daemon_a_lending_returned_by_a_cheap_park_starts_early_enough_for_a_stop(reconciler):
    """The daemon's ``return_by`` is the deadline less its parking return's cost (well under a second); the
    agent's own return stops the worker instead, so it starts early enough for that stop to end in time."""
    r, _ = reconciler
    now = time.time()
    deadline = now + 40
    r.apply(lent(now, by=deadline - 0.4, deadline=deadline), now=now)
    lead = Reconciler.SELF_RETURN_STOP_S + Reconciler.STOP_OVERRUN_S
    assert r.return_lent(deadline - lead - 3.1, early_s=3.0) == []
    assert r.return_lent(deadline - lead - 2.9, early_s=3.0) == ["rollout-1"]
    handle = r.retiring["rollout-1"]
    assert handle.done.wait(5)
    # the stop's budget and what a stop may overrun it by both end before the deadline
    assert handle.stop_budget + Reconciler.STOP_OVERRUN_S <= deadline - (deadline - lead - 2.9)


class SlowServer:
    """A vLLM server (the VllmWorker's seam) at its slowest: the drain never finishes, the abort and the
    SIGTERM each use all the time they are given, and the SIGKILL's reaping takes a moment more."""

    def __init__(self):
        self.calls: list[tuple[str, float]] = []

    def alive(self) -> bool:
        return True

    def drain(self, timeout: float) -> bool:
        self.calls.append(("drain", timeout))
        time.sleep(timeout)
        return False

    def abort_in_flight(self, timeout: float) -> int:
        self.calls.append(("abort", timeout))
        time.sleep(timeout)
        return 3

    def stop(self, timeout: float) -> int:
        self.calls.append(("stop", timeout))
        time.sleep(timeout + 0.2)
        return -9


@pytest.mark.parametrize("budget", [0.5, 2.0, 4.0, 8.0])
def test_a_vllm_workers_stop_overruns_its_budget_by_at_most_the_reconcilers_allowance(budget):
    from pearlctl.agent.workers import VllmWorker

    worker = VllmWorker.__new__(VllmWorker)  # no vLLM process: the server is the seam
    worker.key, worker.server, worker.store = "rollout-1", SlowServer(), None
    t0 = time.monotonic()
    worker.stop(budget)
    took = time.monotonic() - t0
    assert [c for c, _ in worker.server.calls] == ["drain", "abort", "stop"]
    assert took <= budget + Reconciler.STOP_OVERRUN_S, (took, worker.server.calls)
