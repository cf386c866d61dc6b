"""The trainer hook's command handling without DeepSpeed: a fake engine at the one seam (the methods
the hook calls on a DeepSpeed engine), in-process channels, and fake ranks as threads that share an
all-reduce. Real DeepSpeed ranks: tests/engines/test_trainer_hook.py."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.trainer import FileChannel, NullChannel, TrainerHook
from pearlctl.trainer.hook import first_wait_hint
from pearlctl.trainer.weights import stored_version


class QueueChannel:
    """In-process channel for these tests and their threads: the controller side calls ``send`` and
    ``wait_ack``. Delivers each command once (``repeats_commands`` is not set), like ``FileChannel``."""

    def __init__(self) -> None:
        self.commands: queue.Queue[dict] = queue.Queue()
        self.events: list[dict] = []
        self.acks: dict[str, dict] = {}
        self._cond = threading.Condition()

    # trainer side
    def report(self, event: dict) -> dict | None:
        with self._cond:
            self.events.append(dict(event))
            self._cond.notify_all()
        try:
            return self.commands.get_nowait()
        except queue.Empty:
            return None

    def ack(self, command_id: str, result: dict) -> None:
        with self._cond:
            self.acks[command_id] = dict(result)
            self._cond.notify_all()

    # controller side
    def send(self, command: str | None, *, command_id: str | None = None, **fields: Any) -> str:
        command_id = command_id or uuid.uuid4().hex[:12]
        self.commands.put({"command": command, "command_id": command_id, **fields})
        return command_id

    def wait_ack(self, command_id: str, timeout: float = 30.0) -> dict:
        with self._cond:
            if not self._cond.wait_for(lambda: command_id in self.acks, timeout):
                raise TimeoutError(f"no ack for command {command_id} within {timeout} s")
            return self.acks[command_id]

    def wait_event(self, predicate: Callable[[dict], bool], timeout: float = 30.0) -> dict:
        with self._cond:
            found: list[dict] = []

            def seen() -> bool:
                found[:] = [e for e in self.events if predicate(e)]
                return bool(found)

            if not self._cond.wait_for(seen, timeout):
                raise TimeoutError(f"no matching trainer event within {timeout} s")
            return found[0]


class FakeEngine:
    """What the hook uses of a DeepSpeed engine. Records calls; checkpoints are kept in memory plus the
    ``latest`` file DeepSpeed writes, so ``resume`` finds them."""

    def __init__(self, stage: int = 2, optimizer=None):
        self.stage = stage
        self.calls: list[tuple] = []
        self.global_steps = 0
        self.device = "cpu"
        self.optimizer = optimizer
        self.module = None
        self.saved: dict[tuple[str, str], dict] = {}

    def zero_optimization_stage(self) -> int:
        return self.stage

    def offload_states(self) -> None:
        self.calls.append(("offload_states",))

    def reload_states(self) -> None:
        self.calls.append(("reload_states",))

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True) -> None:
        self.calls.append(("save_checkpoint", save_dir, tag, dict(client_state or {})))
        self.saved[(str(save_dir), tag)] = dict(client_state or {})
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)

    def load_checkpoint(self, load_dir, tag=None):
        tag = tag or (Path(load_dir) / "latest").read_text()
        self.calls.append(("load_checkpoint", load_dir, tag))
        state = self.saved.get((str(load_dir), tag))
        return (None, None) if state is None else (f"{load_dir}/{tag}", state)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def hook_for(engine=None, channel=None, **kw) -> TrainerHook:
    return TrainerHook(engine or FakeEngine(), channel=channel or QueueChannel(), rank=0, world_size=1, **kw)


# ---------------------------------------------------------------------- import weight
def test_importing_the_hook_imports_no_engine():
    code = "import sys, pearlctl.trainer; print(sorted(m for m in ('torch', 'deepspeed', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_channels_satisfy_the_protocol():
    from pearlctl.trainer import ControlChannel

    for channel in (NullChannel(), QueueChannel()):
        assert isinstance(channel, ControlChannel)


# ---------------------------------------------------------------------- commands
def test_no_daemon_means_no_command():
    engine = FakeEngine()
    hook = TrainerHook(engine, rank=0, world_size=1)
    assert hook.phase("waiting", step=1, expected_wait_s=3) is None
    assert hook.phase("training", step=1) is None
    assert hook.ensure_reclaimed() is None
    assert engine.calls == [] and not hook.released


def _waits(ch: QueueChannel) -> list:
    return [(e["step"], e["expected_wait_s"]) for e in ch.events if e["phase"] == "waiting"]


def test_a_first_wait_hint_is_reported_counted_down_in_the_first_waiting_step_only(monkeypatch):
    monkeypatch.setenv("PEARL_FIRST_WAIT_S", "600")
    ch = QueueChannel()
    hook = hook_for(channel=ch)
    assert hook.first_wait_s == 600.0
    hook.phase("training", step=1)  # a loop (TRL's) may report training before its first batch: no matter
    hook.phase("waiting", step=1)
    time.sleep(0.05)
    hook.phase("waiting", step=1)
    hook.phase("waiting", step=1, expected_wait_s=7.0)  # the loop's own figure wins
    hook.phase("training", step=1)
    hook.phase("waiting", step=2)  # a later step's unknown wait stays unknown: the hint is the first batch's
    (s1, w1), (_, w2), (_, w3), (s2, w4) = _waits(ch)
    assert s1 == 1 and 599.0 < w2 < w1 <= 600.0 and w3 == 7.0 and (s2, w4) == (2, None)


def test_without_a_hint_an_unknown_wait_is_reported_as_unknown(monkeypatch):
    monkeypatch.delenv("PEARL_FIRST_WAIT_S", raising=False)
    ch = QueueChannel()
    hook = hook_for(channel=ch)
    hook.wait_until(lambda: True, step=1)
    assert hook.first_wait_s is None and _waits(ch) == [(1, None)]


def test_wait_until_counts_the_hint_down_and_an_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("PEARL_FIRST_WAIT_S", "600")
    ch = QueueChannel()
    ready = iter([False, False, True])
    hook_for(channel=ch, first_wait_s=30).wait_until(lambda: next(ready), step=3, poll_interval_s=0.02)
    waits = [w for _, w in _waits(ch)]
    assert len(waits) == 3 and waits == sorted(waits, reverse=True) and 29.0 < waits[-1] < waits[0] <= 30.0


@pytest.mark.parametrize("raw", ["soon", "-1", "inf", "nan"])
def test_a_bad_first_wait_hint_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("PEARL_FIRST_WAIT_S", raw)
    with pytest.raises(ValueError, match=r"PEARL_FIRST_WAIT_S must be a finite number of seconds >= 0, not"):
        hook_for()


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=20), st.floats(allow_nan=True, allow_infinity=True).map(repr)))
def test_any_first_wait_hint_is_a_finite_non_negative_number_or_refused_by_name(raw):
    old = os.environ.get("PEARL_FIRST_WAIT_S")
    os.environ["PEARL_FIRST_WAIT_S"] = raw.replace("\x00", "")
    try:
        got = first_wait_hint()
    except ValueError as exc:
        assert str(exc).startswith("PEARL_FIRST_WAIT_S must be a finite number of seconds >= 0, not ")
    else:
        assert got is None or (got >= 0.0 and got != float("inf"))
        assert (got is None) == (not raw.replace("\x00", "").strip())
    finally:
        if old is None:
            os.environ.pop("PEARL_FIRST_WAIT_S", None)
        else:
            os.environ["PEARL_FIRST_WAIT_S"] = old


def test_release_while_waiting_offloads_and_acks():
    engine, ch = FakeEngine(stage=2), QueueChannel()
    hook = hook_for(engine, ch)
    cid = ch.send("release")
    done = hook.phase("waiting", step=3, expected_wait_s=12.5, metrics={"reward": 0.5})
    assert done["command"] == "release" and done["command_id"] == cid
    assert engine.names() == ["offload_states"]
    assert hook.released
    ack = ch.acks[cid]
    assert ack["ok"] and ack["mode"] == "offload" and ack["freed_by"] == "offload_states" and not ack["noop"]
    assert ch.events[0] == {
        **ch.events[0],
        "phase": "waiting",
        "step": 3,
        "expected_wait_s": 12.5,
        "metrics": {"reward": 0.5},
        "released": False,
        "world_size": 1,
        "zero_stage": 2,
    }


def test_release_during_training_is_held_until_the_next_waiting_point():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    cid = ch.send("release")
    assert hook.phase("training", step=1) is None
    assert engine.calls == [] and cid not in ch.acks and not hook.released
    done = hook.phase("waiting", step=1)
    assert done["command_id"] == cid and hook.released and ch.acks[cid]["ok"]


def test_release_twice_is_one_release_and_reclaim_when_not_released_is_a_noop():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    first, second = ch.send("release"), ch.send("release")
    hook.phase("waiting", step=1)
    hook.phase("waiting", step=1)
    assert engine.names() == ["offload_states"]
    assert ch.acks[first]["noop"] is False and ch.acks[second]["noop"] is True and ch.acks[second]["ok"]
    assert hook.release()["noop"] is True

    r1, r2 = ch.send("reclaim"), ch.send("reclaim")
    hook.phase("waiting", step=1)
    hook.phase("waiting", step=1)
    assert engine.names() == ["offload_states", "reload_states"]
    assert ch.acks[r1]["noop"] is False and ch.acks[r2]["noop"] is True
    assert hook.reclaim() == {"noop": True, "released": False}


def test_a_retried_command_id_gets_the_stored_answer_and_is_not_carried_out_again():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    rel = ch.send("release")
    hook.phase("waiting", step=1)
    first_answer = ch.acks[rel]
    ch.send("reclaim")
    hook.phase("waiting", step=1)
    ch.acks.clear()
    ch.send("release", command_id=rel)  # e.g. an HTTP retry arriving late
    assert hook.phase("waiting", step=2) is None
    assert not hook.released and engine.names() == ["offload_states", "reload_states"]
    assert ch.acks[rel] == first_answer


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"command": "explode"}, "unknown command"),
        ({"command": "release", "mode": "teleport"}, "unknown release mode"),
        ({"command": "release", "mode": "checkpoint"}, "needs the trainer's ckpt_dir"),
    ],
)
def test_invalid_commands_are_refused_with_a_reason(fields, error):
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    ch.commands.put({"command_id": "c1", **fields})
    assert hook.phase("waiting", step=1) is None
    assert ch.acks["c1"]["ok"] is False and error in ch.acks["c1"]["error"]
    assert engine.calls == [] and not hook.released


def test_null_command_and_missing_command_id_are_handled():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    ch.commands.put({"command": None})
    assert hook.phase("waiting", step=1) is None
    ch.commands.put({"command": "release"})  # no id: the hook makes one up and acks under it
    assert hook.phase("waiting", step=1)["command_id"] in ch.acks


def test_a_failing_channel_never_stops_training():
    class Down:
        def report(self, event):
            raise ConnectionError("daemon down")

        def ack(self, command_id, result):
            raise ConnectionError("daemon down")

    engine = FakeEngine()
    hook = TrainerHook(engine, channel=Down(), rank=0, world_size=1)
    assert hook.phase("waiting", step=1) is None
    assert hook.phase("training", step=1) is None
    assert hook.release()["released"] and hook.reclaim()["released"] is False


def test_phase_names_are_checked():
    with pytest.raises(ValueError, match="phase must be one of"):
        hook_for().phase("sleeping", step=1)


# ---------------------------------------------------------------------- blocking until reclaimed
def test_ensure_reclaimed_blocks_and_polls_until_reclaim():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch, poll_interval_s=0.01)
    ch.send("release")
    hook.phase("waiting", step=4)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(hook.ensure_reclaimed()), daemon=True)
    t.start()
    ch.wait_event(lambda e: e.get("blocked_s") is not None, timeout=5)
    time.sleep(0.2)
    assert t.is_alive() and hook.released, "ensure_reclaimed returned while released"
    rid = ch.send("reclaim")
    t.join(5)
    assert not t.is_alive() and not hook.released
    assert result["reclaim"]["command_id"] == rid and result["blocked_s"] >= 0.2
    assert ch.acks[rid]["ok"] and engine.names() == ["offload_states", "reload_states"]
    blocked = [e for e in ch.events if e.get("blocked_s") is not None]
    assert len(blocked) >= 5 and all(e["released"] and e["step"] == 4 for e in blocked)


def test_phase_training_while_released_blocks_until_reclaimed():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch, poll_interval_s=0.01)
    hook.release()
    threading.Timer(0.1, lambda: ch.send("reclaim")).start()
    hook.phase("training", step=2)
    assert not hook.released and engine.names() == ["offload_states", "reload_states"]


def test_wait_until_serves_commands_and_returns_when_ready():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    polls = []

    def ready() -> bool:
        polls.append(1)
        if len(polls) == 2:
            ch.send("release")
        return len(polls) >= 4

    assert hook.wait_until(ready, step=7, expected_wait_s=10, poll_interval_s=0.001) is True
    assert len(polls) == 4 and hook.released  # still released: the loop calls ensure_reclaimed next
    waits = [e["expected_wait_s"] for e in ch.events]
    assert waits == sorted(waits, reverse=True) and all(w <= 10 for w in waits)


class HoldingChannel(QueueChannel):
    """Like the daemon's long poll: a report with ``wait_s`` and no command waits up to that long for one."""

    def report(self, event: dict) -> dict | None:
        with self._cond:
            self.events.append(dict(event))
            self._cond.notify_all()
        try:
            return self.commands.get(timeout=event.get("wait_s") or 0.0) if event.get("wait_s") else None
        except queue.Empty:
            return None


