"""Rollout batch completion time for one deployment (docs/planner.md): how long the unfinished trajectories of
the current batch take on ``decode`` (+ ``prefill``) workers of a profile. Pure and cheap (a few hundred
microseconds): the policies call it dozens of times a decision, the simulator thousands of times a run.

The model — closed-loop trajectories. Each trajectory repeats a turn: prefill its new tokens (the prompt,
then tool output), decode a response, wait on a tool. Only trajectories in the decode step occupy a decode
batch, so the *effective* decode concurrency per worker is below trajectories / workers (PEARL's
environment-induced reduction). It is the fixed point

    B = K * T * it(B) / cycle(B),     cycle(B) = W + prefill latency + T * it(B)

with ``K`` trajectories per decode worker, ``T`` response tokens per turn, ``W`` the tool latency and
``it(B)`` the seconds of one decode iteration at batch ``B``: the profile's ``itl(B, L)``, plus — colocated
only — the prefill that time-shares the worker (each iteration finishes ``B / T`` turns, each needing
``P / prefill_tok_s`` seconds of prefill). ``g(B)`` is increasing and concave with ``g(0) > 0``, so the fixed
point is unique: bisection finds it.

Caps. A worker runs at most ``max_num_seqs`` sequences, and at most ``kv_capacity_tokens / L`` fit its KV
cache; beyond the cap, sequences queue and the cycle becomes ``K * T * it(B) / B``. Tool-waiting sequences
keep their context cached only while it fits: the fraction that does not must re-prefill its whole context
next turn (``recompute_tokens_per_turn``) — on the decode workers when colocated, on the (fewer) prefill
workers when disaggregated.

Requests. Each turn is one request, and a worker's API server does part of its handling one request at a time
(``request_serial_s``, measured by ``pearlctl profile``): that floors the cycle at ``K * request_serial_s``,
and at the batch's start, when every trajectory sends its first request at once, the last a worker takes
waits ``(K - 1) * request_serial_s`` — added to the straggler. (On a GPU node the serial part is a few
milliseconds and rarely binds; on a CPU worker sharing its cores with the engine it is tens.)

Disaggregated: prefill workers and decode workers run in parallel; each turn adds the KV transfer of the
context (``Profile.kv_transfer_s``); prefill capacity floors the cycle at ``n * P / (prefill workers *
prefill_tok_s)`` — the slower side bounds.

The batch drains: trajectories have different numbers of turns left. Turns left follow ``M * q ** a`` over
quantiles ``q`` (``a = M / m - 1`` makes the mean ``m`` and the maximum ``M`` exact); the model runs
``PHASES`` phases, each with the trajectories still unfinished, so concurrency falls in the tail. Contexts
grow by ``P + T`` per turn. A trajectory calls a tool after every turn but its last: of the turns a phase
runs, the last turns of the trajectories it finishes wait on no tool.

Finally no trajectory beats its own sequential time: the straggler floor is ``M * T * it(B_last) + (T_max - T) *
it(B_drain) + tools + M * (prefill latency + queue)``, with ``it(B) >= itl(1, L)`` — batch-1 decode speed — one
tail response (``T_max``, the reported ``decode_tokens_per_turn_max``) and the others typical. The tail
response's tokens beyond the typical ``T`` decode while the others finish theirs: the batch drains. With the
lengths' tail exponential, the sequences still decoding ``x`` tokens past the typical length number ``B e^(-x /
s)``, and the longest of ``B`` ends ``s ln B`` past it, so the mean batch over the excess is ``B_drain = (B - 1) /
ln B`` (``B`` the last phase's batch; 1 at ``B <= 1``). Its ``tools`` are the *expected maximum*, over the
trajectories that have (within one) ``M`` turns left, of the sum of their ``M - 1`` tool calls: the slowest
of n trajectories is slow because of its draws. A call's latency is modelled as a shifted exponential with
the reported mean and p99 (fixed latencies: no spread; an exponential law: no shift), so a sum of k calls is
``k * shift + Gamma(k, scale)``; the expected maximum of n such sums is the Gamma quantile at ``1 -
e^-gamma / n`` (the Gumbel limit: within a few percent of the exact mean for n >= 4), never below the mean.
``Prediction.straggler_sd_s`` is that maximum's standard deviation: how far one batch may land from the
prediction even when the model is right (the correction, pearlctl.planner.correct, weighs batches by it).

Every time returned is multiplied by the profile's ``time_scale``: the run's learned correction of what this
model leaves out (pearlctl.planner.correct; 1 for a profile as measured).

What it does not model: the transient of trajectories on tools right now (``Work.tool_waiting``; the steady
state decides), queueing variance (means only), chunked-prefill details, and speculative decoding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist
from typing import NamedTuple

from pearlctl.planner.model import Deployment, Mode, Work
from pearlctl.planner.profile import DecodeModel, Profile

PHASES = 4  # drain phases: enough to see the tail, few enough to stay cheap
_NORMAL = NormalDist()
_EULER_GAMMA = 0.5772156649015329
_P99_EXP = math.log(100.0) - 1.0  # (p99 - mean) of an exponential law, in units of its scale
_GUMBEL_SD = math.pi / math.sqrt(6.0)  # standard deviation of the standard Gumbel law
_BISECTIONS = 18  # B to ~4e-6 of its range: far below what the profile is accurate to


class Bound(StrEnum):
    """What limits the batch's completion."""

    NONE = "none"  # no work left
    UNSERVED = "unserved"  # no worker can serve it (no decode or, disaggregated, no prefill worker)
    THROUGHPUT = "throughput"  # decode iterations of the whole batch (incl. the max_num_seqs cap)
    KV_CAPACITY = "kv_capacity"  # the running batch is capped by KV cache: sequences queue
    PREFILL = "prefill"  # disaggregated: the prefill workers cannot keep up
    REQUESTS = "requests"  # the workers' API servers, taking requests one at a time, cannot keep up
    STRAGGLER = "straggler"  # the longest trajectory, at (near) batch-1 speed


