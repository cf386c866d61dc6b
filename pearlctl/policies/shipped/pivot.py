"""Policy `pivot`: pearl's plan for the policy's GPUs, and GPUs moved to the run's judge (a generative reward model,
role REWARD) and back when the verdicts' demand makes it pay: idle trainer GPUs lent to the judge, or rollout GPUs
shifted to it (docs/planner.md, "The judge").

`pearl` is extended, not copied: it plans the policy's GPUs (borrowing, elastic capacity, prefill–decode) on the
snapshot without the judges, and its plan comes first; the judge is weighed only when pearl moves nothing, so the
two never plan the same GPU. One decision lends trainer GPUs (one loan) or shifts rollout GPUs, several at once (the
daemon runs an allocation's moves of one kind as one transition), and the next decision sees its effect.

The batch ends when its last trajectory is judged. With R rollout GPUs and J judges:

    E(R, J) = max(T_roll(R), T_judge(J))
    T_roll  = the rollout's predicted completion (the planner's timeline, moving time included)
    T_judge = c + max(0, D - J·r·c) / (J'·r)     (J' judges once a move of cost c is done; D = the judge's demand)

``D`` is every trajectory without a verdict: those waiting for one or being judged (``Snapshot.judging``) and
those still rolling out (``Work.trajectories``), each of which will need one. ``r`` is one judging GPU's verdicts
per second, measured: the driver's rate, taken only when every GPU judging had work at both reports it is from and
at the one before (``Judging.busy``, ``pearlctl.vocabulary.JUDGE_BUSY_REPORTS``: a judge short of work is not at
its capacity, so its rate says nothing of it, and the window in which the judges fill up counts only the few
verdicts begun before it: each takes its prefill and decode), and never less than the most a busy rate showed
before (``Judging.capacity_per_judge_s``). Without such a measure no GPU moves to the judge (no hint, no made-up
rate).

The reward pool's GPUs are planned as generation GPUs whose workers start as judges (``generation_view``): one
may serve the policy, as a rollout GPU shifted to the judge may serve the judge, and pearl counts it as rollout
capacity while it does.

- **GPUs to the judge**, when verdicts are owed at a busy rate: of m idle trainer GPUs lent to the judge (borrows to
  REWARD, each an offload and the judge's start, or its wake where the judge sleeps parked from an earlier loan,
  those first; only while nothing is lent and the trainer's wait fits the borrow, its return and the slack; at most
  ``max_lend``; m the fewest that end the batch within what a move must gain of the soonest any number does) and k
  ROLLOUT GPUs of the rollout or elastic pool shifted to it at once (switches, each the policy's engine parked
  asleep and the judge's woken where it sleeps parked there, else cold-started; those with a parked judge first,
  then those whose allocations end last; rollout keeps a GPU; at most as many as judge now, so the judges at
  most double in one decision; k where the rollout's predicted end and the verdicts' cross, found by bisection), the
  one with the sooner E, the loan on a tie (it costs rollout nothing), when that E beats E now by ``pearl.MARGIN_S``
  and ``pearl.MIN_RELATIVE_GAIN`` of E now. The judge's starts, wakes and stops are its own engine's
  (``Snapshot.judge_costs``: another model than the policy's).
- **A lent GPU back from the judge** when it is due (``budget.must_return``: its deadline, the trainer training or
  its batch complete) or no verdict is owed any more.
- **A shifted GPU back to rollout** when not every judge has work and it is not needed to keep up — the judges
  left would judge D within the rollout's time, at the rate they give now or the capacity a busy window showed,
  whichever is more (a batch's start has given no verdict yet) — or when there is no rollout work at all and no
  verdict owed (between batches the next batch needs rollout first), unless a next batch like the last one
  (``Snapshot.last_batch``) would end later without it — its verdicts at the judges' measured capacity — by more
  than a move must gain: a judge the batches keep needing stays; nor unless such a batch's rollout ends sooner with
  it by more than its move costs (``_back_pays``: the driver holds a due batch while a worker joins, so the move's
  time may be the batch's). One with the policy's engine parked asleep goes first, then one shifted from
  rollout before the reward pool's own, which leaves between batches only once a batch was seen. The last judge
  stays (without one no verdict is given, nor a rate measured that would bring judges back).
- No move sooner after the last plan than twice its cost (moves do not flap with a swinging demand); a tensor-
  parallel worker is not split (with ``gpus_per_worker`` above 1 nothing moves to the judge).

Loaded by name (pearlctl.policies.load_policy); pure.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pearlctl.planner import budget, plan, view
from pearlctl.planner.model import Move, MoveKind, Plan, Role, Snapshot
from pearlctl.policies.shipped import pearl
from pearlctl.vocabulary import GENERATION_POOLS, PoolKind

NAME = "pivot"
NEEDS_PROFILE = True  # pearl's predictions need the run's engine profile


def decide(snapshot: Snapshot) -> Plan | None:
    s = generation_view(snapshot)
    # pearl plans the policy's GPUs: the judges are not its (it would count a trainer GPU lent to the judge as one
    # lent to rollout that no longer pays, and take it back)
    policy_side = tuple(g for g in s.gpus if g.role != Role.REWARD)
    # (the snapshot itself when no GPU judges: its view, built once per snapshot, is pearl's and the judge's)
    planned = pearl.decide(s if len(policy_side) == len(s.gpus) else replace(s, gpus=policy_side))
    if planned is not None and planned.moves:
        return planned
    return _judge_plan(s, frozenset(g.id for g in snapshot.gpus if g.pool == PoolKind.REWARD)) or planned


def generation_view(s: Snapshot) -> Snapshot:
    """``s`` with the reward pool's GPUs planned as the rollout pool's: a reward pool's GPU is a generation GPU
    whose worker starts as the judge. It may serve the policy (pearl plans it as rollout capacity while it does;
    live, pearlctl.daemon.desired serves the run's model on it) and go back to the judge, as a rollout GPU shifted
    to the judge does. Moves name GPUs by id, so they are carried out on the GPUs as they are."""
    if not any(g.pool == PoolKind.REWARD for g in s.gpus):
        return s
    rollout = PoolKind.ROLLOUT
    return replace(s, gpus=tuple(replace(g, pool=rollout) if g.pool == PoolKind.REWARD else g for g in s.gpus))


def judge_rate(s: Snapshot) -> float | None:
    """One judge's verdicts per second, when measured at its capacity (every GPU judging had work at both reports
    the rate is from and at the one before, ``Judging.busy``) and verdicts are still owed; None otherwise."""
    judges = len(_judges(s))
    q = s.judging
    if judges == 0 or q.backlog <= 0 or q.verdicts_per_s <= 0 or not q.busy:
        return None
    return q.verdicts_per_s / judges


def judge_end_s(demand: float, judges: int, after: int, rate: float, cost_s: float) -> float:
    """Seconds until ``demand`` verdicts are given by ``judges`` judging now, ``after`` of them once a shift of
    ``cost_s`` is done (a leaving judge stops at once; a new one serves after the shift)."""
    if demand <= 0:
        return 0.0
    if after > judges:
        if judges * rate * cost_s >= demand:
            return _over(demand, judges * rate)
        return cost_s + _over(demand - judges * rate * cost_s, after * rate)
    return _over(demand, after * rate)


def _over(amount: float, per_s: float) -> float:
    return amount / per_s if per_s > 0 else math.inf


def _judge_plan(s: Snapshot, home: frozenset[int]) -> Plan | None:
    """The judge's plan on ``s`` (``generation_view``'s); ``home``: the reward pool's GPUs (the judge's own, the
    last to leave it and the first to come back to it)."""
    if s.profile.gpus_per_worker != 1:  # a shift moves one GPU: tensor-parallel workers are not split
        return None
    judges = _judges(s)
    v = view.of(s)
    lent = [g for g in judges if g.borrowed]
    if lent:  # trainer GPUs lent to the judge go back in time, and once nothing waits for a verdict
        due = any(budget.must_return(s, g) for g in lent)
        if due or s.judging.backlog == 0:
            back = tuple(v.move(g, MoveKind.RETURN, Role.TRAIN) for g in lent)
            why = "pivot: lent GPUs back from the judge " + ("(due back)" if due else "(nothing waits for a verdict)")
            return plan.make(s, plan.current_target(s), why=why, planned=back)
        return None
    # the last judge stays (without one no verdict is given, nor a rate measured that would bring judges back);
    # one with the policy's engine parked asleep goes back first (a wake, not a start)
    leavers = (g for g in judges if g.pool in GENERATION_POOLS) if len(judges) > 1 else ()
    movable = sorted(leavers, key=lambda g: (not g.parked, g.id in home, *_keep_order(g)))
    demand = s.judging.backlog + s.work.trajectories
    if movable and not (s.judging.waiting or s.judging.judging >= len(judges)):  # the judges are not all busy
        g = movable[0]
        back = v.move(g, MoveKind.SWITCH, Role.ROLLOUT)
        if not _paid(s, back):
            return None
        if s.work.empty and s.judging.backlog == 0:
            like = None if s.last_batch.empty else replace(s, work=s.last_batch)  # a next batch like the last
            if like is None and g.id in home:  # the reward pool's size is the user's until a batch says otherwise
                return None
            if _needed_next(like, len(judges), back) or not _back_pays(like, back):
                return None
            return _plan(s, back, "pivot: nothing to judge, the judge goes back to rollout for the next batch")
        roll_now = plan.timeline_s(s, ())
        roll_back = plan.timeline_s(s, (back,))
        kept = len(judges) - 1
        # the judges left keep up: they judge the demand within the rollout's time (rate unknown while none
        # waits: measured by the verdicts given so far per judge, a lower bound of their capacity, or the most a
        # busy window showed them give)
        per_judge = max(s.judging.verdicts_per_s / len(judges), s.judging.capacity_per_judge_s)
        seen = per_judge if per_judge > 0 else None
        keeps_up = kept > 0 and seen is not None and _over(demand, kept * seen) <= roll_back
        if keeps_up and roll_back + _threshold(roll_now) <= roll_now:
            return _plan(s, back, "pivot: verdicts keep up, a judge goes back to rollout")
        return None
    rate = judge_rate(s)
    if rate is None or (s.work.empty and s.judging.backlog == 0):
        return None
    # a busy window early in a batch sees few verdicts finish (each takes its prefill and decode): the judges'
    # capacity is the most they were seen to give
    rate = max(rate, s.judging.capacity_per_judge_s)
    now = max(plan.timeline_s(s, ()), judge_end_s(demand, len(judges), len(judges), rate, 0.0))
    options = []  # (predicted end, preference, the moves, what they are)
    loans = _loans(s) if not any(g.borrowed for g in s.gpus) else []  # one loan at a time (the daemon's rule)
    if loans:
        end, lent = _best_loan(s, loans, demand, len(judges), rate)
        options.append((end, 0, lent, f"{len(lent)} trainer GPU{'s' if len(lent) > 1 else ''} lent to the judge"))
    rollout = sorted(  # one with the judge's engine parked asleep first (a wake, not a cold start), its own first
        (g for g in s.gpus if g.pool in GENERATION_POOLS and g.role == Role.ROLLOUT and not g.borrowed),
        key=lambda g: (not g.parked_judge, g.id not in home, *_keep_order(g)),
    )
    if len(rollout) > 1:  # rollout keeps a GPU
        end, there = _best_shift(s, rollout, demand, len(judges), rate)
        options.append((end, 1, there, f"{len(there)} rollout GPU{'s' if len(there) > 1 else ''} to judge"))
    if not options:
        return None
    after, _, moves, what = min(options, key=lambda o: (o[0], o[1]))
    if _paid(s, moves[0]) and after + _threshold(now) <= now:
        why = f"pivot: verdicts back up ({s.judging.waiting} waiting), {what}: {now:.1f} s -> {after:.1f} s"
        return _plan(s, moves, why)
    return None


def _ends(s: Snapshot, moves: tuple[Move, ...], demand: float, judges: int, rate: float) -> tuple[float, float]:
    """The rollout's and the verdicts' predicted ends with ``moves`` bringing judges (the batch ends at the later)."""
    return plan.timeline_s(s, moves), judge_end_s(demand, judges, judges + len(moves), rate, moves[0].cost_s)


def _loans(s: Snapshot) -> list[Move]:
    """The loans of idle trainer GPUs to the judge that may be made now, warm ones first (a judge parked there wakes)
    and at most ``Snapshot.max_lend``: only while the trainer waits for a batch not complete, each priced at the
    offload and the judge's start or wake and back with its return and the slack by the trainer's deadline
    (``view.may_lend``, the pool rule every loan keeps)."""
    judge = s.engine_costs(Role.REWARD)

    def borrow_s(g) -> float:
        return s.costs.offload_s + (judge.wake_s if g.parked_judge else judge.start_s)

    idle = sorted(
        (g for g in s.gpus if g.pool == PoolKind.TRAINER and g.role == Role.TRAIN and not g.borrowed),
        key=lambda g: not g.parked_judge,
    )
    return [
        Move(g.id, MoveKind.BORROW, Role.TRAIN, Role.REWARD, borrow_s(g))
        for g in view.may_lend(s, idle[: s.max_lend], borrow_s)
    ]


def _best_loan(s: Snapshot, loans: list[Move], demand: float, judges: int, rate: float) -> tuple[float, tuple]:
    """How many of the ``loans`` (in their order) to make at once, and the batch's predicted end then: the fewest
    that end it within what a move must gain (``_threshold``) of the soonest end any number gives. A loan takes
    nothing from rollout, so only the verdicts' end moves (each loan serves once the dearest of those made is
    done)."""
    roll = plan.timeline_s(s, ())
    ends = [
        max(roll, judge_end_s(demand, judges, judges + k, rate, max(m.cost_s for m in loans[:k])))
        for k in range(1, len(loans) + 1)
    ]
    soonest = min(ends)
    k = next(k for k, end in enumerate(ends, 1) if end <= soonest + _threshold(soonest))
    return ends[k - 1], tuple(loans[:k])


def _best_shift(s: Snapshot, rollout: list, demand: float, judges: int, rate: float) -> tuple[float, tuple]:
    """How many of the ``rollout`` GPUs (in shift order; rollout keeps one) to shift to the judge at once, and the
    batch's predicted end then. Its rollout part grows with the number shifted and its verdicts' part shrinks, so
    the soonest end is where they cross: found by bisection, a logarithmic number of predictions (each number
    predicted once)."""
    v = view.of(s)
    predicted: dict[int, tuple[float, float, tuple]] = {}

    def ends(k: int) -> tuple[float, float, tuple]:
        if k not in predicted:
            moves = tuple(v.move(g, MoveKind.SWITCH, Role.REWARD) for g in rollout[:k])
            predicted[k] = (*_ends(s, moves, demand, judges, rate), moves)
        return predicted[k]

    lo, hi = 1, min(len(rollout) - 1, max(judges, 1))  # at most as many as judge now: the judges at most double
    while lo < hi:  # the fewest shifted for which the verdicts no longer end after the rollout
        mid = (lo + hi) // 2
        roll, judged, _ = ends(mid)
        if judged <= roll:
            hi = mid
        else:
            lo = mid + 1
    best = min({lo, max(1, lo - 1)}, key=lambda k: (max(ends(k)[:2]), k))
    roll, judged, moves = ends(best)
    return max(roll, judged), moves


def _needed_next(like: Snapshot | None, judges: int, back: Move) -> bool:
    """Between batches: whether a next batch like the last one (``like``: the snapshot with ``Snapshot.last_batch``
    as its work; None when no batch was seen) would end later without the judge ``back`` would return to rollout —
    its end the later of its rollout and its verdicts at the judges' measured capacity
    (``Judging.capacity_per_judge_s``) — by more than a move must gain (``_threshold``). Without a measure or a
    batch seen, it is not needed."""
    if like is None or like.judging.capacity_per_judge_s <= 0 or judges < 2:
        return False
    per_judge, verdicts = like.judging.capacity_per_judge_s, like.work.trajectories
    kept = max(plan.timeline_s(like, ()), verdicts / (judges * per_judge))
    given = max(plan.timeline_s(like, (back,)), verdicts / ((judges - 1) * per_judge))
    return given - kept > _threshold(kept)  # by as much as a move must gain to be made


def _back_pays(like: Snapshot | None, back: Move) -> bool:
    """Between batches: whether a judge going back to rollout gains a next batch like the last one (``like``, as
    ``_needed_next``'s) more than its move costs: the rollout driver holds a due batch while a worker joins (up to
    its join wait), so the move's time may be the next batch's, and only a rollout shorter by more than it (and by
    what a move must gain, ``_threshold``) pays. Without a batch seen it pays (nothing says otherwise)."""
    if like is None:
        return True
    kept = plan.timeline_s(like, (), instant=True)
    return kept - plan.timeline_s(like, (back,), instant=True) > back.cost_s + _threshold(kept)


def _keep_order(g) -> tuple:
    """The order GPUs are shifted in: the rollout pool's before the elastic pool's (an elastic GPU may be
    preempted: it judges least), then the one whose allocation ends last, then by id."""
    return (g.pool != GENERATION_POOLS[0], -(g.ends_at if g.ends_at is not None else math.inf), g.id)


def _paid(s: Snapshot, move: Move) -> bool:
    """No shift sooner after the last plan than twice a shift's cost: a GPU that just moved pays for its move
    before it moves again (shifts do not flap with a demand that swings)."""
    return s.last_change_at is None or s.now - s.last_change_at >= 2 * move.cost_s


def _threshold(seconds: float) -> float:
    return max(pearl.MARGIN_S, pearl.MIN_RELATIVE_GAIN * seconds) if math.isfinite(seconds) else pearl.MARGIN_S


def _judges(s: Snapshot) -> list:
    return [g for g in s.gpus if g.role == Role.REWARD]


def _plan(s: Snapshot, moves: Move | tuple[Move, ...], why: str) -> Plan:
    current = plan.current_target(s)
    return plan.make(s, current, why=why, planned=moves if isinstance(moves, tuple) else (moves,))
