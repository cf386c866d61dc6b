"""A policy's plans carried out on the simulated GPUs, as the daemon carries them out (``Moves``, one per
``pearlctl.sim.run.Sim``): each move at its *true* cost from the profile (a move's own ``cost_s`` is the
planner's estimate, not what the simulated GPU pays), a plan's switches one transition at a time, the trainer's
GPUs returned when it needs them.

- **Switches one group at a time.** A plan's switches run one group at a time, a group being the GPUs of one
  node and pool moving between the same roles (one live transition), the other workers serving meanwhile; no
  new plan is made until they all ran — as the daemon does (pearlctl/daemon/borrowing.py).
- **Leaves are paid.** A move that takes a worker out of serving (return, retire, switch) first aborts what it
  runs — ``ABORT_S`` more than the step's own cost (``pearlctl.sim.engine``: abort and continue).
- **Moves to and from the judge cost its engine** (a run with a ``[judge]``): a switch between the policy and the
  judge parks the leaving model's worker asleep on the GPU and wakes the other's where it sleeps there, else starts
  it (each at its own profile's cost); a trainer GPU lent to the judge offloads and starts it, or wakes a judge
  parked there by an earlier loan's return or shift; one parked worker per model per GPU, as the daemon's (a policy
  worker and a judge); a reward pool's GPU moves between the judge and the policy as a rollout GPU does.
- **The truth may differ from the profile.** Under a model mismatch every move takes its profile cost times a
  factor drawn per move (in move order: deterministic for a seed); the steps' true durations are journaled and
  the costs a policy plans with are their running estimates (``costs``), as the daemon's.

Guarantees: the daemon's return guarantee holds — when the trainer needs its GPUs, lent ones are returned
(``force_return``, forced if the policy has not); a GPU is never moved while it is in transition; moves that do
not match the simulated state are refused and counted by reason (``refusals``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pearlctl.planner.model import SERVING, Move, MoveKind, Plan, Role, Snapshot
from pearlctl.planner.profile import (
    COST_ESTIMATE_LAST,
    STEP_COSTS,
    WEIGHT_LOAD,
    Profile,
    TransitionCosts,
    judge_engine_costs,
    judges_step,
)
from pearlctl.sim.migration import ABORT_S
from pearlctl.vocabulary import PoolKind
from pearlctl.vocabulary import StepKind as K

if TYPE_CHECKING:
    from pearlctl.sim.gpus import SimGpu
    from pearlctl.sim.scenario import Scenario
    from pearlctl.sim.snapshot import PolicyView


class MovesRun(Protocol):
    """What ``Moves`` reads and writes of its run (``pearlctl.sim.run.Sim``): the scenario (its seed, weight sync and
    mismatch) and profile, the policy (``decide``) and what it sees (``view``), the GPUs, the trainer's phase and
    weights version, and whether the run is in the oracle's world (``free_migration``: its GPUs come back
    instantly); a move counts in ``transitions`` and sets ``gpus_changed``."""

    scenario: Scenario
    profile: Profile
    decide: Callable[[Snapshot], Plan | None] | None
    view: PolicyView
    gpus: list[SimGpu]
    free_migration: bool
    training_until: float | None
    version: int
    transitions: int
    gpus_changed: bool


class Moves:
    """The moves of ``sim``'s policy: its plans applied, its switches queued, its refusals and forced returns."""

    def __init__(self, sim: MovesRun):
        self.sim = sim
        self.plans = 0
        self.forced_returns = 0
        self.refusals: dict[str, int] = {}  # refused moves by reason
        self.last_change_at: float | None = None
        # a plan's switches not started yet, one group per live transition (node, pool, roles), and the GPUs
        # of the group now switching: the daemon runs a plan's switches one transition at a time
        self._switch_queue: list[list[Move]] = []
        self._switching: list[int] = []
        # Model mismatch: each move's true duration is its profile cost times a factor drawn per move; the steps'
        # true durations are journaled and the snapshot's costs are their running estimates, as the daemon's.
        self._move_rng = np.random.default_rng([sim.scenario.seed, 0x7A11])
        # journaled true step durations by (on the judge's engine, step kind) (``judges_step``)
        self._journal: dict[tuple[bool, str], list[float]] = {}
        self._costs: tuple[TransitionCosts, TransitionCosts] | None = None  # (``costs``, ``judge_costs``)
        # the roles a GPU may serve: the policy's, and the judge's in a run with one
        self._served = (*SERVING, Role.REWARD) if sim.scenario.judge is not None else tuple(SERVING)

    @property
    def switching(self) -> bool:
        """A plan's switches still run (or wait to): the daemon plans nothing new meanwhile."""
        return bool(self._switch_queue or self._switching)

    @property
    def queued(self) -> bool:
        """A plan's switches wait to start."""
        return bool(self._switch_queue)

    def control(self, t: float) -> None:
        """Ask the policy for a plan (on the snapshot at ``t``) and carry it out."""
        sim = self.sim
        plan = sim.decide(sim.view.snapshot(t))
        if plan is None or not plan.moves:
            return
        self.plans += 1
        applied = 0
        groups: dict[tuple, list[Move]] = {}
        for move in plan.moves:
            if move.kind is MoveKind.SWITCH and 0 <= move.gpu < len(sim.gpus):
                g = sim.gpus[move.gpu]
                groups.setdefault((g.node, g.pool, move.from_role, move.to_role), []).append(move)
            else:
                applied += self.apply(move, t)
        self._switch_queue = list(groups.values())
        applied += self.next_switch(t)
        if applied:
            self.last_change_at = t

    def next_switch(self, t: float) -> int:
        """Start the plan's next group of switches once the group switching now has finished (as the
        daemon's transitions do: one switch at a time, the other workers serving meanwhile); a group none
        of whose moves still fit ends the plan's switches, as a failed switch drops the daemon's waiting
        ones. Returns the moves applied."""
        if any(self.sim.gpus[i].busy_until > t for i in self._switching):
            return 0
        self._switching = []
        while self._switch_queue:
            group = self._switch_queue.pop(0)
            applied = [m.gpu for m in group if self.apply(m, t)]
            if applied:
                self._switching = applied
                return len(applied)
            self._switch_queue = []
        return 0

    def force_return(self, g: SimGpu, t: float) -> None:
        """The daemon's return guarantee: trainer GPU ``g`` goes back to TRAIN (instantly for the oracle)."""
        sim = self.sim
        if sim.free_migration:  # the oracle's GPUs come back instantly
            g.role, g.borrowed, sim.gpus_changed = Role.TRAIN, False, True
            return
        self.forced_returns += 1
        self.apply(Move(g.id, MoveKind.RETURN, g.role, Role.TRAIN, 0.0), t)

    def apply(self, move: Move, t: float) -> bool:
        """Apply one move at its true cost; refuse (and count) one that does not fit the simulated state."""
        sim = self.sim
        if not 0 <= move.gpu < len(sim.gpus) or not sim.gpus[move.gpu].present:
            return self._refuse(move, "no such GPU present")
        g = sim.gpus[move.gpu]
        if g.busy_until > t:
            return self._refuse(move, "GPU in transition")
        if g.role != move.from_role or move.to_role == move.from_role:
            return self._refuse(move, f"GPU is {g.role.value}, not {move.from_role.value}")
        steps = self._steps(move, g)
        if isinstance(steps, str):
            return self._refuse(move, steps)
        to = move.to_role
        cost = self.true_cost(steps, g.role, to)
        if g.role in SERVING or g.role == Role.REWARD:
            cost += ABORT_S  # a worker leaving its role first aborts what it runs (continued or sent again)
        if to in SERVING:
            g.version = sim.version  # a cold start loads the newest weights; a stale wake paid its sync above
        g.role = to
        g.busy_until = t + cost
        sim.transitions += 1
        sim.gpus_changed = True
        return True

    def _steps(self, move: Move, g: SimGpu) -> list[tuple[str, float]] | str:
        """The steps of ``move`` on ``g`` (journal kind, profile seconds), with the engines parked on ``g`` and its
        loan brought up to date; or, the GPU left as it was, why the move does not fit ``g``'s pool and role."""
        sim = self.sim
        c = sim.profile.costs
        kind, to = move.kind, move.to_role
        stale = g.version < sim.version
        judge = sim.scenario.judge
        jc = judge.profile.costs if judge is not None else c  # the judge's engine: its own profile's costs
        # the move's steps (journal kind, profile seconds); a stale wake also loads the newest weights
        wake = [(K.WAKE, c.wake_s)] + ([(WEIGHT_LOAD, sim.scenario.training.weight_sync_s)] if stale else [])
        if kind == MoveKind.BORROW:
            # The trainer releases a GPU only while it waits for rollouts, never mid-step.
            if g.pool != PoolKind.TRAINER or sim.training_until is not None or to not in self._served:
                return "borrow of a non-trainer GPU, to a non-serving role, or mid-step"
            if to == Role.REWARD:  # the judge never changes: a parked judge wakes with its weights
                steps = [(K.OFFLOAD, c.offload_s), (K.WAKE, jc.wake_s) if g.parked_judge else (K.START, jc.start_s)]
            else:
                steps = [(K.OFFLOAD, c.offload_s)] + (wake if g.parked else [(K.START, c.start_s)])
            # one parked worker per model: the one of the role lent to serves; the other model's stays parked
            # (live: gpus.worker_id and gpus.parked_judge_id)
            g.borrowed = True
            if to == Role.REWARD:
                g.parked_judge = False
            else:
                g.parked = False
        elif kind == MoveKind.RETURN:
            if g.pool != PoolKind.TRAINER or to != Role.TRAIN:
                return "return of a non-trainer GPU or to a role other than TRAIN"
            # the worker is parked asleep: the next borrow to its role is a wake
            judged = g.role == Role.REWARD
            steps = [(K.SLEEP, jc.sleep_s if judged else c.sleep_s), (K.RELOAD, c.reload_s)]
            g.borrowed = False
            if judged:
                g.parked_judge = True
            else:
                g.parked = True
        elif kind in (MoveKind.START, MoveKind.WAKE):
            if g.pool == PoolKind.TRAINER or g.role != Role.IDLE or to not in SERVING:
                return "start/wake of a trainer GPU, a non-idle GPU, or to a non-serving role"
            steps = wake if g.parked else [(K.START, c.start_s)]  # a WAKE of a GPU with nothing parked: cold start
            g.parked = False
        elif kind == MoveKind.RETIRE:
            if g.role not in SERVING or to != Role.IDLE or g.pool == PoolKind.TRAINER:
                return "retire of a trainer GPU or of a GPU not serving"
            # Elastic GPUs may vanish: stop the worker; rollout GPUs park it for a quick wake.
            elastic = g.pool == PoolKind.ELASTIC
            steps, g.parked = ([(K.STOP, c.stop_s)], False) if elastic else ([(K.SLEEP, c.sleep_s)], True)
        elif kind == MoveKind.SWITCH:
            if g.role not in self._served or to not in self._served:
                return "switch between non-serving roles"
            if Role.REWARD in (g.role, to):
                # another model: the leaving engine parks asleep on the GPU; the coming one wakes where it sleeps
                # there (a policy that slept through a step loads the newest weights), else starts cold
                judged = to == Role.REWARD
                steps = [(K.SLEEP, (c if judged else jc).sleep_s)]
                if judged:
                    steps.append((K.WAKE, jc.wake_s) if g.parked_judge else (K.START, jc.start_s))
                else:
                    steps += wake if g.parked else [(K.START, c.start_s)]
                g.parked, g.parked_judge = judged, not judged
            else:
                steps = [("SWITCH", c.role_switch_s)]  # not a journaled step kind: planned at the profile's cost
        else:
            return "unknown move kind"
        return steps

    def true_cost(self, steps: list[tuple[str, float]], from_role: Role, to_role: Role) -> float:
        """A move's true duration: its steps' profile costs times the mismatch's factor for this move (one
        draw per move, in move order: deterministic for a seed). Each step's true duration is journaled, as the
        daemon's are, with the roles the move is between (whose engine a step acts on, ``judges_step``)."""
        mm = self.sim.scenario.mismatch.transitions
        f = 1.0 if mm.zero else float(mm.factors(self._move_rng, 1)[0])
        cost = 0.0
        for kind, seconds in steps:
            true_s = seconds * f
            judged = judges_step({"kind": kind, "from_role": from_role, "to_role": to_role})
            self._journal.setdefault((judged, kind), []).append(true_s)
            self._costs = None  # (``costs``: estimated again)
            cost += true_s
        return cost

    def costs(self) -> TransitionCosts:
        """The transition costs a policy plans with: the daemon's running estimates (``PolicyInputs.costs``: the
        median of the last 5 journaled steps of each kind, else the profile's). They change only when a step is
        journaled (``true_cost``), so they are kept until then."""
        return self._estimates()[0]

    def judge_costs(self) -> TransitionCosts:
        """``costs`` with the judge's engine's own estimates (its steps', else its profile's; ``Snapshot.
        judge_costs``, the daemon's ``PolicyInputs.judge_costs``)."""
        return self._estimates()[1]

    def _estimates(self) -> tuple[TransitionCosts, TransitionCosts]:
        if self._costs is None:
            policy_base = self.sim.profile.costs
            judge = self.sim.scenario.judge
            judge_base = judge.profile.costs if judge is not None else policy_base

            def measured(judged: bool) -> dict[str, float]:
                return {
                    field: statistics.median(self._journal[(judged, kind)][-COST_ESTIMATE_LAST:])
                    for kind, field in STEP_COSTS.items()
                    if (judged, kind) in self._journal
                }

            policy = replace(policy_base, **measured(False))
            self._costs = (policy, judge_engine_costs(policy, measured(True), judge_base))
        return self._costs

    def _refuse(self, move: Move, why: str) -> bool:
        key = f"{move.kind.value}: {why}"
        self.refusals[key] = self.refusals.get(key, 0) + 1
        return False
