"""The simulator's engine model must not flatter: decode sublinear in batch (far less for MoE), a straggler
floor at batch-1 speed, KV eviction paid in recompute, prefill stealing decode time when colocated, no work
from a GPU in transition, migration as the live system does it (a graceful leave continues every generated
token and re-prefills the context; a hard kill loses the turn), and the run's router (sessions hashed to
workers)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pearlctl.planner.model import Move, MoveKind, Role
from pearlctl.planner.profile import load as load_profile
from pearlctl.sim import scenario as sc
from pearlctl.sim.engine import W_OFF, W_ROLLOUT, Engine
from pearlctl.sim.migration import ABORT_S
from pearlctl.sim.routing import ROUTERS
from pearlctl.sim.run import Sim
from pearlctl.sim.trajectories import DECODE, DONE, PREFILL, TOOL, WAIT, Draws
from pearlctl.vocabulary import JOIN_BALANCE_ABS

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


def test_a_batchs_slowest_tools_are_the_calls_its_trajectories_made():
    # 3 trajectories of 3, 2 and 1 turns: 2, 1 and 0 tool calls (none follows a trajectory's last turn)
    d = draws(3, turns=3, response=10.0)
    d.turns[:] = [3, 2, 1]
    d.tool_latency[:] = np.array([[1.0, 4.0, 50.0, 50.0], [6.0, 50.0, 50.0, 50.0], [50.0] * 4], np.float32)
    e = Engine(DENSE, d, 1, 10**5)
    e.launch(0, 3, 0.0)
    e.set_roles(np.array([W_ROLLOUT]))
    assert e.slowest_tools(0, 3) is None  # no call returned yet
    run_to_the_end(e, 0.0, 3)
    assert e.slowest_tools(0, 3) == pytest.approx(6.0)  # 1 + 4 against 6


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
    sim.moves.apply(Move(trainer_gpu, MoveKind.BORROW, Role.TRAIN, Role.ROLLOUT, 0.0), 0.0)
    cost = s.profile.costs.offload_s + s.profile.costs.start_s  # nothing parked: a cold start
    assert sim.gpus[trainer_gpu].busy_until == pytest.approx(cost)
    sim.roles.refresh(0.0)
    assert sim.engine.w_role[trainer_gpu] == W_OFF  # moving: not serving
    sim.roles.refresh(cost - 0.5)
    assert sim.engine.w_role[trainer_gpu] == W_OFF
    sim.roles.refresh(cost)
    assert sim.engine.w_role[trainer_gpu] == W_ROLLOUT
    assert sim.roles.counts["ROLLOUT"] == s.cluster.rollout_gpus + 1


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


def decoding_on_worker_0(router: str, free_migration: bool = False) -> tuple[Engine, float]:
    """Four 1-turn sequences (100-token prompts, 1,000-token responses) decoding on worker 0 of two, a few
    hundred tokens into their turn; worker 1 is not serving yet. Returns the engine and the time."""
    e = Engine(DENSE, draws(4, prompt=100.0, response=1000.0), 2, 10**6, free_migration, router=router)
    e.launch(0, 4, 0.0)
    e.set_roles(np.array([W_ROLLOUT, W_OFF]), 0.0)
    t = 0.0
    while e.stats["decode_tokens"] < 4 * 300:
        e.step(t, 0.5)
        t += 0.5
        assert t < 60
    assert (e.phase[:4] == DECODE).all() and (e.run_w[:4] == 0).all()
    return e, t


def run_to_the_end(e: Engine, t: float, n: int = 4) -> float:
    while not e.all_done(0, n):
        e.step(t, 0.5)
        t += 0.5
        assert t < 3600
    return t


@pytest.mark.parametrize("router", ROUTERS)
def test_a_graceful_leave_continues_every_generated_token_and_re_prefills_the_context(router):
    e, t = decoding_on_worker_0(router)
    ctx, left, decoded = e.ctx[:4].copy(), e.dec_left[:4].copy(), e.stats["decode_tokens"]
    prefilled = e.stats["prefill_tokens"]
    assert np.allclose(ctx, 100.0 + (1000.0 - left))  # prompt + what each generated so far
    e.set_roles(np.array([W_OFF, W_ROLLOUT]), t)  # worker 0 leaves (a return, a retire...), worker 1 serves
    assert (e.phase[:4] == WAIT).all() and np.allclose(e.ctx[:4], ctx) and np.allclose(e.dec_left[:4], left)
    assert e.stats["aborted"] == 4 and e.stats["killed"] == 0 and e.stats["lost_tokens"] == 0
    e.step(t, 0.5)  # the abort's answers and the continuations are on their way: nothing is admitted yet
    assert (e.phase[:4] == WAIT).all()
    run_to_the_end(e, t + 0.5)
    # nothing was generated twice; the new worker re-prefilled each whole context (prompt + generated)
    assert e.stats["decode_tokens"] == pytest.approx(4 * 1000.0)
    assert e.stats["decode_tokens"] - decoded == pytest.approx(left.sum())
    assert e.stats["recompute_tokens"] == pytest.approx(ctx.sum())
    assert e.stats["leave_recompute_tokens"] == pytest.approx(ctx.sum())
    assert e.stats["prefill_tokens"] - prefilled == pytest.approx(ctx.sum())
    assert (e.done_at[:4] >= t + ABORT_S).all()


@pytest.mark.parametrize("router", ROUTERS)
def test_a_hard_kill_retries_the_running_turn_from_its_start(router):
    e, t = decoding_on_worker_0(router)
    generated = 1000.0 - e.dec_left[:4]
    e.set_roles(np.array([W_OFF, W_ROLLOUT]), t, killed=np.array([True, False]))  # preempted, no notice
    assert np.allclose(e.ctx[:4], 100.0) and np.allclose(e.dec_left[:4], 1000.0)  # back to the turn's start
    assert e.stats["killed"] == 4 and e.stats["aborted"] == 0
    assert e.stats["lost_tokens"] == pytest.approx(generated.sum())
    run_to_the_end(e, t)
    # the lost tokens were generated again; what was re-prefilled is the context the turn began with
    assert e.stats["decode_tokens"] == pytest.approx(4 * 1000.0 + generated.sum())
    assert e.stats["recompute_tokens"] == pytest.approx(4 * 100.0)


def test_the_oracles_free_migration_loses_nothing_on_a_leave():
    e, t = decoding_on_worker_0("consistent_hash", free_migration=True)
    e.set_roles(np.array([W_OFF, W_ROLLOUT]), t)
    run_to_the_end(e, t)
    assert e.stats["recompute_tokens"] == 0 and e.stats["decode_tokens"] == pytest.approx(4 * 1000.0)


def test_a_draining_worker_finishes_what_it_runs_but_is_sent_nothing_new():
    e = Engine(DENSE, draws(8, prompt=100.0, response=2000.0), 2, 10**6)
    e.launch(0, 4, 0.0)
    both = np.array([W_ROLLOUT, W_ROLLOUT])
    e.set_roles(both, 0.0, routable=np.array([True, False]))
    for i in range(10):
        e.step(i * 0.5, 0.5)
    assert (e.run_w[:4] == 0).all()
    e.set_roles(both, 5.0, routable=np.array([False, True]))  # worker 0's preemption notice: it drains
    e.launch(4, 8, 5.0)
    before = e.dec_left[:4].copy()
    for i in range(10, 20):
        e.step(i * 0.5, 0.5)
    assert (e.run_w[:4] == 0).all() and (e.dec_left[:4] < before).all()  # still decoding where they were
    assert (e.run_w[4:8] == 1).all()  # new requests went to the routable worker only
    assert e.stats["requeued"] == 0


def test_the_router_hashes_sessions_and_a_joining_worker_takes_only_the_sessions_that_now_hash_to_it():
    n = 600
    e = Engine(DENSE, draws(n, turns=2, prompt=100.0, response=200.0, latency=30.0), 4, 10**6)
    e.launch(0, n, 0.0)
    e.set_roles(np.array([W_ROLLOUT, W_ROLLOUT, W_ROLLOUT, W_OFF]), 0.0)
    t = 0.0
    while not (e.phase[:n] == TOOL).all():
        e.step(t, 0.5)
        t += 0.5
        assert t < 30
    first = e.kv_w[:n].copy()
    share = np.bincount(first, minlength=4) / n
    assert share[3] == 0 and (np.abs(share[:3] - 1 / 3) < 0.1).all()  # spread by hash, not by load
    e.set_roles(np.full(4, W_ROLLOUT), t)  # worker 3 joins while the sessions wait on their tools
    second = np.full(n, -1)
    while (second < 0).any():
        e.step(t, 0.5)
        t += 0.5
        second = np.where(second < 0, np.where(e.phase[:n] == DECODE, e.run_w[:n], -1), second)
        assert t < 120
    moved = second != first
    assert (second[moved] == 3).all()  # a session moves only to the worker that joined
    assert 0.1 < moved.mean() < 0.4  # about a quarter of them
    # the moved sessions re-prefilled their context (prompt + first response + tool output) there
    assert e.stats["recompute_tokens"] == pytest.approx(moved.sum() * 300.0)


def queued_on_worker_0(n: int, slots: int) -> tuple[Engine, float]:
    """``n`` one-turn sessions on worker 0 of two, which runs at most ``slots`` of them (the rest wait in its
    queue), a few hundred tokens into their turn; worker 1 is not serving yet."""
    profile = replace(DENSE, max_num_seqs=slots)
    e = Engine(profile, draws(n, prompt=100.0, response=1000.0), 2, 10**6)
    e.launch(0, n, 0.0)
    e.set_roles(np.array([W_ROLLOUT, W_OFF]), 0.0)
    t = 0.0
    while e.stats["decode_tokens"] < slots * 300:
        e.step(t, 0.5)
        t += 0.5
        assert t < 60
    return e, t


def first_workers(e: Engine, t: float, n: int) -> tuple[np.ndarray, float]:
    """Step the engine from ``t`` until each of the first ``n`` sessions was admitted somewhere: the worker each was
    first admitted to (prefill or decode), and the time then."""
    first = np.full(n, -1)
    while (first < 0).any():
        e.step(t, 0.5)
        t += 0.5
        first = np.where(first < 0, np.where(e.phase[:n] >= PREFILL, e.run_w[:n], -1), first)
        assert t < 600
    return first, t


def test_a_join_rebalances_a_queue_the_moved_sessions_re_prefill_and_nothing_is_decoded_twice():
    n, slots = 40, 8
    e, t = queued_on_worker_0(n, slots)
    waiting = np.flatnonzero(e.phase[:n] == WAIT)
    decoding = np.flatnonzero(e.phase[:n] == DECODE)
    assert waiting.size == n - slots and decoding.size == slots
    ctx = e.ctx[:n].copy()
    e.set_roles(np.array([W_ROLLOUT, W_ROLLOUT]), t)  # worker 1 joins while worker 0 has a queue
    owner = e.router.ring_owner(e, np.arange(n), np.array([True, True]))
    assert 0.25 < (owner == 1).mean() < 0.75
    # worker 0 aborted what it decoded: all of it waits again, for the abort's answers and the re-sends
    assert (e.phase[:n] == WAIT).all() and e.stats["rebalanced"] == slots
    assert e.stats["moved"] == np.count_nonzero(owner[decoding] == 1)
    first, t = first_workers(e, t, n)
    assert (first == owner).all()  # every session, queued or decoding, went where the new ring sends it
    run_to_the_end(e, t, n)
    # nothing was generated twice; only the moved decodes re-prefilled their context (prompt + generated)
    assert e.stats["decode_tokens"] == pytest.approx(n * 1000.0)
    moved = decoding[owner[decoding] == 1]
    assert e.stats["recompute_tokens"] == pytest.approx(ctx[moved].sum())


def test_a_join_leaves_workers_without_a_queue_alone_unless_they_are_imbalanced_against_the_joined_one():
    """The gateway's rule (pearlctl.vocabulary.imbalanced): a worker with no queue is rebalanced only when it runs
    more than JOIN_BALANCE_ABS sequences above the idlest routable worker (a joined one: none)."""
    for n, rebalanced in ((JOIN_BALANCE_ABS, False), (JOIN_BALANCE_ABS + 1, True)):
        e, t = queued_on_worker_0(n, n)  # worker 0 runs every session: no queue
        run_w = e.run_w[:n].copy()
        e.set_roles(np.array([W_ROLLOUT, W_ROLLOUT]), t)
        if not rebalanced:
            assert e.stats["rebalanced"] == 0 and (e.phase[:n] == DECODE).all() and (e.run_w[:n] == run_w).all()
            continue
        owner = e.router.ring_owner(e, np.arange(n), np.array([True, True]))
        assert e.stats["rebalanced"] == n and e.stats["moved"] == np.count_nonzero(owner == 1) > 0
        first, t = first_workers(e, t, n)
        assert (first == owner).all()  # the sessions that hash to the joined worker went there
        run_to_the_end(e, t, n)
        assert e.stats["decode_tokens"] == pytest.approx(n * 1000.0)  # nothing generated twice


def test_an_unknown_router_model_is_refused():
    with pytest.raises(ValueError, match="no router model 'x'; known: consistent_hash, balance"):
        Engine(DENSE, draws(1), 1, 10**6, router="x")
