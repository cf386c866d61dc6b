"""pearlctl.host.logfiles: finding a run's log files, selecting a target, tails, requeue markers, following."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.host.logfiles import (
    Follower,
    LogFile,
    discover,
    is_known,
    known_targets,
    requeue_marker,
    select,
    tail_lines,
    with_markers,
    worker_log,
)

START = "pearl-worker 1700000000.1 start task=12_0 node=n1 gpus=0 restart={n} cmd=python -m pearlctl.agent"


def touch(path: Path, text: str = "", mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_requeue_marker_only_for_a_restarted_start_line():
    assert requeue_marker(START.format(n=0)) is None
    assert requeue_marker(START.format(n=2)) == "==> requeued (restart 2) <=="
    assert requeue_marker("pearl-worker 1.0 payload exited rc=0") is None
    assert requeue_marker("some line restart=3") is None
    assert list(with_markers(["a", START.format(n=1), "b"])) == [
        "a",
        "==> requeued (restart 1) <==",
        START.format(n=1),
        "b",
    ]


def test_discover_names_pool_tasks_daemon_router_and_workers(tmp_path):
    logs = tmp_path / "logs"
    touch(logs / "trainer-12_0.log", mtime=100)
    touch(logs / "roll-out-local-ab12cd34_1.log")  # pool "roll-out", not "roll" with job "out-local-…"
    touch(logs / "roll-13_0.log")
    touch(logs / "daemon.log")
    touch(logs / "daemon-99.log")
    touch(logs / "router.log")
    touch(logs / "vllm-13_0-r0.log")
    touch(logs / "notes.txt")
    allocations = [{"id": 5, "pool": "roll", "array_index": 0, "job_id": "13"}]
    workers = [{"id": 7, "allocation_id": 5, "engine": "vllm", "worker_key": "r0"}]
    files = discover(tmp_path, ["trainer", "roll", "roll-out"], allocations, workers)
    got = {(f.target, f.kind, f.path.name) for f in files}
    assert got == {
        ("trainer[0]", "pool", "trainer-12_0.log"),
        ("roll-out[1]", "pool", "roll-out-local-ab12cd34_1.log"),
        ("roll[0]", "pool", "roll-13_0.log"),
        ("daemon", "daemon", "daemon.log"),
        ("daemon", "daemon", "daemon-99.log"),
        ("router", "router", "router.log"),
        ("7", "worker", "vllm-13_0-r0.log"),
    }
    assert [f.target for f in select(files, "roll", workers)] == ["roll[0]"]
    assert [f.target for f in select(files, "roll-out[1]", workers)] == ["roll-out[1]"]
    assert [f.path.name for f in select(files, "r0", workers)] == ["vllm-13_0-r0.log"]  # a worker key
    assert [f.path.name for f in select(files, "7", workers)] == ["vllm-13_0-r0.log"]
    assert len(select(files, "daemon")) == 2
    assert select(files, "nothing", workers) == []


def test_discover_orders_a_targets_files_oldest_first(tmp_path):
    touch(tmp_path / "logs" / "trainer-20_0.log", mtime=200)
    touch(tmp_path / "logs" / "trainer-12_0.log", mtime=100)
    files = discover(tmp_path, ["trainer"])
    assert [f.path.name for f in files] == ["trainer-12_0.log", "trainer-20_0.log"]


def test_discover_without_a_logs_directory_is_empty(tmp_path):
    assert discover(tmp_path / "missing", ["trainer"]) == []


def test_worker_log_paths_follow_the_agent(tmp_path):
    alloc = {"id": 1, "array_index": 3, "job_id": "44"}
    assert worker_log(tmp_path, {"engine": "vllm", "worker_key": "k#9"}, alloc) == tmp_path / "logs/vllm-44_3-k.log"
    assert worker_log(tmp_path, {"engine": "deepspeed", "worker_key": "t"}, alloc) == tmp_path / "logs/train-44_3-t.log"
    assert worker_log(tmp_path, {"engine": "vllm", "worker_key": None}, alloc) is None
    assert worker_log(tmp_path, {"engine": "vllm", "worker_key": "k"}, {**alloc, "job_id": None}) is None


def test_known_targets_come_from_state():
    allocations = [{"pool": "trainer", "array_index": 0}, {"pool": "rollout", "array_index": 1}]
    workers = [{"id": 3, "worker_key": "w"}]
    assert known_targets(["trainer", "rollout"], allocations, workers) == [
        "daemon",
        "router",
        "trainer",
        "trainer[0]",
        "rollout",
        "rollout[1]",
        "3",
    ]
    assert is_known("w", [], [], workers) and not is_known("x", [], [], workers)


def test_tail_lines_reads_from_the_end(tmp_path):
    path = touch(tmp_path / "f.log", "".join(f"line {i}\n" for i in range(1000)))
    assert tail_lines(path, 3, block=16) == ["line 997", "line 998", "line 999"]
    assert tail_lines(path, 0) == []
    assert len(tail_lines(path, 5000)) == 1000
    assert tail_lines(touch(tmp_path / "e.log"), 3) == []


def test_follower_marks_requeues_new_files_and_new_tasks(tmp_path):
    logs = tmp_path / "logs"
    first = touch(logs / "rollout-12_0.log", START.format(n=0) + "\nold\n", mtime=100)
    follower = Follower(lambda: select(discover(tmp_path, ["rollout"]), "rollout"))
    assert follower.start(tail=1) == [("rollout[0]", "old")]
    assert follower.poll() == []
    with open(first, "a") as f:
        f.write("half")
    assert follower.poll() == []  # a partial line waits for its end
    with open(first, "a") as f:
        f.write(" done\n" + START.format(n=1) + "\n")
    assert follower.poll() == [
        ("rollout[0]", "half done"),
        ("rollout[0]", "==> requeued (restart 1) <=="),
        ("rollout[0]", START.format(n=1)),
    ]
    added = touch(logs / "rollout-30_1.log", "hello\n")  # an elastic task: a new job, a new index
    assert follower.poll() == [("rollout[1]", f"==> new log {added} <=="), ("rollout[1]", "hello")]
    again = touch(logs / "rollout-40_0.log", "resubmitted\n")  # task 0 submitted again under a new job
    assert follower.poll() == [("rollout[0]", f"==> now {again} <=="), ("rollout[0]", "resubmitted")]
    again.write_text("")
    assert follower.poll() == [("rollout[0]", f"==> {again} truncated <==")]


@settings(max_examples=300, deadline=None)
@given(target=st.text(max_size=40))
def test_any_target_selects_only_files_of_that_target_and_unknown_ones_are_refused(target):
    """Whatever a user types as TARGET: the files chosen are the run's own and match it, and a target the
    state does not name is not known (the CLI then exits 2 naming the targets that exist)."""
    files = [
        LogFile("trainer[0]", "pool", Path("/r/logs/trainer-12_0.log"), pool="trainer", index=0, job="12"),
        LogFile("rollout[1]", "pool", Path("/r/logs/rollout-13_1.log"), pool="rollout", index=1, job="13"),
        LogFile("daemon", "daemon", Path("/r/logs/daemon.log")),
        LogFile("7", "worker", Path("/r/logs/vllm-13_1-rollout-0.log"), pool="rollout", index=1, worker=7),
    ]
    workers = [{"id": 7, "worker_key": "rollout-0"}]
    allocations = [{"pool": "trainer", "array_index": 0}, {"pool": "rollout", "array_index": 1}]
    chosen = select(files, target, workers)
    assert all(f in files for f in chosen)
    assert all(target in (f.target, f.kind, f.pool) or (f.worker == 7 and target == "rollout-0") for f in chosen)
    known = is_known(target, ["trainer", "rollout"], allocations, workers)
    assert known == (target in {"trainer", "rollout", "trainer[0]", "rollout[1]", "daemon", "router", "7", "rollout-0"})
