"""pearlctl.slurm.functions' wait loop on Slurm, with a fake executor and a fake Slurm client: one batched poll
for the whole array per interval (never per task), results in the order of the items, a task Slurm reports
ended without a result file is a failure naming its state and log, and an interrupted wait cancels the
array."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pearlctl.slurm import functions
from pearlctl.slurm.records import JobRecord


class FakeJob:
    def __init__(self, folder: Path, job_id: str, value):
        self.job_id = job_id
        self.paths = SimpleNamespace(result_pickle=folder / f"{job_id}_result", stdout=folder / f"{job_id}.out")
        self.value = value

    def result(self):
        return self.value


class FakeExecutor:
    def __init__(self, folder: Path):
        self.folder = folder

    def submit(self, fn, *args, **kwargs):
        return FakeJob(self.folder, "77", fn(*args, **kwargs))

    def map_array(self, fn, items):
        return [FakeJob(self.folder, f"77_{i}", fn(item)) for i, item in enumerate(items)]


class FakeClient:
    def __init__(self, states):
        self.states = states  # task -> Slurm state
        self.polls: list[tuple[float, list[str]]] = []
        self.cancelled: list[list[str]] = []

    def poll(self, job_ids):
        self.polls.append((time.monotonic(), list(job_ids)))
        return [JobRecord(job_id="77", array_task_id=t, state=s) for t, s in self.states.items()]

    def cancel(self, job_ids):
        self.cancelled.append(list(job_ids))


def _finish(job_paths, after_s: float) -> threading.Thread:
    def write():
        time.sleep(after_s)
        for p in job_paths:
            p.write_text("done")

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def test_one_batched_poll_per_interval_and_results_in_order(tmp_path, monkeypatch):
    client = FakeClient({0: "RUNNING", 1: "RUNNING", 2: "PENDING"})
    monkeypatch.setattr(functions, "SlurmClient", lambda: client)
    paths = [tmp_path / f"77_{i}_result" for i in range(3)]
    _finish(paths, 1.6)
    t0 = time.monotonic()
    lines: list[str] = []
    values, ran = functions._run_slurm(
        FakeExecutor(tmp_path), lambda x: x * 10, [((i,), {}) for i in range(3)], tmp_path, 0.5, lines.append
    )
    elapsed = time.monotonic() - t0
    assert values == [0, 10, 20] and ran.job_id == "77" and ran.executor == "slurm"
    assert all(ids == ["77"] for _, ids in client.polls)  # the array as one id, never task by task
    assert 2 <= len(client.polls) <= elapsed / 0.5 + 1
    gaps = [b - a for (a, _), (b, _) in zip(client.polls, client.polls[1:], strict=False)]
    assert min(gaps) >= 0.5
    assert lines[0] == "job 77: 0/3 done (PENDING 1, RUNNING 2)"
    assert client.cancelled == []


def test_a_task_that_ended_without_a_result_fails_naming_its_state_and_log(tmp_path, monkeypatch):
    client = FakeClient({0: "COMPLETED", 1: "FAILED"})
    monkeypatch.setattr(functions, "SlurmClient", lambda: client)
    monkeypatch.setattr(functions, "RESULT_GRACE_S", 0.0)
    (tmp_path / "77_0_result").write_text("done")
    (tmp_path / "77_1.out").write_text("line 1\nTraceback: it broke\n")
    with pytest.raises(functions.FunctionError) as e:
        functions._run_slurm(FakeExecutor(tmp_path), str, [((i,), {}) for i in range(2)], tmp_path, 0.2, None)
    message = str(e.value)
    assert "job 77_1 ended FAILED without a result" in message and "Traceback: it broke" in message
    assert str(tmp_path / "77_1.out") in message and e.value.scheduler
    assert client.cancelled == [["77"]]  # what was left of the array is cancelled


def test_an_interrupted_wait_cancels_the_array(tmp_path, monkeypatch):
    client = FakeClient({0: "RUNNING"})
    monkeypatch.setattr(functions, "SlurmClient", lambda: client)

    def interrupt(_line):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        functions._run_slurm(FakeExecutor(tmp_path), str, [((0,), {})], tmp_path, 0.2, interrupt)
    assert client.cancelled == [["77"]]


def test_auto_is_local_without_slurm(monkeypatch):
    monkeypatch.setattr(functions, "slurm_answers", lambda: False)
    assert functions.resolve_executor("auto") == "local"
    assert functions.resolve_executor("slurm") == "slurm"
    with pytest.raises(ValueError, match="unknown executor"):
        functions.resolve_executor("k8s")
