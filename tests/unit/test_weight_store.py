"""A node's weight store (pearlctl.host.weight_store): whole copies made once, pruning that keeps what a live engine
uses, a store that outlives an agent's restart and goes with the run's last agent on the node, and copies that do
not fit refused in one line. Real files and real processes; the one fake is a failing copy (the filesystem seam)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from pearlctl.host import weight_store
from pearlctl.host.weight_store import NodeStore, stored_version


def _export(root: Path, version: str, size: int = 256) -> Path:
    """A whole export of ``version`` as the trainer writes it (pearlctl.trainer.weights)."""
    d = root / version
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
    (d / "pearl_weight_version.txt").write_text(version + "\n")
    return d


def _model(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(f'{{"name": "{name}"}}')
    (d / "model.safetensors").write_bytes(name.encode() * 100)
    return d


@pytest.fixture
def live_process():
    """A live process of the test's own (its pid pins, or registers an agent), stopped after."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_model_is_copied_once_whole_and_two_models_of_one_name_stay_apart(tmp_path):
    store = NodeStore(tmp_path / "store")
    judge = _model(tmp_path / "disk", "judge")
    other = _model(tmp_path / "elsewhere", "judge")  # the same directory name, another model
    assert store.model(judge) is None
    local = store.fetch_model(judge)
    assert local is not None and local.is_relative_to(store.models) and store.model(judge) == local
    assert (local / "model.safetensors").read_bytes() == (judge / "model.safetensors").read_bytes()
    first = (local / "model.safetensors").stat().st_mtime_ns
    assert store.fetch_model(judge) == local and (local / "model.safetensors").stat().st_mtime_ns == first  # not again
    assert store.fetch_model(other) not in (None, local)
    assert store.fetch_model("Qwen/Qwen3-8B") is None  # a hub name is not a directory to copy: vLLM resolves it


