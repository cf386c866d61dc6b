"""The shipped policies' contracts (pearlctl/policies/shipped/static.py, elastic.py, pearl.py), loaded by name
as the daemon and the simulator load them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pearlctl.planner import budget
from pearlctl.planner.model import (
    SERVING,
    GpuSlot,
    Mode,
    MoveKind,
    Plan,
    Role,
    Snapshot,
    Work,
)
from pearlctl.planner.plan import current_deployment
from pearlctl.planner.predict import completion_s
from pearlctl.planner.profile import TransitionCosts
from pearlctl.policies import load_policy
from tests import factories

NOW = 10_000.0
COSTS = TransitionCosts()  # start 60 s, wake 3, sleep 3, stop 5, offload 2, reload 2, role switch 5
# Decode dominated by reading the weights; KV on a fast (NVLink-class) link: a profile on which
# disaggregation pays for some work and not for other.
PROFILE = factories.profile(
    "policy-test",
    decode={"weights_s": 0.01, "seq_s": 2e-5, "kv_s_per_token": 1e-9},
    prefill_tok_s=20_000,
    kv_capacity_tokens=2_000_000,
    kv_bytes_per_token=147_456,
    kv_transfer_gb_s=400,
    costs=COSTS,
)
BIG = Work(
    trajectories=2_048,
    tool_waiting=400,
    turns_left=10,
    turns_left_max=11,
    decode_tokens_per_turn=300,
    decode_tokens_per_turn_max=350,
    prefill_tokens_per_turn=400,
    context_tokens=2_000,
    tool_latency_s=3,
    tool_latency_max_s=5,
)
TINY = Work(trajectories=2, turns_left=1, turns_left_max=1, decode_tokens_per_turn=50, context_tokens=500)


def cluster(
    *,
    rollout=4,
    rollout_idle=0,
    trainer=4,
    trainer_parked=True,
    elastic_idle=0,
    lent=0,
    lent_due_in=1_000.0,
    elastic_ends_in=None,
) -> list[GpuSlot]:
    gpus: list[GpuSlot] = []

    def add(**kw):
        gpus.append(GpuSlot(id=len(gpus), node=f"{kw['pool']}-{len(gpus) // 4}", **kw))

    for _ in range(rollout):
        add(pool="rollout", role=Role.ROLLOUT)
    for _ in range(rollout_idle):
        add(pool="rollout", role=Role.IDLE, parked=True)
    for _ in range(trainer):
        add(pool="trainer", role=Role.TRAIN, parked=trainer_parked)
    for _ in range(lent):
        add(pool="trainer", role=Role.ROLLOUT, borrowed=True, return_deadline=NOW + lent_due_in)
    for _ in range(elastic_idle):
        ends = NOW + elastic_ends_in if elastic_ends_in is not None else None
        add(pool="elastic", role=Role.IDLE, ends_at=ends)
    return gpus


def snapshot(gpus, work=BIG, *, wait_left_s=2_000.0, phase="waiting", **kw) -> Snapshot:
    return factories.snapshot(gpus, work, PROFILE, now=kw.pop("now", NOW), phase=phase, wait_left_s=wait_left_s, **kw)


def kinds(plan: Plan | None) -> set[MoveKind]:
    return {m.kind for m in plan.moves} if plan else set()


def pools_moved_in(s: Snapshot, plan: Plan | None) -> set[str]:
    pool = {g.id: g.pool for g in s.gpus}
    return {pool[m.gpu] for m in plan.moves if m.to_role in SERVING} if plan else set()


def apply(s: Snapshot, plan: Plan) -> Snapshot:
    """The snapshot after the plan's moves are done (what the executor would report)."""
    to = {m.gpu: m for m in plan.moves}
    gpus = []
    for g in s.gpus:
        m = to.get(g.id)
        if m is None:
            gpus.append(g)
        elif m.kind is MoveKind.BORROW:
            gpus.append(replace(g, role=m.to_role, borrowed=True, return_deadline=s.now + s.trainer.wait_left_s))
        elif m.kind is MoveKind.RETURN:
            gpus.append(replace(g, role=Role.TRAIN, borrowed=False, return_deadline=None, parked=True))
        else:
            gpus.append(replace(g, role=m.to_role, parked=m.to_role is Role.IDLE))
    return replace(s, gpus=tuple(gpus), mode=plan.target.mode, last_change_at=s.now)


