"""`pearlctl logs RUN [TARGET] [-f] [--tail N]` through the real CLI: a run launched on the local backend, and
runs whose log files are written by hand (requeues, new tasks, workers) to check listing, selecting, tails
and following (the marker lines, Ctrl-C, a reader that goes away)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from pearlctl.state.store import Store
from tests import factories
from tests.conftest import REPO, assert_quiet_on_broken_pipe, write_spec

EXIT_USAGE, EXIT_NOT_FOUND, EXIT_BROKEN_PIPE = 2, 4, 141
START = "pearl-worker {ts} start task={task} node=n1 gpus=none restart={n} cmd=python3 -m pearlctl.agent"


def make_run(state_dir: Path, run_dir: Path, nodes: int = 2) -> None:
    """Run "r" (local backend) with pools trainer (1 task, job 12) and rollout (``nodes`` tasks, job 13)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with Store.open(state_dir / "state.db") as store:
        pools = [
            factories.pool("trainer", "TRAIN", gpus_per_node=0),
            factories.pool("rollout", "ROLLOUT", nodes=nodes, gpus_per_node=0),
        ]
        factories.create_run(store, run_dir, pools, spec_path="r.toml", backend="local")
        for alloc in store.fleet.allocations("r"):
            job = "12" if alloc.pool == "trainer" else "13"
            store.set_state("allocations", alloc.id, expect="REQUESTED", to="PENDING", event="t", job_id=job)
        rollout0 = next(a for a in store.fleet.allocations("r") if a.pool == "rollout" and a.array_index == 0)
        wid = store.fleet.add_worker(run_id="r", allocation_id=rollout0.id, role="ROLLOUT", engine="vllm")
        store.update_fields("workers", wid, worker_key="rollout-0")
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    (logs / "trainer-12_0.log").write_text(START.format(ts=1, task="12_0", n=0) + "\ntrainer says hi\n")
    (logs / "rollout-13_0.log").write_text(START.format(ts=1, task="13_0", n=0) + "\nr0 a\nr0 b\n")
    if nodes > 1:
        (logs / "rollout-13_1.log").write_text(START.format(ts=1, task="13_1", n=0) + "\nr1 a\n")
    (logs / "daemon.log").write_text("daemon up\n")
    (logs / "vllm-13_0-rollout-0.log").write_text("vllm serving\n")


def cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PEARL_STATE_DIR": str(state_dir)}
    return subprocess.run(
        [sys.executable, "-m", "pearlctl", "logs", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


def _ctrl_c_as_in_a_terminal() -> None:
    # a test run started in the background (nohup, CI) ignores SIGINT, and a child inherits that: Python then
    # never turns Ctrl-C into KeyboardInterrupt. The command is tested as a user's terminal runs it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def follow(state_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PEARL_STATE_DIR": str(state_dir)}
    return subprocess.Popen(
        [sys.executable, "-m", "pearlctl", "logs", *args, "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )


def read_until(proc: subprocess.Popen, want: str, timeout: float = 20) -> list[str]:
    """Lines of ``proc``'s stdout up to and including the first that contains ``want`` (read from the file
    descriptor: a buffered readline would hide lines from select)."""
    fd = proc.stdout.fileno()
    pending = PENDING.setdefault(fd, bytearray())
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while b"\n" in pending:
            raw, _, rest = bytes(pending).partition(b"\n")
            pending[:] = rest
            lines.append(raw.decode())
            if want in lines[-1]:
                return lines
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
    raise AssertionError(f"no line with {want!r} within {timeout}s; got {lines}")


PENDING: dict[int, bytearray] = {}


def test_lists_selects_and_tails(tmp_path):
    state, run_dir = tmp_path / "state", tmp_path / "run"
    make_run(state, run_dir)
    listed = cli(state, "r")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[:4] == ["target", "path", "size", "modified"]
    rows = json.loads(cli(state, "r", "--json").stdout)
    assert [(r["target"], Path(r["path"]).name) for r in rows] == [
        ("rollout[0]", "rollout-13_0.log"),
        ("rollout[1]", "rollout-13_1.log"),
        ("trainer[0]", "trainer-12_0.log"),
        ("1", "vllm-13_0-rollout-0.log"),
        ("daemon", "daemon.log"),
    ]
    assert all(set(r) == {"target", "kind", "path", "size", "modified"} for r in rows)

    one = cli(state, "r", "trainer[0]")
    assert one.returncode == 0 and one.stdout.splitlines()[1] == "trainer says hi"
    assert "start task=12_0" in one.stdout.splitlines()[0]
    pool = cli(state, "r", "rollout").stdout.splitlines()
    assert "rollout[0] | r0 b" in pool and "rollout[1] | r1 a" in pool
    assert all(line.startswith(("rollout[0] | ", "rollout[1] | ")) for line in pool)
    assert cli(state, "r", "rollout[0]", "--tail", "1").stdout == "r0 b\n"
    assert cli(state, "r", "rollout", "--tail", "1").stdout == "rollout[0] | r0 b\nrollout[1] | r1 a\n"
    assert cli(state, "r", "daemon").stdout == "daemon up\n"
    assert cli(state, "r", "1").stdout == "vllm serving\n"  # a worker id
    assert cli(state, "r", "rollout-0").stdout == "vllm serving\n"  # its key

    with open(run_dir / "logs" / "trainer-12_0.log", "a") as f:  # a requeued task appends to the same file
        f.write(START.format(ts=2, task="12_0", n=1) + "\nback\n")
    lines = cli(state, "r", "trainer[0]").stdout.splitlines()
    assert lines[2:] == ["==> requeued (restart 1) <==", START.format(ts=2, task="12_0", n=1), "back"]


def test_unknown_run_and_target(tmp_path):
    state = tmp_path / "state"
    make_run(state, tmp_path / "run")
    nope = cli(state, "nope")
    assert nope.returncode == EXIT_NOT_FOUND and "no run 'nope'" in nope.stderr
    bad = cli(state, "r", "trainer[5]")
    assert bad.returncode == EXIT_USAGE, bad.stderr
    assert "no log target 'trainer[5]'" in bad.stderr
    for target in ("trainer[0]", "rollout[1]", "daemon", "router"):
        assert target in bad.stderr
    assert "Traceback" not in bad.stderr
    assert cli(state, "r", "-f").returncode == EXIT_USAGE  # -f needs a target
    missing = cli(state, "r", "router")  # known, no file yet: says so, exits 0
    assert missing.returncode == 0 and missing.stdout == "" and "no log file for router yet" in missing.stderr


def test_follow_marks_a_requeue_and_a_new_task_and_stops_on_ctrl_c(tmp_path):
    state, run_dir = tmp_path / "state", tmp_path / "run"
    make_run(state, run_dir, nodes=1)
    proc = follow(state, "r", "rollout")
    try:
        assert read_until(proc, "r0 b")[-1] == "rollout[0] | r0 b"
        with open(run_dir / "logs" / "rollout-13_0.log", "a") as f:
            f.write(START.format(ts=2, task="13_0", n=1) + "\nafter requeue\n")
        got = read_until(proc, "after requeue")
        assert got == [
            "rollout[0] | ==> requeued (restart 1) <==",
            "rollout[0] | " + START.format(ts=2, task="13_0", n=1),
            "rollout[0] | after requeue",
        ]
        added = run_dir / "logs" / "rollout-77_1.log"  # an elastic task: a new job id, a new index
        added.write_text("elastic hello\n")
        got = read_until(proc, "elastic hello")
        assert got == [f"rollout[1] | ==> new log {added} <==", "rollout[1] | elastic hello"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert "Traceback" not in proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_follow_stops_quietly_when_the_reader_goes_away(tmp_path):
    state = tmp_path / "state"
    make_run(state, tmp_path / "run")
    proc = follow(state, "r", "trainer[0]")
    try:
        assert read_until(proc, "trainer says hi")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    # nothing more is written: the follower notices the closed pipe by itself
    assert_quiet_on_broken_pipe(proc, 20, EXIT_BROKEN_PIPE)


def test_a_launched_local_run_shows_the_wrappers_start_line(pearlctl, tmp_path, model_dir):
    pools = "[pools.trainer]\nnodes = 1\ngpus_per_node = 1\n[pools.rollout]\nnodes = 1\ngpus_per_node = 0\n"
    spec = write_spec(
        tmp_path / "t.toml", name="t", model=model_dir, run_dir=tmp_path / "t", pools=pools, backend="local"
    )
    launched = json.loads(pearlctl("launch", str(spec), "--json").stdout)
    try:
        deadline = time.monotonic() + 30
        while True:
            shown = pearlctl("logs", launched["run_id"], "trainer[0]")
            if "pearl-worker" in shown.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "start task=" in shown.stdout and "restart=0" in shown.stdout, shown
        rows = json.loads(pearlctl("logs", "t", "--json").stdout)
        assert "trainer[0]" in {r["target"] for r in rows}
    finally:
        pearlctl("cancel", "t", check=None)
