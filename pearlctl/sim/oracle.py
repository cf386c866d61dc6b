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
- knows the future: it chooses the PD configuration (colocated, or disaggregated at a prefill share) by
  running each candidate forward on a copy of the true engine state — the drawn remaining work, not an
  estimate — and keeping the one that finishes the oldest batch first (or leaves the least work).

Engine physics (KV capacity, decode speed, prefill, tool latencies) are exactly the ones every policy faces:
the bound comes from capacity, zero cost and foresight only. A test checks on every shipped scenario that no
shipped policy beats it.
"""

from __future__ import annotations

import numpy as np

from pearlctl.planner.model import Role
from pearlctl.sim.engine import DEFAULT_ROUTER, W_DECODE, W_OFF, W_PREFILL, W_ROLLOUT
from pearlctl.sim.run import RunResult, Sim

PREFILL_SHARES = (0.125, 0.25, 0.5)  # disaggregated candidates: the share of workers that prefill
LOOKAHEAD_S = 120.0  # how far each candidate is played forward
REPLAN_S = 300.0  # re-choose at least this often (and whenever the GPUs or the batches change)


class OracleController:
    def __init__(self, sim: Sim):
        self.gpw = sim.gpw
        self.n_prefill = 0
        self.key: tuple | None = None
        self.next_plan = 0.0

    def control(self, sim: Sim, t: float) -> None:
        lend = not sim.trainer_needs_gpus(t)
        avail = {g.id for g in sim.gpus if g.present and (g.pool != "trainer" or lend)}
        n_slots = len(sim.gpus) // self.gpw
        slots = [k for k in range(n_slots) if all(i in avail for i in range(k * self.gpw, (k + 1) * self.gpw))]
        key = (tuple(slots), sim.launched, sim.trained)
        if key != self.key or t >= self.next_plan:
            self.key, self.next_plan = key, t + REPLAN_S
            self.n_prefill = self._choose(sim, t, slots)
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
        """The prefill worker count whose future, played on a copy of the true state, is best."""
        w = len(slots)
        j = len(sim.completed_at)
        if w < 2 or j >= sim.launched:
            return 0
        lo, hi = sim._batch_range(j)
        candidates = sorted({0} | {max(1, round(f * w)) for f in PREFILL_SHARES} - {w})
        dt = sim.scenario.tick_s * 2
        best, best_score = 0, None
        n_slots = len(sim.gpus) // self.gpw
        for n in candidates:
            e = sim.engine.clone()
            e.set_roles(self._roles(slots, n, n_slots))
            tau = t
            while tau - t < LOOKAHEAD_S and not e.all_done(lo, hi):
                e.step(tau, dt)
                tau += dt
            score = (0, tau) if e.all_done(lo, hi) else (1, e.remaining_decode_tokens(lo, hi))
            if best_score is None or score < best_score:
                best, best_score = n, score
        return best


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
    )
    sim.controller = OracleController(sim)
    return sim.run()