@pytest.fixture(scope="module")
def static():
    return load_policy("static")


@pytest.fixture(scope="module")
def elastic():
    return load_policy("elastic")


@pytest.fixture(scope="module")
def pearl():
    return load_policy("pearl")


# -- static ---------------------------------------------------------------------------------------


def test_static_starts_idle_rollout_gpus_but_never_borrows_or_uses_elastic(static):
    s = snapshot(cluster(rollout=4, rollout_idle=2, trainer=4, elastic_idle=4))
    plan = static.decide(s)
    assert kinds(plan) == {MoveKind.WAKE}
    assert pools_moved_in(s, plan) == {"rollout"}
    assert plan.target.mode is Mode.COLOCATED and plan.target.lend == 0 and plan.target.elastic == 0


def test_static_gives_back_lent_gpus_and_keeps_nothing_else_moving(static):
    s = snapshot(cluster(rollout=4, trainer=2, lent=2))
    plan = static.decide(s)
    assert kinds(plan) == {MoveKind.RETURN} and len(plan.moves) == 2
    assert static.decide(apply(s, plan)) is None  # the fixed assignment is stable


# -- elastic --------------------------------------------------------------------------------------


def test_elastic_uses_every_granted_elastic_gpu_and_never_borrows(elastic):
    s = snapshot(cluster(rollout=4, trainer=4, elastic_idle=4))
    plan = elastic.decide(s)
    assert kinds(plan) == {MoveKind.START}
    assert pools_moved_in(s, plan) == {"elastic"} and len(plan.moves) == 4
    assert plan.target.mode is Mode.COLOCATED and plan.target.lend == 0


def test_elastic_skips_an_elastic_gpu_preempted_before_a_worker_could_start(elastic):
    s = snapshot(cluster(rollout=4, trainer=0, elastic_idle=2, elastic_ends_in=30.0))  # a cold start takes 60 s
    assert elastic.decide(s) is None


# -- pearl: borrowing -----------------------------------------------------------------------------


def test_pearl_borrows_when_it_pays(pearl):
    s = snapshot(cluster(rollout=4, trainer=4))
    plan = pearl.decide(s)
    assert MoveKind.BORROW in kinds(plan)
    assert plan.predicted_s < plan.predicted_now_s


def test_pearl_declines_a_borrow_when_the_wait_is_shorter_than_borrow_and_return(pearl):
    # warm borrow 5 s + return 5 s + slack 2 s > 10 s of wait left
    assert MoveKind.BORROW not in kinds(pearl.decide(snapshot(cluster(rollout=4, trainer=4), wait_left_s=10.0)))


def test_pearl_declines_a_borrow_for_tiny_remaining_work(pearl):
    assert pearl.decide(snapshot(cluster(rollout=4, trainer=4), TINY)) is None


def test_pearl_declines_a_cold_borrow_when_the_work_ends_before_the_workers_start(pearl):
    short = replace(BIG, turns_left=2, turns_left_max=2)
    s = snapshot(cluster(rollout=4, trainer=4, trainer_parked=False), short)
    assert completion_s(short, current_deployment(s), PROFILE) < s.costs.borrow_s(warm=False)
    assert MoveKind.BORROW not in kinds(pearl.decide(s))
    # the same GPUs with a parked worker (a 5 s borrow) do pay
    assert MoveKind.BORROW in kinds(pearl.decide(snapshot(cluster(rollout=4, trainer=4, trainer_parked=True), short)))


def test_pearl_borrows_only_when_the_borrow_itself_pays_not_on_the_gain_of_elastic_gpus_brought_up_with_it(pearl):
    """A larger budget's plan (+ borrow) is chosen only when it nets more than a plan's margin over the smaller
    budget's (+ elastic), that margin taken of the smaller plan's batch. Here the 24 idle elastic GPUs shorten the
    batch by about 16 s, and 8 cold trainer GPUs on top, joining after their start, by a fraction of a second
    more: only the elastic GPUs come up. Without the elastic GPUs the same borrow pays and is made."""
    s = snapshot(cluster(rollout=8, trainer=8, trainer_parked=False, elastic_idle=24))
    plan = pearl.decide(s)
    assert plan is not None and plan.target.elastic == 24 and "elastic" in pools_moved_in(s, plan)
    assert MoveKind.BORROW not in kinds(plan) and plan.target.lend == 0
    alone = snapshot(cluster(rollout=8, trainer=8, trainer_parked=False))
    assert MoveKind.BORROW in kinds(pearl.decide(alone))


