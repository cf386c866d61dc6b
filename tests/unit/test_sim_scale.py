"""pearlctl.sim.scale: a scenario resized and sped up is the same scenario, only bigger and faster."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.sim import run, scale
from pearlctl.sim import scenario as sc
from pearlctl.sim.availability import build_trace

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


@pytest.fixture(scope="module")
def bursty() -> sc.Scenario:
    return sc.load(SCENARIOS / "bursty-elastic-8b.toml")


def test_a_faster_profile_predicts_every_time_that_much_shorter(bursty):
    p, q = bursty.profile, scale.time_scaled_profile(bursty.profile, 10)
    assert q.decode.itl(64, 3000) == pytest.approx(p.decode.itl(64, 3000) / 10)
    assert q.prefill_tok_s == pytest.approx(p.prefill_tok_s * 10)
    assert q.costs.borrow_s(warm=False) == pytest.approx(p.costs.borrow_s(warm=False) / 10)
    assert q.costs.weight_sync_s == pytest.approx(p.costs.weight_sync_s / 10)
    assert (q.kv_capacity_tokens, q.max_num_seqs) == (p.kv_capacity_tokens, p.max_num_seqs)


def test_a_sped_up_static_run_is_the_same_run_that_many_times_faster(bursty):
    # static makes no decision that waits on the clock: every event comes k times sooner, bit for bit the same run
    two = bursty.with_overrides(steps=2)
    slow = run.run_policy(two, "static")
    fast = run.run_policy(scale.scaled(two, speedup=4), "static")
    assert fast.samples_per_s == pytest.approx(4 * slow.samples_per_s, rel=1e-9)


def test_resizing_keeps_each_pools_share_in_whole_nodes_and_the_work_per_gpu(bursty):
    big = scale.scaled(bursty, gpus=64, speedup=10)
    c = big.cluster
    assert (c.trainer_gpus, c.rollout_gpus, c.elastic_gpus) == (16, 8, 40)  # 8:4:16 of 64, in 8-GPU nodes
    f = 64 / 28
    assert big.workload.prompts_per_step == round(64 * f)
    # the batch per trainer GPU is what it was: a step takes as long, then 10 times less
    per_gpu = (big.workload.prompts_per_step / 64) * (8 / 16)
    assert big.training.train_step_s == pytest.approx(bursty.training.train_step_s * per_gpu / 10)
    # random grants come as often per elastic node, on a clock 10 times faster
    assert big.availability.grant_interval_s == pytest.approx(bursty.availability.grant_interval_s / 10 / (40 / 16))
    assert big.workload.tool_latency_s.median == pytest.approx(bursty.workload.tool_latency_s.median / 10)


def test_the_live_daemons_own_pace_and_grace_replace_the_scaled_ones(bursty):
    big = scale.scaled(bursty, gpus=64, speedup=10, control_interval_s=5.0, notice_s=10.0)
    assert big.control_interval_s == 5.0 and big.availability.notice_s == 10.0
    leases = build_trace(big, horizon_s=600, seed=big.seed).leases
    ended = [x for x in leases if math.isfinite(x.end)]
    assert ended and all(x.end - x.notice_at == pytest.approx(min(10.0, x.end - x.start)) for x in ended)
    first = min(g for x in leases for g in x.gpus)
    assert first == 16 + 8  # elastic slots follow the trainer and rollout pools


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 64), min_size=3, max_size=3).filter(lambda s: s[0] > 0 and sum(s) > 0),
    nodes=st.integers(1, 200),
)
def test_a_node_split_totals_the_gpus_and_keeps_every_pool(sizes, nodes):
    cluster = sc.Cluster(trainer_gpus=sizes[0], rollout_gpus=sizes[1], elastic_gpus=sizes[2], gpus_per_node=8)
    present = sum(1 for s in sizes if s)
    if nodes < present:
        with pytest.raises(sc.ScenarioError, match="too few for one node per pool"):
            scale.node_split(cluster, nodes * 8)
        return
    out = scale.node_split(cluster, nodes * 8)
    got = [out.trainer_gpus, out.rollout_gpus, out.elastic_gpus]
    assert sum(got) == nodes * 8 and all(g % 8 == 0 for g in got)
    assert all((g > 0) == (s > 0) for g, s in zip(got, sizes, strict=True))
    # no pool is more than a node (plus the one-node floors' debt) away from its share
    share = [nodes * s / sum(sizes) for s in sizes]
    assert all(abs(g / 8 - x) < 1 + present for g, x in zip(got, share, strict=True))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"gpus": 60}, "positive multiple of gpus_per_node"),
        ({"gpus": 0}, "positive multiple"),
        ({"gpus": 16}, "too few for one node per pool"),
        ({"speedup": 0}, "speedup must be a positive number"),
        ({"speedup": float("nan")}, "speedup must be a positive number"),
    ],
)
def test_what_cannot_be_scaled_is_named(bursty, kw, message):
    with pytest.raises(sc.ScenarioError, match=message):
        scale.scaled(bursty, **kw)
