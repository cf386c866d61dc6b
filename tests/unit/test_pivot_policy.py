"""Policy `pivot` (pearlctl/policies/shipped/pivot.py): pearl's plan first, then one shift of a rollout GPU to the
judge when verdicts back up and it pays, and back when the judges keep up or nothing is left to judge.

Snapshots are built by hand (the planner's own types); the prediction is the planner's. Each rule is checked
beside the case it must not fire in, so a rule that ignored its condition fails here."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.planner.model import GpuSlot, Judging, MoveKind, Role, Work
from pearlctl.planner.profile import TransitionCosts
from pearlctl.policies import load_policy
from tests import factories

NOW = 10_000.0
# a switch stops one engine and starts another: dearer than a borrow's offload and start, as this CPU measures
COSTS = TransitionCosts(start_s=15.0, stop_s=3.0, offload_s=1.0, role_switch_s=5.0)
SHIFT_S = COSTS.stop_s + COSTS.start_s  # a switch between the policy and the judge: a stop and a cold start
PROFILE = factories.profile(
    "pivot-test",
    decode={"weights_s": 0.005, "seq_s": 2e-5, "kv_s_per_token": 4e-8},
    prefill_tok_s=20_000,
    kv_capacity_tokens=200_000,
    costs=COSTS,
)
pivot = load_policy("pivot")
pearl = load_policy("pearl")
# the tail of a batch: a few stragglers left, each a turn or two
TAIL = Work(trajectories=4, turns_left=1, decode_tokens_per_turn=100, context_tokens=1_000, tool_latency_s=0.5)
# a batch in full swing: rollout is what bounds it
BUSY = Work(trajectories=256, turns_left=4, decode_tokens_per_turn=400, context_tokens=4_000, tool_latency_s=1)


def gpus(rollout: int = 4, judging: int = 0, reward: int = 1, trainer: int = 0, lent: int = 0) -> list[GpuSlot]:
    """Rollout GPUs serving the policy, rollout GPUs shifted to the judge, the reward pool's judges, idle trainer
    GPUs, and trainer GPUs lent to the judge (due back at NOW + 300 s)."""
    out = [GpuSlot(id=i, node=f"r{i}", pool="rollout", role=Role.ROLLOUT) for i in range(rollout)]
    out += [GpuSlot(id=30 + i, node="t0", pool="trainer", role=Role.TRAIN) for i in range(trainer)]
    out += [
        GpuSlot(id=40 + i, node="t0", pool="trainer", role=Role.REWARD, borrowed=True, return_deadline=NOW + 300)
        for i in range(lent)
    ]
    out += [GpuSlot(id=10 + i, node=f"j{i}", pool="rollout", role=Role.REWARD) for i in range(judging)]
    out += [GpuSlot(id=20 + i, node=f"w{i}", pool="reward", role=Role.REWARD) for i in range(reward)]
    return out


def snapshot(slots, work: Work, judging: Judging, last_change_at: float | None = None, wait_left_s: float = 0.0):
    return factories.snapshot(
        slots,
        work,
        PROFILE,
        now=NOW,
        phase="waiting",
        wait_left_s=wait_left_s,
        judging=judging,
        last_change_at=last_change_at,
    )


def test_verdicts_backing_up_in_the_batchs_tail_shift_a_rollout_gpu_to_the_judge() -> None:
    """200 trajectories wait for one judge at 2 verdicts/s (100 s) while rollout has seconds left: a second judge
    halves it, its 5-s switch included; the shift is one SWITCH of a rollout GPU to REWARD."""
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=2.0, busy=True)
    planned = pivot.decide(snapshot(gpus(), TAIL, backed_up))
    assert planned is not None and pearl.decide(snapshot(gpus(), TAIL, backed_up)) is None
    (move,) = planned.moves
    assert (move.kind, move.from_role, move.to_role) == (MoveKind.SWITCH, Role.ROLLOUT, Role.REWARD)
    assert move.gpu in range(4) and move.cost_s == SHIFT_S
    assert "verdicts back up" in planned.why


@pytest.mark.parametrize(
    ("why", "work", "judging"),
    [
        (
            "the judge keeps up: nothing waits",
            TAIL,
            Judging(waiting=0, judging=4, done=50, verdicts_per_s=2.0, busy=False),
        ),
        ("no measured rate", TAIL, Judging(waiting=200, judging=4, done=0, verdicts_per_s=0.0, busy=True)),
        # the batch's first verdicts: a rate over a window in which the queue ran dry is not the judges' capacity
        ("a rate not at capacity", TAIL, Judging(waiting=200, judging=4, done=1, verdicts_per_s=0.2, busy=False)),
        ("rollout bounds the batch", BUSY, Judging(waiting=3, judging=1, done=10, verdicts_per_s=50.0, busy=True)),
        (
            "a backlog the shift cannot beat",
            TAIL,
            Judging(waiting=2, judging=1, done=10, verdicts_per_s=2.0, busy=True),
        ),
    ],
)
def test_no_shift_to_the_judge_where_it_does_not_pay(why, work, judging) -> None:
    assert pivot.decide(snapshot(gpus(), work, judging)) == pearl.decide(snapshot(gpus(), work, judging)), why


def test_rollout_keeps_a_gpu_and_a_just_moved_gpu_pays_for_its_move_first() -> None:
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=2.0, busy=True)
    assert pivot.decide(snapshot(gpus(rollout=1), TAIL, backed_up)) is None
    assert pivot.decide(snapshot(gpus(), TAIL, backed_up, last_change_at=NOW - 2 * SHIFT_S + 1)) is None
    assert pivot.decide(snapshot(gpus(), TAIL, backed_up, last_change_at=NOW - 2 * SHIFT_S)) is not None


def test_a_shifted_judge_goes_back_when_nothing_is_left_to_judge_and_the_last_judge_never() -> None:
    """The shifted judge goes back before the reward pool's own (the policy's engine is parked on neither: the
    reward pool's is its judge's home); the last judge stays, or no verdict of the next batch would be given."""
    done = Judging(waiting=0, judging=0, done=300, verdicts_per_s=0.0, busy=False)
    planned = pivot.decide(snapshot(gpus(judging=1), Work(), done))
    (move,) = planned.moves
    assert (move.gpu, move.from_role, move.to_role) == (10, Role.REWARD, Role.ROLLOUT)
    assert pivot.decide(snapshot(gpus(judging=0), Work(), done)) == pearl.decide(snapshot(gpus(), Work(), done))
    assert pivot.decide(snapshot(gpus(judging=1, reward=0), Work(), done)) is None
    # whatever their ids: the reward pool's judge (5 here) stays while a shifted one (10) may go
    slots = [replace(g, id=5) if g.pool == "reward" else g for g in gpus(judging=1)]
    assert [m.gpu for m in pivot.decide(snapshot(slots, Work(), done)).moves] == [10]
    # before any batch (a run's launch) the reward pool keeps the judges it was given; after one, one may leave
    assert pivot.decide(snapshot(gpus(reward=2), Work(), done)) is None
    seen = replace(snapshot(gpus(rollout=2, reward=2), Work(), done), last_batch=BUSY)
    assert [(m.gpu, m.to_role) for m in pivot.decide(seen).moves] == [(20, Role.ROLLOUT)]


def test_the_reward_pools_judges_serve_rollout_when_the_judges_left_keep_up_and_come_back_first() -> None:
    """A reward pool's GPU is planned as a generation GPU whose worker starts as the judge: with two of them judging
    and one keeping up, one serves the policy (a SWITCH to ROLLOUT: its judge parks, the policy starts); pearl then
    counts it as rollout capacity, and when verdicts back up it is the first to judge again (its judge wakes)."""
    keeping_up = Judging(waiting=0, judging=1, done=400, verdicts_per_s=10.0, busy=False)
    planned = pivot.decide(snapshot(gpus(rollout=2, reward=2), BUSY, keeping_up))
    assert planned is not None and [(m.gpu, m.from_role, m.to_role) for m in planned.moves] == [
        (20, Role.REWARD, Role.ROLLOUT)
    ]
    assert planned.moves[0].cost_s == COSTS.sleep_s + COSTS.start_s  # its judge sleeps, the policy starts cold
    assert pivot.decide(snapshot(gpus(rollout=2, reward=1), BUSY, keeping_up)) is None  # the last judge stays
    serving = [replace(g, role=Role.ROLLOUT, parked_judge=True) if g.id == 20 else g for g in gpus(rollout=2, reward=2)]
    view = pivot.generation_view(snapshot(serving, BUSY, keeping_up))
    assert {g.pool for g in view.gpus} == {"rollout"}  # pearl's rollout capacity: three GPUs serve the policy
    assert pivot.decide(snapshot(serving, BUSY, keeping_up)) == pearl.decide(view)
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=2.0, busy=True)
    planned = pivot.decide(snapshot(serving, TAIL, backed_up))
    assert planned is not None and planned.moves[0].gpu == 20 and planned.moves[0].to_role == Role.REWARD
    assert planned.moves[0].cost_s == COSTS.sleep_s + COSTS.wake_s  # the policy sleeps, its judge wakes


def test_between_batches_a_shifted_judge_goes_back_only_when_the_next_batch_gains_more_than_its_move_costs() -> None:
    """Nothing to judge or roll out: a next batch like the last one (``Snapshot.last_batch``) decides. A big batch on
    two rollout GPUs ends sooner with a third by more than its 18-s switch: the judge goes back; a batch of a few
    stragglers gains less than that, and the rollout driver would hold the batch while the worker joins: it stays."""
    done = Judging(waiting=0, judging=0, done=300)
    big = replace(snapshot(gpus(rollout=2, judging=1), Work(), done), last_batch=BUSY)
    planned = pivot.decide(big)
    assert planned is not None and [(m.gpu, m.to_role) for m in planned.moves] == [(10, Role.ROLLOUT)]
    small = replace(big, last_batch=TAIL)
    assert pivot.decide(small) == pearl.decide(small)


def test_a_shifted_judge_goes_back_when_the_judges_left_keep_up_and_rollout_gains() -> None:
    """Rollout is busy again and two judges give 10 verdicts/s with nothing waiting and one verdict in flight: one of
    them keeps up with the demand within the rollout's time, so the shifted one serves rollout again; with a demand
    one judge cannot judge in that time it stays, and so it does while every judge has a verdict in flight."""
    keeping_up = Judging(waiting=0, judging=1, done=400, verdicts_per_s=10.0, busy=False)
    planned = pivot.decide(snapshot(gpus(rollout=2, judging=1), BUSY, keeping_up))
    assert planned is not None and [(m.gpu, m.to_role) for m in planned.moves] == [(10, Role.ROLLOUT)]
    slow = Judging(waiting=0, judging=1, done=400, verdicts_per_s=0.2, busy=False)
    assert pivot.decide(snapshot(gpus(rollout=2, judging=1), BUSY, slow)) is None
    all_busy = replace(keeping_up, judging=2)  # both judges (the reward pool's and the shifted one) have work
    assert pivot.decide(snapshot(gpus(rollout=2, judging=1), BUSY, all_busy)) is None
    # a batch's start: no verdict given in the last window, but the judges were seen to give 5 a second each
    starting = Judging(waiting=0, judging=0, done=400, verdicts_per_s=0.0, capacity_per_judge_s=5.0)
    planned = pivot.decide(snapshot(gpus(rollout=2, judging=1), BUSY, starting))
    assert planned is not None and [(m.gpu, m.to_role) for m in planned.moves] == [(10, Role.ROLLOUT)]
    unmeasured = replace(starting, capacity_per_judge_s=0.0)
    assert pivot.decide(snapshot(gpus(rollout=2, judging=1), BUSY, unmeasured)) is None


def test_idle_trainer_gpus_are_lent_to_the_judge_before_a_rollout_gpu_shifts() -> None:
    """The trainer waits (its GPUs idle for 300 s): lending them to the judge costs rollout nothing, so verdicts
    backing up borrow trainer GPUs for the judge (BORROWs to REWARD, one loan) rather than shift a rollout GPU — as
    many as end the batch soonest, and no more than ``max_lend``; with the trainer's wait too short for a borrow and
    its return, a rollout GPU shifts instead."""
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=2.0, busy=True)
    planned = pivot.decide(snapshot(gpus(trainer=2), TAIL, backed_up, wait_left_s=300.0))
    assert [(m.gpu, m.kind, m.from_role, m.to_role) for m in planned.moves] == [
        (g, MoveKind.BORROW, Role.TRAIN, Role.REWARD) for g in (30, 31)
    ]
    assert "2 trainer GPUs lent to the judge" in planned.why
    capped = replace(snapshot(gpus(trainer=2), TAIL, backed_up, wait_left_s=300.0), max_lend=1)
    assert [m.gpu for m in pivot.decide(capped).moves] == [30]
    # fewer verdicts owed (22.5 s at one judge): one loan ends them in 19.2 s, each more by less than a move must gain
    few = Judging(waiting=40, judging=1, done=50, verdicts_per_s=2.0, busy=True)
    assert [m.gpu for m in pivot.decide(snapshot(gpus(trainer=3), TAIL, few, wait_left_s=300.0)).moves] == [30]
    short = pivot.decide(snapshot(gpus(trainer=2), TAIL, backed_up, wait_left_s=20.0))
    assert [(m.kind, m.to_role) for m in short.moves] == [(MoveKind.SWITCH, Role.REWARD)]


def test_a_loan_wakes_a_judge_parked_on_a_trainer_gpu_and_is_priced_as_a_wake() -> None:
    """After a loan's return parked the judge asleep on a trainer GPU, the next loan takes that GPU and is priced as a
    warm borrow (offload and wake), not a cold start: a loan then pays for a backlog a cold one would not."""
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=2.0, busy=True)
    slots = gpus(trainer=2)
    slots = [replace(g, parked_judge=True) if g.id == 31 else g for g in slots]
    one = replace(snapshot(slots, TAIL, backed_up, wait_left_s=300.0), max_lend=1)
    (move,) = pivot.decide(one).moves
    assert (move.gpu, move.kind, move.cost_s) == (31, MoveKind.BORROW, COSTS.borrow_s(warm=True))


def test_the_judges_own_engine_costs_price_its_moves() -> None:
    """The judge is another model: its starts, wakes, sleeps and stops are its engine's (``Snapshot.judge_costs``),
    the offload the trainer's. A shift to it costs the policy's sleep (its engine parks on the GPU) and the judge's
    start, or its wake where a judge sleeps parked there; a shift back the judge's sleep and the policy's start or
    wake; a loan the offload and the judge's start (or wake, where one sleeps parked)."""
    judge = replace(COSTS, start_s=25.0, stop_s=7.0, wake_s=9.0, sleep_s=2.5)
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=2.0, busy=True)
    (there,) = pivot.decide(replace(snapshot(gpus(), TAIL, backed_up), judge_costs=judge)).moves
    assert (there.kind, there.to_role, there.cost_s) == (MoveKind.SWITCH, Role.REWARD, COSTS.sleep_s + judge.start_s)
    assert there.gpu != 3
    warm = [replace(g, parked_judge=True) if g.id == 3 else g for g in gpus()]  # a judge sleeps parked on GPU 3
    (there,) = pivot.decide(replace(snapshot(warm, TAIL, backed_up), judge_costs=judge)).moves
    assert (there.gpu, there.to_role, there.cost_s) == (3, Role.REWARD, COSTS.sleep_s + judge.wake_s)  # it goes first
    done = Judging(waiting=0, judging=0, done=300)
    (back,) = pivot.decide(replace(snapshot(gpus(judging=1), Work(), done), judge_costs=judge)).moves
    assert (back.to_role, back.cost_s) == (Role.ROLLOUT, judge.sleep_s + COSTS.start_s)
    parked = [replace(g, parked=True) if g.id == 11 else g for g in gpus(judging=2)]  # the policy sleeps on GPU 11
    assert pivot.decide(replace(snapshot(gpus(judging=2), Work(), done), judge_costs=judge)).moves[0].gpu != 11
    (back,) = pivot.decide(replace(snapshot(parked, Work(), done), judge_costs=judge)).moves
    assert (back.gpu, back.to_role, back.cost_s) == (11, Role.ROLLOUT, judge.sleep_s + COSTS.wake_s)
    slots = [replace(g, parked_judge=True) if g.id == 31 else g for g in gpus(trainer=2)]
    for parked, cost in ((slots, COSTS.offload_s + judge.wake_s), (gpus(trainer=2), COSTS.offload_s + judge.start_s)):
        lent = replace(snapshot(parked, TAIL, backed_up, wait_left_s=300.0), judge_costs=judge, max_lend=1)
        (loan,) = pivot.decide(lent).moves
        assert (loan.kind, loan.to_role, loan.cost_s) == (MoveKind.BORROW, Role.REWARD, cost)