def test_pearl_returns_lent_gpus_before_their_deadline_even_without_gain(pearl):
    s = snapshot(cluster(rollout=4, trainer=0, lent=2, lent_due_in=4.0), wait_left_s=4.0)
    plan = pearl.decide(s)
    assert plan is not None and kinds(plan) == {MoveKind.RETURN} and len(plan.moves) == 2


def test_pearl_returns_every_lent_gpu_once_the_batch_is_done(pearl):
    # the trainer's wait (30 s) is too short for the GPUs to serve another batch before they are due back
    s = snapshot(cluster(rollout=4, trainer=0, lent=2), Work(), wait_left_s=30.0)
    assert not any(budget.must_return(s, g) for g in s.gpus)  # not due yet: pearl's own choice
    plan = pearl.decide(s)
    assert plan is not None and kinds(plan) == {MoveKind.RETURN} and len(plan.moves) == 2


def test_pearl_lends_ahead_of_the_next_batch_while_the_trainer_waits_long(pearl):
    # Between batches (the weight sync, the launch) the trainer already waits for the next batch: parked
    # trainer GPUs are lent when they would serve at least as long as they spend moving; cold ones are not.
    moving = COSTS.borrow_s(warm=True) + COSTS.weight_sync_s + budget.return_cost_s(snapshot([])) + 2.0
    long_wait = snapshot(cluster(rollout=4, trainer=4), Work(), wait_left_s=2 * moving + 1)
    plan = pearl.decide(long_wait)
    assert plan is not None and kinds(plan) == {MoveKind.BORROW} and len(plan.moves) == 4
    assert plan.target.lend == 4
    short_wait = snapshot(cluster(rollout=4, trainer=4), Work(), wait_left_s=2 * moving - 1)
    assert MoveKind.BORROW not in kinds(pearl.decide(short_wait))
    cold = snapshot(cluster(rollout=4, trainer=4, trainer_parked=False), Work(), wait_left_s=2_000.0)
    assert MoveKind.BORROW not in kinds(pearl.decide(cold))
    training = snapshot(cluster(rollout=4, trainer=4), Work(), wait_left_s=2_000.0, phase="training")
    assert MoveKind.BORROW not in kinds(pearl.decide(training))


def test_pearl_lends_ahead_only_when_a_batch_like_the_last_one_would_be_shortened_by_more_than_it_costs(pearl):
    # Between batches ``work`` is empty; the latest batch as it began (``last_batch``) prices the lending: many
    # trajectories that the GPUs' throughput bounds gain from 4 more GPUs; a few long ones bound by their own
    # sequential time gain nothing, and the lent workers joining a warm borrow after the weight sync would only
    # hold the launch
    gpus = cluster(rollout=4, trainer=4)
    throughput = pearl.decide(snapshot(gpus, Work(), wait_left_s=2_000.0, last_batch=BIG))
    assert throughput is not None and kinds(throughput) == {MoveKind.BORROW} and throughput.target.lend == 4
    stragglers = pearl.decide(snapshot(gpus, Work(), wait_left_s=2_000.0, last_batch=TAIL))
    assert MoveKind.BORROW not in kinds(stragglers)


# A batch's tail: three long trajectories, bound by their own sequential time, not by the GPUs serving them.
TAIL = Work(
    trajectories=3,
    turns_left=4,
    turns_left_max=4,
    decode_tokens_per_turn=2_000,
    decode_tokens_per_turn_max=2_000,
    prefill_tokens_per_turn=100,
    context_tokens=2_000,
    tool_latency_s=3,
    tool_latency_max_s=5,
)