def test_a_waiting_trainer_long_polls_so_a_command_is_carried_out_at_once_not_at_the_next_poll():
    engine, ch = FakeEngine(), HoldingChannel()
    hook = hook_for(engine, ch, poll_interval_s=2.0)
    done = threading.Event()
    t = threading.Thread(target=lambda: hook.wait_until(done.is_set, step=3), daemon=True)
    t.start()
    ch.wait_event(lambda e: e.get("wait_s") == 2.0, timeout=5)
    time.sleep(0.3)  # held, inside one report
    sent = time.monotonic()
    rid = ch.send("release")
    ch.wait_ack(rid, timeout=5)
    assert time.monotonic() - sent < 1.0 and hook.released  # within the held report, not 2 s later
    done.set()
    t.join(5)
    assert not t.is_alive()


def test_a_channel_that_does_not_hold_reports_is_polled_at_the_poll_interval_not_in_a_spin():
    ch = QueueChannel()  # answers at once
    hook = hook_for(channel=ch, poll_interval_s=0.1)
    deadline = time.monotonic() + 0.55
    hook.wait_until(lambda: time.monotonic() > deadline, step=1)
    assert 4 <= len(ch.events) <= 8, len(ch.events)
    assert all(e["wait_s"] == 0.1 for e in ch.events[:-1]) and "wait_s" not in ch.events[-1]  # not once ready


