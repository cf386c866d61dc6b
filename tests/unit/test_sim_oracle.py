"""The oracle is a bound by construction of its choices: every configuration a shipped policy can form is one it
can form too (every prefill share of the planner's grid on any number of workers, every pool, every GPU serving,
at no cost), and its foresight plays each candidate to the end of every batch in flight on a copy of the run
that the copy's future never touches. The full-length check that no policy beats it is the benchmark gate
(tests/benchmarks/bench_simulate.py --check, run by tests/unit/test_sim_gate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pearlctl.planner import choose
from pearlctl.planner.diff import POOLS
from pearlctl.planner.model import SERVING, Role
from pearlctl.sim import oracle
from pearlctl.sim import scenario as sc
from pearlctl.sim.run import Sim

REPO = Path(__file__).resolve().parents[2]


def test_the_oracles_prefill_shares_contain_the_planners():
    assert set(choose.PREFILL_SHARES) <= set(oracle.PREFILL_SHARES)


@pytest.mark.parametrize("workers", range(1, 65))
def test_the_oracle_tries_every_prefill_count_a_policy_could_form_on_as_many_workers_or_fewer(workers):
    # a policy serving w' <= workers workers with p prefill and d decode is matched by the oracle's p prefill
    # workers and workers - p >= d decode workers (more decode workers never decode slower with free migration)
    counts = set(oracle.prefill_counts(workers))
    assert 0 in counts  # colocated
    assert all(0 <= p < workers for p in counts)
    for w in range(2, workers + 1):
        for p, d in choose.disaggregated_splits(w):
            assert p in counts and d <= workers - p, (w, p, d)


def _bursty(steps: int = 1) -> sc.Scenario:
    return sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml").with_overrides(steps=steps)


def test_the_oracle_serves_on_every_pool_a_policy_may_use_and_every_available_gpu():
    s = _bursty()
    sim = Sim(s, "oracle", None, free_migration=True, correction=False)
    assert set(POOLS) == {g.pool for g in sim.gpus}
    for g in sim.gpus:
        if g.pool == "elastic":
            g.present, g.role = True, Role.IDLE  # granted
    sim.launched = 1  # a batch in flight, the trainer waiting for it: its GPUs may serve
    sim.engine.launch(0, sim.batch, 0.0)
    ctl = oracle.OracleController(sim)
    ctl.control(sim, 0.0)
    assert all(g.role in SERVING and g.busy_until == 0.0 for g in sim.gpus)
    assert all(g.borrowed for g in sim.gpus if g.pool == "trainer")
    # the trainer needs its GPUs (its batch is complete): they train at once, everything else serves
    sim.completed_at.append(10.0)
    ctl.control(sim, 10.0)
    assert all(g.role is Role.TRAIN for g in sim.gpus if g.pool == "trainer")
    assert all(g.role in SERVING for g in sim.gpus if g.pool != "trainer")


def test_a_fork_plays_the_future_without_touching_the_run():
    sim = Sim(_bursty(), "oracle", None, free_migration=True, correction=False)
    sim.controller = oracle.OracleController(sim, fixed=(0, 1))
    t = 0.0
    while t < 30.0:
        sim.tick(t, sim.scenario.tick_s)
        t += sim.scenario.tick_s
    before = (sim.engine.phase.copy(), sim.engine.ctx.copy(), [(g.role, g.present) for g in sim.gpus], sim.launched)
    fork = sim.fork()
    fork.controller = oracle.OracleController(fork, fixed=(1, 2))
    tau = t
    while fork.trained < 1:
        fork.tick(tau, 1.0)
        tau += 1.0
    assert fork.trained == 1 and fork.completed_at
    after = (sim.engine.phase, sim.engine.ctx, [(g.role, g.present) for g in sim.gpus], sim.launched)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2:] == after[2:] and not sim.completed_at and sim.trained == 0


def test_the_oracles_lookahead_runs_every_candidate_it_keeps_until_the_batches_in_flight_are_trained(monkeypatch):
    seen = []
    race = oracle._race

    def spy(runs, t, dt):
        n = race(runs, t, dt)
        seen.append(runs)
        return n

    monkeypatch.setattr(oracle, "_race", spy)
    s = sc.load(REPO / "examples/scenarios/short-steps-8b.toml").with_overrides(steps=2)
    oracle.run_oracle(s)
    assert seen
    for runs in seen:
        finished = [r for r in runs if r.finished]
        assert finished, "no candidate was played to the end of the batches in flight"
        assert all(r.sim.trained >= r.target and r.at is not None for r in finished)
        workers = runs[0].sim.controller.fixed[1]
        assert sorted(r.n for r in runs) == oracle.prefill_counts(workers)  # every candidate entered the race


def test_a_fixed_candidate_keeps_its_prefill_share_when_the_workers_change():
    assert oracle._same_share(0, 8, 12) == 0
    assert oracle._same_share(2, 8, 12) == 3
    assert oracle._same_share(7, 8, 2) == 1  # at least one decode worker
    assert oracle._same_share(1, 8, 1) == 0  # one worker: colocated
