"""Incremental plans (pearlctl.planner.diff): minimal, one move per GPU, pool limits and return deadlines.

The property tests check ``moves`` against the rules as the issue states them, written out here
independently of pearlctl.planner.budget, and check minimality by brute force over every assignment of
roles the rules allow (small snapshots: at most 6 GPUs).
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.planner.budget import RETURN_SLACK_S
from pearlctl.planner.diff import moves
from pearlctl.planner.model import (
    SERVING,
    GpuSlot,
    Mode,
    MoveKind,
    Role,
    Snapshot,
    Target,
    Work,
)
from pearlctl.planner.plan import current_target
from pearlctl.planner.profile import TransitionCosts
from tests import factories

NOW = 1_000.0
COSTS = TransitionCosts()  # start 60 s, wake 3, sleep 3, stop 5, offload 2, reload 2, role switch 5
PROFILE = factories.profile(
    "diff-test",
    decode={"weights_s": 0.005, "seq_s": 2e-5, "kv_s_per_token": 4e-8},
    prefill_tok_s=20_000,
    kv_capacity_tokens=200_000,
    costs=COSTS,
)
RETURN_S = COSTS.sleep_s + COSTS.reload_s  # a lent GPU parks its worker and the trainer reloads
WORK = Work(trajectories=64, turns_left=3, decode_tokens_per_turn=200, context_tokens=2_000, tool_latency_s=2)


def snapshot(gpus, *, phase="waiting", wait_left_s=1_000.0, max_lend=None) -> Snapshot:
    return factories.snapshot(gpus, WORK, PROFILE, now=NOW, phase=phase, wait_left_s=wait_left_s, max_lend=max_lend)


# -- the rules, as the issue states them ----------------------------------------------------------


def resting(g: GpuSlot) -> Role:
    return Role.TRAIN if g.pool == "trainer" else Role.IDLE


def deadline(s: Snapshot, g: GpuSlot) -> float:
    return g.return_deadline if g.return_deadline is not None else s.now + s.trainer.wait_left_s


def due_back(s: Snapshot, g: GpuSlot) -> bool:
    return g.borrowed and (s.trainer.phase == "training" or deadline(s, g) - s.now <= RETURN_S + RETURN_SLACK_S)


def may_borrow(s: Snapshot, g: GpuSlot) -> bool:
    borrow_s = COSTS.offload_s + (COSTS.wake_s if g.parked else COSTS.start_s)
    return (
        s.trainer.phase == "waiting"
        and g.pool == "trainer"
        and g.role is Role.TRAIN
        and not g.borrowed
        and s.now + borrow_s + RETURN_S + RETURN_SLACK_S <= s.now + s.trainer.wait_left_s
    )


def may_start(s: Snapshot, g: GpuSlot) -> bool:
    up = COSTS.wake_s if g.parked else COSTS.start_s
    return (
        g.pool != "trainer" and g.role is Role.IDLE and (g.ends_at is None or g.ends_at > s.now + up + RETURN_SLACK_S)
    )


def allowed_roles(s: Snapshot, g: GpuSlot) -> tuple[Role, ...]:
    """Where a GPU may end up after one plan."""
    if g.role in SERVING:
        return (resting(g),) if due_back(s, g) else (resting(g), *SERVING)
    if may_borrow(s, g) or may_start(s, g):
        return (g.role, *SERVING)
    return (g.role,)


def after(s: Snapshot, planned) -> dict[int, Role]:
    roles = {g.id: g.role for g in s.gpus}
    for m in planned:
        roles[m.gpu] = m.to_role
    return roles


def counts(s: Snapshot, roles: dict[int, Role]):
    pools = {
        p: sum(1 for g in s.gpus if g.pool == p and roles[g.id] in SERVING) for p in ("trainer", "rollout", "elastic")
    }
    by_role = {r: sum(1 for v in roles.values() if v is r) for r in SERVING}
    return pools, by_role


def fewest_changes(s: Snapshot, pools, by_role) -> int:
    """Brute force: the fewest GPUs that change role among all allowed assignments with these counts."""
    best = None
    for choice in itertools.product(*(allowed_roles(s, g) for g in s.gpus)):
        roles = {g.id: r for g, r in zip(s.gpus, choice, strict=True)}
        if counts(s, roles) != (pools, by_role):
            continue
        changed = sum(1 for g in s.gpus if roles[g.id] is not g.role)
        best = changed if best is None else min(best, changed)
    return best


# -- strategies ----------------------------------------------------------------------------------


@st.composite
def gpu_slots(draw, i: int) -> GpuSlot:
    pool = draw(st.sampled_from(["trainer", "rollout", "elastic"]))
    node = f"n{i // 2}"
    parked = draw(st.booleans())
    if pool == "trainer":
        lent = draw(st.booleans())
        role = draw(st.sampled_from(SERVING)) if lent else Role.TRAIN
        due = NOW + draw(st.sampled_from([1, 5, 8, 20, 500])) if lent and draw(st.booleans()) else None
        return GpuSlot(i, node, pool, role, parked=parked, borrowed=lent, return_deadline=due)
    role = draw(st.sampled_from([Role.IDLE, *SERVING]))
    ends = draw(st.sampled_from([None, None, NOW + 1, NOW + 30, NOW + 100, NOW + 5_000]))
    return GpuSlot(i, node, pool, role, parked=parked and role is Role.IDLE, ends_at=ends)


@st.composite
def snapshots(draw) -> Snapshot:
    n = draw(st.integers(1, 6))
    gpus = [draw(gpu_slots(i)) for i in range(n)]
    return snapshot(
        gpus,
        phase=draw(st.sampled_from(["waiting", "waiting", "training", None])),
        wait_left_s=draw(st.sampled_from([0.0, 5.0, 11.0, 12.0, 30.0, 69.0, 1_000.0])),
        max_lend=draw(st.sampled_from([None, 0, 1, 2])),
    )


@st.composite
def targets(draw) -> Target:
    lend, elastic, rollout = (draw(st.integers(0, 4)) for _ in range(3))
    total = lend + elastic + rollout
    mode = draw(st.sampled_from(list(Mode)))
    prefill = draw(st.integers(0, total)) if mode is Mode.DISAGGREGATED else 0
    return Target(mode=mode, rollout_gpus=total, prefill_gpus=prefill, lend=lend, elastic=elastic)


# -- properties ----------------------------------------------------------------------------------


@settings(max_examples=250, deadline=None)
@given(s=snapshots(), target=targets())
def test_a_plan_is_never_larger_than_needed(s, target):
    planned = moves(s, target)
    pools, by_role = counts(s, after(s, planned))
    assert len(planned) == fewest_changes(s, pools, by_role)


@settings(max_examples=250, deadline=None)
@given(s=snapshots(), target=targets())
def test_a_plan_reaches_the_target_as_far_as_the_pool_rules_allow(s, target):
    pools, by_role = counts(s, after(s, moves(s, target)))
    lent_kept = sum(1 for g in s.gpus if g.pool == "trainer" and g.role in SERVING and not due_back(s, g))
    lend_cap = s.max_lend if s.max_lend is not None else 10**9
    assert pools["trainer"] == min(target.lend, lend_cap, lent_kept + sum(may_borrow(s, g) for g in s.gpus))
    for pool, want in (("elastic", target.elastic), ("rollout", target.rollout_gpus - target.lend - target.elastic)):
        have = sum(1 for g in s.gpus if g.pool == pool and (g.role in SERVING or may_start(s, g)))
        assert pools[pool] == min(want, have)
    final = sum(pools.values())
    if target.mode is Mode.COLOCATED:
        assert by_role[Role.ROLLOUT] == final
    elif final == target.rollout_gpus:
        assert by_role[Role.PREFILL] == target.prefill_gpus


@settings(max_examples=250, deadline=None)
@given(s=snapshots(), target=targets())
def test_a_plan_moves_each_gpu_once_and_prices_each_move(s, target):
    planned = moves(s, target)
    assert len({m.gpu for m in planned}) == len(planned)
    by_id = {g.id: g for g in s.gpus}
    for m in planned:
        g = by_id[m.gpu]
        assert m.from_role is g.role and m.to_role is not g.role
        expected = {
            MoveKind.RETURN: RETURN_S,
            MoveKind.BORROW: COSTS.offload_s + (COSTS.wake_s if g.parked else COSTS.start_s),
            MoveKind.WAKE: COSTS.wake_s,
            MoveKind.START: COSTS.start_s,
            MoveKind.SWITCH: COSTS.role_switch_s,
            MoveKind.RETIRE: COSTS.stop_s if g.pool == "elastic" else COSTS.sleep_s,
        }[m.kind]
        assert m.cost_s == expected


@settings(max_examples=250, deadline=None)
@given(s=snapshots(), target=targets())
def test_a_plan_respects_lending_limits_and_return_deadlines(s, target):
    planned = moves(s, target)
    by_id = {g.id: g for g in s.gpus}
    kinds = {m.gpu: m.kind for m in planned}
    for m in planned:
        if m.kind is MoveKind.BORROW:
            assert may_borrow(s, by_id[m.gpu])  # trainer waiting, back before its deadline
    for g in s.gpus:
        if g.role in SERVING and due_back(s, g):
            assert kinds.get(g.id) is MoveKind.RETURN
    roles = after(s, planned)
    lent_after = sum(1 for g in s.gpus if g.pool == "trainer" and roles[g.id] in SERVING)
    if s.max_lend is not None:
        assert lent_after <= s.max_lend


@settings(max_examples=250, deadline=None)
@given(s=snapshots(), target=targets())
def test_a_plan_prefers_a_wake_over_a_cold_start(s, target):
    planned = moves(s, target)
    moved = {m.gpu for m in planned}
    by_id = {g.id: g for g in s.gpus}
    for m in planned:
        g = by_id[m.gpu]
        cold = m.kind is MoveKind.START or (m.kind is MoveKind.BORROW and not g.parked)
        if cold:
            left_asleep = [
                h
                for h in s.gpus
                if h.pool == g.pool and h.parked and h.id not in moved and (may_start(s, h) or may_borrow(s, h))
            ]
            assert not left_asleep


def test_keeping_the_current_assignment_moves_nothing():
    gpus = [
        GpuSlot(0, "a", "rollout", Role.PREFILL),
        GpuSlot(1, "a", "rollout", Role.DECODE),
        GpuSlot(2, "b", "elastic", Role.DECODE, ends_at=NOW + 900),
        GpuSlot(3, "c", "trainer", Role.DECODE, borrowed=True, return_deadline=NOW + 500),
        GpuSlot(4, "c", "trainer", Role.TRAIN),
        GpuSlot(5, "d", "rollout", Role.IDLE, parked=True),
    ]
    s = snapshot(gpus)
    assert moves(s, current_target(s)) == ()


def test_shrinking_retires_the_soonest_preempted_elastic_gpus_first():
    gpus = [
        GpuSlot(i, f"e{i}", "elastic", Role.ROLLOUT, ends_at=NOW + end) for i, end in enumerate([900, 40, 5_000, 60])
    ]
    gpus.append(GpuSlot(9, "r", "rollout", Role.ROLLOUT))
    s = snapshot(gpus)
    planned = moves(s, Target(Mode.COLOCATED, rollout_gpus=3, elastic=2))
    assert {m.gpu for m in planned} == {1, 3}  # ends in 40 s and 60 s
    assert all(m.kind is MoveKind.RETIRE for m in planned)


def test_lent_gpus_due_back_return_even_if_the_target_keeps_them():
    gpus = [
        GpuSlot(0, "t", "trainer", Role.ROLLOUT, borrowed=True, return_deadline=NOW + 4),
        GpuSlot(1, "t", "trainer", Role.ROLLOUT, borrowed=True, return_deadline=NOW + 400),
    ]
    s = snapshot(gpus, wait_left_s=400)
    planned = moves(s, current_target(s))
    assert [(m.gpu, m.kind) for m in planned] == [(0, MoveKind.RETURN)]


def test_a_trainer_that_is_training_gets_every_lent_gpu_back_and_lends_none():
    gpus = [
        GpuSlot(0, "t", "trainer", Role.ROLLOUT, borrowed=True, return_deadline=NOW + 400),
        GpuSlot(1, "t", "trainer", Role.TRAIN, parked=True),
    ]
    s = snapshot(gpus, phase="training")
    planned = moves(s, Target(Mode.COLOCATED, rollout_gpus=2, lend=2))
    assert [(m.gpu, m.kind) for m in planned] == [(0, MoveKind.RETURN)]
