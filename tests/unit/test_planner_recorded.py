"""The planner's and the policies' decisions on fixed snapshots equal the ones recorded before the planner was
made faster (tests/data/planner_recorded.json): a speed-up must not change a single move, target, predicted
second or reason. Snapshots: the 4,096-GPU benchmark snapshots (tests/benchmarks/bench_planner.py) and some
variants of them, and seeded random small clusters (several worker sizes, PD modes, trainer phases, lent
GPUs, elastic preemption notices).

Re-record only for an intended change of what the planner decides:

    .venv/bin/python tests/unit/test_planner_recorded.py --record
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pearlctl.planner import budget, diff, plan, view
from pearlctl.planner.choose import choose, worker_groups
from pearlctl.planner.diff import moves
from pearlctl.planner.model import SERVING, GpuSlot, Mode, Plan, Role, Snapshot, Trainer, Work
from pearlctl.planner.profile import DecodeModel, Profile, TransitionCosts

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "planner_recorded.json"
POLICIES = ("never", "greedy", "static", "elastic", "pearl")
NOW = 100_000.0
BENCH_PROFILE = Profile(
    name="bench",
    model="dense-8b",
    hardware="h100",
    decode=DecodeModel(weights_s=0.005, seq_s=2e-5, kv_s_per_token=4.4e-8),
    prefill_tok_s=20_000,
    kv_capacity_tokens=270_000,
    kv_bytes_per_token=147_456,
    kv_transfer_gb_s=25,
)


def big_snapshot(seed: int = 0, *, long_tail: bool = True) -> Snapshot:
    """tests/benchmarks/bench_planner.py's snapshot (a copy: the benchmark may change, the record must not)."""
    rng = random.Random(seed)
    gpus: list[GpuSlot] = []

    def node(pool: str, count: int, slot) -> None:
        for n in range(count):
            for _ in range(8):
                gpus.append(slot(len(gpus), f"{pool}{n:03d}"))

    node(
        "trainer",
        128,
        lambda i, nd: (
            GpuSlot(i, nd, "trainer", Role.ROLLOUT, borrowed=True, return_deadline=NOW + 600)
            if i % 4 == 0
            else GpuSlot(i, nd, "trainer", Role.TRAIN, parked=i % 2 == 1)
        ),
    )
    node(
        "rollout",
        256,
        lambda i, nd: (
            GpuSlot(i, nd, "rollout", Role.IDLE, parked=True)
            if rng.random() < 0.12
            else GpuSlot(i, nd, "rollout", Role.ROLLOUT)
        ),
    )
    node(
        "elastic",
        128,
        lambda i, nd: GpuSlot(
            i,
            nd,
            "elastic",
            Role.ROLLOUT if rng.random() < 0.5 else Role.IDLE,
            ends_at=NOW + rng.uniform(30, 7_200),
        ),
    )
    work = Work(
        trajectories=16_384 if long_tail else 131_072,
        tool_waiting=4_000 if long_tail else 32_000,
        turns_left=6,
        turns_left_max=14 if long_tail else 7,
        decode_tokens_per_turn=350,
        decode_tokens_per_turn_max=2_000 if long_tail else 500,
        prefill_tokens_per_turn=500,
        context_tokens=4_000,
        tool_latency_s=4,
        tool_latency_max_s=30 if long_tail else 6,
    )
    return Snapshot(
        now=NOW,
        gpus=tuple(gpus),
        work=work,
        trainer=Trainer(phase="waiting", wait_left_s=900, step_time_s=120),
        profile=BENCH_PROFILE,
        costs=BENCH_PROFILE.costs,
        preempt_per_hour=0.2,
        max_lend=768,
    )


def _disaggregate(s: Snapshot, share: float) -> Snapshot:
    """Every ``1/share``-th serving GPU prefills, the rest decode: a snapshot in disaggregated mode."""
    gpus, k = [], 0
    for g in s.gpus:
        if g.role is Role.ROLLOUT:
            k += 1
            g = replace(g, role=Role.PREFILL if k % round(1 / share) == 0 else Role.DECODE)
        gpus.append(g)
    return replace(s, gpus=tuple(gpus), mode=Mode.DISAGGREGATED)


