"""The oracle: an upper bound on what any policy can reach on a scenario.

It replaces the policy with a controller that runs every tick and, unlike any policy:

- pays no transition cost — roles change instantly and the trainer's GPUs come back the moment it needs
  them (no trainer delay);
- puts every available GPU to work: every granted elastic GPU and every trainer GPU the trainer is not using
  serves rollouts;
- loses nothing at preemption or on a role change: the engine runs with ``free_migration`` (a worker that
  leaves hands its sequences and their KV over at once, and a session's KV follows it wherever the router
  sends it, so nothing is aborted, lost or recomputed), and its GPUs serve to the end of their lease (no
  drain on a preemption notice);
- chooses among more configurations than any policy can: colocated, or disaggregated with every prefill
  worker count a policy could form (``prefill_counts``: the planner's grid, ``choose.PREFILL_SHARES``, on any
  number of workers up to those available — a policy that serves fewer workers with ``p`` prefill workers is
  matched by the oracle's ``p`` prefill workers and more decode workers, which with free migration never
  decode slower);
- knows the future, to the end of every batch in flight: whenever the GPUs or the batches change (and every
  ``REPLAN_S``) each candidate is played forward on a copy of the whole simulation (``Sim.fork``: the drawn
  remaining work, the trainer and the rollout driver, the elastic trace, and under a model mismatch the true
  speeds — never an estimate) under that configuration, until the trainer has trained every batch that was
  in flight; it is scored by when that happened, then by the sum of those batches' completion times — every
  batch in flight counts, not only the oldest. Candidates are raced (``_race``): all of them play
  ``RACE_S`` forward, the better half goes on for twice as long, and so on; the last ``FINALISTS`` play to
  the end.

Engine physics (KV capacity, decode speed, prefill, tool latencies, and any mismatch) are exactly the ones
every policy faces: the bound comes from capacity, zero cost and foresight only. It is a bound on the shipped
policies by construction of its choices (a superset of theirs, each at no cost) but not a proof against every
conceivable policy: it fixes a configuration until the next change of GPUs or batches (or ``REPLAN_S``) rather
than searching over schedules of configurations; the race may drop early a candidate that would have won at
the end; it places prefill workers on its last worker slots, while a
policy may pick other workers (and so other shares of the router's hash ring); and it never delays the
trainer to keep its GPUs serving. ``tests/benchmarks/bench_simulate.py --check`` checks on every shipped
scenario, at full length, with and without model mismatch, that no shipped policy beats it.
"""

from __future__ import annotations

import numpy as np

from pearlctl.planner.choose import PREFILL_SHARES as POLICY_PREFILL_SHARES
from pearlctl.planner.choose import disaggregated_splits
from pearlctl.planner.model import Role
from pearlctl.sim.engine import DEFAULT_ROUTER, W_DECODE, W_OFF, W_PREFILL, W_ROLLOUT
from pearlctl.sim.run import RunResult, Sim

# Disaggregated candidates: the prefill shares of the workers — every share of the planner's grid and more.
PREFILL_SHARES = tuple(sorted({*POLICY_PREFILL_SHARES, 1 / 8, 1 / 4, 1 / 2}))
REPLAN_S = 300.0  # re-choose at least this often (and whenever the GPUs or the batches change)
RACE_S = 60.0  # the first leg of the race between candidates (simulated seconds); each leg doubles it
LOOKAHEAD_TICKS = 2  # a lookahead steps this many of the scenario's ticks at once
FINALISTS = 3  # candidates played to the end of every in-flight batch
MAX_LOOKAHEAD_S = 6 * 3600.0  # a candidate that has not finished the batches by then is scored by work left


def prefill_counts(workers: int) -> list[int]:
    """Every prefill worker count the oracle tries with ``workers`` workers available (0: colocated): each one
    a policy could choose on any number of them (``choose.disaggregated_splits``), and the oracle's shares."""
    counts = {0}
    for w in range(2, workers + 1):
        counts |= {p for p, _ in disaggregated_splits(w)}
    counts |= {max(1, round(f * workers)) for f in PREFILL_SHARES}
    return sorted(p for p in counts if p < workers)


