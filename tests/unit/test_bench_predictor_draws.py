"""The predictor benchmark's stratified tool draws (tests/benchmarks/bench_predictor.py): a reference batch's
draws follow the tool law exactly, with the batch's slowest sum placed at the quantile it is given, so the plain
mean of the reference batches loses the straggler's luck without a bias."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tests.benchmarks.bench_predictor import (
    Workload,
    batch_latencies,
    erlang_cdf,
    erlang_quantile,
    slowest_tools,
    stratified_latencies,
    tool_latencies,
)

SHAPE = Workload(16, 3, 32, 24, 1.0, "exp")


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999999])
def test_the_erlang_quantile_inverts_its_cdf(k, p):
    assert erlang_cdf(erlang_quantile(p, k), k) == pytest.approx(p, rel=1e-9, abs=1e-12)


def test_one_call_is_the_exponential_law():
    assert erlang_cdf(1.0, 1) == pytest.approx(1 - math.exp(-1))


@pytest.mark.parametrize("v", [0.05, 0.5, 0.95])
def test_the_slowest_sum_sits_at_the_quantile_given_and_every_other_below_it(v):
    rows = stratified_latencies(SHAPE, v, random.Random(1))
    sums = sorted(sum(r) for r in rows)
    assert len(rows) == SHAPE.trajectories and all(len(r) == SHAPE.turns - 1 for r in rows)
    assert erlang_cdf(sums[-1] / SHAPE.tool_mean_s, SHAPE.turns - 1) ** SHAPE.trajectories == pytest.approx(v)
    assert sums[-2] < sums[-1]


def test_with_a_uniform_quantile_the_draws_follow_the_independent_law():
    rng = random.Random(7)
    stratified = [stratified_latencies(SHAPE, rng.random(), rng) for _ in range(3000)]
    independent = [tool_latencies(16, 3, 1.0, "exp", rng) for _ in range(3000)]
    for key in (lambda b: slowest_tools(3, b), lambda b: statistics.fmean(c for r in b for c in r[:2])):
        a, b = [key(x) for x in stratified], [key(x) for x in independent]
        se = math.hypot(statistics.stdev(a), statistics.stdev(b)) / math.sqrt(3000)
        assert abs(statistics.fmean(a) - statistics.fmean(b)) < 4 * se


def test_the_reference_batches_mean_spreads_less_than_independent_batches():
    """Twenty reference batches' mean slowest sum, over 200 runs: about half the spread of independent draws."""
    rng = random.Random(3)

    def mean_of_run(draw) -> float:
        u0 = rng.random()
        return statistics.fmean(slowest_tools(3, draw(b, u0)) for b in range(2, 22))

    stratified = [mean_of_run(lambda b, u0: batch_latencies(SHAPE, b, u0, rng)) for _ in range(200)]
    independent = [mean_of_run(lambda b, u0: tool_latencies(16, 3, 1.0, "exp", rng)) for _ in range(200)]
    assert statistics.stdev(stratified) < 0.7 * statistics.stdev(independent)


def test_the_two_batches_the_correction_learns_from_and_fixed_tools_are_drawn_independently():
    fixed = Workload(8, 2, 32, 24, 0.5, "fixed")
    assert batch_latencies(fixed, 5, 0.3, random.Random(0)) == [[0.5, 0.5]] * 8
    a, b = random.Random(4), random.Random(4)
    assert batch_latencies(SHAPE, 1, 0.3, a) == tool_latencies(16, 3, 1.0, "exp", b)
