"""The reference rollout driver's work report (examples/grpo/rollout.py, ``Remaining.work``): with more episodes
than ``--concurrency`` it reports the episodes as that many closed loops running their share one after another,
so the predictor — whose trajectories all run at once — predicts the queued batch, not a quarter of it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pearlctl.planner.model import Deployment, Mode, Work
from pearlctl.planner.predict import predict
from pearlctl.planner.profile import DecodeModel, Profile
from tests.conftest import REPO, load_example

driver = load_example("grpo_rollout_work", REPO / "examples/grpo/rollout.py")
# a small CPU worker: decoding a 16-token turn takes a fraction of a second, the tool call 12 s
PROFILE = Profile(
    name="cpu",
    model="tiny",
    hardware="cpu",
    decode=DecodeModel(weights_s=0.006, seq_s=0.0005, kv_s_per_token=0.0),
    prefill_tok_s=5000.0,
    kv_capacity_tokens=4000,
)


def remaining(concurrency: int | None, episodes: int = 16) -> object:
    args = SimpleNamespace(max_tokens=16, tool_latency_s=12.0, tool_latency_dist="fixed", concurrency=concurrency)
    r = driver.Remaining(args)
    r.start([f"s1-p0-g{i}" for i in range(episodes)])
    return r


def seconds(work: dict) -> float:
    return predict(Work(**work), Deployment(Mode.COLOCATED, 1), PROFILE).seconds


def test_queued_episodes_are_reported_as_concurrency_loops_with_the_same_tool_time():
    w = remaining(4).work()
    # 16 episodes of 2 turns, 4 at a time: 4 loops of 8 turns; 16 tool calls of 12 s over their 28 gaps
    assert w["trajectories"] == 4 and w["turns_left"] == 8.0 and w["turns_left_max"] == 8.0
    assert w["tool_latency_s"] == pytest.approx(12.0 * 16 / 28) and w["tool_latency_max_s"] == w["tool_latency_s"]
    # 4 episodes after one another, each a 12 s tool call and two short turns
    assert 4 * 12.0 <= seconds(w) < 4 * 12.0 + 4.0
    # the first 4 answered their first turn and wait on their tool: still 4 x 12 s of tool time a loop
    r = remaining(4)
    for i in range(4):
        r.turn(f"s1-p0-g{i}", 16)
    w = r.work()
    assert w["trajectories"] == 4 and w["turns_left"] == 7.0
    assert 6 * w["tool_latency_s"] == pytest.approx(4 * 12.0) and 4 * 12.0 <= seconds(w) < 4 * 12.0 + 4.0
    for i in range(4):
        r.tool(f"s1-p0-g{i}", 12.0)  # their tools returned: one call fewer a loop
    assert 6 * r.work()["tool_latency_s"] == pytest.approx(3 * 12.0)
    all_at_once = remaining(16).work()
    assert all_at_once["trajectories"] == 16 and all_at_once["tool_latency_s"] == 12.0
    assert 12.0 <= seconds(all_at_once) < 14.0


@pytest.mark.parametrize("concurrency", [None, 16, 64])
def test_without_a_queue_the_episodes_are_the_loops(concurrency):
    w = remaining(concurrency).work()
    assert (w["trajectories"], w["turns_left"], w["turns_left_max"]) == (16, 2.0, 2.0)
    assert w["tool_latency_s"] == 12.0


def test_the_tail_has_fewer_episodes_than_loops_and_an_empty_batch_reports_none():
    r = remaining(4, episodes=6)
    for i in range(3):
        r.finish(f"s1-p0-g{i}")
    r.turn("s1-p0-g3", 16)  # one episode answered its first turn: its tool call is next
    w = r.work()
    assert w["trajectories"] == 3 and w["turns_left"] == pytest.approx(5 / 3) and w["tool_latency_s"] == 12.0
    for i in range(3, 6):
        r.finish(f"s1-p0-g{i}")
    w = r.work()
    assert w["trajectories"] == 0 and w["turns_left"] == 0.0 and Work(**w).empty


def test_the_steps_tool_calls_are_summed_per_loop_for_the_daemon():
    # a loop is a thread of the step's pool: its episodes' tool calls add up; the slowest loop is reported
    r = remaining(2, episodes=4)
    assert r.tools() is None  # no call returned yet

    both = threading.Barrier(2)  # the loops run side by side, as a pool's threads (an ended thread's id recurs)

    def loop(episodes: list[tuple[int, float]]) -> None:
        both.wait()
        for i, seconds in episodes:
            r.turn(f"s1-p0-g{i}", 16)
            r.tool(f"s1-p0-g{i}", seconds)
            r.finish(f"s1-p0-g{i}")  # an episode that finished still counts in its step's tools
        both.wait()

    threads = [threading.Thread(target=loop, args=(e,)) for e in ([(0, 11.0), (1, 14.5)], [(2, 12.0), (3, 10.0)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.tools() == {"slowest_s": 25.5}
    r.start(["s2-p0-g0"])  # the next step starts with none
    assert r.tools() is None