@dataclass(frozen=True)
class Prediction:
    seconds: float  # until the last trajectory of the batch finishes (inf: never)
    batch: float  # effective decode batch per decode worker, first phase
    bound: Bound
    turn_s: float = 0.0  # one turn of a mean trajectory, first phase (decode + prefill + tool + queue)
    straggler_s: float = 0.0  # the straggler floor
    straggler_sd_s: float = 0.0  # the straggler's spread from batch to batch (its tool draws): standard deviation
    straggler_tools_s: float = 0.0  # the straggler's tools: the expected maximum of the trajectories' tool-time sums
    recompute_tokens_per_turn: float = 0.0  # context re-prefilled per turn (evicted while on a tool), first phase
    phases_s: tuple[float, ...] = ()  # the duration of each drain phase

    @property
    def spread(self) -> float:
        """The batch-to-batch spread expected of ``seconds``: the straggler's standard deviation relative to it."""
        return self.straggler_sd_s / self.seconds if 0 < self.seconds < math.inf else 0.0


@dataclass(frozen=True)
class _Steady:
    """One phase's steady state."""

    turn_s: float
    batch: float
    it_s: float  # one decode iteration at ``batch``
    prefill_s: float  # a trajectory's own non-decode, non-tool latency per turn
    queue_s: float  # waiting per turn for a batch slot or the prefill workers
    recompute: float
    bound: Bound


def completion_s(work: Work, dep: Deployment, profile: Profile) -> float:
    """Predicted seconds until the batch's last trajectory finishes on ``dep`` (inf if it cannot)."""
    return predict(work, dep, profile).seconds


