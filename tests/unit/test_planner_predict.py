"""The completion-time model (pearlctl.planner.predict): the behaviours the planner relies on."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.planner.model import Deployment, Mode, Work
from pearlctl.planner.predict import Bound, completion_s, predict
from pearlctl.planner.profile import DecodeModel, Profile

# Shaped like Qwen3-8B on one H100: weights ~16 GB at ~3.3 TB/s, ~144 KiB of KV per token.
DENSE = Profile(
    name="dense-test",
    model="dense-8b",
    hardware="h100",
    decode=DecodeModel(weights_s=0.005, seq_s=2e-5, kv_s_per_token=4.4e-8),
    prefill_tok_s=20_000,
    kv_capacity_tokens=270_000,
    max_num_seqs=256,
    kv_bytes_per_token=147_456,
    kv_transfer_gb_s=25,
)
# Shaped like Qwen3-30B-A3B: the same batch-1 step time, but most of it is experts (128, top-8).
_dense_at_1 = DENSE.decode.itl(1, 0)
_MOE_DECODE = DecodeModel(
    weights_s=0.0015, seq_s=2e-5, kv_s_per_token=2e-8, experts_s=0.0, moe_experts=128, moe_top_k=8
)
MOE = replace(
    DENSE,
    name="moe-test",
    decode=replace(_MOE_DECODE, experts_s=(_dense_at_1 - _MOE_DECODE.itl(1, 0)) / 8),
)

# A worker whose API server takes 20 ms of each request one at a time (a CPU worker's is tens of ms)
SERIAL = replace(DENSE, name="serial-test", request_overhead_s=0.03, request_serial_s=0.02)

WORK = Work(
    trajectories=512,
    tool_waiting=128,
    turns_left=4,
    turns_left_max=4,
    decode_tokens_per_turn=300,
    decode_tokens_per_turn_max=300,
    prefill_tokens_per_turn=400,
    context_tokens=3_000,
    tool_latency_s=3.0,
    tool_latency_max_s=3.0,
)


def colocated(n: int) -> Deployment:
    return Deployment(Mode.COLOCATED, decode=n)


works = st.builds(
    Work,
    trajectories=st.integers(1, 2_000),
    turns_left=st.floats(0.5, 20),
    decode_tokens_per_turn=st.floats(1, 4_000),
    prefill_tokens_per_turn=st.floats(0, 8_000),
    context_tokens=st.floats(0, 60_000),
    tool_latency_s=st.floats(0, 120),
).flatmap(
    lambda w: st.builds(
        replace,
        st.just(w),
        turns_left_max=st.floats(w.turns_left, w.turns_left * 5),
        decode_tokens_per_turn_max=st.floats(w.decode_tokens_per_turn, w.decode_tokens_per_turn * 4),
        tool_latency_max_s=st.floats(w.tool_latency_s, w.tool_latency_s * 4 + 1),
    )
)


@settings(max_examples=150, deadline=None)
@given(work=works, n=st.integers(1, 64), profile=st.sampled_from([DENSE, MOE, SERIAL]))
def test_more_colocated_workers_are_never_predicted_slower(work, n, profile):
    fewer = completion_s(work, colocated(n), profile)
    more = completion_s(work, colocated(n + 1), profile)
    assert more <= fewer * (1 + 1e-6)


@settings(max_examples=100, deadline=None)
@given(work=works, n=st.integers(1, 32), extra=st.floats(0.5, 60))
def test_longer_tool_latency_lowers_the_effective_decode_batch(work, n, extra):
    short = predict(work, colocated(n), DENSE).batch
    longer = replace(
        work, tool_latency_s=work.tool_latency_s + extra, tool_latency_max_s=work.tool_latency_max_s + extra
    )
    assert predict(longer, colocated(n), DENSE).batch <= short * (1 + 1e-6)


def test_tool_waits_lower_the_batch_below_trajectories_per_worker():
    no_tools = predict(replace(WORK, tool_latency_s=0, tool_latency_max_s=0), colocated(8), DENSE)
    tools = predict(replace(WORK, tool_latency_s=10, tool_latency_max_s=10), colocated(8), DENSE)
    assert no_tools.batch > 0.9 * WORK.trajectories / 8  # nearly everyone decodes (prefill aside)
    assert tools.batch < 0.5 * no_tools.batch


@settings(max_examples=150, deadline=None)
@given(
    work=works,
    dep=st.one_of(
        st.builds(colocated, st.integers(1, 4_096)),
        st.builds(
            lambda p, d: Deployment(Mode.DISAGGREGATED, decode=d, prefill=p), st.integers(1, 64), st.integers(1, 64)
        ),
    ),
)
def test_the_straggler_floor_holds(work, dep):
    """No deployment finishes before the longest trajectory could — one tail response and its others typical,
    decoding alone at batch-1 speed, its tool calls (one after every turn but the last) at least their mean."""
    turns = work.turns_left_max
    tokens = (
        max(work.decode_tokens_per_turn_max, work.decode_tokens_per_turn) + (turns - 1) * work.decode_tokens_per_turn
    )
    tool = max(turns - 1, 0) * work.tool_latency_s
    floor = tokens * DENSE.decode.itl(1, work.context_tokens) + tool
    assert completion_s(work, dep, DENSE) >= floor * (1 - 1e-9)


def test_the_tail_responses_excess_decodes_as_the_batch_drains():
    """The straggler's one long response: its tokens beyond the typical length decode while the others finish,
    at the drain's mean batch ``(B - 1) / ln B`` — not at the full batch (a 42% overestimate on a real 2-s batch,
    docs/planner.md), and never faster than batch 1. A profile whose step time ignores context isolates it."""
    flat = replace(DENSE, decode=DecodeModel(weights_s=0.005, seq_s=2e-4, kv_s_per_token=0.0))
    typical = replace(WORK, turns_left=2, turns_left_max=2, tool_latency_s=0.0, tool_latency_max_s=0.0)
    tail = replace(typical, decode_tokens_per_turn_max=typical.decode_tokens_per_turn + 500)
    dep = colocated(4)
    base, long = predict(typical, dep, flat), predict(tail, dep, flat)
    drained = (base.batch - 1) / math.log(base.batch)
    assert base.batch > 10  # a full batch, far from its drained mean
    assert long.straggler_s - base.straggler_s == pytest.approx(500 * flat.decode.itl(drained, 0))
    assert long.straggler_s - base.straggler_s < 500 * flat.decode.itl(base.batch, 0) * 0.9
    # a lone trajectory drains nothing: its excess decodes at batch-1 speed
    alone = replace(tail, trajectories=1)
    one, one_typical = predict(alone, dep, flat), predict(replace(alone, decode_tokens_per_turn_max=0), dep, flat)
    assert one.straggler_s - one_typical.straggler_s == pytest.approx(500 * flat.decode.itl(1, 0))


def test_with_ample_gpus_the_straggler_bounds():
    long_tail = replace(WORK, turns_left_max=20, decode_tokens_per_turn_max=2_000, tool_latency_max_s=30)
    p = predict(long_tail, colocated(4_096), DENSE)
    assert p.bound is Bound.STRAGGLER
    assert p.seconds == p.straggler_s


def test_moe_decode_grows_less_with_batch_than_dense():
    # Same step time at batch 1 by construction; at batch 64 the MoE touches ~128 experts instead of 8.
    assert math.isclose(MOE.decode.itl(1, 0), DENSE.decode.itl(1, 0))
    assert MOE.decode.tok_s(64, 2_000) / MOE.decode.tok_s(1, 2_000) < DENSE.decode.tok_s(
        64, 2_000
    ) / DENSE.decode.tok_s(1, 2_000)
    # In the batch model: 8x the trajectories on one worker costs the MoE relatively more time than the
    # dense model (each new sequence routes to experts no other sequence has touched yet).
    few = replace(WORK, tool_latency_s=0, tool_latency_max_s=0, trajectories=2)
    many = replace(few, trajectories=16)

    def growth(profile):
        return completion_s(many, colocated(1), profile) / completion_s(few, colocated(1), profile)

    assert growth(MOE) > growth(DENSE)


def test_kv_capacity_caps_the_batch_and_queues_the_rest():
    small_kv = replace(DENSE, kv_capacity_tokens=60_000)  # 20 sequences of 3,000 tokens
    roomy = predict(replace(WORK, tool_latency_s=0, tool_latency_max_s=0), colocated(4), DENSE)
    tight = predict(replace(WORK, tool_latency_s=0, tool_latency_max_s=0), colocated(4), small_kv)
    assert tight.bound is Bound.KV_CAPACITY
    assert tight.batch <= 60_000 / 3_000 + 1e-9
    assert tight.seconds > roomy.seconds


def test_tool_waiting_contexts_that_do_not_fit_are_re_prefilled():
    fits = predict(WORK, colocated(64), DENSE)  # 8 trajectories x 3k tokens per worker: all cached
    spills = predict(WORK, colocated(2), DENSE)  # 256 x 3k = 768k tokens > 270k per worker
    assert fits.recompute_tokens_per_turn == 0
    assert spills.recompute_tokens_per_turn > 0
    cheaper_prefill = replace(DENSE, prefill_tok_s=DENSE.prefill_tok_s * 100)
    assert completion_s(WORK, colocated(2), cheaper_prefill) < spills.seconds  # the recompute is paid for


def test_disaggregated_pays_the_kv_transfer():
    dep = Deployment(Mode.DISAGGREGATED, decode=6, prefill=2)
    work = replace(WORK, trajectories=128)  # the prefill workers keep up: the transfer is on every turn's path
    free = replace(DENSE, kv_bytes_per_token=0)
    slow_link = replace(DENSE, kv_transfer_gb_s=0.5)
    assert completion_s(work, dep, free) < completion_s(work, dep, DENSE) < completion_s(work, dep, slow_link)


def test_too_few_prefill_workers_bound_a_disaggregated_deployment():
    heavy_prefill = replace(WORK, prefill_tokens_per_turn=8_000, tool_latency_s=0, tool_latency_max_s=0)
    p = predict(heavy_prefill, Deployment(Mode.DISAGGREGATED, decode=15, prefill=1), DENSE)
    assert p.bound is Bound.PREFILL


def test_a_serial_api_server_bounds_the_turns_a_worker_takes():
    # 512 trajectories on one worker, 20 ms each of serial handling: a turn of all of them takes >= 10.2 s,
    # far more than their decode and tools
    quick = replace(WORK, decode_tokens_per_turn=20, decode_tokens_per_turn_max=20, prefill_tokens_per_turn=50,
                    context_tokens=200, tool_latency_s=0.5, tool_latency_max_s=0.5)  # fmt: skip
    p = predict(quick, colocated(1), SERIAL)
    assert p.bound is Bound.REQUESTS
    assert p.turn_s >= 512 * 0.02 * (1 - 1e-9)
    assert predict(quick, colocated(1), DENSE).turn_s < 0.5 * p.turn_s  # without the serial part: not bound
    assert predict(quick, colocated(64), SERIAL).bound is not Bound.REQUESTS  # 8 a worker: far below


def test_at_the_batch_start_the_last_request_of_the_burst_waits_for_the_others():
    start = replace(WORK, trajectories=64, tool_waiting=0, context_tokens=0, tool_latency_max_s=30)
    later = replace(start, context_tokens=1e-3)
    for dep, takers in ((colocated(2), 2), (Deployment(Mode.DISAGGREGATED, decode=3, prefill=2), 2)):
        burst = predict(start, dep, SERIAL).straggler_s - predict(later, dep, SERIAL).straggler_s
        assert abs(burst - (64 / takers - 1) * 0.02) < 1e-3, dep
        no_serial = predict(start, dep, DENSE).straggler_s - predict(later, dep, DENSE).straggler_s
        assert abs(no_serial) < 1e-6, dep


def test_the_tail_drains_with_falling_concurrency():
    skewed = replace(WORK, turns_left=4, turns_left_max=12)
    p = predict(skewed, colocated(8), DENSE)
    assert len(p.phases_s) == 4
    assert p.seconds >= sum(p.phases_s) * (1 - 1e-9)
    # more skew at the same mean: the tail runs at lower concurrency, so more turns pass at near batch-1 speed
    assert completion_s(skewed, colocated(8), DENSE) > completion_s(
        replace(skewed, turns_left_max=4), colocated(8), DENSE
    )


def test_no_work_takes_no_time_and_no_workers_never_finish():
    assert completion_s(Work(), colocated(4), DENSE) == 0
    assert completion_s(WORK, colocated(0), DENSE) == math.inf
    assert completion_s(WORK, Deployment(Mode.DISAGGREGATED, decode=4, prefill=0), DENSE) == math.inf


# -- the straggler's tool calls ------------------------------------------------------------------------------

# a handful of short trajectories on ample workers: the straggler bounds, and its tools are all that differs
AMPLE = colocated(4_096)
SHORT = replace(WORK, decode_tokens_per_turn=20, decode_tokens_per_turn_max=20, prefill_tokens_per_turn=10)


def straggler_tools(work: Work) -> tuple[float, float]:
    """The straggler's tool time (its floor with these tools less the same without any) and its spread."""
    with_tools = predict(work, AMPLE, DENSE)
    without = predict(replace(work, tool_latency_s=0, tool_latency_max_s=0), AMPLE, DENSE)
    return with_tools.straggler_s - without.straggler_s, with_tools.straggler_sd_s


