"""The oracle (pearlctl/sim/oracle.py): its candidates, its world (every available GPU, nothing paid), and the
property it exists for — no compared policy beats it — over generated scenarios and seeds (hypothesis), with
the proof that the property test catches an oracle whose action set is narrowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pearlctl.planner.model import SERVING, Role
from pearlctl.sim import oracle
from pearlctl.sim import scenario as sc
from pearlctl.sim.compare import simulate
from pearlctl.sim.run import RunResult, Sim, make_draws, make_trace, run_policy

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "examples/profiles"


def _bursty(steps: int = 1) -> sc.Scenario:
    return sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml").with_overrides(steps=steps)


def _oracle_sim(s: sc.Scenario) -> Sim:
    return Sim(s, "oracle", None, free_migration=True, correction=False)


def test_every_available_gpu_serves_and_the_trainers_come_back_at_once():
    sim = _oracle_sim(_bursty())
    for g in sim.gpus:
        if g.pool == "elastic":
            g.present, g.role = True, Role.IDLE  # granted
    sim.launched = 1  # a batch in flight, the trainer waiting for it: its GPUs may serve
    sim.engine.launch(0, sim.batch, 0.0)
    ctl = oracle.FixedController(sim)
    ctl.control(sim, 0.0)
    assert all(g.role in SERVING and g.busy_until == 0.0 for g in sim.gpus)
    assert all(g.borrowed for g in sim.gpus if g.pool == "trainer")
    # the trainer needs its GPUs (its batch is complete): they train at once, everything else serves
    sim.completed_at.append(10.0)
    ctl.control(sim, 10.0)
    assert all(g.role is Role.TRAIN and g.busy_until == 0.0 for g in sim.gpus if g.pool == "trainer")
    assert all(g.role in SERVING for g in sim.gpus if g.pool != "trainer")


def test_a_fixed_share_applies_to_whatever_workers_are_available():
    assert oracle._same_share(0.0, 12) == 0
    assert oracle._same_share(0.25, 12) == 3
    assert oracle._same_share(0.9, 2) == 1  # at least one decode worker
    assert oracle._same_share(0.5, 1) == 0  # one worker: colocated


def test_the_replay_plays_the_policys_roles_at_the_same_offset_into_each_train_step():
    s = _bursty(steps=2)
    draws, trace = make_draws(s), make_trace(s)
    pearl = run_policy(s, "pearl", draws=draws, trace=trace, record_schedule=True)
    schedule = pearl.schedule
    assert schedule.epochs[0] == 0.0 and len(schedule.epochs) == 3  # started, then after each of its 2 steps
    assert any(role in SERVING for _, gid, role in schedule.changes if gid < s.cluster.trainer_gpus)  # it lent
    sim = oracle._sim(s, draws, trace, "consistent_hash", oracle.ReplayController, schedule)
    follow = sim.controller.plan
    # at t, in its first epoch, the replay plays the policy's roles at t (changes up to t applied)
    sim.advance(30.0)
    assert follow.applied == sum(1 for c in schedule.changes if c[0] <= sim.now - s.tick_s + 1e-9)
    # later epochs start when the replay's trainer got there: the policy's roles from its own epoch start
    while sim.trained < 1:
        sim.advance(sim.now + s.tick_s)
    start = sim.now - s.tick_s
    sim.advance(sim.now + 10.0)
    offset = (sim.now - s.tick_s) - start
    expected = min(schedule.epochs[1] + offset, schedule.epochs[2] - 1e-9)
    assert follow.applied == sum(1 for c in schedule.changes if c[0] <= expected + 1e-9)
    # GPUs take their roles at no cost: nothing is ever in transition
    assert all(g.busy_until == 0.0 for g in sim.gpus)


def test_the_oracle_replays_pearl_even_when_pearl_is_not_compared_and_names_its_winner():
    s = _bursty(steps=1)
    result = simulate(s, "oracle")
    assert result.policy == "oracle" and result.finished
    assert result.oracle_choice in {oracle.EVERY_GPU, oracle.WIDENED, "replay of pearl"}
    assert result.schedule is None


# -- the bound, over generated scenarios ------------------------------------------------------------------


@st.composite
def scenarios(draw) -> sc.Scenario:
    """A small scenario (up to 28 GPUs, a batch of up to 512 trajectories, 2 steps), anywhere in the format's
    space: sync or async, elastic grants and preemptions with and without notice, short or long turns and tools,
    with or without the measured model mismatch."""
    trainer = draw(st.sampled_from([2, 4, 8, 16]))
    rollout = draw(st.sampled_from([1, 2, 4]))
    elastic = draw(st.sampled_from([0, 0, 2, 4]))
    median_prompt = draw(st.integers(100, 3000))
    median_resp = draw(st.integers(50, 1500))
    median_tool = draw(st.floats(0.2, 30.0))
    doc = {
        "scenario": {
            "name": "generated",
            "profile": "qwen3-8b-h100.toml",
            "steps": 2,
            "seed": draw(st.integers(0, 10_000)),
            "tick_s": 0.5,
            "control_interval_s": 5.0,
        },
        "cluster": {"trainer_gpus": trainer, "rollout_gpus": rollout, "elastic_gpus": elastic, "gpus_per_node": 2},
        "workload": {
            "prompts_per_step": draw(st.integers(2, 32)),
            "group_size": draw(st.sampled_from([2, 4, 8, 16])),
            "max_context_tokens": 32768,
            "turns": {"kind": "uniform", "low": 1, "high": draw(st.integers(1, 8))},
            "prompt_tokens": {"kind": "lognormal", "median": median_prompt, "p99": 3 * median_prompt},
            "response_tokens": {"kind": "lognormal", "median": median_resp, "p99": 5 * median_resp, "max": 8192},
            "tool_output_tokens": {"kind": "lognormal", "median": 200, "p99": 1500},
            "tool_latency_s": {"kind": "lognormal", "median": median_tool, "p99": 6 * median_tool},
        },
        "training": {"train_step_s": draw(st.floats(5.0, 200.0)), "weight_sync_s": draw(st.floats(1.0, 20.0))},
    }
    if draw(st.booleans()):
        doc["training"] |= {"mode": "async", "staleness": draw(st.integers(1, 2))}
    if elastic:
        doc["availability"] = {
            "initial_gpus": draw(st.sampled_from([0, elastic])),
            "grant_interval_s": draw(st.sampled_from([0.0, 120.0, 600.0])),
            "grant_gpus": 2,
            "lifetime_s": draw(st.sampled_from([0.0, 300.0, 1200.0])),
            "notice_s": draw(st.sampled_from([0.0, 30.0])),
        }
    s = sc.from_dict(doc, base=PROFILES)
    return s.with_overrides(mismatch=draw(st.sampled_from([sc.NO_MISMATCH, sc.MEASURED])))


def _policies(s: sc.Scenario) -> dict[str, RunResult]:
    draws, trace = make_draws(s), make_trace(s)
    return {p: run_policy(s, p, draws=draws, trace=trace, record_schedule=p == "pearl") for p in ("static", "pearl")}


def _check_bound(s: sc.Scenario, oracle_run) -> None:
    """The property: on ``s``, every policy trains all its steps and none is faster than ``oracle_run``'s."""
    runs = _policies(s)
    best = oracle_run(s, {"pearl": runs["pearl"].schedule})
    assert best.finished and all(r.finished for r in runs.values())
    for name, r in runs.items():
        assert r.samples_per_s <= best.samples_per_s * (1 + 1e-9), (
            f"{name} {r.samples_per_s:.5f} samples/s beats the oracle's {best.samples_per_s:.5f} on {s}"
        )