def predict(work: Work, dep: Deployment, profile: Profile) -> Prediction:
    """The completion time, the effective decode batch and the bound that dominates (see the module doc)."""
    if work.trajectories <= 0:
        return Prediction(0.0, 0.0, Bound.NONE)
    if dep.decode <= 0 or (dep.mode is Mode.DISAGGREGATED and dep.prefill <= 0):
        return Prediction(math.inf, 0.0, Bound.UNSERVED)
    shape = _Shape.of(work)
    drain = _drain(shape, dep, profile)
    if drain is None:  # no turns left at all: the batch is done
        return Prediction(0.0, 0.0, Bound.NONE)
    phases, total, first, last, slowest = drain
    straggler, s_sd, s_tool = _straggler(shape, work, dep, profile, last)

    # (identical trajectories make the two equal: the drain's bound says more then)
    seconds, bound = (straggler, Bound.STRAGGLER) if straggler > total * (1 + 1e-9) else (total, slowest)
    seconds = max(seconds, straggler)
    k = profile.time_scale  # the run's learned correction (pearlctl.planner.correct); 1 without one
    return Prediction(
        seconds=seconds * k,
        batch=first.batch,
        bound=bound,
        turn_s=first.turn_s * k,
        straggler_s=straggler * k,
        straggler_sd_s=s_sd * k,
        straggler_tools_s=s_tool * k,
        recompute_tokens_per_turn=first.recompute,
        phases_s=tuple(p * k for p in phases),
    )


class _Shape(NamedTuple):
    """The batch's remaining work per trajectory, clamped to what the model takes (``Work``'s means)."""

    n: float  # unfinished trajectories
    mean_turns: float
    max_turns: float
    decode_tokens: float  # response tokens per turn
    prefill_tokens: float  # new tokens per turn
    tool_s: float  # one tool call's mean latency
    context0: float  # a trajectory's context now

    @classmethod
    def of(cls, work: Work) -> _Shape:
        mean_turns = max(work.turns_left, 0.0)
        return cls(  # (positional: a prediction makes one, and keywords cost more than the rest of it)
            float(work.trajectories),
            mean_turns,
            max(work.turns_left_max, mean_turns),
            max(work.decode_tokens_per_turn, 1.0),  # a turn always emits at least one token
            max(work.prefill_tokens_per_turn, 0.0),
            max(work.tool_latency_s, 0.0),
            max(work.context_tokens, 0.0),
        )


def _drain(
    shape: _Shape, dep: Deployment, profile: Profile
) -> tuple[list[float], float, _Steady, _Steady, Bound] | None:
    """The batch's drain, ``PHASES`` phases of the trajectories still unfinished (the module doc): each phase's
    duration, their total, the first and last phases' steady states and the bound of the longest phase (None:
    no phase runs a turn)."""
    n, groups = shape.n, _turn_groups(shape.mean_turns, shape.max_turns)
    decode_tokens, prefill_tokens, tool_s = shape.decode_tokens, shape.prefill_tokens, shape.tool_s
    growth = decode_tokens + prefill_tokens  # context tokens one turn adds
    total = 0.0
    phases: list[float] = []
    first: _Steady | None = None
    last: _Steady | None = None
    slowest: tuple[float, Bound] = (-1.0, Bound.THROUGHPUT)
    done_turns = 0.0
    for k, turns in enumerate(groups):
        delta = turns - done_turns
        if delta <= 1e-12:
            phases.append(0.0)
            continue
        active = n * (PHASES - k) / PHASES  # groups k.. are still running
        context = shape.context0 + (done_turns + delta / 2) * growth
        # the groups this phase finishes call no tool after their last turn
        ending = sum(1 for g in groups[k:] if g - turns <= 1e-12) / (PHASES - k)
        phase_tool_s = tool_s * (1.0 - ending * min(1.0, 1.0 / delta))
        steady = _steady(active, context, dep, profile, decode_tokens, prefill_tokens, phase_tool_s)
        duration = delta * steady.turn_s
        phases.append(duration)
        total += duration
        first = first or steady
        last = steady
        if duration > slowest[0]:
            slowest = (duration, steady.bound)
        done_turns = turns
    if first is None or last is None:
        return None
    return phases, total, first, last, slowest[1]