def test_the_last_turn_calls_no_tool():
    two_turns = replace(SHORT, trajectories=8, turns_left=2, turns_left_max=2, tool_latency_s=0.5,
                        tool_latency_max_s=0.5)  # fmt: skip
    tools, spread = straggler_tools(two_turns)
    assert tools == pytest.approx(0.5, rel=1e-4) and spread == 0.0  # one call of a fixed 0.5 s
    last = replace(two_turns, turns_left=1, turns_left_max=1)
    assert predict(last, colocated(1), DENSE) == predict(replace(last, tool_latency_s=9, tool_latency_max_s=40),
                                                         colocated(1), DENSE)  # fmt: skip


@pytest.mark.parametrize(("calls", "trajectories"), [(1, 8), (1, 64), (2, 16), (3, 32), (5, 4)])
def test_the_stragglers_tools_are_the_expected_maximum_of_the_trajectories_sums(calls, trajectories):
    """Exponential tool latencies (p99 = mean * ln 100): the predicted straggler's tools against the mean and
    the standard deviation of the slowest of ``trajectories`` sums of ``calls`` draws, by seeded simulation."""
    mean = 2.0
    work = replace(SHORT, trajectories=trajectories, turns_left=calls + 1, turns_left_max=calls + 1,
                   tool_latency_s=mean, tool_latency_max_s=mean * math.log(100))  # fmt: skip
    tools, spread = straggler_tools(work)
    rng = random.Random(7)
    slowest = [max(sum(rng.expovariate(1 / mean) for _ in range(calls)) for _ in range(trajectories))
               for _ in range(4_000)]  # fmt: skip
    assert tools == pytest.approx(statistics.fmean(slowest), rel=0.06)
    assert spread == pytest.approx(statistics.stdev(slowest), rel=0.25)