# ---------------------------------------------------------------------- held releases (issue 8, defect 6)
def test_a_release_held_while_training_is_dropped_by_a_reclaim_and_ensure_reclaimed_does_not_block():
    """A borrow's release arrives during training and is held; the borrow is rolled back (its quick reclaim is
    a no-op: nothing was released). The next waiting point must not release for a transition already undone:
    no reclaim would ever come, and ensure_reclaimed would block forever. Two ranks, through the all-reduce."""
    world, ch = FakeWorld(2), QueueChannel()
    engines = [FakeEngine(), FakeEngine()]
    hooks = [
        TrainerHook(
            engines[r],
            channel=ch if r == 0 else None,
            rank=r,
            world_size=2,
            all_reduce_max=world.all_reduce_max(r),
            poll_interval_s=0.01,
        )
        for r in range(2)
    ]
    rel = ch.send("release")
    _, errors = run_ranks(*(lambda h=h: h.phase("training", step=1) for h in hooks))  # held
    assert not errors and rel not in ch.acks
    rec = ch.send("reclaim")  # the rollback's quick reclaim
    _, errors = run_ranks(*(lambda h=h: h.phase("training", step=1) for h in hooks))
    assert not errors and ch.acks[rec]["ok"] and ch.acks[rec]["noop"] is True

    outcome: list = [None, None]

    def waiting_then_train(r: int) -> None:
        hooks[r].phase("waiting", step=2)
        outcome[r] = ("returned", hooks[r].ensure_reclaimed())

    threads = [threading.Thread(target=waiting_then_train, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3)
    assert not any(t.is_alive() for t in threads), "ensure_reclaimed blocked on a release nobody will reclaim"
    assert outcome == [("returned", None), ("returned", None)]
    assert not any(h.released for h in hooks) and all(e.calls == [] for e in engines)
    assert rel not in ch.acks  # dropped, not acked: a daemon that still wanted it would ask again


def test_the_same_release_id_delivered_twice_while_training_is_carried_out_once():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch, poll_interval_s=0.01)
    rel = ch.send("release")
    assert hook.phase("training", step=1) is None
    ch.send("release", command_id=rel)  # the daemon repeats its pending command on every report
    assert hook.phase("training", step=1) is None
    assert engine.calls == [] and not hook.released
    done = hook.phase("waiting", step=1)
    assert done["command_id"] == rel and hook.released
    first_ack = dict(ch.acks[rel])
    assert first_ack["noop"] is False
    assert hook.phase("waiting", step=1) is None  # the copy is not carried out (not even as a no-op)
    assert ch.acks[rel] == first_ack
    rec = ch.send("reclaim")
    assert hook.phase("waiting", step=1)["command_id"] == rec and not hook.released
    assert hook.phase("waiting", step=2) is None and not hook.released  # and never again after the reclaim
    assert hook.ensure_reclaimed() is None
    assert engine.names() == ["offload_states", "reload_states"]


