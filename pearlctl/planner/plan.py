"""Plans (docs/planner.md): a target turned into moves (``diff``) and priced — the batch's predicted completion
without the plan and with it, the moving time included.

Completion over time. The GPUs serving change during a batch: moved GPUs stop serving when their move starts
and serve in their new role once it is done (``Move.cost_s`` later); lent GPUs leave when their return must
start (deadline − return cost − slack) and GPUs of an ending allocation leave at ``ends_at``. ``timeline_s``
runs the batch through these segments: in each, the deployment formed by the serving GPUs does the fraction
``segment / completion_s(deployment)`` of the remaining batch. Departures are rounded down to 1/16 of the
batch's time so a snapshot with many distinct preemption notices costs a bounded number of predictions.

This treats the rest of the batch as a scaled copy of the whole (the tail and straggler scale with it): a
plan's relative merit is right, its absolute seconds are an estimate.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable

from pearlctl.planner import budget
from pearlctl.planner.diff import POOLS, moves
from pearlctl.planner.model import SERVING, Deployment, Mode, Move, MoveKind, Plan, Role, Snapshot, Target
from pearlctl.planner.predict import completion_s

_PLANNED_POOLS = frozenset(POOLS)
_SERVING = frozenset(SERVING)
_DEPARTURE_GRID = 16  # departures rounded down to 1/16 of the batch's time


def make(snapshot: Snapshot, target: Target, why: str = "", *, predicted_now_s: float | None = None) -> Plan:
    """The plan from the current assignment to ``target`` (clipped to what the pool rules allow).
    ``predicted_now_s``: the completion without a plan, when the caller already has it (a policy pricing
    several targets against one snapshot)."""
    planned = moves(snapshot, target)
    if predicted_now_s is None:
        predicted_now_s = timeline_s(snapshot, ())
    return Plan(
        target=target,
        moves=planned,
        predicted_now_s=predicted_now_s,
        predicted_s=timeline_s(snapshot, planned) if planned else predicted_now_s,
        cost_s=sum(m.cost_s for m in planned),
        why=why,
    )


def current_deployment(snapshot: Snapshot) -> Deployment:
    """The deployment the serving GPUs form now (whole tensor-parallel workers only)."""
    serving = [(g.node, g.pool, g.role) for g in snapshot.gpus if g.pool in _PLANNED_POOLS and g.role in _SERVING]
    return _Fleet(snapshot.profile.gpus_per_worker, serving).deployment()


def current_target(snapshot: Snapshot) -> Target:
    """The current assignment as a target: ``make(snapshot, current_target(snapshot))`` moves only what must
    move anyway (lent GPUs due back)."""
    serving = [g for g in snapshot.gpus if g.pool in POOLS and g.role in SERVING]
    roles = Counter(g.role for g in serving)
    disaggregated = roles[Role.PREFILL] or roles[Role.DECODE]
    mode = Mode.DISAGGREGATED if disaggregated else (Mode.COLOCATED if serving else snapshot.mode)
    return Target(
        mode=mode,
        rollout_gpus=len(serving),
        prefill_gpus=roles[Role.PREFILL],
        lend=sum(1 for g in serving if g.pool == "trainer"),
        elastic=sum(1 for g in serving if g.pool == "elastic"),
    )


def final_deployment(snapshot: Snapshot, planned: Iterable[Move]) -> Deployment:
    """The deployment once every move is done."""
    to_role = {m.gpu: m.to_role for m in planned}
    serving = []
    for g in snapshot.gpus:
        role = to_role.get(g.id, g.role)
        if g.pool in _PLANNED_POOLS and role in _SERVING:
            serving.append((g.node, g.pool, role))
    return _Fleet(snapshot.profile.gpus_per_worker, serving).deployment()


def timeline_s(snapshot: Snapshot, planned: Iterable[Move], *, instant: bool = False) -> float:
    """Predicted completion when ``planned`` runs now (``instant``: as if moves took no time — the steady
    gain of a plan, without its moving cost)."""
    s = snapshot
    profile, work = s.profile, s.work
    if work.empty:
        return 0.0
    moving = {m.gpu: m for m in planned}
    # One pass over the GPUs (this runs for every candidate plan on snapshots of thousands of GPUs):
    # serving from the start, arriving when a move is done, leaving when a return is due or an allocation ends.
    serving: list[tuple[str, str, Role]] = []
    arrivals: list[tuple[float, tuple[str, str, Role]]] = []  # (starts serving, worker key)
    departures: list[tuple[float, float, tuple[str, str, Role]]] = []  # (leaves, started serving, worker key)
    now = s.now
    lent_due = budget.return_cost_s(s) + budget.RETURN_SLACK_S  # a lent GPU leaves this long before its deadline
    trainer_due = budget.trainer_deadline(s)
    for g in s.gpus:
        pool = g.pool
        if pool not in _PLANNED_POOLS:
            continue
        m = moving.get(g.id) if moving else None
        if m is None:
            role, start = g.role, 0.0
        else:
            role, start = m.to_role, (0.0 if instant else m.cost_s)
        if role not in _SERVING:
            continue
        leave = g.ends_at - now if g.ends_at is not None else None
        if pool == "trainer" and (g.borrowed or (m is not None and m.kind is MoveKind.BORROW)):
            due = (g.return_deadline if g.return_deadline is not None else trainer_due) - lent_due - now
            leave = due if leave is None else min(leave, due)
        key = (g.node, pool, role)
        if leave is not None:
            if leave <= start:
                continue  # gone before it serves
            departures.append((leave, start, key))
        if start > 0:
            arrivals.append((start, key))
        else:
            serving.append(key)
    fleet = _Fleet(profile.gpus_per_worker, serving)

    cache: dict[Deployment, float] = {}

    def seconds(dep: Deployment) -> float:
        if dep not in cache:
            cache[dep] = completion_s(work, dep, profile)
        return cache[dep]

    # Events grouped by instant: at one instant arrivals count before departures (counts never go negative).
    joins: defaultdict[float, Counter] = defaultdict(Counter)
    for t, key in arrivals:
        joins[t][key] += 1
    leaving: list[tuple[float, tuple[str, str, Role]]] = []
    if departures:
        # Round departures down (never later than they happen, never before the GPU serves) to a grid
        # scaled by the batch's time; sorted, and consumed only up to the batch's end.
        final = fleet.copy()
        for joined in joins.values():
            final.update(joined, 1)
        ref = min(seconds(fleet.deployment()), seconds(final.deployment()))
        grid = ref / _DEPARTURE_GRID if math.isfinite(ref) and ref > 0 else 1.0
        leaving = sorted(((max(math.floor(t / grid) * grid, start), key) for t, start, key in departures))
    join_times = sorted(joins)

    done, t = 0.0, 0.0
    j = k = 0
    while j < len(join_times) or k < len(leaving):
        t_next = min(
            join_times[j] if j < len(join_times) else math.inf,
            leaving[k][0] if k < len(leaving) else math.inf,
        )
        total = seconds(fleet.deployment())
        if math.isfinite(total):
            if t + (1.0 - done) * total <= t_next:
                return t + (1.0 - done) * total
            if total > 0:
                done += (t_next - t) / total
        t = t_next
        if j < len(join_times) and join_times[j] == t_next:
            fleet.update(joins[t_next], 1)
            j += 1
        left: Counter = Counter()
        while k < len(leaving) and leaving[k][0] == t_next:
            left[leaving[k][1]] += 1
            k += 1
        if left:
            fleet.update(left, -1)
    total = seconds(fleet.deployment())
    return t + (1.0 - done) * total if math.isfinite(total) else math.inf


class _Fleet:
    """Serving GPUs counted into whole workers per (node, pool, role)."""

    def __init__(self, gpus_per_worker: int, serving: Iterable[tuple[str, str, Role]] = ()):
        self.gpw = gpus_per_worker
        self.gpus: Counter[tuple[str, str, Role]] = Counter(serving)  # (node, pool, role) -> GPUs
        self.workers: Counter[Role] = Counter()
        for (_, _, role), count in self.gpus.items():
            self.workers[role] += count // gpus_per_worker

    def update(self, change: Counter, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) GPUs counted per (node, pool, role)."""
        gpw = self.gpw
        for key, count in change.items():
            before = self.gpus[key]
            after = before + sign * count
            self.gpus[key] = after
            self.workers[key[2]] += after // gpw - before // gpw

    def copy(self) -> _Fleet:
        out = _Fleet(self.gpw)
        out.gpus, out.workers = self.gpus.copy(), self.workers.copy()
        return out

    def deployment(self) -> Deployment:
        # Mid-transition a fleet may mix roles: with both prefill and decode workers it runs disaggregated
        # (colocated workers take decode work too); otherwise every worker serves whole requests.
        rollout, prefill, decode = (self.workers[r] for r in (Role.ROLLOUT, Role.PREFILL, Role.DECODE))
        if prefill and decode:
            return Deployment(Mode.DISAGGREGATED, decode=decode + rollout, prefill=prefill)
        return Deployment(Mode.COLOCATED, decode=rollout + prefill + decode)