def _unlend(g: GpuSlot) -> GpuSlot:
    return replace(g, role=Role.TRAIN, borrowed=False, return_deadline=None, parked=True) if g.borrowed else g


def random_snapshot(seed: int) -> Snapshot:
    rng = random.Random(seed)
    gpw = rng.choice((1, 1, 2, 4, 8))
    per_node = max(gpw, rng.choice((4, 8)))
    gpus: list[GpuSlot] = []
    disaggregated = rng.random() < 0.3
    serving_roles = (Role.PREFILL, Role.DECODE, Role.DECODE) if disaggregated else (Role.ROLLOUT,)
    phase = rng.choice(("waiting", "waiting", "waiting", "training", None))
    wait = rng.choice((0.0, 10.0, 60.0, 300.0, 2_000.0))
    for pool, nodes in (("trainer", rng.randint(0, 6)), ("rollout", rng.randint(0, 8)), ("elastic", rng.randint(0, 6))):
        for n in range(nodes):
            for _ in range(per_node):
                i, nd, r = len(gpus), f"{pool}{n:02d}", rng.random()
                if pool == "trainer":
                    if r < 0.25:
                        due = NOW + rng.choice((3.0, 8.0, 60.0, 600.0)) if rng.random() < 0.7 else None
                        g = GpuSlot(i, nd, pool, rng.choice(serving_roles), borrowed=True, return_deadline=due)
                    else:
                        g = GpuSlot(i, nd, pool, Role.TRAIN, parked=rng.random() < 0.5)
                elif r < 0.3:
                    ends = NOW + rng.uniform(5, 3_000) if pool == "elastic" and rng.random() < 0.8 else None
                    g = GpuSlot(i, nd, pool, Role.IDLE, parked=rng.random() < 0.5, ends_at=ends)
                else:
                    ends = NOW + rng.uniform(5, 3_000) if pool == "elastic" and rng.random() < 0.8 else None
                    g = GpuSlot(i, nd, pool, rng.choice(serving_roles), ends_at=ends)
                gpus.append(g)
    for _ in range(rng.randint(0, 3)):  # reward GPUs are not planned
        gpus.append(GpuSlot(len(gpus), "reward00", "reward", Role.REWARD))
    turns = rng.choice((1.0, 3.0, 8.0))
    work = (
        Work()
        if rng.random() < 0.15
        else Work(
            trajectories=rng.choice((4, 64, 512, 4_096)),
            tool_waiting=rng.randint(0, 4),
            turns_left=turns,
            turns_left_max=turns * rng.choice((1.0, 1.5, 3.0)),
            decode_tokens_per_turn=rng.choice((50.0, 300.0, 1_000.0)),
            decode_tokens_per_turn_max=rng.choice((0.0, 2_000.0)),
            prefill_tokens_per_turn=rng.choice((0.0, 400.0, 4_000.0)),
            context_tokens=rng.choice((500.0, 8_000.0, 60_000.0)),
            tool_latency_s=rng.choice((0.0, 1.0, 10.0)),
            tool_latency_max_s=rng.choice((0.0, 30.0)),
        )
    )
    profile = Profile(
        name="recorded",
        model="m",
        hardware="h",
        decode=DecodeModel(
            weights_s=rng.choice((0.005, 0.02)),
            seq_s=rng.choice((0.0, 2e-5)),
            kv_s_per_token=rng.choice((1e-9, 4e-8)),
            experts_s=0.001 if rng.random() < 0.2 else 0.0,
            moe_experts=128 if rng.random() < 0.2 else 0,
            moe_top_k=8,
        ),
        prefill_tok_s=rng.choice((5_000, 20_000)),
        kv_capacity_tokens=rng.choice((270_000, 2_000_000)),
        max_num_seqs=rng.choice((64, 256)),
        gpus_per_worker=gpw,
        kv_bytes_per_token=147_456,
        kv_transfer_gb_s=rng.choice((25.0, 400.0)),
        costs=TransitionCosts(),
        time_scale=rng.choice((1.0, 1.0, 1.3)),
    )
    return Snapshot(
        now=NOW,
        gpus=tuple(gpus),
        work=work,
        trainer=Trainer(phase=phase, wait_left_s=wait, step_time_s=60.0),
        profile=profile,
        costs=profile.costs,
        mode=Mode.DISAGGREGATED if disaggregated else Mode.COLOCATED,
        max_lend=rng.choice((None, 0, 4, 16)),
        preempt_per_hour=rng.choice((0.0, 0.5, 5.0)),
        last_change_at=rng.choice((None, NOW - 30.0, NOW - 600.0)),
        horizon_s=rng.choice((None, None, 30.0, 600.0)),
    )


