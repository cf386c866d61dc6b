"""Incremental plans (docs/planner.md): the smallest set of moves from the current GPU roles to a ``Target``.

A target is counts: serving GPUs per pool (``lend`` trainer GPUs, ``elastic`` elastic GPUs, the rest from
the rollout pool) and, disaggregated, how many of them prefill. ``moves`` reaches the nearest assignment with
those counts that the pool rules (``budget``) allow, and guarantees:

- minimal: every GPU that already serves keeps serving while its pool still needs it, and the GPUs that
  leave are chosen so that the fewest remaining ones change role (an exact max-flow over pools × roles), so
  ``len(moves)`` is the least number of GPUs whose role must change;
- one move per GPU at most, each carrying its cost from ``snapshot.costs``;
- adds prefer a parked worker (WAKE, or a warm BORROW) over a cold START, then the allocation that lasts
  longest, then whole nodes (tensor-parallel workers sit on one node);
- lending: only what ``view.lendable`` allows (trainer "waiting", ``max_lend``, back before the deadline);
  lent GPUs that ``budget.must_return`` go back whatever the target says;
- shrinking a pool retires first the GPUs whose allocation ends soonest (elastic: the preemption notice;
  lent: the return deadline), after the minimality rule.

Counts the rules forbid are clipped, not errors: a policy may ask for more than is lendable.
"""

from __future__ import annotations

import math
from collections import deque
from operator import attrgetter

from pearlctl.planner import view
from pearlctl.planner.model import GpuSlot, Mode, Move, MoveKind, Role, Snapshot, Target
from pearlctl.vocabulary import GENERATION_ROLES, PoolKind

# the pools whose GPUs may serve rollout: the trainer's lent, and the generation pools (reward GPUs are not
# planned here)
POOLS = view.POOLS
_ROLES = GENERATION_ROLES
_ORDER = {
    MoveKind.RETURN: 0,
    MoveKind.RETIRE: 1,
    MoveKind.SWITCH: 2,
    MoveKind.WAKE: 3,
    MoveKind.BORROW: 4,
    MoveKind.START: 5,
}  # the order an executor should run them in: deadlines first, capacity freed before it is used
_KINDS = sorted(_ORDER, key=_ORDER.__getitem__)
_gpu = attrgetter("gpu")


def moves(snapshot: Snapshot, target: Target) -> tuple[Move, ...]:
    """The fewest moves from the current assignment to ``target`` (the module doc), in the order an executor
    should run them (``_ORDER``, then by GPU)."""
    v = view.of(snapshot)  # the snapshot's GPUs grouped and sorted once, for every target priced against it
    keep_n, add_n, drop_n = _counts(snapshot, v, target)
    wanted_roles = _role_counts(target, sum(keep_n.values()) + sum(add_n.values()))

    # Which serving GPUs leave: as many as possible from roles that have too many GPUs (each saves a switch).
    have = v.staying_roles
    excess = {r: max(0, sum(have[(p, r)] for p in POOLS) - wanted_roles[r]) for r in _ROLES}
    from_role = _max_flow(drop_n, have, excess)

    move = v.move  # (each cost from snapshot.costs: what the GPU's pool and parked worker make it)
    out: list[Move] = [move(g, MoveKind.RETURN, Role.TRAIN) for g in v.forced]
    kept_roles = {r: sum(have[(p, r)] for p in POOLS) for r in _ROLES}
    kept_by_pool: dict[str, list[GpuSlot]] = {}
    for p in POOLS:
        leaving, kept_by_pool[p] = _leaving(v, p, drop_n[p], from_role)
        for g in leaving:
            kept_roles[g.role] -= 1
        kind = MoveKind.RETURN if p == PoolKind.TRAINER else MoveKind.RETIRE
        to = Role.TRAIN if p == PoolKind.TRAINER else Role.IDLE
        out += [move(g, kind, to) for g in leaving]

    # Roles: kept GPUs in an over-full role switch; new GPUs and switchers fill the roles that are short.
    runs = _short_runs(wanted_roles, kept_roles)
    switching = _switching(kept_by_pool, wanted_roles, kept_roles)
    # The pools' new GPUs take the slots in order, then the switchers.
    out += _adds(v, add_n, runs)
    if switching:
        at = sum(add_n.values())
        roles = [r for r, first, stop in runs for _ in range(stop - first)]
        for g in switching:
            out.append(move(g, MoveKind.SWITCH, roles[at]))
            at += 1
    return _in_order(out)


