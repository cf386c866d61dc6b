"""The oracle: an upper bound on the compared policies, by construction, that costs a few simulations.

The oracle is the best of a few whole-run *candidates*. Each is a schedule of GPU roles played on the true run
(the same drawn trajectories, elastic trace and model mismatch as every policy) in a world no policy has:

- **no transition cost**: a GPU takes its new role at the instant its move would start, and the trainer's GPUs
  come back the moment it needs them (no trainer delay);
- **no loss at a leave**: the engine runs with ``free_migration`` (a worker that leaves hands its sequences and
  their KV over at once, a session's KV follows it wherever the router sends it: nothing is aborted, lost or
  recomputed), and a preempted GPU serves to the end of its lease (no drain on a notice);
- **foresight**: every candidate is played to the end, and the one whose trainer trains all the steps soonest
  (the most samples per second) is the oracle's run (``RunResult.oracle_choice`` names it).

The candidates:

1. **Every compared policy's own decisions, replayed** (``ReplayController``): the roles the policy gave each
   GPU over time (``pearlctl.sim.gpus.Schedule``), each taken at the moment the policy's move began, at no
   cost. The replay follows the policy's run step by step (``_Follow``): in the trainer's ``e``-th step (its
   epoch: from when it had trained ``e`` steps) it plays the roles the policy had at the same offset into its
   own ``e``-th epoch. A replay pays no move, loses nothing at a leave and never waits for a return, so its
   epochs are no longer than the policy's and it plays the policy's whole sequence of decisions no later than
   the policy did. pearl's schedule is always among them (``run_oracle`` runs pearl when the comparison has
   none): the oracle's action set contains pearl's at every decision time, each action free.
2. **pearl's prefill-decode choices on every available GPU** (``WidenedController``): at each moment pearl's
   configuration (colocated, or its share of prefill workers) applied to every granted elastic GPU and every
   trainer GPU the trainer is not using. (When pearl never left colocated this is candidate 3: played once.)
3. **Every available GPU serving, colocated** (``FixedController``), from t = 0 to the end.

In a run with a judge (a scenario's ``[judge]``) the candidates are the replays (1.), the judge's roles among the
replayed ones, and the judge too loses nothing at a leave (pearlctl.sim.judging, ``free_migration``); ``compare``
passes the schedules of the ``colocated`` and ``disaggregated`` baselines it ran (pearlctl.sim.baselines), so the
oracle replays every compared deployment at no cost. Candidates 2 and 3 serve the policy alone and would leave
the verdicts unasked: they are not played.

What holds by construction is the containment: whatever pearl did, the oracle could do at the same moment of
its run, for free. That the free replay is then at least as fast as pearl itself is the claim the property
test checks over generated scenarios and seeds (``tests/unit/test_sim_oracle.py``), and the gate on every
shipped one; a narrowed oracle (without the replay, or without lending) fails that test. What the oracle may
do that no policy can is listed in docs/simulator.md ("The oracle").

Cost: a candidate is one simulation, nothing is forked, and the candidates run one after another (the memory of
one engine at a time), so the oracle costs two or three runs more than the policies and scales as they do.
"""

from __future__ import annotations

import bisect

import numpy as np

from pearlctl.planner.model import SERVING, Role
from pearlctl.sim.engine import DEFAULT_ROUTER, W_DECODE, W_OFF, W_PREFILL, W_ROLLOUT
from pearlctl.sim.gpus import Schedule
from pearlctl.sim.run import RunResult, Sim, make_draws, make_trace, run_policy
from pearlctl.vocabulary import PD_ROLES, PoolKind

REPLAYED = "pearl"  # the policy whose schedule the oracle always replays (and widens)
WIDENED = "pearl's prefill-decode choices on every GPU"
EVERY_GPU = "every GPU serving, colocated"


def _same_share(share: float, workers: int) -> int:
    """``share`` of ``workers`` as prefill workers (at least one each side; 0 stays colocated)."""
    if share <= 0 or workers < 2:
        return 0
    return min(max(round(share * workers), 1), workers - 1)


_ROLE = {W_ROLLOUT: Role.ROLLOUT, W_PREFILL: Role.PREFILL, W_DECODE: Role.DECODE}