class OracleController:
    """The oracle's control: every available GPU serving, in the configuration ``_choose`` finds best. With
    ``fixed`` — (prefill workers, of workers) — it is a candidate played forward in a lookahead: the same
    configuration throughout (its prefill share applied to whatever workers are available), never re-chosen."""

    def __init__(self, sim: Sim, fixed: tuple[int, int] | None = None):
        self.gpw = sim.gpw
        self.fixed = fixed
        self.n_prefill = 0
        self.key: tuple | None = None
        self.next_plan = 0.0
        self._present: tuple | None = None  # whether the trainer lends, and which GPUs are present
        self._slots: list[int] = []  # the worker slots every GPU of which is available
        self._applied: tuple | None = None  # (present, prefill workers, weights version) the roles were set for

    def control(self, sim: Sim, t: float) -> None:
        lend = not sim.trainer_needs_gpus(t)
        present = (lend, *(g.present for g in sim.gpus))
        if present != self._present:
            self._present = present
            avail = {g.id for g in sim.gpus if g.present and (g.pool != "trainer" or lend)}
            n_slots = len(sim.gpus) // self.gpw
            self._slots = [
                k for k in range(n_slots) if all(i in avail for i in range(k * self.gpw, (k + 1) * self.gpw))
            ]
        slots = self._slots
        if self.fixed is not None:
            self.n_prefill = _same_share(*self.fixed, len(slots))
        else:
            key = (tuple(slots), sim.launched, len(sim.completed_at), sim.trained)
            if key != self.key or t >= self.next_plan:
                self.key, self.next_plan = key, t + REPLAN_S
                self.n_prefill = self._choose(sim, t, slots)
        applied = (present, self.n_prefill, sim.version)
        if applied == self._applied:
            return  # every GPU already has its role (roles change only with the GPUs present or the choice)
        self._applied = applied
        n_slots = len(sim.gpus) // self.gpw
        roles = self._roles(slots, self.n_prefill, n_slots)
        for g in sim.gpus:
            if not g.present:
                continue
            r = roles[g.id // self.gpw]
            role = _ROLE[r] if r != W_OFF else (Role.TRAIN if g.pool == "trainer" else Role.IDLE)
            if role != g.role:
                sim.transitions += 1
                sim._dirty = True
            g.role, g.borrowed, g.busy_until, g.parked = role, g.pool == "trainer" and role != Role.TRAIN, 0.0, False
            g.version = sim.version

    @staticmethod
    def _roles(slots: list[int], n_prefill: int, n_slots: int) -> np.ndarray:
        roles = np.full(n_slots, W_OFF, np.int8)
        if not n_prefill:
            roles[slots] = W_ROLLOUT
            return roles
        roles[slots] = W_DECODE
        roles[slots[len(slots) - n_prefill :]] = W_PREFILL
        return roles

    def _choose(self, sim: Sim, t: float, slots: list[int]) -> int:
        """The prefill worker count whose future — the whole run played forward on a copy of the true state,
        with that configuration — lets the trainer consume every batch now in flight soonest."""
        w = len(slots)
        if w < 2 or len(sim.completed_at) >= sim.launched:
            return 0
        runs = []
        for n in prefill_counts(w):
            fork = sim.fork()
            fork.controller = OracleController(fork, fixed=(n, w))
            runs.append(_Lookahead(n, fork, t, first=len(sim.completed_at), target=sim.launched))
        return _race(runs, t, sim.scenario.tick_s * LOOKAHEAD_TICKS)


def _same_share(n: int, of: int, workers: int) -> int:
    """``n`` prefill workers of ``of``, as the same share of ``workers`` (at least one each side; 0 stays 0)."""
    if n == 0 or workers < 2:
        return 0
    return min(max(round(n * workers / of), 1), workers - 1)


class _Lookahead:
    """One candidate played forward: a fork of the simulation under a fixed configuration, until the trainer has
    trained every batch that was in flight (``target`` steps trained)."""

    def __init__(self, n: int, fork: Sim, t: float, *, first: int, target: int):
        self.n, self.sim, self.tau = n, fork, t
        self.first, self.target = first, target
        self.at: float | None = None  # when the trainer had trained them all

    @property
    def finished(self) -> bool:
        return self.at is not None

    def run(self, until: float, dt: float) -> None:
        while self.at is None and self.tau < until - 1e-9:
            self.sim.tick(self.tau, dt)
            self.tau += dt
            if self.sim.trained >= self.target:
                self.at = self.tau

    def score(self) -> tuple:
        """Finished: (0, when the trainer had trained every batch that was in flight, the sum of their completion
        times). Not yet: (1, fewer steps trained, fewer batches complete, the true decode work left in them)."""
        s = self.sim
        if self.at is not None:
            return (0, self.at, sum(s.completed_at[self.first : self.target]))
        left = sum(s.engine.remaining_decode_tokens(*s._batch_range(j)) for j in range(self.first, self.target))
        return (1, -s.trained, -len(s.completed_at), left)


def _race(runs: list[_Lookahead], t: float, dt: float) -> int:
    """Successive halving: every candidate plays ``RACE_S`` forward, the better half (by ``score``) goes on for
    twice as long, and so on until ``FINALISTS`` are left; they play on until the trainer has trained every
    batch that was in flight (at most ``MAX_LOOKAHEAD_S``), and the best is chosen. Ties go to fewer prefill
    workers (colocated first)."""
    leg, alive, end = RACE_S, runs, t + MAX_LOOKAHEAD_S
    while len(alive) > FINALISTS and not all(r.finished for r in alive):
        for r in alive:
            r.run(min(t + leg, end), dt)
        alive.sort(key=lambda r: (r.score(), r.n))
        alive = alive[: max(FINALISTS, len(alive) // 2)]
        leg *= 2
    for r in alive:
        r.run(end, dt)
    return min(alive, key=lambda r: (r.score(), r.n)).n


_ROLE = {W_ROLLOUT: Role.ROLLOUT, W_PREFILL: Role.PREFILL, W_DECODE: Role.DECODE}


def run_oracle(
    scenario, *, record_timeline: bool = False, draws=None, trace=None, router: str = DEFAULT_ROUTER
) -> RunResult:
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
    sim.controller = OracleController(sim)
    return sim.run()
