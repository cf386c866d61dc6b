"""A worker that keeps failing is restarted with a growing wait (pearlctl.agent.workers.Reconciler): 10 s, then
twice as long after each failure in a row, at most 5 minutes; a worker that reached READY starts afresh. The
clock and the worker handles are stand-ins (the seams); the agent's reconciler is the real one."""

from __future__ import annotations

import pytest

from pearlctl.agent.identity import Identity
from pearlctl.agent.workers import RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S, Reconciler, restart_wait

WANT = {"key": "rollout-0", "role": "ROLLOUT", "engine": "vllm", "gpus": [0], "state": "RUNNING"}


class Crashing:
    """A worker that fails at once, or (``ready``) is READY."""

    engine = "vllm"

    def __init__(self, key: str, ready: bool):
        self.key, self.role, self.gpus, self.ready = key, "ROLLOUT", (0,), ready

    def start(self) -> None:
        pass

    def state(self) -> str:
        return "READY" if self.ready else "FAILED"

    def failure(self) -> str:
        return "exit 1; log ends: ValueError: max_model_len too long"

    def stop(self, drain_timeout: float) -> None:
        pass

    def report(self) -> dict:
        return {"key": self.key, "state": self.state()}


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setenv("PEARL_NODE_DIR", str(tmp_path / "node"))
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="7", task_id=0, node="n1", gpus=(0,), restarts=0)
    r = Reconciler(me, str(tmp_path), env={"PEARL_MODEL": "m"})
    clock = [1000.0]
    r.clock = lambda: clock[0]
    starts: list[float] = []
    healthy = [False]

    def make(want):
        starts.append(clock[0])
        return Crashing(want["key"], healthy[0])

    r._make = make
    return r, clock, starts, healthy


def run_for(r: Reconciler, clock: list[float], seconds: float, step: float = 1.0) -> None:
    end = clock[0] + seconds
    while clock[0] < end:
        r._apply({WANT["key"]: WANT})
        clock[0] += step


def test_the_wait_doubles_from_ten_seconds_up_to_five_minutes():
    assert [restart_wait(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [10, 20, 40, 80, 160, 300, 300]
    assert (RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S) == (10.0, 300.0)


def test_a_worker_failing_at_every_start_is_restarted_ever_more_slowly(agent, caplog):
    r, clock, starts, _ = agent
    run_for(r, clock, 700)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # each restart waits its backoff after the failure is seen (one reconcile step, 1 s, after the start)
    assert gaps[:6] == [11, 21, 41, 81, 161, 301], gaps
    assert len(starts) == 7  # where a fixed 10-s wait restarted it 63 times
    assert "failure 3 in a row, restarting in 40s" in caplog.text and "max_model_len too long" in caplog.text


def test_a_worker_that_became_ready_starts_its_count_afresh(agent):
    r, clock, starts, healthy = agent
    run_for(r, clock, 100)  # failed at 1000, 1011, 1032, 1073: four starts, the fourth failure waiting 80 s
    assert len(starts) == 4
    healthy[0] = True
    run_for(r, clock, 100)  # the restart at 1154 is READY
    assert len(starts) == 5 and r.failures == {}
    r.workers[WANT["key"]].ready = False  # it crashes later: the first wait again, not 160 s
    crashed = clock[0]
    run_for(r, clock, 30)
    assert len(starts) == 6 and starts[-1] - crashed == 10  # seen failed at once, restarted 10 s later
