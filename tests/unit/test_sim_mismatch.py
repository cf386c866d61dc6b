"""Model mismatch: the simulator's truth may differ from what the planner believes. ``[mismatch]`` perturbs
decode, prefill, tool latency and transitions (a bias and a seeded per-request spread); the engines and the
moves run the truth while the policies keep seeing the scenario's profile and workload; the measured default
comes from the predictor's error against real runs; runs stay deterministic per seed."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pearlctl.planner.model import Move, MoveKind, Role
from pearlctl.sim import scenario as sc
from pearlctl.sim.engine import W_ROLLOUT, Engine
from pearlctl.sim.migration import ABORT_S
from pearlctl.sim.run import Sim, make_draws, run_policy
from pearlctl.sim.trajectories import DECODE

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, **over) -> sc.Scenario:
    return sc.load(REPO / f"examples/scenarios/{name}.toml").with_overrides(**over)


def test_the_measured_mismatch_comes_from_the_predictors_measured_error():
    # docs/planner.md: predicted vs measured on six batch shapes, short by 13-37% (median |error| 25%)
    ratios = [1 / (1 + e) for e in sc.MEASURED_PREDICTOR_ERRORS]
    assert min(sc.MEASURED_PREDICTOR_ERRORS) == -0.37 and max(sc.MEASURED_PREDICTOR_ERRORS) == -0.13
    assert sc.MEASURED_BIAS == pytest.approx(statistics.median(ratios), abs=1e-3) == pytest.approx(1.334, abs=1e-3)
    assert sc.MEASURED_SPREAD == pytest.approx(statistics.stdev(math.log(r) for r in ratios), abs=1e-3)
    for kind in sc.MISMATCH_KINDS:
        assert getattr(sc.MEASURED, kind) == sc.Perturbation(sc.MEASURED_BIAS, sc.MEASURED_SPREAD)
    assert sc.NO_MISMATCH.zero and not sc.MEASURED.zero and sc.MEASURED.label() == "measured"


def _doc(mismatch: dict | None) -> sc.Scenario:
    import tomllib

    doc = tomllib.loads((REPO / "examples/scenarios/short-steps-8b.toml").read_text())
    if mismatch is not None:
        doc["mismatch"] = mismatch
    return sc.from_dict(doc, base=REPO / "examples/scenarios", where="s.toml")


def test_the_mismatch_table():
    assert _doc(None).mismatch == sc.NO_MISMATCH  # the shipped scenarios: the planner's model is the truth
    assert _doc({"preset": "measured"}).mismatch == sc.MEASURED
    m = _doc({"decode": 1.5, "tool_latency": {"bias": 2.0, "spread": 0.3}}).mismatch
    assert m.decode == sc.Perturbation(1.5, 0.0) and m.tool_latency == sc.Perturbation(2.0, 0.3)
    assert m.prefill.zero and m.transitions.zero
    m = _doc({"preset": "measured", "prefill": {"bias": 1.0}}).mismatch
    assert m.prefill == sc.Perturbation(1.0, sc.MEASURED_SPREAD) and m.decode == sc.MEASURED.decode


@pytest.mark.parametrize(
    "table, message",
    [
        ({"decod": 1.2}, "[mismatch]: unknown key(s) decod; allowed: decode, prefill, preset, tool_latency"),
        ({"preset": "worst"}, "preset: must be one of none, measured"),
        ({"decode": 0}, "decode.bias: must be > 0"),
        ({"decode": {"bias": 1.2, "spread": -1}}, "decode.spread: must be >= 0"),
        ({"decode": {"bias": 1.2, "sd": 0.1}}, "unknown key(s) sd"),
        ({"decode": "fast"}, "decode: must be a number (the bias) or an inline table"),
    ],
)
def test_a_bad_mismatch_names_the_key(table, message):
    with pytest.raises(sc.ScenarioError) as err:
        _doc(table)
    assert message in str(err.value)


def test_per_request_factors_have_the_bias_as_their_mean():
    p = sc.Perturbation(1.3, 0.4)
    x = p.factors(np.random.default_rng(0), 200_000)
    assert x.mean() == pytest.approx(1.3, rel=0.01)
    assert np.log(x).std() == pytest.approx(0.4, rel=0.02)
    assert (sc.Perturbation(1.3, 0.0).factors(np.random.default_rng(0), 5) == 1.3).all()


def test_no_mismatch_leaves_the_draws_as_drawn_and_a_mismatch_keeps_the_workload():
    s = _load("bursty-elastic-8b", steps=1)
    plain, truth = make_draws(s), make_draws(s.with_overrides(mismatch=sc.MEASURED))
    assert plain.decode_scale is None and plain.prefill_scale is None
    for name in ("turns", "prompt", "response", "tool_output"):
        assert np.array_equal(getattr(plain, name), getattr(truth, name))  # the same trajectories
    ratio = truth.tool_latency / plain.tool_latency
    assert ratio.mean() == pytest.approx(sc.MEASURED_BIAS, rel=0.02)
    assert truth.decode_scale.mean() == pytest.approx(sc.MEASURED_BIAS, rel=0.02)
    assert np.array_equal(make_draws(s.with_overrides(mismatch=sc.MEASURED)).decode_scale, truth.decode_scale)


def _decoded(scale: float, seconds: float = 4.0) -> float:
    from tests.unit.test_sim_engine import DENSE, draws

    d = draws(8, response=5000.0)
    d = replace(d, decode_scale=np.full(d.response.shape, scale, np.float32))
    e = Engine(DENSE, d, 1, 10**5)
    e.launch(0, 8, 0.0)
    e.set_roles(np.array([W_ROLLOUT]))
    t = 0.0
    while not (e.phase[:8] == DECODE).all():
        e.step(t, 0.1)
        t += 0.1
    before = e.stats["decode_tokens"]
    for _ in range(int(seconds / 0.1)):
        e.step(t, 0.1)
        t += 0.1
    return e.stats["decode_tokens"] - before


def test_a_decode_bias_slows_decode_by_its_factor():
    # (contexts then grow more slowly, so iterations are a little shorter: within 2%)
    assert _decoded(2.0) == pytest.approx(_decoded(1.0) / 2, rel=0.02)


def test_a_prefill_bias_makes_prefill_take_that_much_longer():
    from tests.unit.test_sim_engine import DENSE, draws

    def prefill_s(scale: float) -> float:
        d = draws(4, prompt=20000.0, response=10.0)
        d = replace(d, prefill_scale=np.full(d.response.shape, scale, np.float32))
        e = Engine(DENSE, d, 1, 10**5)
        e.launch(0, 4, 0.0)
        e.set_roles(np.array([W_ROLLOUT]))
        t = 0.0
        while e.stats["prefill_tokens"] < 4 * 20000.0 - 1e-3:
            e.step(t, 0.05)
            t += 0.05
        assert e.stats["prefill_tokens"] == pytest.approx(4 * 20000.0)  # tokens, not token-seconds
        return t

    assert prefill_s(1.5) == pytest.approx(1.5 * prefill_s(1.0), rel=0.03)


def test_moves_take_their_true_cost_and_the_policy_plans_with_the_daemons_running_estimates():
    s = _load("bursty-elastic-8b", steps=1)
    s = s.with_overrides(mismatch=sc.Mismatch(transitions=sc.Perturbation(2.0)))
    c = s.profile.costs
    sim = Sim(s, "test", lambda snap: None)
    lent = sim.gpus[0]
    assert sim.view.snapshot(0.0).costs == c  # nothing measured yet: the profile's
    assert sim.moves.apply(Move(lent.id, MoveKind.BORROW, Role.TRAIN, Role.ROLLOUT, 0.0), 10.0)
    assert lent.busy_until == pytest.approx(10.0 + 2.0 * (c.offload_s + c.start_s))
    lent.busy_until = 0.0
    assert sim.moves.apply(Move(lent.id, MoveKind.RETURN, Role.ROLLOUT, Role.TRAIN, 0.0), 100.0)
    assert lent.busy_until == pytest.approx(100.0 + ABORT_S + 2.0 * (c.sleep_s + c.reload_s))  # the abort is not
    seen = sim.view.snapshot(200.0).costs  # the journal's medians, as the daemon's Borrowing.costs
    assert seen.start_s == 2 * c.start_s and seen.offload_s == 2 * c.offload_s and seen.sleep_s == 2 * c.sleep_s
    assert seen.wake_s == c.wake_s and seen.role_switch_s == c.role_switch_s  # not measured yet
    assert sim.view.snapshot(200.0).profile.costs == c and sim.view.snapshot(200.0).profile.decode == s.profile.decode


def test_the_policy_sees_the_belief_while_the_engines_run_the_truth():
    s = _load("short-steps-8b", steps=1)
    plain = Sim(s, "test", lambda snap: None, correction=False)
    truth = Sim(s.with_overrides(mismatch=sc.MEASURED), "test", lambda snap: None, correction=False)
    for sim in (plain, truth):
        sim.engine.launch(0, sim.batch, 0.0)
        sim.launched = 1
    a, b = plain.view.snapshot(0.0), truth.view.snapshot(0.0)
    assert a.profile == b.profile == s.profile and a.work == b.work and a.costs == b.costs


def test_a_run_under_mismatch_is_deterministic_and_slower():
    s = _load("short-steps-8b", steps=2)
    m = s.with_overrides(mismatch=sc.MEASURED)
    one, two = run_policy(m, "pearl"), run_policy(m, "pearl")
    assert one.samples_per_s == two.samples_per_s and one.batch_rollout_s == two.batch_rollout_s
    assert one.engine == two.engine and one.predictor_ratio == two.predictor_ratio
    assert one.samples_per_s < run_policy(s, "pearl").samples_per_s
