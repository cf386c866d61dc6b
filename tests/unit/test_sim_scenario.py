"""Scenario files: every shipped one loads; bad input names the key and what would be allowed."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.sim import scenario as sc

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "examples/scenarios").glob("*.toml"))
PROFILES = sorted((REPO / "examples/profiles").glob("*.toml"))


def test_the_shipped_scenarios_are_of_different_character():
    names = {p.stem for p in SCENARIOS}
    assert {
        "agentic-coding-8b",  # KV-cache pressure, asynchronous (staleness 1)
        "reasoning-tools-30b-moe",  # a long-tailed MoE, asynchronous (staleness 2)
        "bursty-elastic-8b",  # bursty elastic grants, correlated reclaims
        "short-steps-8b",  # short multi-turn steps
        "spot-bimodal-8b",  # spot lifetimes that are bimodal
        "single-turn-math-8b",  # single-turn short steps
        "rag-long-prompt-8b",  # long prompts, prefill dominates
        "preemption-storm-8b",  # half the elastic pool gone within one minute
        "scale-4096-8b",  # 4,096 GPUs
    } <= names
    by_name = {p.stem: sc.load(p) for p in SCENARIOS}
    big = by_name["scale-4096-8b"].cluster
    assert big.trainer_gpus + big.rollout_gpus + big.elastic_gpus == 4096
    storm = by_name["preemption-storm-8b"]
    preempts = [e for e in storm.availability.events if e.preempt]
    assert sum(e.preempt for e in preempts) * 2 >= storm.cluster.elastic_gpus
    assert max(e.at_s for e in preempts) - min(e.at_s for e in preempts) <= 60
    assert len(by_name["spot-bimodal-8b"].availability.lifetime_mixture) == 2


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenarios_load(path):
    s = sc.load(path)
    assert s.name == path.stem
    assert s.profile_path.is_file()


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_shipped_profiles_cite_every_number(path):
    doc = tomllib.loads(path.read_text())
    numbers = set(doc["profile"]) - {"name", "model", "hardware"}
    numbers |= set(doc["profile"]["decode"]) | set(doc["profile"]["costs"])
    numbers -= {"decode", "costs", "gpus_per_worker"}
    assert numbers <= set(doc["sources"]), sorted(numbers - set(doc["sources"]))


def base_doc() -> dict:
    return tomllib.loads((REPO / "examples/scenarios/short-steps-8b.toml").read_text())


def load_doc(doc: dict) -> sc.Scenario:
    return sc.from_dict(doc, base=REPO / "examples/scenarios", where="s.toml")


def _elastic(doc: dict, **availability) -> None:
    doc["cluster"]["elastic_gpus"] = 8
    doc["availability"] = {"grant_interval_s": 600.0, **availability}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["workload"].update(turnz=3), "[workload]: unknown key(s) turnz; allowed:"),
        (
            lambda d: d["workload"].update(turns={"kind": "pareto"}),
            "turns.kind: must be one of const, uniform, lognormal",
        ),
        (
            lambda d: d["workload"].update(response_tokens={"kind": "lognormal", "median": 500, "p99": 100}),
            "response_tokens.p99: must be >= median",
        ),
        (lambda d: d["workload"].pop("prompts_per_step"), "[workload] prompts_per_step: required"),
        (lambda d: d["training"].update(mode="fast"), 'mode: must be "sync" or "async"'),
        (lambda d: d["training"].update(mode="async", staleness=0), "async needs staleness >= 1"),
        (lambda d: d["training"].update(join_wait_s=-1), "[training] join_wait_s: must be >= 0"),
        (lambda d: d["training"].update(first_wait_s="10m"), "[training] first_wait_s: must be a number"),
        (lambda d: d["cluster"].update(trainer_gpus=-1), "[cluster] trainer_gpus: must be >= 1"),
        (lambda d: d["cluster"].update(rollout_gpus="8"), "rollout_gpus: must be an integer"),
        (lambda d: d["scenario"].update(profile="nope.toml"), "[scenario] profile: cannot read profile"),
        (lambda d: d.update(avail={}), "unknown key(s) avail"),
        (
            lambda d: (
                d["availability"].update(initial_gpus=4)
                if "availability" in d
                else d.update(availability={"initial_gpus": 4})
            ),
            "elastic_gpus > 0",
        ),
        (
            lambda d: d["workload"].update(max_context_tokens=10**7),
            "max_context_tokens: must be <= the profile's kv_capacity_tokens",
        ),
        (
            lambda d: _elastic(d, lifetime_mixture=[{"weight": 0.5, "mean_s": 60.0}, {"weight": 0.4, "mean_s": 6e3}]),
            "[availability] lifetime_mixture: the weights must sum to 1 (got 0.9)",
        ),
        (
            lambda d: _elastic(d, lifetime_s=60.0, lifetime_mixture=[{"weight": 1.0, "mean_s": 60.0}]),
            "lifetime_mixture: give lifetime_s (one exponential mean) or lifetime_mixture, not both",
        ),
        (
            lambda d: _elastic(d, lifetime_mixture=[{"weight": 1.0, "mean_s": 0.0}]),
            "lifetime_mixture[0] mean_s: must be > 0",
        ),
        (
            lambda d: _elastic(d, lifetime_mixture=[{"weight": 0.0, "mean_s": 5.0}, {"weight": 1.0, "mean_s": 5.0}]),
            "lifetime_mixture[0] weight: must be > 0",
        ),
        (
            lambda d: _elastic(d, lifetime_mixture=[{"weight": 1.0, "median_s": 5.0}]),
            "lifetime_mixture[0]: unknown key(s) median_s",
        ),
        (lambda d: _elastic(d, lifetime_mixture=[]), "lifetime_mixture: must be a non-empty list"),
        (lambda d: _elastic(d, lifetime_mixture=600.0), "lifetime_mixture: must be a non-empty list"),
    ],
)
def test_bad_scenarios_name_the_key_and_what_is_allowed(edit, message):
    doc = base_doc()
    edit(doc)
    with pytest.raises(sc.ScenarioError) as err:
        load_doc(doc)
    assert message in str(err.value)


def test_every_problem_is_reported_one_line_each_with_its_key_path(tmp_path):
    doc = base_doc()
    doc["workload"]["turnz"] = 3
    doc["cluster"]["rollout_gpus"] = "8"
    doc["training"]["train_step_s"] = float("nan")
    doc["workload"]["turns"] = {"kind": "lognormal", "median": 5, "p99": 1, "low": 1}
    with pytest.raises(sc.ScenarioError) as err:
        load_doc(doc)
    assert err.value.problems == [
        "s.toml [cluster] rollout_gpus: must be an integer (got '8')",
        "s.toml [workload]: unknown key(s) turnz; allowed: group_size, max_context_tokens, prompt_tokens, "
        "prompts_per_step, response_tokens, tool_latency_s, tool_output_tokens, turns",
        "s.toml [workload] turns: unknown key(s) low; allowed: kind, max, median, min, p99",  # a lognormal's keys
        "s.toml [workload] turns.p99: must be >= median (5.0)",
        "s.toml [training] train_step_s: must be a number (got nan)",
    ]
    assert str(err.value) == "\n".join(err.value.problems)

    from typer.testing import CliRunner

    from pearlctl.cli import app

    bad = tmp_path / "bad.toml"
    text = (
        (REPO / "examples/scenarios/short-steps-8b.toml")
        .read_text()
        .replace("../profiles/", f"{REPO}/examples/profiles/")
    )
    bad.write_text(text.replace("group_size", "group_sz").replace("prompts_per_step = ", "prompts_per_step = -"))
    result = CliRunner().invoke(app, ["simulate", str(bad), "--policy", "static"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if str(bad) in line]
    assert len(lines) == 3, result.output
    assert "unknown key(s) group_sz" in lines[0] and "prompts_per_step: must be >= 1 (got -" in lines[1]
    assert lines[2].endswith("[workload] group_size: required (an integer)")


def test_a_bare_number_is_a_constant_and_a_distribution_refuses_another_kinds_keys():
    doc = base_doc()
    doc["workload"]["turns"] = 3
    doc["workload"]["tool_latency_s"] = {"kind": "uniform", "low": 1, "high": 4.5, "max": 4}
    s = load_doc(doc)
    assert s.workload.turns == sc.Distribution("const", value=3.0, min=1.0)  # at least one turn
    assert s.workload.tool_latency_s == sc.Distribution("uniform", low=1.0, high=4.5, max=4.0)
    doc["workload"]["tool_latency_s"] = {"kind": "const", "value": 1, "median": 2}
    with pytest.raises(
        sc.ScenarioError, match=r"tool_latency_s: unknown key\(s\) median; allowed: kind, max, min, value"
    ):
        load_doc(doc)


def test_the_drivers_join_wait_defaults_to_the_live_drivers_and_may_be_set_or_turned_off():
    assert load_doc(base_doc()).training.join_wait_s == sc.JOIN_WAIT_S
    for value in (0, 4.5):
        doc = base_doc()
        doc["training"]["join_wait_s"] = value
        assert load_doc(doc).training.join_wait_s == value


def test_events_need_exactly_one_of_grant_or_preempt():
    doc = base_doc()
    doc["cluster"]["elastic_gpus"] = 8
    doc["availability"] = {"events": [{"at_s": 10, "grant": 8, "preempt": 8}]}
    with pytest.raises(sc.ScenarioError, match=r"events\[0\]: give exactly one of grant"):
        load_doc(doc)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(sc.ScenarioError, match="cannot read scenario"):
        sc.load(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[scenario\n")
    with pytest.raises(sc.ScenarioError, match="not valid TOML"):
        sc.load(bad)


def test_lognormal_matches_its_median_and_p99():
    import numpy as np

    d = sc.Distribution("lognormal", median=100.0, p99=1000.0)
    x = d.sample(np.random.default_rng(0), 200_000)
    assert np.median(x) == pytest.approx(100, rel=0.02)
    assert np.quantile(x, 0.99) == pytest.approx(1000, rel=0.05)


def test_a_lifetime_mixture_gives_bimodal_lifetimes_with_the_mixtures_mean():
    import numpy as np

    from pearlctl.sim.availability import build_trace

    doc = base_doc()
    doc["cluster"]["elastic_gpus"] = 512  # 64 node slots: a grant is almost never refused for want of a slot
    mixture = [{"weight": 0.6, "mean_s": 100.0}, {"weight": 0.4, "mean_s": 10_000.0}]
    doc["availability"] = {"grant_interval_s": 1000.0, "lifetime_mixture": mixture}
    s = load_doc(doc)
    assert s.availability.lifetime_mixture == ((0.6, 100.0), (0.4, 10_000.0))
    assert s.availability.lifetime_s == pytest.approx(4060.0)  # the mixture's mean: what preempt_per_hour uses
    trace = build_trace(s, horizon_s=1e6, seed=3)
    life = np.array([x.end - x.start for x in trace.leases])
    assert len(life) > 800
    # 0.6 (1 - e^-5) + 0.4 (1 - e^-0.05) = 0.615 die within 500 s; one exponential of the same mean: 0.116
    assert np.mean(life < 500) == pytest.approx(0.615, abs=0.06)
    assert np.mean(life > 5000) == pytest.approx(0.4 * np.exp(-0.5), abs=0.06)
    assert life.mean() == pytest.approx(4060.0, rel=0.2)
    assert trace.preempt_per_hour == pytest.approx(3600.0 / 4060.0)
    again = build_trace(s, horizon_s=1e6, seed=3)
    assert again == trace  # the same seed, the same trace
    # without a mixture the trace is drawn as before (one exponential of lifetime_s)
    doc["availability"] = {"grant_interval_s": 1000.0, "lifetime_s": 4060.0}
    single = np.array([x.end - x.start for x in build_trace(load_doc(doc), horizon_s=1e6, seed=3).leases])
    assert np.mean(single < 500) == pytest.approx(0.116, abs=0.05)


# any value a TOML key may hold, well formed or not (the scenario keys' fuzz tests)
ANY_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.text(max_size=8),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(value=ANY_VALUE)
def test_any_first_wait_loads_as_a_finite_non_negative_number_or_is_refused_by_name(value):
    doc = base_doc()
    doc["training"]["first_wait_s"] = value
    try:
        got = load_doc(doc).training.first_wait_s
    except sc.ScenarioError as err:
        assert "[training] first_wait_s: must be" in str(err)
        return
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    assert got == float(value) and math.isfinite(got) and got >= 0


def test_a_profile_path_no_file_can_have_is_refused_by_name():
    doc = base_doc()
    doc["scenario"]["profile"] = "bad\x00.toml"
    with pytest.raises(sc.ScenarioError, match=r"\[scenario\] profile: 'bad\\x00.toml' is no file's path"):
        load_doc(doc)