@functools.cache
def snapshots() -> dict[str, Snapshot]:
    out: dict[str, Snapshot] = {}
    for long_tail in (True, False):
        name = "big-straggler" if long_tail else "big-throughput"
        s = big_snapshot(long_tail=long_tail)
        out[name] = s
        out[f"{name}-disaggregated"] = _disaggregate(s, 1 / 4)
        out[f"{name}-dwelling-disaggregated"] = replace(_disaggregate(s, 1 / 3), last_change_at=NOW - 10.0)
        out[f"{name}-no-cap-no-preemption"] = replace(s, max_lend=None, preempt_per_hour=0.0, horizon_s=120.0)
        unlent = replace(s, gpus=tuple(_unlend(g) for g in s.gpus))
        out[f"{name}-nothing-lent"] = unlent
        out[f"{name}-nothing-lent-disaggregated"] = _disaggregate(unlent, 1 / 6)
        out[f"{name}-training"] = replace(s, trainer=Trainer(phase="training", wait_left_s=0.0))
        out[f"{name}-short-wait"] = replace(s, trainer=Trainer(phase="waiting", wait_left_s=40.0))
    out["big-between-batches"] = replace(big_snapshot(), work=Work())
    out["big-tp2"] = replace(big_snapshot(long_tail=False), profile=replace(BENCH_PROFILE, gpus_per_worker=2))
    out["big-tp4-tail"] = replace(
        big_snapshot(long_tail=False),
        profile=replace(BENCH_PROFILE, gpus_per_worker=4),
        work=replace(big_snapshot(long_tail=False).work, trajectories=2_000, turns_left=1.5, turns_left_max=3),
    )
    for seed in range(60):
        out[f"random-{seed}"] = random_snapshot(seed)
    return out