def _straggler(
    shape: _Shape, work: Work, dep: Deployment, profile: Profile, last: _Steady
) -> tuple[float, float, float]:
    """The straggler floor, its standard deviation and its tools' share (the module doc): its own turns one
    after another, in the ``last`` phase's batch (never faster than batch 1) and behind that phase's queue for
    a batch slot or a prefill worker. One tail response (the ``*_max``), the others typical: response lengths
    per turn are independent, so two tail turns in one trajectory are rare. The tail response's excess decodes
    as the batch drains. Its tools: the expected maximum of the tool-time sums of the trajectories that could be it."""
    n, mean_turns, max_turns = shape.n, shape.mean_turns, shape.max_turns
    decode_tokens, context0 = shape.decode_tokens, shape.context0
    s_excess = max(work.decode_tokens_per_turn_max - decode_tokens, 0.0)
    s_decode = s_excess + max_turns * decode_tokens
    s_tool, s_sd = _slowest_tools(
        max(max_turns - 1.0, 0.0), n * _tail_share(mean_turns, max_turns), shape.tool_s, work.tool_latency_max_s
    )
    s_context = context0 + (max_turns * shape.prefill_tokens + s_decode) / 2
    s_itl1 = profile.decode.itl(1.0, s_context)
    s_it = max(last.it_s, s_itl1)
    s_drain_it = 0.0  # one decode step of the tail response's excess, at the drain's mean batch
    if s_excess > 0:  # (most predictions have none: exact lengths, or a tail no longer than the mean)
        drain = (last.batch - 1.0) / math.log(last.batch) if last.batch > 1.0 + 1e-9 else 1.0
        s_drain_it = max(profile.decode.itl(drain, s_context), s_itl1)
    straggler = max_turns * (decode_tokens * s_it + last.prefill_s + last.queue_s) + s_excess * s_drain_it + s_tool
    if context0 <= 0:  # the batch's start: every trajectory sends its first request at once, and the last
        # one a worker's API server takes waits for all the others (later turns arrive spread by the tools)
        entry = min(dep.decode, dep.prefill) if dep.mode is Mode.DISAGGREGATED else dep.decode
        straggler += max(n / entry - 1.0, 0.0) * profile.request_serial_s
    return straggler, s_sd, s_tool


def _tail_share(mean_turns: float, max_turns: float) -> float:
    """The share of trajectories with at least ``max_turns - 1`` turns left, under the drain's law of turns left
    ``M * q ** a`` (``_turn_groups``): all when every trajectory has as many."""
    if max_turns <= 1.0 or mean_turns <= 0:
        return 1.0
    a = max_turns / mean_turns - 1.0
    if a <= 1e-9:
        return 1.0
    return 1.0 - ((max_turns - 1.0) / max_turns) ** (1.0 / a)


def _slowest_tools(calls: float, trajectories: float, mean_s: float, p99_s: float) -> tuple[float, float]:
    """The expected maximum, over ``trajectories``, of the sum of ``calls`` tool latencies of mean ``mean_s`` and
    p99 ``p99_s``, and its standard deviation (the module doc: a shifted exponential per call, a Gamma sum,
    the Gumbel limit of its maximum), never below the sum's mean."""
    mean_s = max(mean_s, 0.0)
    if calls <= 0 or mean_s <= 0:
        return 0.0, 0.0
    scale = max(p99_s - mean_s, 0.0) / _P99_EXP if math.isfinite(p99_s) else mean_s
    shift = mean_s - scale  # below 0 for a law with a heavier tail than the exponential's: its p99 still holds
    if scale <= 0:
        return calls * mean_s, 0.0
    n = max(trajectories, 1.0)
    top = _gamma_quantile(calls, 1.0 - math.exp(-_EULER_GAMMA) / n)
    # the Gumbel scale: the quantile's step from 1 - 1/n to 1 - 1/(e n); one trajectory: the sum's own spread
    if n < 2.0:
        sd = math.sqrt(calls)
    else:
        sd = _GUMBEL_SD * (_gamma_quantile(calls, 1.0 - 1.0 / (math.e * n)) - _gamma_quantile(calls, 1.0 - 1.0 / n))
    return max(calls * shift + scale * top, calls * mean_s), scale * sd


