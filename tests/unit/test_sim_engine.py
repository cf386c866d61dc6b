"""The simulator's engine model must not flatter: decode sublinear in batch (far less for MoE), a straggler
floor at batch-1 speed, KV eviction paid in recompute, prefill stealing decode time when colocated, and no
work from a GPU in transition."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pearlctl.planner.model import Move, MoveKind, Role
from pearlctl.planner.profile import load as load_profile
from pearlctl.sim import scenario as sc
from pearlctl.sim.engine import DECODE, DONE, TOOL, W_OFF, W_ROLLOUT, Draws, Engine
from pearlctl.sim.run import Sim

REPO = Path(__file__).resolve().parents[2]
DENSE = load_profile(REPO / "examples/profiles/qwen3-8b-h100.toml")
MOE = load_profile(REPO / "examples/profiles/qwen3-30b-a3b-h200.toml")


def draws(n: int, *, turns=1, prompt=100.0, response=1000.0, tool_out=0.0, latency=1.0) -> Draws:
    t = max(turns, 1) + 1
    return Draws(
        turns=np.full(n, turns, np.int32),
        prompt=np.full(n, prompt),
        response=np.full((n, t), response, np.float32),
        tool_output=np.full((n, t), tool_out, np.float32),
        tool_latency=np.full((n, t), latency, np.float32),
    )


def decode_rate(profile, batch: int, seconds: float = 2.0) -> float:
    """Aggregate decode tokens/s of one worker holding ``batch`` sequences (prefill excluded)."""
    e = Engine(profile, draws(batch, response=5000.0), 1, 10**5)
    e.launch(0, batch, 0.0)
    e.set_roles(np.array([W_ROLLOUT]))
    t = 0.0
    while not (e.phase[:batch] == DECODE).all():
        e.step(t, 0.1)
        t += 0.1
        assert t < 60, "sequences never reached decode"
    before = e.stats["decode_tokens"]
    for _ in range(int(seconds / 0.1)):
        e.step(t, 0.1)
        t += 0.1
    return (e.stats["decode_tokens"] - before) / seconds


def test_decode_grows_sublinearly_with_batch():
    one, many = decode_rate(DENSE, 1), decode_rate(DENSE, 64)
    assert one < many < 64 * one
    assert many < 0.9 * 64 * one


def test_moe_decode_grows_much_less_than_dense():
    dense_gain = decode_rate(DENSE, 32) / decode_rate(DENSE, 1)
    moe_gain = decode_rate(MOE, 32) / decode_rate(MOE, 1)
    assert moe_gain < 0.6 * dense_gain


def test_a_straggler_cannot_beat_batch_one_decode():
    tokens = 3000.0
    floor = tokens * DENSE.decode.itl(1, 100.0 + tokens / 2) * 0.98  # context grows from 100 to 3100
    for workers in (1, 8):
        e = Engine(DENSE, draws(1, response=tokens), workers, 10**6)
        e.launch(0, 1, 0.0)
        e.set_roles(np.full(workers, W_ROLLOUT))
        t = 0.0
        while e.phase[0] != DONE:
            e.step(t, 0.25)
            t += 0.25
            assert t < 600
        assert e.done_at[0] >= floor


def test_kv_eviction_costs_recompute():
    # 40 trajectories of 2 turns, 4k-token contexts, a long tool wait: they cannot all keep their KV on a
    # worker holding 60k tokens, so returning sequences re-prefill their whole context.
    d = draws(40, turns=2, prompt=4000.0, response=200.0, tool_out=100.0, latency=20.0)

    def run(capacity: int) -> Engine:
        e = Engine(replace(DENSE, kv_capacity_tokens=capacity), d, 1, 10**6)
        e.launch(0, 40, 0.0)
        e.set_roles(np.array([W_ROLLOUT]))
        t = 0.0
        while not e.all_done(0, 40):
            e.step(t, 0.25)
            t += 0.25
            assert t < 3600
        e.finished_at = t
        return e

    small, large = run(60_000), run(10**6)
    assert large.stats["recompute_tokens"] == 0 and large.stats["evictions"] == 0
    assert small.stats["evictions"] > 0
    assert small.stats["recompute_tokens"] >= 4000 * small.stats["evictions"] * 0.9
    assert small.stats["prefill_tokens"] > large.stats["prefill_tokens"]
    assert small.finished_at > large.finished_at


def test_colocated_prefill_takes_time_from_decode():
    # One worker decoding 8 sequences; 40 long prompts arrive: while it prefills them, decode slows.
    def decoded(with_prefill: bool) -> float:
        n = 48 if with_prefill else 8
        d = draws(n, prompt=100.0, response=5000.0)
        d.prompt[8:] = 20000.0
        e = Engine(DENSE, d, 1, 10**5)
        e.launch(0, 8, 0.0)
        e.set_roles(np.array([W_ROLLOUT]))
        for i in range(4):
            e.step(i * 0.25, 0.25)
        if with_prefill:
            e.launch(8, n, 1.0)
        before = e.stats["decode_tokens"]
        for i in range(4, 12):
            e.step(i * 0.25, 0.25)
        return e.stats["decode_tokens"] - before

    assert decoded(True) < 0.7 * decoded(False)


def test_an_engine_without_serving_workers_does_no_work():
    e = Engine(DENSE, draws(4), 2, 10**6)
    e.launch(0, 4, 0.0)
    e.set_roles(np.array([W_OFF, W_OFF]))
    for i in range(20):
        e.step(i * 0.5, 0.5)
    assert e.stats["decode_tokens"] == 0 and e.stats["prefill_tokens"] == 0


def test_a_gpu_in_transition_does_no_work():
    s = sc.load(REPO / "examples/scenarios/short-steps-8b.toml").with_overrides(steps=1)
    sim = Sim(s, "test", lambda snap: None)
    sim._availability(0.0)
    sim._trainer(0.0)
    trainer_gpu = 0
    sim._apply(Move(trainer_gpu, MoveKind.BORROW, Role.TRAIN, Role.ROLLOUT, 0.0), 0.0)
    cost = s.profile.costs.offload_s + s.profile.costs.start_s  # nothing parked: a cold start
    assert sim.gpus[trainer_gpu].busy_until == pytest.approx(cost)
    sim._refresh(0.0)
    assert sim.engine.w_role[trainer_gpu] == W_OFF  # moving: not serving
    sim._refresh(cost - 0.5)
    assert sim.engine.w_role[trainer_gpu] == W_OFF
    sim._refresh(cost)
    assert sim.engine.w_role[trainer_gpu] == W_ROLLOUT
    assert sim._counts["ROLLOUT"] == s.cluster.rollout_gpus + 1


def test_a_worker_that_leaves_requeues_its_sequences_with_their_context():
    e = Engine(DENSE, draws(4, turns=2, latency=1000.0), 1, 10**6)
    e.launch(0, 4, 0.0)
    e.set_roles(np.array([W_ROLLOUT]))
    t = 0.0
    while not (e.phase[:4] == TOOL).all():
        e.step(t, 0.5)
        t += 0.5
        assert t < 600
    assert (e.kv_w[:4] == 0).all()
    e.set_roles(np.array([W_OFF]))  # preempted, returned or retired: its KV is gone
    assert (e.kv_w[:4] == -1).all() and np.allclose(e.ctx[:4], 1100)