def _number(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


def _lines(lines: list[str]) -> dict:
    """A long list as its length, its first lines and a digest of all (the record stays small)."""
    return {"n": len(lines), "head": lines[:8], "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}


def _plan(p: Plan | None) -> dict | None:
    if p is None:
        return None
    t = p.target
    return {
        "target": [t.mode.value, t.rollout_gpus, t.prefill_gpus, t.lend, t.elastic],
        "moves": _lines(
            [f"{m.kind.value} {m.gpu} {m.from_role.value}>{m.to_role.value} {m.cost_s!r}" for m in p.moves]
        ),
        "predicted_now_s": _number(p.predicted_now_s),
        "predicted_s": _number(p.predicted_s),
        "cost_s": _number(p.cost_s),
        "why": p.why,
    }


@functools.cache
def policy(name: str):
    """The shipped policy module ``pearlctl/policies/shipped/<name>.py`` (from its file, as pearlctl.policies
    loads it)."""
    path = REPO / "pearlctl" / "policies" / "shipped" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recorded_policy_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decisions(s: Snapshot) -> dict:
    """What the planner and every shipped policy decide for ``s``, as JSON-able data."""
    out: dict = {}
    choice = choose(s, view.may_serve(s, elastic=True, borrow=True))
    if choice is None:
        out["choose"] = None
    else:
        d = choice.deployment
        out["choose"] = {"deployment": [d.mode.value, d.decode, d.prefill], "seconds": _number(choice.seconds)}
        out["diff"] = _lines([f"{m.kind.value} {m.gpu} {m.to_role.value}" for m in moves(s, choice.target)])
        out["make"] = _plan(plan.make(s, choice.target, why="choose"))
    out["current"] = _plan(plan.make(s, plan.current_target(s), why="current"))
    for name in POLICIES:
        out[name] = _plan(policy(name).decide(s))
    return out


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", sorted(snapshots()))
def test_decisions_equal_the_recorded_ones(name, recorded):
    assert name in recorded, f"{name}: not recorded (re-record: {__doc__.strip().splitlines()[-1].strip()})"
    got = json.loads(json.dumps(decisions(snapshots()[name])))
    want = recorded[name]
    for key in want:
        assert got[key] == want[key], f"{name}: {key} differs from the record"
    assert got.keys() == want.keys()


def rules_lendable(s: Snapshot) -> list[GpuSlot]:
    """The trainer GPUs lendable now, GPU by GPU from ``budget``'s rules (the view computes them in one pass)."""
    if s.trainer.phase != "waiting" or s.trainer.batch_ready:
        return []
    limit = budget.trainer_deadline(s) - budget.RETURN_SLACK_S - budget.return_cost_s(s)
    out = [
        g
        for g in s.gpus
        if g.pool == "trainer" and g.role is Role.TRAIN and not g.borrowed and s.now + budget.bring_up_s(s, g) <= limit
    ]
    out.sort(key=lambda g: (not g.parked, g.node, g.id))
    if s.max_lend is not None:
        kept = sum(1 for g in s.gpus if budget.is_lent(g) and not budget.must_return(s, g))
        out = out[: max(0, s.max_lend - kept)]
    return out


def rules_servable(s: Snapshot) -> view.Servable:
    """The GPUs that may serve by pool, GPU by GPU from ``budget``'s rules."""
    rollout, elastic, lent = [], [], []
    for g in s.gpus:
        if g.pool in ("rollout", "elastic"):
            if g.role in SERVING or budget.may_start(s, g):
                (rollout if g.pool == "rollout" else elastic).append(g)
        elif budget.is_lent(g) and not budget.must_return(s, g):
            lent.append(g)
    if s.max_lend is not None:
        lent = lent[: s.max_lend]
    return view.Servable(tuple(rollout), tuple(elastic), tuple(lent), tuple(rules_lendable(s)))


@pytest.mark.parametrize("name", sorted(snapshots()))
def test_the_view_applies_the_pool_rules_gpu_by_gpu(name):
    s = snapshots()[name]
    v = view.View(s)
    assert v.servable == rules_servable(s)
    assert v.lendable == rules_lendable(s)
    assert v.forced == [g for g in s.gpus if g.pool in diff.POOLS and g.role in SERVING and budget.must_return(s, g)]
    for pool in ("rollout", "elastic"):
        assert v.startable(pool) == diff_startable(s, pool)
    for kw in ({"elastic": False, "borrow": False}, {"elastic": True, "borrow": True, "warm_borrow_only": True}):
        assert v.workers(**kw) == worker_groups(rules_servable(s).budget(**kw), s.profile.gpus_per_worker)


def diff_startable(s: Snapshot, pool: str) -> list[GpuSlot]:
    """diff's order of startable GPUs, as it was written before the view."""
    out = [g for g in s.gpus if g.pool == pool and budget.may_start(s, g)]
    out.sort(key=lambda g: (not g.parked, -(g.ends_at if g.ends_at is not None else math.inf), g.node, g.id))
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    record = {name: decisions(s) for name, s in snapshots().items()}
    FIXTURE.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
    print(f"{FIXTURE}: {len(record)} snapshots")
