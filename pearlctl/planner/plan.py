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
from collections.abc import Callable, Iterable
from dataclasses import replace

from pearlctl.planner import view
from pearlctl.planner.diff import POOLS, moves
from pearlctl.planner.model import SERVING, Deployment, Mode, Move, Plan, Role, Snapshot, Target
from pearlctl.vocabulary import GENERATION_ROLES, PoolKind

_PLANNED_POOLS = frozenset(POOLS)
_SERVING = frozenset(SERVING)
_DEPARTURE_GRID = 16  # departures rounded down to 1/16 of the batch's time
Key = tuple[str, str, Role]  # (node, pool, role)


def make(
    snapshot: Snapshot,
    target: Target,
    why: str = "",
    *,
    predicted_now_s: float | None = None,
    planned: tuple[Move, ...] | None = None,
) -> Plan:
    """The plan from the current assignment to ``target`` (clipped to what the pool rules allow).
    ``predicted_now_s``: the completion without a plan, when the caller already has it (a policy pricing
    several targets against one snapshot); ``planned``: ``moves(snapshot, target)``, when the caller has it."""
    if planned is None:
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


def make_if_moves(snapshot: Snapshot, target: Target, why: str = "") -> Plan | None:
    """``make``, or None when nothing moves — without pricing a plan that would be dropped (the baselines'
    decisions, most of which move nothing)."""
    planned = moves(snapshot, target)
    return make(snapshot, target, why, planned=planned) if planned else None


def current_deployment(snapshot: Snapshot) -> Deployment:
    """The deployment the serving GPUs form now (whole tensor-parallel workers only)."""
    by_pool = view.of(snapshot).serving
    serving = [(g.node, g.pool, g.role) for p in POOLS for g in by_pool[p]]
    return _Fleet(snapshot.profile.gpus_per_worker, serving).deployment()


def expect_wait(snapshot: Snapshot) -> Snapshot:
    """The snapshot with the trainer's wait filled in when the trainer waits and reported none (``wait_known``
    false: it has measured no wait yet): the batch in flight's predicted completion on the GPUs serving now, by
    the predictor and its correction (the profile's ``time_scale``). So the first batch's lending horizon needs
    no hint from the user. Nothing serving, or nothing in flight, predicts no wait (nothing is lent on it). The
    daemon (``PolicyInputs.snapshot``) and the simulator (``PolicyView.snapshot``) both build their snapshots
    through it.
    """
    trainer = snapshot.trainer
    if trainer.wait_known or trainer.phase != "waiting":
        return snapshot
    seconds = 0.0 if snapshot.work.empty else view.of(snapshot).completion_s(current_deployment(snapshot))
    wait = seconds if math.isfinite(seconds) else 0.0
    return replace(snapshot, trainer=replace(trainer, wait_left_s=wait, wait_predicted=True))


