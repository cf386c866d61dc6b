"""The agent's weight catch-up (pearlctl.agent.reconciler.Reconciler.catch_up): a vLLM worker that becomes READY
between two answers of the daemon loads the weights the latest answer asked for at once, so its report names
them as soon as they load, rather than one long poll later. Reloads run in the background: the agent's loop (its
heartbeat) never waits for one. The vLLM server is the seam."""

from __future__ import annotations

import threading
import time

from pearlctl.agent.identity import Identity
from pearlctl.agent.reconciler import Reconciler
from pearlctl.agent.workers import VllmWorker


class StartingServer:
    """A vLLM server that is starting until ``ready`` is set; records reloads."""

    port, pid = 8000, 4242

    def __init__(self):
        self.ready = False
        self.ready_s: float | None = None
        self.reloads: list[str] = []
        self.version: str | None = None

    def start(self) -> None: ...

    def alive(self) -> bool:
        return True

    def health(self) -> bool:
        return self.ready

    def is_ready(self) -> bool:
        if self.ready and self.ready_s is None:
            self.ready_s = 1.0  # its cold start, as the real server measures it
        return self.ready

    def reload_weights(self, path: str) -> float:
        self.reloads.append(path)
        return 0.01

    def set_weight_version(self, version: str) -> None:
        self.version = version


def worker(key: str) -> VllmWorker:
    w = VllmWorker.__new__(VllmWorker)  # no vLLM process: the server is the seam
    w.key, w.role, w.gpus, w.server = key, "ROLLOUT", (1,), StartingServer()
    w._stopping = w._stopped = False
    w._reloading = threading.Lock()
    w._sleep_state, w.weight_version, w.store, w.receives_broadcast = None, None, None, False
    return w


def test_a_worker_ready_since_the_last_answer_loads_the_weights_it_was_asked_for_before_its_next_report(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PEARL_NODE_DIR", str(tmp_path / "node"))
    me = Identity(run_id="r", pool="trainer", role="TRAIN", job_id="7", task_id=0, node="n1", gpus=(0, 1), restarts=0)
    r = Reconciler(me, str(tmp_path), env={"PEARL_MODEL": "m"}, drain_timeout=30.0)
    w = worker("rollout-1")
    r._make = lambda want: w
    weights = {"version": "3", "path": str(tmp_path / "weights" / "3")}
    r.apply([{"key": "rollout-1", "role": "ROLLOUT", "engine": "vllm", "gpus": [1], "state": "RUNNING",
              "weights": weights}])  # fmt: skip
    assert w.server.reloads == [] and w.weight_version is None  # still starting: nothing to load into
    r.catch_up()
    assert w.server.reloads == []
    w.server.ready = True  # READY between two answers of the daemon
    r.catch_up()
    settle(r)
    assert w.server.reloads == [weights["path"]] and w.server.version == "3"
    [report] = r.report()
    assert report["state"] == "READY" and report["weight_version"] == "3"
    r.catch_up()  # on the asked-for version: nothing more
    assert w.server.reloads == [weights["path"]]


def settle(r: Reconciler, timeout: float = 10.0) -> None:
    """Wait for the reloads in flight to end."""
    end = time.monotonic() + timeout
    while r.reloading():
        assert time.monotonic() < end, "a reload did not end"
        time.sleep(0.01)


class SlowServer(StartingServer):
    """READY; a reload takes ``seconds`` and records when it ran."""

    def __init__(self, seconds: float):
        super().__init__()
        self.ready, self.seconds, self.spans = True, seconds, []

    def reload_weights(self, path: str) -> float:
        import time

        start = time.monotonic()
        time.sleep(self.seconds)
        self.spans.append((start, time.monotonic()))
        return super().reload_weights(path)


def test_a_nodes_workers_reload_a_new_version_at_once_not_one_after_another(tmp_path, monkeypatch):
    """Four workers behind on the weights: one apply reloads them all, their reloads overlapping (the planner's
    weight_sync_s is one reload, not four), in the background: apply returns at once, and the agent reports
    reloading until every one is done."""
    monkeypatch.setenv("PEARL_NODE_DIR", str(tmp_path / "node"))
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="7", task_id=0, node="n1", gpus=(0, 1, 2, 3),
                  restarts=0)  # fmt: skip
    r = Reconciler(me, str(tmp_path), env={"PEARL_MODEL": "m"}, drain_timeout=30.0)
    made = {}

    def make(want):
        w = worker(want["key"])
        w.server = SlowServer(0.3)
        made[want["key"]] = w
        return w

    r._make = make
    weights = {"version": "5", "path": str(tmp_path / "weights" / "5")}
    desired = [{"key": f"rollout-{i}", "role": "ROLLOUT", "engine": "vllm", "gpus": [i], "state": "RUNNING",
                "weights": weights} for i in range(4)]  # fmt: skip
    t0 = time.monotonic()
    r.apply(desired)
    assert time.monotonic() - t0 < 0.3 and r.reloading()  # the loop goes on: its heartbeat is not held up
    r.apply(desired)  # asked again while they run: no second reload of any
    settle(r)
    spans = [made[d["key"]].server.spans[0] for d in desired]
    assert all(made[d["key"]].weight_version == "5" for d in desired)
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # every reload overlapped every other
    r.apply(desired)  # on the version: no reload
    assert all(len(w.server.spans) == 1 for w in made.values())