def test_concurrent_copies_of_one_model_make_one_whole_directory_and_leave_nothing_half_made(tmp_path):
    store = NodeStore(tmp_path / "store")
    judge = _model(tmp_path / "disk", "judge")
    got: list[Path | None] = []
    threads = [threading.Thread(target=lambda: got.append(store.fetch_model(judge))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and got[0] is not None
    assert sorted(p.name for p in store.models.iterdir() if not p.name.endswith(".lock")) == [got[0].name]


def test_a_version_is_fetched_from_its_export_and_pruning_keeps_the_newest_and_every_pinned_one(tmp_path, live_process):
    store = NodeStore(tmp_path / "store")
    disk = tmp_path / "disk"
    for v in ("1", "2", "3"):
        _export(disk, v)
    serving = live_process()  # an engine still serving version 1 (or parked with it)
    v1 = store.fetch_version("1", disk / "1", keep=2)
    assert v1 is not None and stored_version(v1) == "1"
    store.pin(serving.pid, v1)
    store.fetch_version("2", disk / "2", keep=2)
    os.utime(store.versions / "2", (1e9 + 2, 1e9 + 2))  # ordered by modification time, as the writer's are
    os.utime(store.versions / "1", (1e9 + 1, 1e9 + 1))
    store.fetch_version("3", disk / "3", keep=1)
    assert sorted(p.name for p in store.versions.iterdir() if p.is_dir()) == ["1", "3"]  # 2 pruned, 1 pinned
    serving.kill()
    serving.wait()
    assert store.prune(keep=1) == ["1"]  # its engine is gone: its pin is stale, the version goes
    assert store.version("3") is not None and store.pinned() == set()


def test_an_export_still_being_written_is_never_fetched(tmp_path):
    store = NodeStore(tmp_path / "store")
    half = tmp_path / "disk" / "4"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"x")  # its version file, written last, is not there yet
    assert store.fetch_version("4", half, keep=2) is None
    assert store.fetch_version("5", _export(tmp_path / "disk", "4b"), keep=2) is None  # it holds another version
    assert not store.versions.exists() or not any(store.versions.iterdir())


def test_a_pin_replaces_the_processes_last_and_a_path_outside_the_store_pins_nothing(tmp_path):
    store = NodeStore(tmp_path / "store")
    v = _export(store.versions, "7")
    store.pin(os.getpid(), v)
    assert store.pinned() == {v}
    store.pin(os.getpid(), tmp_path / "disk" / "8")  # a reload from shared disk: nothing here is in use now
    assert store.pinned() == set()
    store.pin(_dead_pid(), v)
    assert store.pinned() == set() and not any((store.root / "pins").iterdir())  # a dead engine's pin is dropped


def test_the_store_outlives_an_agents_restart_and_goes_with_the_runs_last_agent_on_the_node(
    tmp_path, monkeypatch, live_process
):
    monkeypatch.setenv("PEARL_SHM_DIR", str(tmp_path))
    store = NodeStore.for_node("r", "gpu1")
    assert store.root == tmp_path / "pearl" / "r" / "gpu1"  # per run and node: a test machine's nodes stay apart
    _export(store.versions, "1")
    crashed = live_process()  # an agent that will be SIGKILLed (its leave never runs)
    store.join(crashed.pid)
    crashed.kill()
    crashed.wait()
    restarted, rollout = live_process(), live_process()  # its restart in the allocation, and a rollout job's agent
    store.join(restarted.pid)
    store.join(rollout.pid)
    assert store.version("1") is not None  # the restarted agent finds the store whole
    assert store.leave(restarted.pid) is False and store.version("1") is not None  # the rollout agent still uses it
    assert store.leave(rollout.pid) is True and not store.root.exists()  # the last live agent frees it (RAM)


class Usage(NamedTuple):  # shutil.disk_usage's answer
    total: int
    used: int
    free: int


def test_the_room_rule_keeps_a_share_of_what_is_free_however_full_the_filesystem_already_is(tmp_path, monkeypatch):
    """A copy may take three quarters of the space free before it, on an empty or a nearly full filesystem alike
    (the filesystem's usage is the seam: a real one's fill is the host's)."""
    judge = _model(tmp_path / "disk", "judge")
    need = sum(f.stat().st_size for f in judge.iterdir())
    for total in (10 * need, 10**12):  # the copy's share of the filesystem: large, or a speck of a full one
        for free, fits in ((need * 4 // 3 + 1, True), (need * 4 // 3 - 1, False)):
            usage = Usage(total, total - free, free)
            monkeypatch.setattr(weight_store.shutil, "disk_usage", lambda _path, usage=usage: usage)
            store = NodeStore(tmp_path / f"store-{total}-{free}")
            assert (store.fetch_model(judge) is not None) is fits, (total, free)


def test_a_model_that_does_not_fit_or_a_failed_copy_is_one_line_and_the_worker_reads_shared_disk(
    tmp_path, monkeypatch, caplog
):
    store = NodeStore(tmp_path / "store")
    judge = _model(tmp_path / "disk", "judge")
    caplog.set_level(logging.WARNING, logger="pearlctl.store")
    monkeypatch.setattr(weight_store, "HEADROOM", 1.0)  # nothing may be copied: all that is free is kept free
    assert store.fetch_model(judge) is None
    assert "does not fit" in caplog.text and "read from shared disk" in caplog.text
    monkeypatch.setattr(weight_store, "HEADROOM", 0.0)

    def fail(src, dst, **kw):
        Path(dst).mkdir()
        (Path(dst) / "part").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", fail)
    assert store.fetch_model(judge) is None and "No space left on device" in caplog.text
    assert [p.name for p in store.models.iterdir() if not p.name.endswith(".lock")] == []  # no half copy left


def test_a_judge_starts_from_its_nodes_store_under_its_shared_name_once_the_agent_copied_it_there(
    tmp_path, monkeypatch
):
    from pearlctl.agent.identity import Identity
    from pearlctl.agent.reconciler import Reconciler

    monkeypatch.setenv("PEARL_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("PEARL_ENGINE_DEVICE", "cpu")
    judge = _model(tmp_path / "disk", "judge")
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="9", task_id=0, node="gpu1", gpus=(0,), restarts=0)
    env = {"PEARL_MODEL": str(tmp_path / "disk" / "policy"), "PEARL_STORE_MODELS": json.dumps([str(judge)])}
    agent = Reconciler(me, str(tmp_path), env=env)
    want = {"key": "REWARD-0", "role": "REWARD", "engine": "vllm", "gpus": [0], "model": str(judge), "engine_args": {}}
    early = agent._make(want).server  # before the copy is there: shared disk, as without a store
    assert early.model == str(judge) and early.served_model_name is None
    agent.join_store()  # the agent's start: the copy runs in the background
    for _ in range(200):
        if agent.store.model(judge) is not None:
            break
        time.sleep(0.05)
    server = agent._make(want).server
    assert server.model == str(agent.store.model(judge)) and server.model.startswith(str(tmp_path / "shm"))
    argv = server.command()
    assert argv[argv.index("--served-model-name") + 1] == str(judge)  # requests name the judge as before
    policy = agent._make({**want, "key": "ROLLOUT-0", "role": "ROLLOUT", "model": None}).server
    assert policy.model == env["PEARL_MODEL"] and policy.served_model_name is None  # not a model the store holds
    agent.leave_store()
    assert not agent.store.root.exists()  # this node's last agent of the run


def test_a_version_the_trainer_puts_in_place_while_it_is_copied_is_the_one_used(tmp_path, monkeypatch):
    """The trainer's export writes its node's store with no lock (a temporary name, then a rename): a worker's copy of
    the same version from shared disk that finds it in place when its own copy is done uses that whole one, and
    leaves no half copy (it once fell back to shared disk: the rename of a directory onto a full one fails)."""
    store = NodeStore(tmp_path / "store")
    disk = _export(tmp_path / "disk", "5")
    copy = shutil.copytree

    def trainer_meanwhile(src, dst, **kw):
        copy(src, dst, **kw)
        _export(store.versions, "5")  # the trainer's rename lands between this copy and its own rename

    monkeypatch.setattr(shutil, "copytree", trainer_meanwhile)
    assert store.fetch_version("5", disk, keep=2) == store.versions / "5"
    assert [p.name for p in store.versions.iterdir() if not p.name.endswith(".lock")] == ["5"]
