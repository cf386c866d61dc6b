"""The predictor's running correction: how far recent batches of each shape were from what ``predict`` said.

``predict.completion_s`` models decode, prefill, tools and queues from the run's profile; what it leaves out
(the API server and the clients sharing the host, tokenizing, scheduling gaps, the spread of tool latencies)
makes it consistently off on a given machine and workload — on the CPU predictor benchmark's first run,
short by 13–37% on every batch shape (docs/planner.md). The daemon checks each finished batch: the completion
predicted at the batch's start (or at the last change of the serving GPUs, so that a plan made during the
batch does not count as prediction error) against the time it really took — from watches that cover at
least ``MIN_COVER`` of their batch — and keeps, per batch *shape*, an estimate of the log of measured /
predicted. A prediction for a shape seen before is multiplied by its ratio; for an unseen shape, by the
ratio of all batches so far. The correction is the profile's ``time_scale`` (``predict`` scales every time
it returns by it), so every policy, plan and deadline rule that predicts sees the corrected time.

How much one batch teaches. A batch's completion is set by its slowest trajectory, and with random tool
latencies that straggler varies from batch to batch by an amount the predictor knows
(``Prediction.straggler_sd_s``): the maximum of n exponential draws has a standard deviation of about 1.3
draws' means whatever n. A correction that took each batch at its word would carry that noise into every
later prediction. So the estimate is a scalar Kalman filter in log space: it starts ``PRIOR_SD`` from the
ratio of all batches (how far the model is off a shape it has not seen), may drift ``DRIFT_SD`` a batch, and
each batch counts with the noise its prediction expected (``spread``, the straggler's relative standard
deviation, at least ``NOISE_FLOOR``: the batch-to-batch jitter of a shape with fixed latencies on a shared
machine). A batch of a shape with fixed tool latencies moves the correction almost all the way; one of a
shape whose straggler spreads 25% moves it about halfway at first, and less as batches accumulate.

Taking the tools' luck out. The rollout driver times its tool calls, so at a batch's end it may report the
largest sum of tool seconds over the batch's trajectories (``Tools``). When the batch's prediction was set by
its straggler and the watch covered the batch from its first report, the batch counts as ``measured - luck``
(``tool_luck``): the straggler's tools as drawn, less the straggler's tools the prediction expected; and it
counts with ``NOISE_FLOOR`` only, since the spread the prediction expected was that luck. So the correction
learns the model's error, not the draw of the maximum. A slowest sum further from that expectation than
``LUCK_SDS`` of its standard deviations is no draw of the law the predictor models (a heavier tail, or calls
far slower than reported: a bias) and stays in. Without a report, or for a batch set by its throughput, the
batch counts as measured, weighed by its expected spread. What this leaves out: calls slower than the
reported law by less than that on every call are taken as luck too, so a driver should report the tool
latency it measures (the correction learns no bias the report hides within the maximum's spread). Scaling
the expectation by the batch's own mean call would take that bias in, but a batch's mean moves with its
maximum and cancels most of the luck (on the CPU benchmark's first run with it, docs/planner.md, the
correction after two batches was 28% off on one shape); a mean pooled over earlier batches was too noisy
after two of them.

A shape is the work's order of magnitude on the axes that move the error: trajectories per worker, tokens
per turn, and tool latency (log2 buckets). Pure: the state is a JSON-able dict the daemon stores with the run.
Ratios are clamped to ``[MIN_RATIO, MAX_RATIO]``: one batch cut short or stalled by an outage must not
throw the planner off by more than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pearlctl.planner.model import Work
from pearlctl.planner.predict import Bound, Prediction

PRIOR_SD = 0.25  # log: how far the model may be off a shape not seen yet (the first CPU run: 13-37% short)
DRIFT_SD = 0.05  # log, per batch: how far a shape's true ratio may move between two of its batches
NOISE_FLOOR = 0.05  # log: a batch's own jitter when the predictor expects no spread (fixed latencies)
MIN_RATIO, MAX_RATIO = 0.25, 4.0
MIN_PREDICTED_S = 1.0  # predictions shorter than this are too coarse to learn from
# a watch must cover at least this share of its batch's time: one started in the tail (after lent GPUs went
# back, say) sees stragglers only, where the prediction errs in its own way, not as it does on a whole batch
MIN_COVER = 0.5
# a slowest tool sum this many of its standard deviations from the expected maximum is not luck but another law
# (the Gumbel maximum lies further above its mean about once in a hundred batches)
LUCK_SDS = 3.0


def shape(work: Work, workers: int) -> str:
    """The batch shape of ``work`` on ``workers`` serving workers: log2 buckets of trajectories per
    worker, decode tokens per turn, and tool latency (in tenths of a second)."""
    per_worker = work.trajectories / max(workers, 1)
    buckets = (
        round(math.log2(max(per_worker, 1.0))),
        round(math.log2(max(work.decode_tokens_per_turn, 1.0))),
        round(math.log2(1.0 + 10.0 * max(work.tool_latency_s, 0.0))),
    )
    return "t{}-d{}-l{}".format(*buckets)


@dataclass(frozen=True)
class Tools:
    """A batch's tool calls as its rollout driver timed them: the largest sum of tool seconds over its
    trajectories (the closed loops its ``Work`` reports)."""

    slowest_s: float


def tool_luck(expected_s: float, sd_s: float, slowest_s: float, measured_s: float) -> float | None:
    """Seconds by which a straggler-bound batch's tools ran over what its prediction expected of them by the
    draw of the maximum (the module doc): the slowest tool sum (at most the batch's ``measured_s``) less
    ``expected_s``, the prediction's ``straggler_tools_s``; negative for a batch whose straggler drew fast
    tools. None when the slowest sum is further than ``LUCK_SDS`` of the maximum's standard deviations
    (``sd_s``, the prediction's ``straggler_sd_s``) from that expectation: the tools do not follow the law the
    predictor models, so its expectation is no mean to take luck against."""
    luck = min(slowest_s, measured_s) - expected_s
    return luck if abs(luck) <= LUCK_SDS * sd_s else None


@dataclass(frozen=True)
class Check:
    """One finished batch: what was predicted, what it took, and the correction after it."""

    shape: str
    predicted_s: float
    measured_s: float
    ratio: float  # measured / predicted, clamped
    corrected: float  # the shape's correction after this batch


def _clamp(r: float) -> float:
    return min(max(r, MIN_RATIO), MAX_RATIO)


def factor(state: dict | None, key: str) -> float:
    """The multiplier for a prediction of shape ``key``: its own ratio when seen before, else the ratio of
    all batches so far, else 1."""
    state = state or {}
    known = (state.get("shapes") or {}).get(key)
    if known:
        return float(known["ratio"])
    overall = state.get("all")
    return float(overall["ratio"]) if overall else 1.0


def _blend(entry: dict | None, ratio: float, noise: float, prior: float) -> dict:
    """The Kalman update of ``entry`` (log ratio and its variance) by one batch's ``ratio`` observed with
    log-space standard deviation ``noise``; a new entry starts at ``prior`` with variance ``PRIOR_SD ** 2``."""
    if entry:
        mean = math.log(float(entry["ratio"]))
        var = float(entry.get("var", PRIOR_SD**2)) + DRIFT_SD**2
        batches = int(entry["batches"])
    else:
        mean, var, batches = math.log(prior), PRIOR_SD**2, 0
    gain = var / (var + noise**2)
    mean += gain * (math.log(ratio) - mean)
    return {"ratio": math.exp(mean), "batches": batches + 1, "var": (1.0 - gain) * var}


def learn(
    state: dict | None,
    key: str,
    predicted_s: float,
    measured_s: float,
    batch_s: float | None = None,
    spread: float = 0.0,
    luck_s: float | None = None,
) -> tuple[dict, Check | None]:
    """The state after a batch of shape ``key`` predicted (uncorrected) at ``predicted_s`` took ``measured_s``
    from the prediction on (``batch_s``: the whole batch's time, when known; ``spread``: the relative standard
    deviation the prediction expected of it, ``straggler_sd_s / seconds``; ``luck_s``: its tools' luck,
    ``tool_luck``, when known — the batch then counts as ``measured_s - luck_s`` with no spread); and the check
    (None: the prediction was too short or not finite, or covered too little of its batch, to learn from;
    state unchanged)."""
    state = dict(state or {})
    if not (math.isfinite(predicted_s) and predicted_s >= MIN_PREDICTED_S and measured_s > 0):
        return state, None
    if batch_s is not None and measured_s < MIN_COVER * batch_s:
        return state, None
    if luck_s is not None and math.isfinite(luck_s) and measured_s - luck_s > 0:
        measured_s, spread = measured_s - luck_s, 0.0
    ratio = _clamp(measured_s / predicted_s)
    spread = spread if math.isfinite(spread) and spread > 0 else 0.0
    noise = math.hypot(NOISE_FLOOR, math.log1p(spread))
    shapes = dict(state.get("shapes") or {})
    shapes[key] = _blend(shapes.get(key), ratio, noise, factor(state, key))
    state["shapes"] = shapes
    state["all"] = _blend(state.get("all"), ratio, noise, 1.0)
    return state, Check(key, predicted_s, measured_s, ratio, shapes[key]["ratio"])


def watch(prediction: Prediction, key: str, since: float, gpus, trajectories: int = 0) -> dict:
    """The watch of a batch (as the daemon stores it with the run): its uncorrected ``prediction`` made at
    ``since`` for the serving ``gpus``, with the spread it expects, for the shape ``key``, the ``trajectories``
    in flight then (``grew``), and — a prediction set by its straggler — the straggler's expected tools
    (``tool_luck``; their standard deviation is the spread's, ``spread * predicted_s``)."""
    straggler = prediction.bound is Bound.STRAGGLER and prediction.straggler_tools_s > 0
    return {
        "since": since,
        "predicted_s": prediction.seconds,
        "spread": prediction.spread,
        "shape": key,
        "gpus": gpus,
        "trajectories": trajectories,
        "tools_s": prediction.straggler_tools_s if straggler else None,
    }


def grew(state: dict, work: Work) -> bool:
    """Whether work joined the batch the state watches: more trajectories in flight than when the watch began.
    A watch spans one batch: in an asynchronous run the next batch is launched before the current one ends
    (the work in flight never empties between them), and a watch that ran on would measure two batches
    against the prediction of one. Its watch and its batch's start are dropped (the caller starts anew)."""
    w = state.get("watch")
    return w is not None and work.trajectories > int(w.get("trajectories") or 0)


def finish(state: dict, at: float, tools: Tools | None = None) -> tuple[dict, Check | None]:
    """``learn`` from the state's watch, its batch ended at ``at`` (the whole batch counted from
    ``state["batch_since"]``, else from the watch), with the batch's ``tools`` as its driver timed them: their
    luck is taken out when the watch expected a straggler's tools and covered the batch from its first report
    (the straggler's tools from the batch's start are what it expected); the state unchanged without a
    watch."""
    w = state.get("watch")
    if w is None:
        return state, None
    since = state.get("batch_since")
    since = w["since"] if since is None else since
    measured_s = at - w["since"]
    luck = None
    if tools is not None and w.get("tools_s") is not None and w["since"] == since:
        sd = float(w.get("spread", 0.0)) * float(w["predicted_s"])  # the straggler's (Prediction.spread)
        luck = tool_luck(float(w["tools_s"]), sd, tools.slowest_s, measured_s)
    return learn(state, w["shape"], w["predicted_s"], measured_s, at - since, w.get("spread", 0.0), luck)