def _gamma_quantile(shape: float, p: float) -> float:
    """The ``p`` quantile of Gamma(``shape``, 1), by the Wilson–Hilferty cube-root normal approximation (``p``
    kept off 1: ``1 - x / n`` rounds to 1 for n beyond 1e16)."""
    c = 1.0 / (9.0 * shape)
    z = _NORMAL.inv_cdf(min(p, 1.0 - 1e-15))
    return shape * max(1.0 - c + z * math.sqrt(c), 0.0) ** 3


def _turn_groups(mean_turns: float, max_turns: float) -> list[float]:
    """Mean turns left of each quantile group (ascending): turns(q) = M * q ** a, a = M / m - 1, so the groups'
    mean is exactly ``mean_turns`` and the top of the last group is ``max_turns``."""
    if mean_turns <= 0:
        return [0.0] * PHASES
    a = max(max_turns / mean_turns - 1.0, 0.0)
    # mean of M q^a over [k/K, (k+1)/K] = M * K * ((k+1)^(a+1) - k^(a+1)) / ((a+1) K^(a+1))
    scale = max_turns / ((a + 1.0) * PHASES**a)
    return [scale * ((k + 1) ** (a + 1.0) - k ** (a + 1.0)) for k in range(PHASES)]


def _steady(
    active: float,
    context: float,
    dep: Deployment,
    profile: Profile,
    decode_tokens: float,
    prefill_tokens: float,
    tool_s: float,
) -> _Steady:
    """The steady state of ``active`` trajectories of mean context ``context`` on ``dep``."""
    per_worker = active / dep.decode
    kv = float(profile.kv_capacity_tokens)
    context = max(context, 1.0)
    kv_cap = kv / context
    cap = min(float(profile.max_num_seqs), kv_cap)
    recompute = _recompute_tokens(active, context, dep, kv)
    own_prefill, steal, prefill_floor, requests_floor = _turn_overheads(
        active, context, dep, profile, decode_tokens, prefill_tokens + recompute
    )
    floor = max(prefill_floor, requests_floor)

    itl = profile.decode.itl_at(context)

    def it(b: float) -> float:
        return itl(b) + b * steal

    def cycle(b: float) -> float:
        return max(tool_s + own_prefill + decode_tokens * it(b), floor)

    hi = min(per_worker, cap)
    capped = False
    if per_worker * decode_tokens * it(hi) / cycle(hi) >= hi:
        batch = hi  # more would decode if they could: the cap binds (or every trajectory decodes)
        capped = hi < per_worker
    else:
        batch = _fixed_point(
            profile.decode,
            context,
            itl,
            hi,
            per_worker * decode_tokens,
            tool_s + own_prefill,
            decode_tokens,
            steal,
            floor,
        )
    it_s = it(batch)
    c = cycle(batch)
    # Queued behind the cap: a turn's decode waits for a slot, so the cycle is set by throughput. Uncapped,
    # the fixed point makes the two equal; the cycle is the one free of the bisection's error.
    turn = max(c, per_worker * decode_tokens * it_s / batch) if capped else c

    if floor > 0 and floor >= tool_s + own_prefill + decode_tokens * it_s:
        bound = Bound.PREFILL if prefill_floor >= requests_floor else Bound.REQUESTS
    elif capped and kv_cap < profile.max_num_seqs:
        bound = Bound.KV_CAPACITY
    else:
        bound = Bound.THROUGHPUT
    queue = max(0.0, turn - (tool_s + own_prefill + decode_tokens * it_s))
    return _Steady(turn, batch, it_s, own_prefill, queue, recompute, bound)


