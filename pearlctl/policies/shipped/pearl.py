"""Policy `pearl`: elastic capacity + borrowed trainer GPUs + adaptive prefill–decode, with cost-aware gating
(docs/planner.md, "Policies"; PEARL's cost-aware switching and borrowing).

Each decision considers a few GPU budgets — the rollout pool; + elastic GPUs; + lent trainer GPUs that need
only a wake; + every lendable trainer GPU — lets ``choose`` pick the PD mode and ratio for each, and prices
each resulting plan against keeping the current assignment (the baseline, ``T0``; it includes the lent
GPUs' departures at their deadlines):

    gain  = (T0 - T_steady) * min(1, horizon / T0)    the speed-up, counted over the horizon only
    delay = T_plan - T_steady                         batch time lost while GPUs move
    risk  = preemptions x (move cost + a turn) / GPUs (elastic GPUs the plan adds)
          + P(late) x return cost                     (trainer GPUs the plan borrows)

``T_steady`` is the plan's completion as if its moves were instant, ``T_plan`` with them; the horizon is
``snapshot.horizon_s`` or ``T0``. A plan runs only if ``gain - delay - risk`` beats ``MARGIN_S`` and
``MIN_RELATIVE_GAIN`` of ``T0`` (a relative band: the model is not finer, and a band stops borrow/return
or ratio flapping); of those, the one with the largest net gain, then the fewest moves, then the first budget —
but a plan that lends more trainer GPUs than another that clears the band is taken only when it nets the band
(of the other's predicted batch) more: a borrow must pay for itself, not ride on the gain of the elastic GPUs
both plans bring up.
No PD mode flip within ``MIN_DWELL_S`` of ``snapshot.last_change_at``. Candidates are priced most promising
first, and one whose gain with instant moves is already a band below a net gain priced is not priced further (the
delay and the risks only lower it): the plan chosen is the one pricing every candidate whole would choose.

Whatever the gating says, lent GPUs due back go back (``budget.must_return``), and lent GPUs go back once the
batch is predicted to end within a return's time, or as soon as they no longer pay: when the batch predicted
without them — plus re-prefilling their sequences' contexts on the workers that stay — ends less than a
return's time later than with them. In a batch's tail the prediction is bound by the stragglers, not by the
GPUs, and a lent GPU still out when the batch ends makes the trainer wait for its return.

Idle rollout and elastic GPUs that may serve are brought up at once, whatever the batch gains from them (they
owe the trainer nothing, and a start put off until between batches makes the next launch wait in the driver's
join wait); elastic ones only while one is expected to outlive twice a cold start.

Between batches (no work in flight), lent GPUs go back — unless the trainer already waits for the next batch
(in a synchronous loop it reports its wait from the end of its step: the weight sync and the launch are inside
it), that wait is at least twice what a warm borrow (its parked worker reloads the new weights), a return and
the slack take, and a batch like the latest one (``Snapshot.last_batch``: its work as it began) is predicted to
end sooner with them by more than a warm borrow, a return and the slack (the lent workers join a warm borrow
after the others, and the driver's join wait holds the launch for them; a straggler-bound batch gains nothing):
then parked trainer GPUs are lent ahead of the batch, so that they serve from its first seconds rather than
after its first turns have been admitted elsewhere. Loaded by name (pearlctl.policies.load_policy); pure.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pearlctl.planner import budget, diff, plan, view
from pearlctl.planner.choose import Choice, choose_workers, worker_groups
from pearlctl.planner.model import SERVING, Deployment, Mode, MoveKind, Plan, Snapshot, Target
from pearlctl.vocabulary import PoolKind

NAME = "pearl"
NEEDS_PROFILE = True  # predicts with the run's engine profile: the daemon refuses it for a run without one
MARGIN_S = 2.0  # the least net gain worth a plan, in seconds of batch time
MIN_RELATIVE_GAIN = 0.05  # and at least this share of the batch's remaining time
MIN_DWELL_S = 120.0  # no PD mode flip this soon after the last applied plan: a flip drains every worker
LATE_RETURN_CV = 0.1  # spread of the trainer's wait report, as a share of the wait (late-return risk)


def decide(snapshot: Snapshot) -> Plan | None:
    s = snapshot
    current = plan.current_target(s)
    keep = plan.make(s, current, why="pearl: return lent GPUs before their deadline")
    if s.work.empty:
        return _between_batches(s, current)

    baseline = keep.predicted_s
    if current.lend:
        back = replace(current, rollout_gpus=current.rollout_gpus - current.lend, lend=0)
        if baseline <= budget.return_cost_s(s) + budget.RETURN_SLACK_S:
            # the batch ends before a return could: give lent GPUs back now, so the trainer does not wait
            return plan.make(s, back, why="pearl: batch ending, return lent GPUs")
        without = plan.make(s, back, why="pearl: lent GPUs no longer pay, return them", predicted_now_s=baseline)
        if without.predicted_s - baseline + _migration_s(s, current.lend) <= budget.return_cost_s(s):
            # In the batch's tail the lent GPUs shorten it — their sequences' move elsewhere included — by less
            # than the trainer would wait for them if the batch ended before they were back (a return's time):
            # they go back now.
            return without
    horizon = s.horizon_s if s.horizon_s is not None else baseline
    dwelling = s.last_change_at is not None and s.now - s.last_change_at < MIN_DWELL_S
    modes = (current.mode,) if dwelling else (Mode.COLOCATED, Mode.DISAGGREGATED)

    threshold = max(MARGIN_S, MIN_RELATIVE_GAIN * baseline)
    candidates = _candidates(s, modes, baseline, threshold)

    # Each candidate's net gain. The most promising (the fastest steady prediction) is priced first; a later
    # one whose gain with instant moves — which its net gain never exceeds: the delay and the risks are never
    # negative — is not above a net gain already priced less the threshold can be neither chosen nor the plan a
    # borrow must beat (below), and its moving time is not priced. The choice below is made in the budgets' order,
    # so it is the one pricing every candidate would make.
    priced: dict[int, tuple[float, Plan]] = {}
    best_net = -math.inf
    for index, label, choice in sorted(candidates, key=lambda c: c[2].seconds):
        d = choice.deployment
        shape = f"{d.mode.value} {d.workers}w" + (f" ({d.prefill}P:{d.decode}D)" if d.prefill else "")
        planned = diff.moves(s, choice.target)
        if not planned:
            continue
        steady = plan.timeline_s(s, planned, instant=True)
        if math.isfinite(baseline) and _gain(baseline, steady, horizon) <= best_net - threshold:
            continue
        why = f"pearl: {label}, {shape}"
        candidate = plan.make(s, choice.target, why=why, predicted_now_s=keep.predicted_now_s, planned=planned)
        net = _net_gain(s, candidate, d, baseline, horizon, steady=steady)
        priced[index] = (net, candidate)
        if net > best_net:
            best_net = net

    # The largest net gain, then the fewest moves, then the first budget. But trainer GPUs owe the trainer a
    # return: a plan that lends more of them than another plan clearing the threshold is taken only when it nets
    # a plan's margin — 2 s and 5% of the other's predicted batch — more, so that a borrow pays for itself rather
    # than riding on the gain of the elastic GPUs both plans bring up.
    ordered = [priced[index] for index in sorted(priced)]  # in the budgets' order
    best: tuple[float, Plan] | None = None
    for net, candidate in ordered:
        if best is None or net > best[0] or (net == best[0] and len(candidate.moves) < len(best[1].moves)):
            best = (net, candidate)
    if best is None or best[0] < threshold:
        grow = _bring_up_idle(s, current, keep)
        return grow if grow is not None else (None if keep.empty else keep)
    best_net, chosen = best
    fewer = [(net, c) for net, c in ordered if net >= threshold and c.target.lend < chosen.target.lend]
    if fewer and math.isfinite(best_net):
        net, other = max(fewer, key=lambda nc: nc[0])
        if best_net - net < max(MARGIN_S, MIN_RELATIVE_GAIN * other.predicted_s):
            return other
    return chosen


def _between_batches(s: Snapshot, current: Target) -> Plan | None:
    """The plan while there is no work (``decide``'s first case), or None to change nothing."""
    # Nothing to roll out now: idle rollout and elastic GPUs are brought up for the next batch (when one
    # was not already, during the last). Lent GPUs go back to the trainer, unless it waits long enough for
    # them to serve the next batch (``_lend_ahead``).
    ahead = _lend_ahead(s)
    target = replace(current, rollout_gpus=current.rollout_gpus - current.lend, lend=0)
    if current.mode is Mode.COLOCATED:
        whole = _whole_workers(s, view.may_serve(s, elastic=True, borrow=ahead, warm_borrow_only=True))
        target = replace(
            target,
            rollout_gpus=sum(whole.values()),
            elastic=whole.get(PoolKind.ELASTIC, 0),
            lend=whole.get(PoolKind.TRAINER, 0),
        )
    lent = "lend ahead of the batch" if ahead else "lent GPUs back"
    why = f"pearl: between batches, {lent}, idle capacity warm"
    idle = plan.make(s, target, why=why)
    return None if idle.empty else idle


def _candidates(
    s: Snapshot, modes: tuple[Mode, ...], baseline: float, threshold: float
) -> list[tuple[int, str, Choice]]:
    """The targets worth pricing: the best choice of workers in each budget, each with its index and label."""
    # The budgets, counted in whole workers per pool: worker_groups(view.servable(s).budget(...)), from
    # counts made once per snapshot.
    workers = view.of(s).workers
    budgets = (
        ("rollout pool", workers(elastic=False, borrow=False)),
        ("+ elastic", workers(elastic=True, borrow=False)),
        ("+ elastic + warm borrow", workers(elastic=True, borrow=True, warm_borrow_only=True)),
        ("+ elastic + borrow", workers(elastic=True, borrow=True)),
    )
    # The candidates, in the order of the budgets above (a target two budgets share keeps the first's label).
    candidates: list[tuple[int, str, Choice]] = []
    tried = set()
    for label, by_pool in budgets:
        choice = choose_workers(s, by_pool, modes=modes)
        if choice is None or choice.target in tried:
            continue
        tried.add(choice.target)
        # The steady prediction bounds the gain (departures and moving only slow a plan down): skip pricing a
        # plan that could not clear the threshold even for free.
        if baseline - choice.seconds < threshold:
            continue
        candidates.append((len(candidates), label, choice))
    return candidates


def _whole_workers(s: Snapshot, gpus: list) -> dict[str, int]:
    """GPUs per pool, counted in whole workers of the profile's size (``worker_groups``)."""
    gpw = s.profile.gpus_per_worker
    return {p: n * gpw for p, n in worker_groups(gpus, gpw).items()}


def _bring_up_idle(s: Snapshot, current: Target, keep: Plan) -> Plan | None:
    """A colocated deployment grows onto every idle rollout and elastic GPU that may serve, whatever this batch
    gains from it: that capacity owes the trainer nothing, its start takes no batch time from the GPUs serving,
    and a start put off until between batches makes the next batch's launch wait for it (the driver's join
    wait). Only starts and wakes (besides ``keep``'s returns); a PD deployment grows by the priced path. Elastic
    GPUs only while one is expected to serve at least as long as its start takes (its expected lifetime, from
    ``preempt_per_hour``, at least twice a cold start); idle ones that are not wait for the priced path."""
    if current.mode is not Mode.COLOCATED:
        return None
    lasting = s.preempt_per_hour <= 0 or 3600.0 / s.preempt_per_hour >= 2 * s.costs.start_s
    may = [
        g
        for g in view.may_serve(s, elastic=True, borrow=False)
        if lasting or g.pool != PoolKind.ELASTIC or g.role in SERVING
    ]
    whole = _whole_workers(s, may)
    pool = sum(whole.values())
    if pool <= current.rollout_gpus - current.lend:
        return None
    target = replace(current, rollout_gpus=current.lend + pool, elastic=whole.get(PoolKind.ELASTIC, 0))
    grown = plan.make(s, target, why="pearl: idle rollout and elastic GPUs brought up")
    kept = set(keep.moves)
    added = [m for m in grown.moves if m not in kept]
    if not added or any(m.kind not in (MoveKind.START, MoveKind.WAKE) for m in added):
        return None
    return grown


def _migration_s(s: Snapshot, leaving: int) -> float:
    """Batch seconds that ``leaving`` serving GPUs cost on their way out: their share of the trajectories
    re-prefills its context on the workers that stay (abort and continue; the KV stays behind)."""
    serving = view.of(s).serving_count  # GPUs serving now, every pool
    staying = max(serving - leaving, 0) // s.profile.gpus_per_worker
    if not staying:
        return math.inf
    tokens = s.work.trajectories * leaving / max(serving, 1) * s.work.context_tokens
    return tokens / (s.profile.prefill_tok_s * staying)


def _lend_ahead(s: Snapshot) -> bool:
    """Whether to lend trainer GPUs before the next batch starts (the trainer waits through the weight sync
    and the batch). Only when the GPUs would serve at least as long as they spend moving: the borrow (a parked
    worker's weights are a train step old, so a wake pays the weight sync too), the return and the slack must
    take at most half of the trainer's wait. And, once a batch was seen (``Snapshot.last_batch``), only when
    lending shortens a batch like it — predicted on the GPUs that serve without the lent ones and with them —
    by more than the lending costs the batch: the lent workers are ready a warm borrow after the others, so
    the driver's join wait holds the launch that long, and the trainer may wait for their return at its end.
    A batch bound by its stragglers gains nothing from more GPUs."""
    if s.trainer.phase != "waiting" or s.trainer.batch_ready:  # its batch is complete: it trains next
        return False
    c = s.costs
    moving = c.borrow_s(warm=True) + c.weight_sync_s + budget.return_cost_s(s) + budget.RETURN_SLACK_S
    if s.trainer.wait_left_s < 2 * moving:
        return False
    if s.last_batch.empty:
        return True
    like = replace(s, work=s.last_batch)
    workers = view.of(like).workers
    alone = choose_workers(like, workers(elastic=True, borrow=False), modes=(Mode.COLOCATED,))
    lent = choose_workers(like, workers(elastic=True, borrow=True, warm_borrow_only=True), modes=(Mode.COLOCATED,))
    if lent is None:
        return False
    if alone is None:
        return True
    cost = c.borrow_s(warm=True) + budget.return_cost_s(s) + budget.RETURN_SLACK_S
    return alone.seconds - lent.seconds > cost


def _gain(baseline: float, steady: float, horizon: float) -> float:
    """The speed-up of a plan whose moves are instant, counted over the horizon only (see the module doc)."""
    return (baseline - steady) * (min(1.0, horizon / baseline) if baseline > 0 else 0.0)


def _net_gain(
    s: Snapshot, candidate: Plan, deployment: Deployment, baseline: float, horizon: float, *, steady: float
) -> float:
    """gain - delay - risk, in seconds of batch time (see the module doc). ``steady``: the candidate's completion
    with instant moves (``plan.timeline_s(s, candidate.moves, instant=True)``)."""
    if not math.isfinite(candidate.predicted_s):
        return -math.inf
    if not math.isfinite(baseline):
        return math.inf  # nothing serves now: any plan that serves beats waiting
    gain = _gain(baseline, steady, horizon)
    delay = max(0.0, candidate.predicted_s - steady)
    return gain - delay - _preemption_risk(s, candidate, deployment, horizon) - _late_return_risk(s, candidate)


def _preemption_risk(s: Snapshot, candidate: Plan, deployment: Deployment, horizon: float) -> float:
    """Expected batch seconds lost to preempted elastic GPUs the plan brings up: each preemption wastes the
    GPU's bring-up and the turns in flight on it, spread over the GPUs serving."""
    if s.preempt_per_hour <= 0:
        return 0.0
    elastic = view.of(s).elastic_ids
    added = [m for m in candidate.moves if m.kind in (MoveKind.START, MoveKind.WAKE) and m.gpu in elastic]
    if not added:
        return 0.0
    turn_s = view.of(s).predict(deployment).turn_s  # predict(s.work, deployment, s.profile)
    gpus = max(deployment.workers * s.profile.gpus_per_worker, 1)
    exposure = min(horizon, candidate.predicted_s)
    preemptions = s.preempt_per_hour * exposure / 3600.0  # expected, per GPU
    return sum(preemptions * (m.cost_s + turn_s) for m in added) / gpus


def _late_return_risk(s: Snapshot, candidate: Plan) -> float:
    """Expected trainer seconds lost when a GPU the plan borrows comes back late: the trainer's wait report
    is uncertain (``LATE_RETURN_CV``); a late return costs it the return itself."""
    borrowed = [m for m in candidate.moves if m.kind is MoveKind.BORROW]
    if not borrowed:
        return 0.0
    back_s = budget.return_cost_s(s)
    latest = max(m.cost_s for m in borrowed)
    slack = budget.trainer_deadline(s) - (s.now + latest + back_s + budget.RETURN_SLACK_S)
    spread = max(back_s, LATE_RETURN_CV * s.trainer.wait_left_s, 1e-9)
    return math.exp(-max(slack, 0.0) / spread) * back_s