def test_pearl_returns_lent_gpus_once_they_no_longer_shorten_the_batch(pearl):
    s = snapshot(cluster(rollout=4, trainer=0, lent=4), TAIL)
    assert completion_s(TAIL, current_deployment(s), PROFILE) > 60  # far from its end: no deadline forces it
    plan = pearl.decide(s)
    assert plan is not None and kinds(plan) == {MoveKind.RETURN} and len(plan.moves) == 4
    # with much work left the same lent GPUs shorten the batch: they stay
    busy = pearl.decide(snapshot(cluster(rollout=4, trainer=0, lent=4), BIG))
    assert MoveKind.RETURN not in kinds(busy)
    # and so do lent GPUs whose sequences' contexts would cost more to re-prefill elsewhere than a return
    long = replace(TAIL, context_tokens=400_000, prefill_tokens_per_turn=0)
    assert MoveKind.RETURN not in kinds(pearl.decide(snapshot(cluster(rollout=4, trainer=0, lent=4), long)))


def test_pearl_respects_max_lend(pearl):
    plan = pearl.decide(snapshot(cluster(rollout=4, trainer=4), max_lend=1))
    assert sum(1 for m in plan.moves if m.kind is MoveKind.BORROW) == 1


# -- pearl: elastic risk --------------------------------------------------------------------------


def test_pearl_uses_elastic_gpus_unless_preemption_risk_outweighs_the_gain(pearl):
    gpus = cluster(rollout=4, trainer=0, elastic_idle=4)
    calm = pearl.decide(snapshot(gpus, preempt_per_hour=0.0))
    assert "elastic" in pools_moved_in(snapshot(gpus), calm)
    stormy = pearl.decide(snapshot(gpus, preempt_per_hour=600.0))  # every 6 s: a worker never pays its start
    assert stormy is None


def test_pearl_brings_up_idle_elastic_capacity_even_when_this_batch_gains_nothing_from_it(pearl):
    # a straggler-bound tail: more GPUs do not shorten this batch, but a start put off to between batches would
    # hold the next launch (the driver's join wait), and elastic capacity owes the trainer nothing
    s = snapshot(cluster(rollout=4, trainer=0, elastic_idle=4), TAIL)
    plan = pearl.decide(s)
    assert plan is not None and kinds(plan) == {MoveKind.START} and pools_moved_in(s, plan) == {"elastic"}
    assert plan.target.elastic == 4
    # elastic GPUs preempted faster than they start are not brought up for nothing
    assert pearl.decide(snapshot(cluster(rollout=4, trainer=0, elastic_idle=4), TAIL, preempt_per_hour=600.0)) is None


# -- pearl: hysteresis ----------------------------------------------------------------------------

# Short turns with heavy prefill: disaggregated wins. Long contexts, many trajectories: colocated wins
# (the few prefill workers cannot cache every context).
FAVOURS_PD = Work(
    trajectories=128,
    turns_left=200,
    turns_left_max=200,
    decode_tokens_per_turn=20,
    decode_tokens_per_turn_max=20,
    prefill_tokens_per_turn=200,
    context_tokens=500,
)
FAVOURS_COLOCATED = Work(
    trajectories=1_024,
    turns_left=20,
    turns_left_max=20,
    decode_tokens_per_turn=200,
    decode_tokens_per_turn_max=200,
    prefill_tokens_per_turn=20,
    context_tokens=20_000,
)


def test_pearl_switches_pd_mode_when_the_work_calls_for_it(pearl):
    colocated = snapshot(cluster(rollout=16, trainer=0), FAVOURS_PD)
    to_pd = pearl.decide(colocated)
    assert to_pd is not None and to_pd.target.mode is Mode.DISAGGREGATED
    back = replace(apply(colocated, to_pd), work=FAVOURS_COLOCATED, last_change_at=None)
    to_colocated = pearl.decide(back)
    assert to_colocated is not None and to_colocated.target.mode is Mode.COLOCATED


def test_pearl_hysteresis_prevents_flapping_on_alternating_snapshots(pearl):
    s = snapshot(cluster(rollout=16, trainer=0), FAVOURS_PD)
    modes = [Mode.COLOCATED]
    for tick in range(10):  # a decision every 10 s, the work alternating between the two kinds
        s = replace(s, now=NOW + 10 * tick, work=FAVOURS_PD if tick % 2 == 0 else FAVOURS_COLOCATED)
        plan = pearl.decide(s)
        if plan is not None:
            s = apply(s, plan)
        modes.append(s.mode)
    flips = sum(1 for a, b in zip(modes, modes[1:], strict=False) if a is not b)
    assert flips == 1  # to disaggregated on the first snapshot, then held through the dwell