def _recompute_tokens(active: float, context: float, dep: Deployment, kv: float) -> float:
    """Context tokens a trajectory re-prefills per turn: the share of the tool-waiting contexts that does not fit
    the KV cache (``kv`` tokens a worker) of the workers that hold them between turns — the colocated workers,
    or the prefill workers."""
    holders = dep.prefill if dep.mode is Mode.DISAGGREGATED else dep.decode
    resident = active / holders * context
    evicted = max(0.0, 1.0 - kv / resident) if resident > 0 else 0.0
    return evicted * context


def _turn_overheads(
    active: float, context: float, dep: Deployment, profile: Profile, decode_tokens: float, prefill_eff: float
) -> tuple[float, float, float, float]:
    """What a turn costs besides its decode and its tool, ``(own_prefill, steal, prefill_floor, requests_floor)``:
    a trajectory's own latency per turn (its ``prefill_eff`` tokens' prefill, the KV transfer when
    disaggregated, the request's overhead), the prefill seconds a colocated decode iteration spends per sequence
    (``steal``: prefill time-shares the worker), and the floors the prefill workers and the API servers put
    under the cycle."""
    pf = profile.prefill_tok_s
    # a turn's request also waits for the server's own handling (HTTP, tokenizing, scheduling); the serial
    # part of it bounds the requests a worker's API server takes per second: every turn of its trajectories
    # passes through it once (disaggregated: through a prefill worker's and a decode worker's)
    overhead = profile.request_overhead_s
    requests_floor = active / dep.decode * profile.request_serial_s
    if dep.mode is Mode.DISAGGREGATED:
        own_prefill = prefill_eff / pf + profile.kv_transfer_s(context) + overhead
        prefill_floor = active * prefill_eff / (dep.prefill * pf)
        requests_floor = max(requests_floor, active / dep.prefill * profile.request_serial_s)
        return own_prefill, 0.0, prefill_floor, requests_floor
    steal = prefill_eff / (decode_tokens * pf)  # prefill seconds per decode iteration per sequence
    return prefill_eff / pf + overhead, steal, 0.0, requests_floor


def _fixed_point(
    decode: DecodeModel,
    context: float,
    itl: Callable[[float], float],
    hi: float,
    demand: float,
    waits: float,
    decode_tokens: float,
    steal: float,
    floor: float,
) -> float:
    """The effective batch below ``hi`` by bisection: the ``B`` where ``g(B) = demand * it(B) / cycle(B)`` meets
    it, with ``it(B) = itl(B) + B * steal`` (``itl``: ``decode.itl_at(context)``) and ``cycle(B) = max(waits +
    decode_tokens * it(B), floor)`` (the module doc). ``g(mid) > mid`` is tested with ``it(mid)`` computed once
    per step and the constant products hoisted: the same floating-point operations in the same order as
    ``per_worker * decode_tokens * it(mid) / cycle(mid)`` with ``demand = per_worker * decode_tokens`` and
    ``waits = tool_s + own_prefill``."""
    lo = 0.0
    if type(decode) is DecodeModel:
        # ``itl(mid)`` (``DecodeModel.itl_at``, from the same ``itl_terms``) and ``max(..., floor)`` written out,
        # the same operations in the same order: the loop runs a thousand times a decision
        fixed, per_seq, experts, keep = decode.itl_terms(context)
        moe = bool(decode.moe_experts)
        for _ in range(_BISECTIONS):
            mid = 0.5 * (lo + hi)
            b = mid if mid > 1.0 else 1.0
            i = (fixed + experts * (1.0 - keep**b) + per_seq * b if moe else fixed + per_seq * b) + mid * steal
            c = waits + decode_tokens * i
            if floor > c:
                c = floor
            if demand * i / c > mid:
                lo = mid
            else:
                hi = mid
    else:
        for _ in range(_BISECTIONS):
            mid = 0.5 * (lo + hi)
            i = itl(mid) + mid * steal
            c = max(waits + decode_tokens * i, floor)
            if demand * i / c > mid:
                lo = mid
            else:
                hi = mid
    return 0.5 * (lo + hi)
