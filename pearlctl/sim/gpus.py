"""The simulated GPUs (``SimGpu``) and what follows from their roles whenever they change (``GpuRoles``, one per
``pearlctl.sim.run.Sim``): which engine worker serves in which role, the GPU-second census by category, the
timeline and the schedule of roles the oracle replays (``Schedule``).

A worker (``gpus_per_worker`` GPUs) serves when all its GPUs are present, in its first GPU's serving role and
not stopped (in a transition, or drained before a preemption); a preemption notice makes it unroutable (it
drains). Each GPU counts in one category (``CATEGORIES``): its role, TRAIN split by whether the trainer is
computing, and TRANSITION while it is stopped.

Guarantees: the roles and the census change only on events, so they are recomputed only then (the ``Sim``'s
``gpus_changed``: a GPU's presence, role, ``busy_until`` or ``abort_at`` changed) or when time passes one of those
instants (``next_expiry``); between two refreshes every tick counts the same census.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pearlctl.planner.model import SERVING, Role
from pearlctl.sim.engine import W_DECODE, W_OFF, W_PREFILL, W_ROLLOUT, Engine
from pearlctl.vocabulary import PoolKind

if TYPE_CHECKING:
    from pearlctl.sim.scenario import Cluster

ENGINE_ROLE = {Role.ROLLOUT: W_ROLLOUT, Role.PREFILL: W_PREFILL, Role.DECODE: W_DECODE}
TIMELINE_EVERY_S = 10.0

# GPU-second categories: the roles, with TRAIN split by whether the trainer is computing, and TRANSITION.
_R = Role
CATEGORIES = (_R.TRAIN, "TRAIN_IDLE", _R.ROLLOUT, _R.PREFILL, _R.DECODE, _R.REWARD, _R.IDLE, "TRANSITION")


@dataclass
class SimGpu:
    id: int
    node: str
    pool: str
    role: Role
    present: bool = True  # elastic: granted and not yet preempted
    parked: bool = False  # a policy worker sleeps here
    parked_judge: bool = False  # a judge sleeps here (a trainer GPU lent to the judge and returned)
    borrowed: bool = False
    busy_until: float = 0.0  # in transition until then (does no work)
    ends_at: float | None = None
    version: int = 0  # policy weights it holds (a woken parked worker with old weights must sync)
    abort_at: float | None = None  # preemption notice: its worker drains until then, then aborts and stops


@dataclass
class Schedule:
    """What a run did with its GPUs, as the oracle replays it (pearlctl.sim.oracle, ``ReplayController``): every
    change of a GPU's role (its target role from the moment its move began; None while the GPU is not granted),
    and when each of the trainer's steps began its epoch — ``epochs[e]``: the time it had trained ``e`` steps."""

    epochs: list[float] = field(default_factory=lambda: [0.0])
    changes: list[tuple[float, int, Role | None]] = field(default_factory=list)


class RolesRun(Protocol):
    """What ``GpuRoles`` reads and writes of its run (``pearlctl.sim.run.Sim``): the GPUs and how many make a worker,
    the engines their roles go to, whether the trainer computes, and whether a GPU's presence, role, ``busy_until``
    or ``abort_at`` changed since the last refresh (``gpus_changed``: whoever changes one sets it, ``refresh``
    clears it)."""

    gpus: list[SimGpu]
    gpw: int
    engine: Engine
    training_until: float | None
    gpus_changed: bool


def make_gpus(c: Cluster) -> list[SimGpu]:
    """The cluster's GPUs, numbered trainer, rollout, elastic, reward: the trainer's training, the rollout pool's
    serving rollouts, the elastic pool's idle and not granted yet, the reward pool's judging."""
    gpus = []
    generation = c.trainer_gpus + c.rollout_gpus + c.elastic_gpus
    for i in range(generation + c.reward_gpus):
        if i < c.trainer_gpus:
            pool, role, node = PoolKind.TRAINER, Role.TRAIN, f"t{i // c.gpus_per_node}"
        elif i < c.trainer_gpus + c.rollout_gpus:
            j = i - c.trainer_gpus
            pool, role, node = PoolKind.ROLLOUT, Role.ROLLOUT, f"r{j // c.gpus_per_node}"
        elif i < generation:
            j = i - c.trainer_gpus - c.rollout_gpus
            pool, role, node = PoolKind.ELASTIC, Role.IDLE, f"e{j // c.gpus_per_node}"
        else:
            j = i - generation
            pool, role, node = PoolKind.REWARD, Role.REWARD, f"j{j // c.gpus_per_node}"
        gpus.append(SimGpu(i, node, pool, role, present=pool != PoolKind.ELASTIC))
    return gpus


def judge_workers(gpus: list[SimGpu], gpus_per_worker: int, t: float) -> int:
    """Judge workers serving at ``t``: GPUs judging (role REWARD, present, not in transition), ``gpus_per_worker``
    of the judge's profile each."""
    return sum(1 for g in gpus if g.present and g.role == Role.REWARD and not stopped(g, t)) // gpus_per_worker


def stopped(g: SimGpu, t: float) -> bool:
    """In transition, or a worker drained and stopped before its GPU's preemption."""
    return g.busy_until > t or (g.abort_at is not None and t >= g.abort_at and g.role in SERVING)


