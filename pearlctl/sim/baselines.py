"""The two fixed deployments a run with a judge is compared against, which no daemon policy is: ``colocated`` (the
policy and the judge time-share every generation GPU) and ``disaggregated`` (a fixed split of the GPUs between
them, the best a sweep finds).

Both keep what a fixed allocation keeps: the trainer trains on its own GPUs and lends none, and no elastic GPU is
used; they differ only in how the rollout and reward pools' GPUs are shared between the two models — in time, or
in space. Each run records its schedule of roles when asked (``record_schedule``), in the scenario's own GPU
numbering, so that the oracle (pearlctl.sim.oracle) can replay it.

Guarantees: deterministic for a scenario, as every simulated run; a scenario without a ``[judge]`` is a
``SimulationError`` naming it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pearlctl.planner.model import Role
from pearlctl.planner.profile import WEIGHT_LOAD
from pearlctl.sim.gpus import Schedule, SimGpu
from pearlctl.sim.run import RunResult, Sim, SimulationError
from pearlctl.sim.scenario import Cluster, Scenario
from pearlctl.vocabulary import SERVING_POOLS
from pearlctl.vocabulary import StepKind as K

SPLITS_MAX = 16  # ``disaggregated`` tries at most this many splits, evenly spaced


def _needs_judge(scenario: Scenario, what: str) -> None:
    if scenario.judge is None:
        raise SimulationError(f"{what}; {scenario.name} has no [judge]")


class TimeShared:
    """``colocated``'s controller: every rollout and reward GPU holds the policy's worker and the judge's, one
    awake at a time (vLLM's sleep mode, level 1). The policy serves while a rollout is in flight; once none is and
    verdicts wait, every GPU puts the policy to sleep and wakes the judge, which judges until no verdict is left
    and a rollout waits (as verl's colocated reward loop wakes its judge once all rollouts are done). Each switch
    costs, per GPU, the leaving model's ``sleep_s`` and the coming one's ``wake_s`` (each model's own profile,
    times the mismatch's factor for the move), and a policy worker that slept through a train step loads the new
    weights as it wakes (``weight_sync_s``)."""

    def __init__(self, sim: Sim):
        self.gpus: list[SimGpu] = [g for g in sim.gpus if g.pool in SERVING_POOLS]
        for g in self.gpus:  # deployed with the policy awake, the judge asleep beside it
            g.role = Role.ROLLOUT
        sim.gpus_changed = True
        self.judging = False

    def control(self, sim: Sim, t: float) -> None:
        if any(g.busy_until > t for g in self.gpus):
            return  # a switch is under way
        waiting, judging, _ = sim.judges.counts()
        verdicts, rollouts = waiting + judging > 0, sim.engine.busy()
        if not self.judging and verdicts and not rollouts:
            self._switch(sim, t, Role.REWARD)
        elif self.judging and rollouts and not verdicts:
            self._switch(sim, t, Role.ROLLOUT)

    def _switch(self, sim: Sim, t: float, to: Role) -> None:
        policy, judge = sim.profile.costs, sim.scenario.judge.profile.costs
        leave, come = (policy, judge) if to == Role.REWARD else (judge, policy)
        for g in self.gpus:
            steps = [(K.SLEEP, leave.sleep_s), (K.WAKE, come.wake_s)]
            if to == Role.ROLLOUT and g.version < sim.version:
                steps.append((WEIGHT_LOAD, sim.scenario.training.weight_sync_s))
                g.version = sim.version
            g.role, g.busy_until = to, t + sim.moves.true_cost(steps, g.role, to)
            sim.transitions += 1
        self.judging = to == Role.REWARD
        sim.gpus_changed = True


def colocated(scenario: Scenario, *, record_schedule: bool = False, **kw) -> RunResult:
    """The colocated baseline (``TimeShared``). ``kw``: ``run.run_policy``'s."""
    _needs_judge(scenario, "colocated time-shares GPUs between the policy and a judge")
    sim = Sim(scenario, "colocated", None, record_schedule=record_schedule, **kw)
    sim.controller = TimeShared(sim)
    return sim.run()


def disaggregated(scenario: Scenario, *, record_schedule: bool = False, **kw) -> RunResult:
    """The disaggregated baseline: a fixed split of the rollout and reward pools' GPUs between the policy and the
    judge, the best one found by a sweep (``static`` on each split, every ``gpus_per_worker`` of the judge's
    profile, at most ``SPLITS_MAX`` evenly spaced; on a tie the fewer judges). Every split trains the same samples,
    so a split still training when the best so far had finished cannot win: it is stopped there (the sweep starts
    from the scenario's own split and goes outward, so that a good one comes early). ``RunResult.chosen`` names the
    split; its schedule (when recorded) is in the scenario's GPU numbering. ``kw``: ``run.run_policy``'s."""
    from pearlctl.policies import load_policy

    _needs_judge(scenario, "disaggregated splits GPUs between the policy and a judge")
    c, step = scenario.cluster, scenario.judge.profile.gpus_per_worker
    total = c.rollout_gpus + c.reward_gpus
    splits = list(range(step, total - scenario.profile.gpus_per_worker + 1, step))
    if not splits:
        raise SimulationError(f"{scenario.name}: {total} rollout and reward GPUs cannot be split between two models")
    if len(splits) > SPLITS_MAX:
        splits = sorted({splits[round(i * (len(splits) - 1) / (SPLITS_MAX - 1))] for i in range(SPLITS_MAX)})
    splits.sort(key=lambda j: (abs(j - c.reward_gpus), j))
    decide = load_policy("static").decide
    best: tuple[RunResult, int] | None = None
    for judges in splits:
        split = replace(c, rollout_gpus=total - judges, reward_gpus=judges)
        sim = Sim(replace(scenario, cluster=split), "static", decide, record_schedule=record_schedule, **kw)
        finished = best is not None and best[0].finished
        sim.advance(best[0].sim_time_s + scenario.tick_s if finished else math.inf)
        if finished and sim.trained < sim.steps:
            continue  # slower than the best so far
        r = sim.result()
        if best is None or (r.finished, r.samples_per_s, -judges) > (best[0].finished, best[0].samples_per_s, -best[1]):
            best = r, judges
            r.chosen = f"{judges} of {total} GPUs judging"
            if r.schedule is not None:
                r.schedule = renumbered(r.schedule, split, c)
    result = best[0]
    result.policy = "disaggregated"
    return result


def renumbered(schedule: Schedule, split: Cluster, cluster: Cluster) -> Schedule:
    """``schedule`` of a run on ``split`` (``cluster`` with its rollout and reward GPUs split otherwise) in
    ``cluster``'s GPU numbering (pearlctl.sim.gpus.make_gpus: trainer, rollout, elastic, reward): the trainer's
    and the elastic GPUs keep their place; the k-th rollout-or-reward GPU of one is the k-th of the other."""

    def layout(c: Cluster) -> list[int]:
        t, r, e = c.trainer_gpus, c.rollout_gpus, c.elastic_gpus
        gen = t + r + e
        return [*range(t, t + r), *range(gen, gen + c.reward_gpus)]

    to = dict(zip(layout(split), layout(cluster), strict=True))
    shift = cluster.rollout_gpus - split.rollout_gpus  # elastic GPUs sit after the rollout pool
    first_elastic = split.trainer_gpus + split.rollout_gpus

    def gid(i: int) -> int:
        if i in to:
            return to[i]
        return i + shift if first_elastic <= i < first_elastic + split.elastic_gpus else i

    return replace(schedule, changes=[(at, gid(i), role) for at, i, role in schedule.changes])
