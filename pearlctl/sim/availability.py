"""The elastic-capacity trace: when preemptible GPUs are granted, when their preemption notice arrives and
when they are taken away.

A trace is computed once, before the run, from the scenario's explicit events and its seeded random process
(``Availability``), so every policy in a comparison — and the oracle, which may read it — faces exactly the
same capacity. Guarantees: a GPU id is never granted twice at once; a lease's notice comes at most
``notice_s`` before its end and never before its start; the same seed gives the same trace.

Correlation: random grants are node-sized blocks that are preempted as a block, and cluster-wide reclaims
end every lease alive at that moment — the correlated preemptions of a partition taken back by a
higher-priority job (Slurm preempts by job, and jobs hold whole nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pearlctl.sim.scenario import Scenario


@dataclass(frozen=True)
class Lease:
    gpus: tuple[int, ...]
    start: float
    end: float  # math.inf: never preempted within the horizon
    notice_at: float  # when ends_at becomes known (start <= notice_at <= end)


@dataclass(frozen=True)
class Trace:
    leases: tuple[Lease, ...]
    preempt_per_hour: float  # expected preemptions of one elastic GPU per hour (what a live estimate would say)

    def granted_at(self, t: float) -> set[int]:
        return {g for lease in self.leases if lease.start <= t < lease.end for g in lease.gpus}


def build_trace(scenario: Scenario, *, horizon_s: float, seed: int) -> Trace:
    """The elastic leases over ``[0, horizon_s]``. Elastic GPU ids follow the trainer and rollout pools."""
    c, a = scenario.cluster, scenario.availability
    if not c.elastic_gpus:
        return Trace((), 0.0)
    first = c.trainer_gpus + c.rollout_gpus
    slots = list(range(first, first + c.elastic_gpus))
    rng = np.random.default_rng([seed, 0xE1A5])

    # Candidate events in time order: (time, order, kind, n). Explicit ones first at equal times.
    events: list[tuple[float, int, str, int, float]] = []
    if a.initial_gpus:
        events.append((0.0, 0, "grant", a.initial_gpus, a.notice_s))
    for e in a.events:
        events.append((e.at_s, 1, "grant" if e.grant else "preempt", e.grant or e.preempt, e.notice_s or a.notice_s))
    if a.grant_interval_s > 0:
        t = rng.exponential(a.grant_interval_s)
        while t < horizon_s:
            events.append((t, 2, "grant", a.grant_gpus, a.notice_s))
            t += rng.exponential(a.grant_interval_s)
    if a.reclaim_interval_s > 0:
        t = rng.exponential(a.reclaim_interval_s)
        while t < horizon_s:
            events.append((t, 3, "reclaim", 0, a.notice_s))
            t += rng.exponential(a.reclaim_interval_s)
    events.sort(key=lambda e: (e[0], e[1]))

    # Leases as mutable [gpus, start, end, notice_s]; a slot is free once its lease has ended.
    leases: list[list] = []

    def free_slots(t: float) -> list[int]:
        used = {g for gpus, start, end, _ in leases if start <= t < end for g in gpus}
        return [s for s in slots if s not in used]

    for t, _, kind, n, notice in events:
        if kind == "grant":
            free = free_slots(t)
            # The lowest free ids: grants of node size on a node-aligned pool stay node-aligned.
            take = free[:n]
            if take:
                # Every grant (explicit or random) draws a lifetime when the scenario sets lifetime_s or
                # lifetime_mixture (a component by weight, then its exponential).
                if a.lifetime_mixture:
                    weights = [p for p, _ in a.lifetime_mixture]
                    mean = a.lifetime_mixture[int(rng.choice(len(weights), p=weights))][1]
                    life = rng.exponential(mean)
                else:
                    life = rng.exponential(a.lifetime_s) if a.lifetime_s > 0 else math.inf
                leases.append([tuple(take), t, t + life, notice])
        else:
            alive = [lease for lease in leases if lease[1] <= t < lease[2]]
            if kind == "reclaim":
                for lease in alive:
                    lease[2], lease[3] = t, notice
                continue
            # Explicit preemption of n GPUs: the newest leases first; a lease partly hit is split.
            left = n
            for lease in sorted(alive, key=lambda x: -x[1]):
                if left <= 0:
                    break
                gpus = lease[0]
                hit, keep = gpus[len(gpus) - min(left, len(gpus)) :], gpus[: len(gpus) - min(left, len(gpus))]
                left -= len(hit)
                if keep:
                    leases.append([keep, lease[1], lease[2], lease[3]])
                lease[0], lease[2], lease[3] = hit, t, notice

    out = tuple(
        sorted(
            (Lease(tuple(g), s, e, max(s, e - notice) if math.isfinite(e) else math.inf) for g, s, e, notice in leases),
            key=lambda x: (x.start, x.gpus),
        )
    )
    return Trace(out, _preempt_rate(scenario, out, horizon_s))


def _preempt_rate(scenario: Scenario, leases: tuple[Lease, ...], horizon_s: float) -> float:
    a = scenario.availability
    rate = 0.0
    if a.lifetime_s > 0:
        rate += 3600.0 / a.lifetime_s
    if a.reclaim_interval_s > 0:
        rate += 3600.0 / a.reclaim_interval_s
    explicit = [e for e in a.events if e.preempt]
    if explicit:
        gpu_h = sum(len(x.gpus) * (min(x.end, horizon_s) - x.start) for x in leases) / 3600.0
        rate += sum(e.preempt for e in explicit) / gpu_h if gpu_h > 0 else 0.0
    return rate