def test_at_a_waiting_point_the_channels_answer_wins_over_held_releases():
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch, poll_interval_s=0.01)
    old = ch.send("release")
    hook.phase("training", step=1)  # held
    new = ch.send("release")  # what the controller wants now
    assert hook.phase("waiting", step=1)["command_id"] == new
    rec = ch.send("reclaim")
    hook.phase("waiting", step=1)
    assert ch.acks[rec]["noop"] is False and not hook.released
    assert hook.phase("waiting", step=2) is None and not hook.released  # the old one was dropped
    assert old not in ch.acks and engine.names() == ["offload_states", "reload_states"]


def test_a_channel_that_repeats_its_commands_confirms_no_held_release_by_asking_for_nothing():
    class Repeating(QueueChannel):  # like the daemon: it answers what it wants on every report
        repeats_commands = True

    engine, ch = FakeEngine(), Repeating()
    hook = hook_for(engine, ch)
    rel = ch.send("release")
    hook.phase("training", step=1)  # held
    assert hook.phase("waiting", step=1) is None  # no command now: the daemon no longer wants it
    assert not hook.released and engine.calls == [] and rel not in ch.acks
    ch.send("release", command_id=rel)  # still wanted: the daemon repeats it and it is carried out
    hook.phase("training", step=2)
    ch.send("release", command_id=rel)
    assert hook.phase("waiting", step=2)["command_id"] == rel and hook.released