def _oracle(s: sc.Scenario, schedules) -> RunResult:
    return oracle.run_oracle(s, draws=make_draws(s), trace=make_trace(s), schedules=schedules)


class _NoLending(oracle.FixedController):
    def control(self, sim, t):
        self.share = 0.0
        needs = sim.trainer_needs_gpus
        sim.trainer_needs_gpus = lambda t: True  # the trainer's GPUs never serve
        try:
            super().control(sim, t)
        finally:
            sim.trainer_needs_gpus = needs


def _narrowed(s: sc.Scenario, schedules) -> RunResult:
    """A deliberately narrowed oracle: every rollout and elastic GPU serving, colocated, at no cost — but no
    replay of pearl's decisions and no lent trainer GPU (its action set no longer contains pearl's)."""
    return oracle._sim(s, make_draws(s), make_trace(s), "consistent_hash", _NoLending, 0.0).run()


_PROPERTY = settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


@_PROPERTY
@given(scenarios())
def test_no_policy_beats_the_oracle_on_generated_scenarios(s):
    _check_bound(s, _oracle)


def test_the_property_test_catches_an_oracle_whose_action_set_is_narrowed():
    # The same property, the same generated scenarios, against an oracle that may not lend the trainer's GPUs
    # and does not replay pearl: hypothesis finds a scenario where pearl beats it (no shrinking: only the finding).
    @settings(_PROPERTY, max_examples=40, phases=[Phase.generate])
    @given(scenarios())
    def narrowed(s):
        _check_bound(s, _narrowed)

    with pytest.raises(AssertionError, match="beats the oracle"):
        narrowed()