def test_more_trajectories_make_a_slower_straggler_only_when_tool_latency_spreads():
    exp = replace(SHORT, turns_left=3, turns_left_max=3, tool_latency_s=1.0, tool_latency_max_s=4.6)
    fixed = replace(exp, tool_latency_max_s=1.0)
    assert straggler_tools(replace(exp, trajectories=8))[0] < straggler_tools(replace(exp, trajectories=256))[0]
    for n in (8, 256):
        assert straggler_tools(replace(fixed, trajectories=n)) == (pytest.approx(2.0, rel=1e-4), 0.0)
    # a tail heavier than the exponential's (p99 = 40 means) still reaches past the p99 at many trajectories
    heavy = replace(exp, turns_left=2, turns_left_max=2, trajectories=512, tool_latency_max_s=40.0)
    assert straggler_tools(heavy)[0] > 40.0


def test_a_batch_of_absurdly_many_trajectories_still_gets_a_finite_straggler():
    # 1 - e^-gamma / n rounds to 1.0 beyond n ~ 1e16: the normal quantile must not be asked for it
    huge = replace(SHORT, trajectories=10**18, turns_left=3, turns_left_max=3, tool_latency_s=1.0,
                   tool_latency_max_s=4.6)  # fmt: skip
    p = predict(huge, AMPLE, DENSE)
    assert math.isfinite(p.straggler_s) and p.straggler_s >= 2.0 and math.isfinite(p.straggler_sd_s)