def _set_roles(sim: Sim, roles: dict[int, Role]) -> None:
    """Give present GPUs their roles at no cost (the oracle's world): no transition, nothing parked, the newest
    weights. A trainer GPU in a serving role is lent."""
    for g in sim.gpus:
        if not g.present:
            continue
        role = roles.get(g.id, Role.TRAIN if g.pool == PoolKind.TRAINER else Role.IDLE)
        if role != g.role:
            sim.transitions += 1
            sim.gpus_changed = True
        g.role, g.borrowed, g.busy_until, g.parked = role, g.pool == PoolKind.TRAINER and role != Role.TRAIN, 0.0, False
        g.version = sim.version


class FixedController:
    """Every available GPU serving — every granted elastic GPU, every trainer GPU the trainer is not using — in
    one configuration: colocated (``share`` 0) or that share of the workers prefilling, whatever workers are
    available. Roles change only when the GPUs present, the trainer's need, the weights or the share change."""

    def __init__(self, sim: Sim, share: float = 0.0):
        self.gpw = sim.gpw
        self.share = share
        self._applied: tuple | None = None

    def control(self, sim: Sim, t: float) -> None:
        lend = not sim.trainer_needs_gpus(t)
        key = (lend, sim.version, self.share, sim.presence())
        if key == self._applied:
            return
        self._applied = key
        avail = {g.id for g in sim.gpus if g.present and (g.pool != PoolKind.TRAINER or lend)}
        n_slots = len(sim.gpus) // self.gpw
        slots = [k for k in range(n_slots) if all(i in avail for i in range(k * self.gpw, (k + 1) * self.gpw))]
        roles = self.roles(slots, _same_share(self.share, len(slots)), n_slots)
        _set_roles(sim, {g.id: _ROLE[roles[g.id // self.gpw]] for g in sim.gpus if roles[g.id // self.gpw] != W_OFF})

    @staticmethod
    def roles(slots: list[int], n_prefill: int, n_slots: int) -> np.ndarray:
        roles = np.full(n_slots, W_OFF, np.int8)
        if not n_prefill:
            roles[slots] = W_ROLLOUT
            return roles
        roles[slots] = W_DECODE
        roles[slots[len(slots) - n_prefill :]] = W_PREFILL
        return roles


class _Follow:
    """A policy's schedule (``Schedule``) followed step by step: in the trainer's ``e``-th epoch, ``t - start``
    into it, the roles the policy's run had ``t - start`` into its own ``e``-th epoch (clamped to that epoch: a
    run that got further than the policy in an epoch keeps the policy's roles at its end)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self._times = [c[0] for c in schedule.changes]
        self.applied = 0  # changes applied so far
        self.roles: dict[int, Role | None] = {}
        self._epoch, self._epoch_at = -1, 0.0

    def follow(self, sim: Sim, t: float) -> None:
        """Bring ``roles`` to the policy's roles at the time replay time ``t`` plays."""
        epochs = self.schedule.epochs
        if sim.trained != self._epoch:
            self._epoch, self._epoch_at = sim.trained, t
        e = min(self._epoch, len(epochs) - 1)
        mapped = epochs[e] + (t - self._epoch_at)
        if e + 1 < len(epochs):
            mapped = min(mapped, epochs[e + 1] - 1e-9)
        upto = bisect.bisect_right(self._times, mapped + 1e-9)
        changes = self.schedule.changes
        while self.applied < upto:
            _, gid, role = changes[self.applied]
            self.roles[gid] = role
            self.applied += 1

    def share(self) -> float:
        """The prefill share of the policy's serving GPUs now (0: colocated)."""
        counts = {r: 0 for r in SERVING}
        for role in self.roles.values():
            if role in counts:
                counts[role] += 1
        pd = counts[Role.PREFILL] + counts[Role.DECODE]
        return counts[Role.PREFILL] / pd if counts[Role.PREFILL] and counts[Role.DECODE] else 0.0


class ReplayController:
    """A policy's own decisions at no cost (``_Follow``): each GPU takes the role the policy gave it, at the
    moment the policy's move began (the judge's among them, in a run with one). A trainer GPU serves only while
    the trainer does not need it (it comes back at once when it does), and a GPU the elastic trace has not
    granted does nothing."""

    def __init__(self, sim: Sim, schedule: Schedule):
        self.plan = _Follow(schedule)
        self._applied: tuple | None = None
        self.served = (*SERVING, Role.REWARD) if sim.judges is not None else tuple(SERVING)

    def control(self, sim: Sim, t: float) -> None:
        self.plan.follow(sim, t)
        lend = not sim.trainer_needs_gpus(t)
        key = (self.plan.applied, lend, sim.version, sim.presence())
        if key == self._applied:
            return
        self._applied = key
        roles = {}
        for g in sim.gpus:
            role = self.plan.roles.get(g.id)
            if role in self.served and (g.pool != PoolKind.TRAINER or lend):
                roles[g.id] = role
        _set_roles(sim, roles)


class WidenedController(FixedController):
    """A policy's prefill–decode choices on every available GPU: at each moment the configuration the policy
    had (colocated, or its share of prefill workers, ``_Follow``), applied as ``FixedController`` applies a
    share — to every granted elastic GPU and every trainer GPU the trainer is not using."""

    def __init__(self, sim: Sim, schedule: Schedule):
        super().__init__(sim)
        self.plan = _Follow(schedule)

    def control(self, sim: Sim, t: float) -> None:
        self.plan.follow(sim, t)
        self.share = self.plan.share()
        super().control(sim, t)


def _sim(scenario, draws, trace, router: str, controller, arg, *, record_timeline: bool = False) -> Sim:
    """A candidate: a simulation in the oracle's world under ``controller(sim, arg)``."""
    sim = Sim(
        scenario,
        "oracle",
        None,
        draws=draws,
        trace=trace,
        free_migration=True,
        record_timeline=record_timeline,
        router=router,
        correction=False,
    )
    sim.controller = controller(sim, arg)
    return sim


def _candidate(label: str, schedules: dict[str, Schedule]) -> tuple:
    """(controller, its argument) of the candidate named ``label``."""
    if label == EVERY_GPU:
        return FixedController, 0.0
    if label == WIDENED:
        return WidenedController, schedules[REPLAYED]
    return ReplayController, schedules[label.removeprefix("replay of ")]


def run_oracle(
    scenario,
    *,
    record_timeline: bool = False,
    draws=None,
    trace=None,
    router: str = DEFAULT_ROUTER,
    schedules: dict[str, Schedule] | None = None,
) -> RunResult:
    """The oracle's run: the best of the candidates (the module doc). ``schedules``: the compared policies' own
    schedules (``RunResult.schedule``, recorded with ``record_schedule``) to replay; pearl's is always among them
    (run here when missing)."""
    draws = draws if draws is not None else make_draws(scenario)
    trace = trace if trace is not None else make_trace(scenario)
    schedules = dict(schedules or {})
    if REPLAYED not in schedules:
        pearl = run_policy(scenario, REPLAYED, draws=draws, trace=trace, router=router, record_schedule=True)
        schedules[REPLAYED] = pearl.schedule
    results: dict[str, RunResult] = {}  # (ties go to the first: the simplest)
    if scenario.judge is None:  # (with a judge, every GPU serving the policy would leave the verdicts unasked)
        results[EVERY_GPU] = _sim(scenario, draws, trace, router, FixedController, 0.0).run()
        if any(role in PD_ROLES for _, _, role in schedules[REPLAYED].changes):
            # (a pearl that stayed colocated widens to the candidate above: not played twice)
            results[WIDENED] = _sim(scenario, draws, trace, router, WidenedController, schedules[REPLAYED]).run()
    for name, schedule in schedules.items():
        results[f"replay of {name}"] = _sim(scenario, draws, trace, router, ReplayController, schedule).run()
    label = min(results, key=lambda k: (not results[k].finished, -results[k].samples_per_s))
    if record_timeline:  # played again, recording (only the winner's timeline is drawn)
        best = _sim(scenario, draws, trace, router, *_candidate(label, schedules), record_timeline=True).run()
    else:
        best = results[label]
    best.policy, best.oracle_choice = "oracle", label
    return best