def current_target(snapshot: Snapshot) -> Target:
    """The current assignment as a target: ``make(snapshot, current_target(snapshot))`` moves only what must
    move anyway (lent GPUs due back)."""
    v = view.of(snapshot)
    by_pool = v.serving
    serving = sum(len(by_pool[p]) for p in POOLS)
    roles: Counter[Role] = Counter()
    for (_, role), count in v.serving_roles.items():
        roles[role] += count
    disaggregated = roles[Role.PREFILL] or roles[Role.DECODE]
    mode = Mode.DISAGGREGATED if disaggregated else (Mode.COLOCATED if serving else snapshot.mode)
    return Target(
        mode=mode,
        rollout_gpus=serving,
        prefill_gpus=roles[Role.PREFILL],
        lend=len(by_pool[PoolKind.TRAINER]),
        elastic=len(by_pool[PoolKind.ELASTIC]),
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
    if s.work.empty:
        return 0.0
    v = view.of(s)
    # The current assignment's GPUs (serving from the start, leaving when a return is due or an allocation
    # ends) are counted once per snapshot (``view.base``); a plan changes only its moved GPUs' shares: each
    # stops serving as it was, and serves in its new role once its move is done.
    base_gpus, base_workers, base_leaving, base_departing = v.base_timeline
    taken, cancelled, added = v.changes(planned)
    fleet = _Fleet(s.profile.gpus_per_worker)
    fleet.gpus, fleet.workers = base_gpus.copy(), base_workers.copy()
    if taken:
        fleet.update(taken, -1)
    joins, arrived, departing = _arrivals(added, instant)
    if arrived:
        fleet.update(arrived, 1)
    seconds = v.completion_s

    # Departures come from two lists, each in time order: the current assignment's that the plan keeps (sorted
    # once per snapshot) and the moved GPUs'.
    base = [] if base_departing - sum(cancelled.values()) <= 0 else base_leaving
    leaving: list[tuple[float, Key, int]] = []  # (leaves, worker key, GPUs)
    grid = 1.0
    if base or departing:
        grid, leaving = _rounded_departures(fleet, joins, departing, seconds)
    return _run_segments(fleet, seconds, joins, leaving, base, cancelled, grid)


def _arrivals(
    added: Counter, instant: bool
) -> tuple[defaultdict[float, Counter], Counter, list[tuple[float, float, Key, int]]]:
    """When the GPUs a plan brings in (``View.changes``' added: per (key, leaves, move cost)) serve: those that
    start later per start time and worker key, those serving from the start per worker key, and those that
    leave as (leaves, starts serving, worker key, GPUs). A GPU gone before its move is done never serves."""
    joins: defaultdict[float, Counter] = defaultdict(Counter)  # (starts serving) -> worker key -> GPUs
    arrived: Counter = Counter()
    departing: list[tuple[float, float, Key, int]] = []
    for (key, leave, cost), n in added.items():
        start = 0.0 if instant else cost
        if leave is not None:
            if leave <= start:
                continue  # gone before it serves
            departing.append((leave, start, key, n))
        if start > 0:
            joins[start][key] += n
        else:
            arrived[key] += n
    return joins, arrived, departing


def _rounded_departures(
    fleet: _Fleet,
    joins: dict[float, Counter],
    departing: list[tuple[float, float, Key, int]],
    seconds: Callable[[Deployment], float],
) -> tuple[float, list[tuple[float, Key, int]]]:
    """The departure grid, 1/``_DEPARTURE_GRID`` of the batch's time (the lesser of its time on ``fleet`` now and
    once every GPU has joined), and the moved GPUs' ``departing`` rounded down to it (never later than they
    happen, never before the GPU serves) as (leaves, worker key, GPUs), in time order."""
    final = fleet.copy()
    for joined in joins.values():
        final.update(joined, 1)
    ref = min(seconds(fleet.deployment()), seconds(final.deployment()))
    grid = ref / _DEPARTURE_GRID if math.isfinite(ref) and ref > 0 else 1.0
    return grid, sorted((max(math.floor(t / grid) * grid, start), key, n) for t, start, key, n in departing)


def _run_segments(
    fleet: _Fleet,
    seconds: Callable[[Deployment], float],
    joins: dict[float, Counter],
    leaving: list[tuple[float, Key, int]],
    base: list[tuple[float, Key, int]],
    cancelled: Counter,
    grid: float,
) -> float:
    """The batch run through the segments between events, from now on ``fleet`` (the module doc): GPUs join at
    their ``joins`` times; the moved GPUs leave at their (rounded) ``leaving`` times, and the current
    assignment's ``base`` departures the plan keeps (those not ``cancelled``) at their times rounded down to
    ``grid``; consumed in time order, and only up to the batch's end. At one instant arrivals count before
    departures (counts never go negative)."""
    join_times = sorted(joins)

    # the next kept departure of the current assignment: rounded times grow with its (sorted) raw times
    b, b_end = 0, len(base)

    def next_base() -> float:
        nonlocal b
        while b < b_end:
            t, key, n = base[b]
            if n - cancelled.get((t, 0.0, key), 0) > 0:
                return max(math.floor(t / grid) * grid, 0.0)
            b += 1
        return math.inf

    b_at = next_base()
    done, t = 0.0, 0.0
    j = k = 0
    while j < len(join_times) or k < len(leaving) or b < b_end:
        t_next = min(
            join_times[j] if j < len(join_times) else math.inf,
            leaving[k][0] if k < len(leaving) else math.inf,
            b_at,
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
            left[leaving[k][1]] += leaving[k][2]
            k += 1
        while b_at == t_next:
            at, key, n = base[b]
            left[key] += n - cancelled.get((at, 0.0, key), 0)
            b += 1
            b_at = next_base()
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

    @classmethod
    def counted(cls, gpus_per_worker: int, gpus: Counter) -> _Fleet:
        """A fleet of ``gpus`` already counted per (node, pool, role)."""
        out = cls(gpus_per_worker)
        out.gpus = +gpus  # (drops keys counted down to zero)
        for (_, _, role), count in out.gpus.items():
            out.workers[role] += count // gpus_per_worker
        return out

    def copy(self) -> _Fleet:
        out = _Fleet(self.gpw)
        out.gpus, out.workers = self.gpus.copy(), self.workers.copy()
        return out

    def deployment(self) -> Deployment:
        # Mid-transition a fleet may mix roles: with both prefill and decode workers it runs disaggregated
        # (colocated workers take decode work too); otherwise every worker serves whole requests.
        rollout, prefill, decode = (self.workers[r] for r in GENERATION_ROLES)
        if prefill and decode:
            return Deployment(Mode.DISAGGREGATED, decode=decode + rollout, prefill=prefill)
        return Deployment(Mode.COLOCATED, decode=rollout + prefill + decode)