def test_a_trainer_gpu_lent_to_the_judge_goes_back_when_due_or_when_no_verdict_is_owed_and_pearl_never_takes_it():
    backed_up = Judging(waiting=200, judging=4, done=50, verdicts_per_s=3.0, busy=True)
    held = snapshot(gpus(trainer=1, lent=1), TAIL, backed_up, wait_left_s=300.0)
    assert pivot.decide(held) is None  # still needed, not due: kept (pearl does not count it as its own to return)
    judging = Judging(waiting=0, judging=2, done=250, verdicts_per_s=3.0, busy=False)
    assert pivot.decide(snapshot(gpus(trainer=1, lent=1), TAIL, judging, wait_left_s=300.0)) is None  # in flight
    drained = Judging(waiting=0, judging=0, done=252, verdicts_per_s=3.0, busy=False)
    (back,) = pivot.decide(snapshot(gpus(trainer=1, lent=1), TAIL, drained, wait_left_s=300.0)).moves
    assert (back.gpu, back.kind, back.to_role) == (40, MoveKind.RETURN, Role.TRAIN)
    training = replace(held, trainer=replace(held.trainer, phase="training"))
    (due,) = pivot.decide(training).moves
    assert (due.gpu, due.kind) == (40, MoveKind.RETURN)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(0, 3),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 1),
    st.floats(0, 1_000),
    st.builds(
        Judging,
        waiting=st.integers(0, 5_000),
        judging=st.integers(0, 64),
        done=st.integers(0, 10_000),
        verdicts_per_s=st.floats(0, 100, allow_nan=False),
        busy=st.booleans(),
    ),
    st.sampled_from([Work(), TAIL, BUSY]),
)
def test_any_plan_pivot_makes_is_pearls_or_legal_moves_of_the_judge(
    rollout, judging, reward, trainer, lent, wait, queue, work
) -> None:
    """Whatever the snapshot: pivot's plan is pearl's on the policy's GPUs, or moves of the judge — SWITCHes between
    ROLLOUT and REWARD of rollout-pool GPUs (never the reward pool's, never the last rollout GPU, at most as many to
    the judge as judge now), idle trainer GPUs lent to the judge (only while nothing is lent and the trainer waits
    long enough), or the lent judges returned — priced finite, and to the judge only on a rate measured busy."""
    s = snapshot(gpus(rollout, judging, reward, trainer, lent), work, queue, wait_left_s=wait)
    planned = pivot.decide(s)
    judges = {g.id for g in s.gpus if g.role == Role.REWARD}
    if planned is None:
        return
    if not any(m.gpu in judges or m.to_role == Role.REWARD for m in planned.moves):
        assert planned == pearl.decide(replace(s, gpus=tuple(g for g in s.gpus if g.id not in judges)))
        return
    assert math.isfinite(planned.predicted_s)
    moved = {m.gpu: next(g for g in s.gpus if g.id == m.gpu) for m in planned.moves}
    if all(m.kind == MoveKind.RETURN for m in planned.moves):
        assert {g.id for g in moved.values()} == {g.id for g in s.gpus if g.borrowed and g.role == Role.REWARD}
        return
    if all(m.kind == MoveKind.BORROW for m in planned.moves):  # one loan of idle trainer GPUs to the judge
        assert all(m.to_role == Role.REWARD and moved[m.gpu].pool == "trainer" for m in planned.moves)
        assert all(moved[m.gpu].role == Role.TRAIN and wait >= m.cost_s for m in planned.moves) and lent == 0
        assert len(planned.moves) <= trainer and queue.backlog > 0 and queue.busy
        return
    if len(planned.moves) > 1:  # rollout GPUs shifted to the judge at once: at most as many as judge, one left
        assert all(m.kind == MoveKind.SWITCH and m.to_role == Role.REWARD for m in planned.moves)
        assert all(moved[m.gpu].pool == "rollout" and moved[m.gpu].role == Role.ROLLOUT for m in planned.moves)
        assert len(planned.moves) <= min(rollout - 1, len(judges)) and queue.backlog > 0 and queue.busy
        return
    (move,) = planned.moves
    g = moved[move.gpu]
    assert move.kind == MoveKind.SWITCH and {move.from_role, move.to_role} == {Role.ROLLOUT, Role.REWARD}
    assert g.pool == "rollout" and g.role == move.from_role
    if move.to_role == Role.REWARD:
        assert rollout >= 2 and queue.backlog > 0 and queue.busy
