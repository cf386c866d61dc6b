"""DaemonChannel without a daemon: the node's return file (the GPUs come back with the daemon down), and the
mapping of the daemon's answers through the one control-API client. The daemon end to end: tests/integration."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from pearlctl.api.client import DaemonRefusal
from pearlctl.trainer import ControlChannel, TrainerHook
from pearlctl.trainer.channel import DaemonChannel
from tests.unit.test_trainer_hook_unit import FakeEngine

RELEASED = {"phase": "waiting", "step": 3, "released": True, "release_mode": "offload", "blocked_s": 0.5}
NOT_RELEASED = {"phase": "waiting", "step": 3, "released": False}


def write_return(path: Path, returned_at: float, **fields) -> None:
    """What the agent writes (temp + rename) once it stopped or parked the lent worker."""
    doc = {"returned_at": returned_at, "deadline": returned_at - 2, "gpus": [0], "worker_key": "rollout-0"}
    doc.update({"how": "stopped"}, **fields)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory with no daemon: no .pearl/daemon.json, no token."""
    d = tmp_path / "run"
    d.mkdir()
    return d


def channel(run_dir: Path, return_file, **kw) -> DaemonChannel:
    return DaemonChannel(run_dir, "tiny-run", return_file=return_file, timeout=0.5, **kw)


def test_the_daemon_channel_satisfies_the_protocol_and_repeats_its_commands(run_dir):
    ch = channel(run_dir, None)
    assert isinstance(ch, ControlChannel) and ch.repeats_commands is True


def test_no_daemon_means_no_command_and_acks_never_raise(run_dir):
    ch = channel(run_dir, run_dir / "absent-return")
    t0 = time.monotonic()
    assert ch.report(NOT_RELEASED) is None
    assert ch.report(RELEASED) is None  # released, no file, no daemon: nothing
    ch.ack("t1:0:OFFLOAD", {"ok": True, "command": "release"})
    assert time.monotonic() - t0 < 2


def test_a_return_file_while_released_is_a_local_reclaim_without_the_daemon(run_dir, tmp_path):
    ret = tmp_path / "pearl-return.json"
    ch = channel(run_dir, ret)
    write_return(ret, 1_700_000_000)
    assert ch.report(NOT_RELEASED) is None  # not released: ignored, and left for later
    assert ret.exists()
    assert ch.report(RELEASED) == {"command": "reclaim", "command_id": "local-return:1700000000"}
    assert not ret.exists() and json.loads(Path(f"{ret}.taken-1700000000").read_text())["how"] == "stopped"
    assert ch.report(RELEASED) is None  # taken once

    write_return(ret, 1_700_000_100.25, how="parked")
    assert ch.report(RELEASED)["command_id"] == "local-return:1700000100.25"
    assert Path(f"{ret}.taken-1700000100.25").exists()


def test_the_return_file_comes_from_the_environment_and_none_turns_it_off(run_dir, tmp_path, monkeypatch):
    ret = tmp_path / "ret.json"
    monkeypatch.setenv("PEARL_RETURN_FILE", str(ret))
    assert DaemonChannel(run_dir, "tiny-run").return_file == str(ret)
    off = channel(run_dir, None)
    write_return(ret, time.time())
    assert off.return_file is None and off.report(RELEASED) is None and ret.exists()
    monkeypatch.setenv("PEARL_RETURN_FILE", "")
    assert DaemonChannel(run_dir, "tiny-run").return_file is None


def test_a_return_file_older_than_the_latest_release_is_stale(run_dir, tmp_path):
    """Left by a lending the daemon already ended: taking it would reload onto GPUs a new worker may hold."""
    ret = tmp_path / "ret.json"
    ch = channel(run_dir, ret)
    old = time.time() - 60
    write_return(ret, old)
    ch.ack("t2:0:OFFLOAD", {"ok": True, "command": "release", "noop": False})  # a new lending began
    assert ch.report(RELEASED) is None
    assert not ret.exists() and len(list(tmp_path.glob("ret.json.stale-*"))) == 1
    ch.ack("t2:0:OFFLOAD", {"ok": True, "command": "release", "noop": False})  # a re-ack keeps the first time
    now = time.time()
    write_return(ret, now)
    assert ch.report(RELEASED)["command_id"].startswith("local-return:")


def test_a_return_file_that_is_not_json_still_counts_as_a_return(run_dir, tmp_path):
    ret = tmp_path / "ret.json"
    ret.write_text("{half")
    os.utime(ret, (1_700_000_007, 1_700_000_007))
    assert channel(run_dir, ret).report(RELEASED) == {"command": "reclaim", "command_id": "local-return:1700000007"}


def test_the_daemons_answers_through_the_control_client(run_dir, monkeypatch):
    ch = channel(run_dir, None, weights_dir="/runs/w")
    calls = []

    def answer(method, path, body=None, **kw):
        calls.append((method, path, body))
        if path == "/v1/trainer/ack":
            raise DaemonRefusal("/v1/trainer/ack: no step 'x'", 404)
        return {"epoch": 3, "command": "release", "command_id": "t5:0:OFFLOAD", "mode": None}

    monkeypatch.setattr(ch._client, "try_call", answer)
    assert ch.report(dict(NOT_RELEASED, weight_version="7")) == {"command": "release", "command_id": "t5:0:OFFLOAD"}
    assert calls[0][:2] == ("POST", "/v1/trainer/phase") and calls[0][2]["weights_path"] == "/runs/w/7"
    ch.ack("x", {"ok": True, "command": "reclaim"})  # a refusal never raises

    def refuse(method, path, body=None, **kw):
        raise DaemonRefusal(f"{path}: bad token", 401)

    monkeypatch.setattr(ch._client, "try_call", refuse)
    assert ch.report(NOT_RELEASED) is None  # a refusal is no command


def test_the_hook_reclaims_from_the_return_file_while_the_daemon_is_down(run_dir, tmp_path):
    ret = tmp_path / "ret.json"
    engine = FakeEngine()
    done: list = []
    ch = channel(run_dir, ret)
    hook = TrainerHook(
        engine,
        channel=ch,
        rank=0,
        world_size=1,
        all_reduce_max=lambda values: values,
        poll_interval_s=0.01,
        on_command=done.append,
    )
    hook.release()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(hook.ensure_reclaimed()), daemon=True)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and hook.released  # no daemon, no file: the GPUs stay lent
    returned_at = int(time.time()) + 0.5
    write_return(ret, returned_at)
    t.join(5)
    assert not t.is_alive() and not hook.released
    assert result["reclaim"]["command_id"] == f"local-return:{returned_at!r}"
    assert engine.names() == ["offload_states", "reload_states"]
    assert not ret.exists() and Path(f"{ret}.taken-{returned_at!r}").exists()
    assert [d["command"] for d in done] == ["reclaim"]