def _counts(s: Snapshot, v: view.View, target: Target) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per pool: how many of its serving GPUs stay, how many new ones come up and how many leave — the target's
    counts clipped to what the pool rules allow (``max_lend``, the lendable and startable candidates)."""
    serving = v.staying
    lend = max(target.lend, 0)
    if s.max_lend is not None:
        lend = min(lend, s.max_lend)
    trainer, rollout, elastic = PoolKind.TRAINER, PoolKind.ROLLOUT, PoolKind.ELASTIC
    want = {
        trainer: lend,
        elastic: max(target.elastic, 0),
        rollout: max(target.rollout_gpus - max(target.lend, 0) - max(target.elastic, 0), 0),
    }
    keep_n = {p: min(want[p], len(serving[p])) for p in POOLS}
    # Only pools that grow need their candidates.
    candidates = {
        trainer: v.lendable if want[trainer] > keep_n[trainer] else [],
        rollout: v.startable(rollout) if want[rollout] > keep_n[rollout] else [],
        elastic: v.startable(elastic) if want[elastic] > keep_n[elastic] else [],
    }
    add_n = {p: min(want[p] - keep_n[p], len(candidates[p])) for p in POOLS}
    drop_n = {p: len(serving[p]) - keep_n[p] for p in POOLS}
    return keep_n, add_n, drop_n


def _leaving(
    v: view.View, pool: str, drop: int, from_role: dict[tuple[str, Role], int]
) -> tuple[list[GpuSlot], list[GpuSlot]]:
    """Which ``drop`` of ``pool``'s staying GPUs leave, and which stay: ``from_role``'s count of each role (the
    max flow's), then any; the soonest to end first (``view.leave_order``)."""
    if not drop:  # (the common case, cheap: nothing leaves this pool)
        return [], v.staying[pool]
    order = v.leave_order(pool)
    leaving: list[GpuSlot] = []
    for r in _ROLES:
        if from_role[(pool, r)]:
            leaving += [g for g in order if g.role is r][: from_role[(pool, r)]]
    left = {g.id for g in leaving}
    rest = [g for g in order if g.id not in left]
    extra = drop - len(leaving)
    leaving += rest[:extra]
    return leaving, rest[extra:]


def _short_runs(wanted_roles: dict[Role, int], kept_roles: dict[Role, int]) -> list[tuple[Role, int, int]]:
    """The slots new GPUs and switchers fill, in order: runs of one role each (ROLLOUT, PREFILL, DECODE), as
    (role, first, end), one for each role the kept GPUs leave short."""
    runs: list[tuple[Role, int, int]] = []
    end = 0
    for r in _ROLES:
        short = max(0, wanted_roles[r] - kept_roles[r])
        if short:
            runs.append((r, end, end + short))
            end += short
    return runs


def _switching(
    kept_by_pool: dict[str, list[GpuSlot]], wanted_roles: dict[Role, int], kept_roles: dict[Role, int]
) -> list[GpuSlot]:
    """The kept GPUs that switch role: as many of each over-full role as it has too many, by node and id."""
    over = {r: max(0, kept_roles[r] - wanted_roles[r]) for r in _ROLES}
    switching: list[GpuSlot] = []
    if any(over.values()):
        kept = [g for p in POOLS for g in kept_by_pool[p]]
        for g in sorted(kept, key=lambda g: (g.node, g.id)):
            if over[g.role] > 0:
                over[g.role] -= 1
                switching.append(g)
    return switching


def _adds(v: view.View, add_n: dict[str, int], runs: list[tuple[Role, int, int]]) -> list[Move]:
    """The pools' new GPUs in the first slots of ``runs``, in POOLS' order, each pool's best candidates first:
    each new GPU's move (BORROW, WAKE or START) is ``view.adds``'."""
    out: list[Move] = []
    at = 0
    for p in POOLS:
        n = add_n[p]
        if not n:
            continue
        for r, first, stop in runs:
            lo, hi = max(first, at), min(stop, at + n)
            if lo < hi:
                out += v.adds(p, r, lo - at, hi - at)
        at += n
    return out


def _in_order(out: list[Move]) -> tuple[Move, ...]:
    """``out`` in _ORDER, then by GPU (a stable sort by kind and GPU, one kind at a time)."""
    by_kind: dict[MoveKind, list[Move]] = {kind: [] for kind in _KINDS}
    for m in out:
        by_kind[m.kind].append(m)
    return tuple(m for kind in _KINDS for m in sorted(by_kind[kind], key=_gpu))


def _role_counts(target: Target, final: int) -> dict[Role, int]:
    """How many of the ``final`` serving GPUs take each role (the target's prefill share if it was clipped)."""
    if target.mode is Mode.COLOCATED or final <= 0:
        return {Role.ROLLOUT: final, Role.PREFILL: 0, Role.DECODE: 0}
    prefill = target.prefill_gpus
    if final != target.rollout_gpus and target.rollout_gpus > 0:
        prefill = round(target.prefill_gpus * final / target.rollout_gpus)
    prefill = min(max(prefill, 0), final)
    return {Role.ROLLOUT: 0, Role.PREFILL: prefill, Role.DECODE: final - prefill}


def _max_flow(drop: dict[str, int], have: dict[tuple[str, Role], int], excess: dict[Role, int]):
    """How many GPUs of each (pool, role) leave so that the most leave from over-full roles: a max flow
    source → pool (``drop``) → role (``have``) → sink (``excess``). Edmonds–Karp on 8 nodes."""
    nodes = ["src", *POOLS, *_ROLES, "sink"]
    index = {n: i for i, n in enumerate(nodes)}
    size = len(nodes)
    cap = [[0] * size for _ in range(size)]
    for p in POOLS:
        cap[index["src"]][index[p]] = drop[p]
        for r in _ROLES:
            cap[index[p]][index[r]] = have[(p, r)]
    for r in _ROLES:
        cap[index[r]][index["sink"]] = excess[r]
    flow = [[0] * size for _ in range(size)]
    src, sink = index["src"], index["sink"]
    while True:
        parent = [-1] * size
        parent[src] = src
        queue = deque([src])
        while queue and parent[sink] < 0:
            u = queue.popleft()
            for v in range(size):
                if parent[v] < 0 and cap[u][v] - flow[u][v] > 0:
                    parent[v] = u
                    queue.append(v)
        if parent[sink] < 0:
            break
        push, v = math.inf, sink
        while v != src:
            u = parent[v]
            push = min(push, cap[u][v] - flow[u][v])
            v = u
        v = sink
        while v != src:
            u = parent[v]
            flow[u][v] += push
            flow[v][u] -= push
            v = u
    return {(p, r): flow[index[p]][index[r]] for p in POOLS for r in _ROLES}
