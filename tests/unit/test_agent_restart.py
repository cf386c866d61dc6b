"""A worker that keeps failing is restarted with a growing wait (pearlctl.agent.reconciler.Reconciler): 10 s, then
twice as long after each failure in a row, at most 5 minutes; a worker that reached READY starts afresh. The
clock and the worker handles are stand-ins (the seams); the agent's reconciler is the real one. A failed worker's
report says why (exit status, the end of its log) and the daemon journals it."""

from __future__ import annotations

import pytest

from pearlctl.agent.identity import Identity
from pearlctl.agent.reconciler import RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S, Reconciler, restart_wait
from pearlctl.agent.workers import identity
from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.controller import Controller
from pearlctl.state.store import Store
from tests.conftest import create_trainer_run

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


class LoudCrash(Crashing):
    """A failed engine whose log ends in a coloured, over-long line."""

    def failure(self) -> str:
        return "exit 1; log /x/vllm.log ends: \x1b[31mValueError\x1b[0m: " + "max_model_len " * 40 + "\nnext"


def test_a_failed_workers_report_says_why_in_one_line_the_control_api_takes():
    report = identity(LoudCrash("rollout-0", ready=False))
    assert report["state"] == "FAILED"
    assert report["error"].startswith("exit 1; log /x/vllm.log ends:  [31mValueError") and len(report["error"]) == 256
    worker = parse(bodies.WorkerReport, report)  # what the daemon parses it into: accepted as it is
    assert worker.error == report["error"]
    assert "error" not in identity(Crashing("rollout-0", ready=True))


WHY = "exit 1; log /x/train.log ends: CUDA error: out of memory"
TRAIN = {"key": "train-0", "role": "TRAIN", "engine": "deepspeed", "gpus": [0, 1], "pid": 5}


@pytest.fixture
def failed(tmp_path):
    """A trainer allocation whose agent reported its worker READY, then FAILED with WHY: (store, controller,
    allocation)."""
    with Store.open(tmp_path / "state.db") as store:
        alloc = create_trainer_run(store, tmp_path, job_id="7")
        store.set_state("allocations", alloc.id, expect="PENDING", to="RUNNING", event="t", node="gpu1")
        controller = Controller(store, "r", None, heartbeat_s=1.0)
        controller.agents.register(
            parse(bodies.Register, {"job_id": "7", "task_id": 0, "node": "gpu1", "gpus": [0, 1]})
        )
        for state, error in (("READY", None), ("FAILED", WHY)):
            beat = {"allocation_id": alloc.id, "workers": [{**TRAIN, "state": state, "error": error}]}
            controller.agents.heartbeat(parse(bodies.Heartbeat, beat), alloc.id)
        yield store, controller, alloc


def test_the_daemon_journals_why_a_worker_failed(failed):
    store, _, _ = failed
    failed_rows = [j for j in store.journal.read("r") if j["entity"] == "workers" and j["to_state"] == "FAILED"]
    assert [j["data"]["error"] for j in failed_rows] == [WHY]


def test_status_shows_why_a_worker_failed(failed):
    from rich.console import Console

    from pearlctl.cli.render import status_tables
    from pearlctl.state.views import run_document

    store, controller, alloc = failed
    doc = run_document(store, "r")
    [worker] = doc["workers"]
    assert worker["state"] == "FAILED" and worker["error"] == WHY
    console = Console(width=200, record=True)
    console.print(status_tables({**doc, "router": None}))
    assert f"worker {worker['id']} failed: {WHY}" in console.export_text()
    # restarted: a new worker, without a reason; the failed one keeps its own
    beat = {"allocation_id": alloc.id, "workers": [{**TRAIN, "state": "STARTING", "pid": 6}]}
    controller.agents.heartbeat(parse(bodies.Heartbeat, beat), alloc.id)
    assert [(w["state"], w.get("error")) for w in run_document(store, "r")["workers"]] == [
        ("FAILED", WHY),
        ("STARTING", None),
    ]
    # a crash loop: the latest failures are named, the rest counted
    many = [dict(worker, id=i, error=f"exit {i}") for i in range(1, 8)]
    console = Console(width=200, record=True)
    console.print(status_tables({**doc, "workers": many, "router": None}))
    text = console.export_text()
    assert "worker 7 failed: exit 7" in text and "worker 4 failed" not in text
    assert "4 earlier failed workers: pearlctl journal" in text