# ---------------------------------------------------------------------- ZeRO-0: release by checkpoint
def zero0_engine():
    import torch

    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    opt.step()
    return FakeEngine(stage=0, optimizer=opt)


def test_zero0_cannot_offload_so_release_checkpoints_and_reclaim_loads(tmp_path):
    engine, ch = zero0_engine(), QueueChannel()
    engine.global_steps = 5
    hook = hook_for(engine, ch, ckpt_dir=tmp_path / "ckpt")
    cid = ch.send("release")  # mode offload (the default) is not possible on ZeRO-0
    hook.phase("waiting", step=6)
    ack = ch.acks[cid]
    assert ack["ok"] and ack["mode"] == "checkpoint" and ack["fallback"].startswith("ZeRO-0")
    assert ack["freed_by"] == "optimizer_states_to_host"
    assert engine.calls[0] == (
        "save_checkpoint",
        str(tmp_path / "ckpt"),
        "global_step5",
        {"step": 5, "pearl_release": True},
    )
    rid = ch.send("reclaim")
    hook.phase("waiting", step=6)
    assert ch.acks[rid]["ok"] and engine.calls[-1] == ("load_checkpoint", str(tmp_path / "ckpt"), "global_step5")


def test_zero3_without_fused_adam_falls_back_and_without_ckpt_dir_refuses():
    engine, ch = FakeEngine(stage=3, optimizer=type("Z3", (), {"optimizer": object()})()), QueueChannel()
    hook = hook_for(engine, ch)
    ch.commands.put({"command": "release", "command_id": "r"})
    hook.phase("waiting", step=1)
    assert ch.acks["r"]["ok"] is False and "ckpt_dir" in ch.acks["r"]["error"] and engine.calls == []
    with pytest.raises(RuntimeError, match="FusedAdam"):
        hook.release()