class GpuRoles:
    """``sim``'s GPUs' roles as the engines serve them and the accounting counts them. ``schedule``: where to
    record each change of a GPU's role (None: not recorded); ``record_timeline``: sample the census over time."""

    def __init__(self, sim: RolesRun, schedule: Schedule | None, record_timeline: bool):
        self.sim = sim
        self.counts: dict[str, int] = {}  # GPUs per category since the last refresh
        self.next_expiry = 0.0  # the first busy_until or abort_at after the last refresh
        self.killed: set[int] = set()  # workers preempted without a drain since the last role sync
        self.gpu_s = dict.fromkeys(CATEGORIES, 0.0)
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self._next_sample = 0.0
        # The roles over time, for the oracle's replay (``Schedule``): recorded at every refresh of the roles.
        self.schedule = schedule
        self._recorded: list[Role | None] = [None] * len(sim.gpus)
        self._state_kept: tuple[bool, tuple[int, ...]] | None = None  # (``_state``)

    def refresh(self, t: float) -> None:
        """The roles changed, or time passed one of their instants: record, sync the engines, count."""
        if self.schedule is not None:
            self._record(t)
        self._sync_roles(t)
        self.counts = self._census(t)
        self.next_expiry = min(
            (x for g in self.sim.gpus for x in (g.busy_until, g.abort_at or 0.0) if x > t), default=math.inf
        )
        self.sim.gpus_changed = False
        self._state_kept = None

    def account(self, t: float, dt: float) -> None:
        """The tick from ``t`` in the GPU-seconds by category (and the timeline's sample when one is due)."""
        for k, n in self.counts.items():
            self.gpu_s[k] += n * dt
        if self.record_timeline and t >= self._next_sample:
            self.timeline.append((t, dict(self.counts)))
            self._next_sample = t + TIMELINE_EVERY_S

    def in_transition(self, t: float) -> bool:
        """Some present GPU is in transition at ``t``."""
        return self._state(t)[0]

    def serving_ids(self, t: float) -> tuple[int, ...]:
        """The ids of the serving GPUs that are not stopped at ``t``."""
        return self._state(t)[1]

    def _state(self, t: float) -> tuple[bool, tuple[int, ...]]:
        """(some present GPU is in transition, the ids of the serving GPUs that are not stopped) at ``t``. Both
        change only when a GPU's presence, role, ``busy_until`` or ``abort_at`` does (each sets the sim's
        ``gpus_changed``) or when time passes one of those instants (``next_expiry``: the first after the last
        ``refresh``), so the answer is kept from the first tick that asks until either happens (``refresh``
        drops it)."""
        kept, dirty = self._state_kept, self.sim.gpus_changed
        if kept is not None and not dirty and t < self.next_expiry:
            return kept
        busy, ids = False, []
        for g in self.sim.gpus:  # (one pass: a large cluster has thousands)
            if g.present:
                if g.busy_until > t:
                    busy = True  # (in transition: stopped)
                elif g.role in SERVING and not stopped(g, t):
                    ids.append(g.id)
        serving = tuple(ids)
        if not dirty and t < self.next_expiry:
            self._state_kept = busy, serving
        return busy, serving

    def _record(self, t: float) -> None:
        """Append the GPUs whose role (or presence) changed since the last record to the schedule."""
        seen, changes = self._recorded, self.schedule.changes
        for g in self.sim.gpus:
            role = g.role if g.present else None
            if role != seen[g.id]:
                seen[g.id] = role
                changes.append((t, g.id, role))

    def _sync_roles(self, t: float) -> None:
        gpus, gpw = self.sim.gpus, self.sim.gpw
        n = len(gpus) // gpw
        # A worker serves when all its GPUs are present, in its first GPU's serving role and not stopped: one pass
        # over the GPUs, one over the workers (a large cluster has thousands; a one-GPU worker is its GPU).
        up = [g.present and g.role in SERVING and not stopped(g, t) for g in gpus]
        notice = [g.abort_at is not None for g in gpus]  # a preemption notice: its worker drains
        roles, routable = [W_OFF] * n, [True] * n
        for k in range(n):
            lo, hi = k * gpw, (k + 1) * gpw
            r = gpus[lo].role
            if up[lo] and (gpw == 1 or (all(up[lo:hi]) and all(g.role == r for g in gpus[lo:hi]))):
                roles[k] = ENGINE_ROLE[r]
                routable[k] = not any(notice[lo:hi])
        killed = np.zeros(n, bool)
        killed[list(self.killed)] = True
        self.killed.clear()
        self.sim.engine.set_roles(np.array(roles, np.int8), t, routable=np.array(routable, bool), killed=killed)

    def _census(self, t: float) -> dict[str, int]:
        counts = dict.fromkeys(CATEGORIES, 0)
        training = self.sim.training_until is not None
        for g in self.sim.gpus:
            if g.present:
                counts[_category(g, t, training)] += 1
        return counts


def _category(g: SimGpu, t: float, training: bool) -> str:
    if stopped(g, t):
        return "TRANSITION"
    if g.role == Role.TRAIN:
        return Role.TRAIN.value if training else "TRAIN_IDLE"
    return str(g.role)  # (its value: a StrEnum's str, without the enum's value property)
