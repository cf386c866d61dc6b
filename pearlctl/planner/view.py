"""What the planner derives from one snapshot more than once (docs/planner.md, "Planner speed").

A policy's decision prices several targets against one snapshot: each ``choose``, ``diff.moves`` and
``plan.timeline_s`` used to walk the snapshot's thousands of GPUs again, and each drain timeline predicted the
same deployments again. ``of(snapshot)`` gives the snapshot's ``View``: the GPUs sorted and grouped the way the
diff and the pricing need them, the timeline of the current assignment, and the predictions made so far —
each computed on first use, once per snapshot.

Still pure: a ``Snapshot`` is frozen, so everything here is a function of it, and a view answers exactly what
the code without it computed (tests/unit/test_planner_recorded.py checks decisions against ones recorded
before the view existed). Only the most recent snapshot's view is kept (a strong reference, compared by
identity, so a new snapshot never meets an old snapshot's view): the daemon and the simulator build a new
snapshot for every decision.

Moves are made once per snapshot too: ``move`` for returns, retires and switches, ``adds`` for the GPUs a
target brings up (prefixes of the same best-first candidates, whichever target asks), each with its change to
the current assignment's timeline (``changes``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from operator import attrgetter, is_, itemgetter

from pearlctl.planner import budget
from pearlctl.planner.model import SERVING, Deployment, GpuSlot, Move, MoveKind, Role, Snapshot
from pearlctl.planner.predict import Prediction, predict
from pearlctl.vocabulary import GENERATION_POOLS, PoolKind

# the pools as plain str, as POOLS has them (compared and looked up per GPU)
_TRAINER, _ROLLOUT, _ELASTIC = str(PoolKind.TRAINER), str(PoolKind.ROLLOUT), str(PoolKind.ELASTIC)
_GENERATION = tuple(str(p) for p in GENERATION_POOLS)
# the pools whose GPUs may serve rollout: the trainer's lent, and the generation pools (reward GPUs are not
# planned here)
POOLS = (_TRAINER, *_GENERATION)
_POOLS = frozenset(POOLS)
_SERVING = frozenset(SERVING)

Key = tuple[str, str, Role]  # (node, pool, role): GPUs counted into workers per key

_last: tuple[Snapshot, View] | None = None
_UNKNOWN = (None, (), (), ())  # a move whose change is not worked out yet
_first = itemgetter(0)
_worker_key = attrgetter("node", "pool", "role")  # a GPU's (node, pool, role)
_node_pool = attrgetter("node", "pool")
_PARTS = (itemgetter(1), itemgetter(2), itemgetter(3))  # a move's (taken, cancelled, added)
_new = object.__new__


@dataclass(frozen=True)
class Servable:
    """The GPUs that may serve, by where they come from (budgets are unions of these)."""

    rollout: tuple[GpuSlot, ...]  # rollout pool: serving, or idle and startable (``budget.may_start``)
    elastic: tuple[GpuSlot, ...]  # elastic pool: serving, or idle and startable
    lent: tuple[GpuSlot, ...]  # lent trainer GPUs that need not return yet (``budget.must_return``), within max_lend
    lendable: tuple[GpuSlot, ...]  # trainer GPUs that may be lent now, parked first (``View.lendable``)

    def budget(self, *, elastic: bool, borrow: bool, warm_borrow_only: bool = False) -> list[GpuSlot]:
        out = list(self.rollout)
        if elastic:
            out += self.elastic
        if borrow:
            out += self.lent
            out += [g for g in self.lendable if g.parked] if warm_borrow_only else self.lendable
        return out


def lendable(snapshot: Snapshot) -> list[GpuSlot]:
    """``View.lendable`` of the snapshot (a new list)."""
    return list(of(snapshot).lendable)


def servable(snapshot: Snapshot) -> Servable:
    """``View.servable`` of the snapshot."""
    return of(snapshot).servable


def may_serve(snapshot: Snapshot, *, elastic: bool, borrow: bool, warm_borrow_only: bool = False) -> list[GpuSlot]:
    """The GPUs a deployment may use: the rollout pool's serving or startable GPUs; with ``elastic`` the
    elastic pool's; with ``borrow`` the lent trainer GPUs that need not return yet and the lendable ones
    (``warm_borrow_only``: only those with a parked worker, whose borrow is a wake)."""
    return of(snapshot).servable.budget(elastic=elastic, borrow=borrow, warm_borrow_only=warm_borrow_only)


def of(snapshot: Snapshot) -> View:
    """The view of ``snapshot`` (the last one's if it is the same object)."""
    global _last
    last = _last
    if last is not None and last[0] is snapshot:
        return last[1]
    view = View(snapshot)
    _last = (snapshot, view)
    return view


def _generation(
    by_pool: dict[str, list[GpuSlot]], start_by: dict[bool, float]
) -> tuple[dict[str, list[GpuSlot]], dict[str, list[GpuSlot]], dict[str, list[GpuSlot]]]:
    """Each generation pool's GPUs that serve, that are startable — idle, and their allocation outlasts a wake
    (parked) or a start by ``start_by`` (``budget.may_start``) — and that may serve: either, in snapshot order."""
    serving: dict[str, list[GpuSlot]] = {}
    startable: dict[str, list[GpuSlot]] = {}
    may_serve: dict[str, list[GpuSlot]] = {}
    idle = Role.IDLE
    for p in _GENERATION:
        on, up, may = serving[p], startable[p], may_serve[p] = [], [], []
        for g in by_pool[p]:
            role = g.role
            if role in _SERVING:
                on.append(g)
                may.append(g)
            elif role is idle and (g.ends_at is None or g.ends_at > start_by[g.parked]):  # budget.may_start
                up.append(g)
                may.append(g)
    return serving, startable, may_serve


def _split_lent(
    s: Snapshot, serving: list[GpuSlot], lent_due_s: float, trainer_due: float
) -> tuple[list[GpuSlot], list[GpuSlot]]:
    """The lent trainer GPUs among ``serving``: those that must go back now (``budget.must_return``: the trainer
    trains, or the return must start within ``lent_due_s`` of the deadline) and the rest (``budget.is_lent``
    and not ``must_return``)."""
    now = s.now
    training = s.trainer.phase == "training" or s.trainer.batch_ready  # budget.must_return
    forced: list[GpuSlot] = []
    lent: list[GpuSlot] = []
    for g in serving:
        if g.borrowed:
            due = g.return_deadline if g.return_deadline is not None else trainer_due
            (forced if training or due - now <= lent_due_s else lent).append(g)
    return forced, lent


def may_lend(
    s: Snapshot, trainer: Iterable[GpuSlot], borrow_s: Callable[[GpuSlot], float], lend_limit: float | None = None
) -> list[GpuSlot]:
    """The ``trainer`` GPUs that may be lent (``budget``), in their order: only while the trainer waits and its
    batch is not complete, training GPUs not lent yet whose borrow (``borrow_s``: to the policy, or to the judge,
    whose engine is another) ends by ``lend_limit`` — by default the trainer's deadline less a return and the
    slack, so that it is back in time."""
    if not (s.trainer.phase == "waiting" and not s.trainer.batch_ready):
        return []
    if lend_limit is None:
        lend_limit = budget.trainer_deadline(s) - budget.RETURN_SLACK_S - budget.return_cost_s(s)
    now, train = s.now, Role.TRAIN
    return [g for g in trainer if g.role is train and not g.borrowed and now + borrow_s(g) <= lend_limit]


class View:
    """One snapshot's derived values. One pass over the GPUs sorts them into what the pool rules, the diff and
    the pricing read; the rest is computed on first use."""

    def __init__(self, snapshot: Snapshot):
        s = self.s = snapshot
        self._predictions: dict[Deployment, Prediction] = {}
        self._leave_order: dict[str, list[GpuSlot]] = {}
        self._move_changes: dict[int, tuple] = {}
        self._moves: dict[tuple[int, MoveKind, Role], Move] = {}
        self._adds: dict[tuple[str, Role], list[Move]] = {}
        self._changes: tuple[tuple[Move, ...], tuple[Counter, Counter, Counter]] | None = None
        now, costs = s.now, s.costs
        slack = budget.RETURN_SLACK_S
        return_s = budget.return_cost_s(s)
        self.lent_due_s = return_s + slack  # a lent GPU leaves this long before its deadline
        self.trainer_due = trainer_due = budget.trainer_deadline(s)
        lend_limit = trainer_due - slack - return_s  # lendable: borrowed and back with the slack
        start_by = {True: now + costs.wake_s + slack, False: now + costs.start_s + slack}  # budget.may_start
        borrow_by = self._borrow_by = {True: costs.borrow_s(warm=True), False: costs.borrow_s(warm=False)}
        # (kind, cost) of bringing up an idle GPU (``adds``), by whether a worker is parked on it
        self._wake_or_start = {True: (MoveKind.WAKE, costs.wake_s), False: (MoveKind.START, costs.start_s)}
        self._lend = {parked: (MoveKind.BORROW, cost) for parked, cost in borrow_by.items()}
        self._cost_by_kind = {
            MoveKind.RETURN: costs.return_s(park=True),
            MoveKind.WAKE: costs.wake_s,
            MoveKind.START: costs.start_s,
            MoveKind.SWITCH: costs.role_switch_s,
        }

        # One pass sorts the GPUs by pool; one more per pool sorts them by what they may do.
        by_pool: dict[str, list[GpuSlot]] = {p: [] for p in POOLS}
        for g in s.gpus:
            gpus = by_pool.get(g.pool)
            if gpus is not None:
                gpus.append(g)
        planned = [g for g in s.gpus if g.pool in _POOLS]
        serving, self._startable, self._may_serve = _generation(by_pool, start_by)
        trainer = by_pool[_TRAINER]
        serving[_TRAINER] = [g for g in trainer if g.role in _SERVING]
        self.serving = serving = {p: serving[p] for p in POOLS}
        self.forced, self._lent = _split_lent(s, serving[_TRAINER], self.lent_due_s, trainer_due)
        self._lendable = may_lend(s, trainer, lambda g: borrow_by[g.parked], lend_limit)
        self.by_id = by_id = {g.id: g for g in planned}
        # ids are unique in a well-formed snapshot; where they are not, a move applies to every GPU of its id
        self._twins: dict[int, list[GpuSlot]] | None = None
        if len(by_id) != len(planned):
            twins: dict[int, list[GpuSlot]] = {}
            for g in planned:
                twins.setdefault(g.id, []).append(g)
            self._twins = twins
        self._other_pools = len(planned) != len(s.gpus)  # GPUs of pools not planned here (reward)
        self._count_base([g for p in POOLS for g in serving[p]])

    def _count_base(self, serving_gpus: list[GpuSlot]) -> None:
        """The current assignment's timeline (``base``): its ``serving_gpus`` serve from the start and leave at
        the allocation's end or, lent, when their return must start; and ``serving_roles``."""
        base_serving = Counter(map(_worker_key, serving_gpus))  # (g.node, g.pool, g.role) per GPU
        # serving GPUs per (pool, role), from the few hundred worker keys rather than the thousands of GPUs
        serving_roles: Counter[tuple[str, Role]] = Counter()
        for (_, pool, role), count in base_serving.items():
            serving_roles[(pool, role)] += count
        self.serving_roles = serving_roles
        departures: Counter[tuple[float, float, Key]] = Counter()
        for g in serving_gpus:
            if g.ends_at is not None or (g.pool == _TRAINER and g.borrowed):
                key, leave = self.contribution(g, g.role, 0.0, False) or (None, None)
                if key is None:
                    base_serving[(g.node, g.pool, g.role)] -= 1  # gone before it serves
                elif leave is not None:
                    departures[(leave, 0.0, key)] += 1
        self.base = (base_serving, departures)

    def move(self, g: GpuSlot, kind: MoveKind, to: Role) -> Move:
        """The move of ``g`` (each move made once per snapshot: several targets share most of their moves). The
        moves that bring GPUs up (BORROW, WAKE, START) are ``adds``'."""
        key = (id(g), kind, to)
        m = self._moves.get(key)
        if m is None:
            if kind is MoveKind.BORROW:
                cost = self._borrow_by[g.parked]
            elif kind is MoveKind.RETIRE:
                # an elastic allocation may end, so its worker stops; a rollout worker parks asleep
                cost = self.s.costs.stop_s if g.pool == _ELASTIC else self.s.costs.sleep_s
            elif kind is MoveKind.SWITCH and Role.REWARD in (g.role, to):
                # between the policy and the judge: the leaving model's engine parks asleep on the GPU, and the
                # coming one's wakes where it sleeps there (from an earlier shift or loan), else starts cold
                coming = self.s.engine_costs(to)
                woken = g.parked_judge if to == Role.REWARD else g.parked
                cost = self.s.engine_costs(g.role).sleep_s + (coming.wake_s if woken else coming.start_s)
            else:
                cost = self._cost_by_kind[kind]
            # Move(g.id, kind, g.role, to, cost) without the frozen dataclass's five object.__setattr__ calls
            # (a plan of a 4,096-GPU snapshot has over a thousand moves)
            m = _new(Move)
            d = m.__dict__
            d["gpu"], d["kind"], d["from_role"], d["to_role"], d["cost_s"] = g.id, kind, g.role, to, cost
            self._moves[key] = m
        return m

    def adds(self, pool: str, role: Role, start: int, stop: int) -> list[Move]:
        """The moves that bring up ``pool``'s candidates ``[start:stop]`` in ``role``: lendable trainer GPUs
        borrowed, startable rollout or elastic GPUs woken (parked) or started, in ``lendable`` and
        ``startable(pool)`` order. The moves of a prefix are made once per snapshot (the targets a decision
        prices bring up prefixes of the same candidates), each with its change to the timeline (``changes``):
        these GPUs serve nothing now, so a move only adds its GPU in ``role`` once it is done."""
        made = self._adds.get((pool, role))
        if made is None:
            made = self._adds[(pool, role)] = []
        if len(made) < stop:
            now, lent_due, trainer_due = self.s.now, self.lent_due_s, self.trainer_due
            memo = None if self._twins is not None else self._move_changes  # (twins: ``_change`` adds them all)
            serves = role in _SERVING
            if pool == _TRAINER:
                gpus, cost_of = self.lendable[len(made) : stop], self._lend
            else:
                gpus, cost_of = self._sorted_startable[pool][len(made) : stop], self._wake_or_start
            borrow = pool == _TRAINER
            for g in gpus:
                # Move(g.id, kind, g.role, role, cost), as ``move`` makes it
                kind, cost = cost_of[g.parked]
                m = _new(Move)
                d = m.__dict__
                d["gpu"], d["kind"], d["from_role"], d["to_role"], d["cost_s"] = g.id, kind, g.role, role, cost
                made.append(m)
                if memo is not None:  # ``_change(g.id, m)``
                    ends = g.ends_at
                    leave = ends - now if ends is not None else None
                    if borrow:
                        due = (g.return_deadline if g.return_deadline is not None else trainer_due) - lent_due - now
                        leave = due if leave is None else min(leave, due)
                    if serves and (leave is None or not leave <= -math.inf):
                        memo[id(m)] = (m, (), (), (((g.node, pool, role), leave, cost),))
                    else:
                        memo[id(m)] = (m, (), (), ())
        return made[start:stop]

    def changes(self, planned: Iterable[Move]) -> tuple[Counter, Counter, Counter]:
        """What ``planned`` changes in the current assignment's timeline: the serving GPUs it takes away (per
        worker key), their departures it cancels (per (leaves, 0.0, key)), and the GPUs it brings in (per
        (key, leaves, move cost); leaves None: it stays). The last moves priced are remembered: a policy
        prices a plan's moves twice (with their moving time, and without)."""
        last = self._changes
        if last is not None and last[0] is planned:
            return last[1]
        moving = list({m.gpu: m for m in planned}.values())
        # Each move's change is worked out once per snapshot (several plans share most of their moves): by
        # the move's identity, the move kept with it so that its id is not reused. (Looked up, checked and
        # summed with the iterator built-ins: a plan has thousands of moves.)
        memo = self._move_changes
        changes = list(map(memo.get, map(id, moving), repeat(_UNKNOWN)))
        if not all(map(is_, map(_first, changes), moving)):
            for i, m in enumerate(moving):
                if changes[i][0] is not m:
                    changes[i] = memo[id(m)] = (m, *self._change(m.gpu, m))
        out = tuple(Counter(chain.from_iterable(map(part, changes))) for part in _PARTS)
        if isinstance(planned, tuple):
            self._changes = (planned, out)
        return out

    def _change(self, gid: int, m: Move) -> tuple[tuple, tuple, tuple]:
        """One move's (taken, cancelled, added) entries (see ``changes``): ``contribution`` for the moved
        GPU's current role and for its new one."""
        taken: list[Key] = []
        cancelled: list[tuple[float, float, Key]] = []
        added: list[tuple[Key, float | None, float]] = []
        now, lent_due, trainer_due = self.s.now, self.lent_due_s, self.trainer_due
        to = m.to_role
        for g in self.planned(gid):
            pool, ends = g.pool, g.ends_at
            lent = pool == _TRAINER and g.borrowed
            if lent or (pool == _TRAINER and m.kind is MoveKind.BORROW):
                due = (g.return_deadline if g.return_deadline is not None else trainer_due) - lent_due - now
            else:
                due = None
            if g.role in _SERVING:  # its share of the current assignment goes
                leave = ends - now if ends is not None else None
                if lent:
                    leave = due if leave is None else min(leave, due)
                if leave is None:
                    taken.append((g.node, pool, g.role))
                elif not leave <= 0.0:
                    key = (g.node, pool, g.role)
                    taken.append(key)
                    cancelled.append((leave, 0.0, key))
            if to in _SERVING:  # it serves in its new role (whether it does depends on its start)
                leave = ends - now if ends is not None else None
                if due is not None:
                    leave = due if leave is None else min(leave, due)
                if leave is None or not leave <= -math.inf:
                    added.append(((g.node, pool, to), leave, m.cost_s))
        return tuple(taken), tuple(cancelled), tuple(added)

    def planned(self, gid: int) -> list[GpuSlot] | tuple[GpuSlot, ...]:
        """The planned GPUs of id ``gid`` (one, in a well-formed snapshot; none: not planned)."""
        if self._twins is not None:
            return self._twins.get(gid, ())
        g = self.by_id.get(gid)
        return (g,) if g is not None else ()

    @cached_property
    def base_timeline(self) -> tuple[Counter[Key], Counter[Role], list[tuple[float, Key, int]], int]:
        """The current assignment's GPUs serving now per worker key (none counted down to zero), its whole
        workers per role, its departures as (leaves, key, GPUs) in time order, and how many GPUs depart."""
        serving, departures = self.base
        serving = +serving
        gpw = self.s.profile.gpus_per_worker
        workers: Counter[Role] = Counter()
        for (_, _, role), count in serving.items():
            workers[role] += count // gpw
        leaving = sorted((t, key, n) for (t, _, key), n in departures.items())
        return serving, workers, leaving, sum(departures.values())

    def base_share(self, g: GpuSlot) -> tuple[Key, float | None] | None:
        """``g``'s share of the current assignment's timeline (``contribution`` in its current role)."""
        return self.contribution(g, g.role, 0.0, False)

    @cached_property
    def elastic_ids(self) -> frozenset[int]:
        return frozenset(g.id for g in self.s.gpus if g.pool == _ELASTIC)

    @cached_property
    def serving_count(self) -> int:
        """GPUs serving now, every pool."""
        if self._other_pools:
            return sum(1 for g in self.s.gpus if g.role in _SERVING)
        return sum(len(gpus) for gpus in self.serving.values())

    # -- predictions ---------------------------------------------------------------------------------

    def predict(self, dep: Deployment) -> Prediction:
        """``predict(snapshot.work, dep, snapshot.profile)``, each deployment predicted once."""
        p = self._predictions.get(dep)
        if p is None:
            p = self._predictions[dep] = predict(self.s.work, dep, self.s.profile)
        return p

    def completion_s(self, dep: Deployment) -> float:
        return self.predict(dep).seconds

    # -- the pool rules (budget) ---------------------------------------------------------------------

    @cached_property
    def lendable(self) -> list[GpuSlot]:
        """Trainer GPUs that may be lent now (not yet lent), best first (parked: a warm borrow): only while the
        trainer waits and its batch is not complete, each only if its borrow, its return and the slack fit before
        the trainer's deadline (``budget``), capped so that kept lent GPUs plus these never exceed ``max_lend``."""
        # (a new list, never sorted in place: two threads may ask one view at once)
        out = sorted(self._lendable, key=lambda g: (not g.parked, g.node, g.id))
        max_lend = self.s.max_lend
        if max_lend is not None:
            out = out[: max(0, max_lend - len(self._lent))]
        return out

    @cached_property
    def servable(self) -> Servable:
        """The GPUs that may serve by where they come from: rollout and elastic GPUs serving or startable, lent
        trainer GPUs that need not return yet (at most ``max_lend``), and the lendable ones."""
        lent = self._lent
        if self.s.max_lend is not None:
            lent = lent[: self.s.max_lend]
        may = self._may_serve
        return Servable(tuple(may[_ROLLOUT]), tuple(may[_ELASTIC]), tuple(lent), tuple(self.lendable))

    def workers(self, *, elastic: bool, borrow: bool, warm_borrow_only: bool = False) -> dict[str, int]:
        """``choose.worker_groups(self.servable.budget(...))``: whole workers per pool of a budget."""
        parts = self._node_counts
        per_node = parts[_ROLLOUT].copy()
        if elastic:
            per_node.update(parts[_ELASTIC])
        if borrow:
            per_node.update(parts["lent"])
            per_node.update(parts["warm"] if warm_borrow_only else parts["lendable"])
        gpw = self.s.profile.gpus_per_worker
        out: Counter[str] = Counter()
        for (_, pool), count in per_node.items():
            out[pool] += count // gpw
        return dict(out)

    @cached_property
    def _node_counts(self) -> dict[str, Counter[tuple[str, str]]]:
        """GPUs per (node, pool) of each part of the servable GPUs."""
        s = self.servable
        return {
            _ROLLOUT: Counter(map(_node_pool, s.rollout)),  # (g.node, g.pool) per GPU
            _ELASTIC: Counter(map(_node_pool, s.elastic)),
            "lent": Counter(map(_node_pool, s.lent)),
            "lendable": Counter(map(_node_pool, s.lendable)),
            "warm": Counter([(g.node, g.pool) for g in s.lendable if g.parked]),
        }

    # -- what the diff needs -------------------------------------------------------------------------

    @cached_property
    def staying(self) -> dict[str, list[GpuSlot]]:
        """``serving`` without the lent GPUs that must go back."""
        out = dict(self.serving)
        if self.forced:
            forced = {g.id for g in self.forced}
            out[_TRAINER] = [g for g in out[_TRAINER] if g.id not in forced]
        return out

    @cached_property
    def staying_roles(self) -> dict[tuple[str, Role], int]:
        """How many ``staying`` GPUs hold each (pool, role)."""
        have = self.serving_roles
        if self.forced:  # (``staying``: by id)
            forced = {g.id for g in self.forced}
            have = have - Counter([(g.pool, g.role) for g in self.serving[_TRAINER] if g.id in forced])
        return {(p, r): have[(p, r)] for p in POOLS for r in SERVING}

    def startable(self, pool: str) -> list[GpuSlot]:
        """Idle GPUs of ``pool`` a worker may come up on, best first (diff's order: parked, the allocation
        that lasts longest, then by node so that new tensor-parallel groups fill whole nodes)."""
        return self._sorted_startable[pool]

    @cached_property
    def _sorted_startable(self) -> dict[str, list[GpuSlot]]:
        def best(g: GpuSlot) -> tuple:
            return (not g.parked, -(g.ends_at if g.ends_at is not None else math.inf), g.node, g.id)

        return {pool: sorted(gpus, key=best) for pool, gpus in self._startable.items()}

    def leave_order(self, pool: str) -> list[GpuSlot]:
        """``staying[pool]`` in retire order: the soonest end (preemption notice, return deadline) first."""
        order = self._leave_order.get(pool)
        if order is None:
            s = self.s

            def first(g: GpuSlot) -> tuple:
                end = budget.deadline(s, g) if g.pool == _TRAINER else g.ends_at
                return (end if end is not None else math.inf, g.node, g.id)

            order = self._leave_order[pool] = sorted(self.staying[pool], key=first)
        return order

    # -- what the pricing needs ----------------------------------------------------------------------

    def contribution(self, g: GpuSlot, role: Role, start: float, borrowing: bool) -> tuple[Key, float | None] | None:
        """How ``g`` in ``role`` serves from ``start`` (seconds from now): its worker key and when it leaves
        (None: it stays; the whole result None: it never serves)."""
        if role not in _SERVING:
            return None
        now = self.s.now
        leave = g.ends_at - now if g.ends_at is not None else None
        if g.pool == _TRAINER and (g.borrowed or borrowing):
            due = (g.return_deadline if g.return_deadline is not None else self.trainer_due) - self.lent_due_s - now
            leave = due if leave is None else min(leave, due)
        if leave is not None and leave <= start:
            return None  # gone before it serves
        return (g.node, g.pool, role), leave