# ---------------------------------------------------------------------- fake ranks
class FakeWorld:
    """Ranks as threads: an all-reduce MAX over lists that every rank contributes to."""

    def __init__(self, n: int):
        self.slots: list[list[float] | None] = [None] * n
        self.barrier = threading.Barrier(n)

    def all_reduce_max(self, rank: int):
        def reduce(values: list[float]) -> list[float]:
            self.slots[rank] = list(values)
            self.barrier.wait(timeout=5)
            out = [max(col) for col in zip(*self.slots, strict=True)]
            self.barrier.wait(timeout=5)
            return out

        return reduce


def run_ranks(*bodies):
    errors, results = [], [None] * len(bodies)

    def run(i, body):
        try:
            results[i] = body()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results, errors


def test_every_rank_acts_on_rank_zeros_decision_and_the_ack_waits_for_all():
    world, ch = FakeWorld(2), QueueChannel()
    engines = [FakeEngine(), FakeEngine()]
    slow = threading.Event()

    def slow_offload():  # rank 1 takes longer: the ack must report it
        time.sleep(0.2)
        engines[1].calls.append(("offload_states",))
        slow.set()

    engines[1].offload_states = slow_offload
    hooks = [
        TrainerHook(
            engines[r], channel=ch if r == 0 else None, rank=r, world_size=2, all_reduce_max=world.all_reduce_max(r)
        )
        for r in range(2)
    ]
    cid = ch.send("release")
    results, errors = run_ranks(*(lambda h=h: h.phase("waiting", step=1) for h in hooks))
    assert not errors, errors
    assert [r["command_id"] for r in results] == [cid, None]  # only rank 0 knows the id
    assert all(h.released for h in hooks) and all(e.names() == ["offload_states"] for e in engines)
    assert ch.acks[cid]["max_rank_s"] >= 0.2 > ch.acks[cid]["total_s"]  # acked after the slow rank finished
    assert len(ch.events) == 1  # only rank 0 reports


def test_a_signal_on_any_rank_stops_every_rank_at_the_same_point():
    world = FakeWorld(2)
    hooks = [TrainerHook(FakeEngine(), rank=r, world_size=2, all_reduce_max=world.all_reduce_max(r)) for r in range(2)]
    results, errors = run_ranks(*(lambda h=h: h.should_stop() for h in hooks))
    assert results == [False, False] and not errors
    hooks[1]._on_signal(signal.SIGUSR2, None)
    results, errors = run_ranks(*(lambda h=h: (h.phase("waiting", step=2), h.should_stop()) for h in hooks))
    assert [r[1] for r in results] == [True, True] and not errors


def test_ranks_calling_hook_methods_in_different_orders_fail_loudly():
    world = FakeWorld(2)
    hooks = [TrainerHook(FakeEngine(), rank=r, world_size=2, all_reduce_max=world.all_reduce_max(r)) for r in range(2)]
    _, errors = run_ranks(lambda: hooks[0].phase("waiting", step=1), lambda: hooks[1].should_stop())
    assert len(errors) == 2 and all("out of step" in str(e) for e in errors)


# ---------------------------------------------------------------------- signals, checkpoint, resume
@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_signal_sets_a_flag_then_a_joint_checkpoint_exits_and_resume_returns_the_step(tmp_path, restore_signals):
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch)
    hook.save_on_signal(tmp_path / "ckpt")
    assert hook.should_stop() is False
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
    assert engine.calls == []  # the handler only sets a flag
    assert hook.should_stop() is True
    engine.global_steps = 9
    with pytest.raises(SystemExit) as exit_:
        hook.checkpoint_and_exit()
    assert exit_.value.code == 0
    assert engine.calls == [("save_checkpoint", str(tmp_path / "ckpt"), "global_step9", {"step": 9})]
    stopped = ch.events[-1]
    assert stopped["phase"] == "stopped" and stopped["step"] == 9 and stopped["metrics"]["signal"] == "SIGUSR2"

    fresh = hook_for(engine, ch)
    assert fresh.resume(tmp_path / "ckpt") == 9
    assert fresh.resume(tmp_path / "empty") == 0


def test_a_stop_while_released_checkpoints_without_reclaiming(tmp_path, restore_signals):
    engine, ch = FakeEngine(), QueueChannel()
    hook = hook_for(engine, ch, poll_interval_s=0.01)
    hook.save_on_signal(tmp_path / "ckpt")
    hook.release()
    hook._on_signal(signal.SIGTERM, None)
    with pytest.raises(SystemExit):
        hook.ensure_reclaimed()
    assert engine.names() == ["offload_states", "save_checkpoint"]  # no reload_states: GPUs stay lent


# ---------------------------------------------------------------------- weight export
class TinyModule:
    def __init__(self, torch):
        w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        self.tensors = {"model.embed_tokens.weight": w, "lm_head.weight": w, "model.norm.weight": torch.ones(3)}

    def state_dict(self):
        return dict(self.tensors)


def test_export_weights_writes_a_complete_directory_atomically(tmp_path):
    import torch
    from safetensors.torch import load_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_text("old weights: never copied")
    engine = FakeEngine()
    engine.module = TinyModule(torch)  # lm_head shares storage with embed_tokens (tied weights)
    hook = hook_for(engine, base_model_dir=base)
    out = hook.export_weights(tmp_path / "weights", "12")
    assert out == tmp_path / "weights" / "12"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "pearl_weight_version.txt",
        "tokenizer.json",
    ]
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())  # the base config's dtype
    assert torch.equal(tensors["lm_head.weight"].float(), torch.arange(6.0).reshape(2, 3))
    assert (out / "pearl_weight_version.txt").read_text() == "12\n"
    assert (tmp_path / "weights" / "LATEST").read_text() == "12\n"
    assert hook.weight_version == "12" and hook.last_export["export_s"] >= 0

    engine.module.tensors["model.norm.weight"] = torch.full((3,), 2.0)
    hook.export_weights(tmp_path / "weights", "12")  # the same version again: swapped in whole
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].tolist() == [2.0, 2.0, 2.0]
    assert [p.name for p in (tmp_path / "weights").iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ValueError, match="one path component"):
        hook.export_weights(tmp_path / "weights", "../escape")


def test_each_nodes_first_rank_writes_the_export_into_its_nodes_store_and_keeps_two_versions(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    store = tmp_path / "shm" / "weights"
    monkeypatch.setenv("PEARL_WEIGHT_STORE", str(store))
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine = FakeEngine()
    engine.module = TinyModule(torch)
    # rank 2 of 4: node 1's first rank writes only its node's copy; the shared-disk export is rank 0's
    hook = TrainerHook(engine, channel=QueueChannel(), rank=2, world_size=4, base_model_dir=base)
    hook._barrier = lambda: None  # no process group in a unit test
    for version in ("1", "2", "3"):
        hook.export_weights(tmp_path / "disk", version)
    assert not (tmp_path / "disk").exists()
    assert sorted(p.name for p in store.iterdir() if p.is_dir()) == ["2", "3"]  # the newest two
    assert stored_version(store / "3") == "3" and (store / "LATEST").read_text() == "3\n"
    assert torch.equal(
        load_file(str(store / "3" / "model.safetensors"))["lm_head.weight"], torch.arange(6.0).reshape(2, 3)
    )
    assert hook.last_export["node_store"] == str(store / "3")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's other ranks write nothing
    hook.export_weights(tmp_path / "disk", "4")
    assert not (store / "4").exists() and not (tmp_path / "disk").exists()
    # a store that cannot be written (here: a file where its directory should be) loses the copy, not the step
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("PEARL_WEIGHT_STORE", str(tmp_path / "not-a-dir"))
    (tmp_path / "not-a-dir").write_text("")
    hook.export_weights(tmp_path / "disk", "5")
    assert hook.last_export["node_store"] is None and "not-a-dir" in hook.last_export["node_store_error"]


# ---------------------------------------------------------------------- the file channel
def test_file_channel_round_trip(tmp_path):
    trainer, daemon = FileChannel(tmp_path), FileChannel(tmp_path)
    assert trainer.report({"phase": "waiting", "step": 1}) is None
    first, second = daemon.send("release", mode="offload"), daemon.send("reclaim")
    assert trainer.report({"phase": "waiting", "step": 1}) == {
        "command": "release",
        "command_id": first,
        "mode": "offload",
    }
    assert trainer.report({"phase": "waiting", "step": 1})["command_id"] == second
    assert trainer.report({"phase": "training", "step": 2}) is None  # each command is taken once
    trainer.ack(first, {"ok": True})
    assert daemon.wait_ack(first, timeout=1) == {"ok": True}
    assert daemon.read_ack(second) is None
    assert [e["step"] for e in daemon.read_events()] == [1, 1, 1, 2]
