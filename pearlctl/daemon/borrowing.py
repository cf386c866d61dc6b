"""The run's policy, live: whole plans carried out as transitions, and lent trainer GPUs returned before
the trainer needs them.

Each tick: advance open transitions (aborting a borrow whose return deadline is too close). With nothing
moving: lent GPUs go back at once when the trainer blocks waiting for them, its batch is complete (the
rollout driver reported no work left since the trainer began waiting: ``batch_ready``; it trains next,
whatever the deadline says), borrowing was turned off, or their deadline minus the running estimate of a
return's duration has come; otherwise the policy's plan is
carried out whole — every move of it, on every pool: RETURN and BORROW of trainer GPUs, START, WAKE,
RETIRE and SWITCH of rollout and elastic GPUs (``transitions_for`` groups the moves into transitions,
one per allocation, kind and target role — the GPUs of one worker move together).

Switches run one at a time: a switch takes its worker out of serving (drain, restart in the new role), so a
plan that turns a whole worker set between colocated and disaggregated keeps all but one worker serving
throughout, instead of none for a restart's time. The plan's other switches wait PLANNED; when one of
them fails or rolls back, those still waiting are dropped and the next plan starts from what is.

The policy is a module loaded by name (pearlctl.policies), the same one the simulator runs:
``decide(snapshot)`` gets a planner ``Snapshot`` built from state by pearlctl.daemon.policy_view (GPUs by pool
and role, the rollout driver's progress as ``Work``, the trainer's phase, the run's profile, transition costs measured
from the journal) and answers with a ``Plan``.

The return deadline comes from the trainer's own report: when it said it would wait, plus how long it
said. A trainer that reported no expected wait (it has measured none yet: the first batch) gets the
planner's prediction of the batch in flight instead (``plan.expect_wait``, with a measured profile only), so
the borrow's deadline is its decision time plus that prediction. Whether a return met its deadline is
journaled (``deadline met`` / ``deadline missed`` with the lateness) and counted in the metrics.

The policy is asked only when its answer may differ from the last one it gave (the tick's own rules — open
transitions, lent GPUs due back — run every tick). A policy is a pure function of the snapshot, and the
snapshot is a function of what it is built from (its inputs: the GPUs' pools, roles, parked workers and
return deadlines, the rollout driver's work, the trainer's phase and the time its report says it waits
until, the profile and its learned correction, the transition costs, the last transition's time, the
borrowing settings) and of the clock. The clock enters through deadlines only — a lent GPU's return, the
trainer's wait, the mode-flip dwell — so with the inputs unchanged a tick re-decides when:

- ``REDECIDE_S`` (5 s) have passed since the last decision: a decision that waits on the clock alone (a
  dwell ending, a borrow that stops paying as its return nears) comes at most that late;
- a lent GPU's return must start within ``REDECIDE_S`` plus the return's running cost and the slack: then
  the policy is asked every tick, as it was before, so that it returns lent GPUs by its own rule and never
  waits for the tick's deadline rule.

Otherwise the tick skips the decision: the same inputs gave the last plan, and that plan was carried out
(a plan whose transitions ran has changed the GPUs or opened transitions, both of which decide again).
A tick that fails after deciding forgets the decision, so the next one decides again.

The decision is made off the daemon's decision lock (``tick``): the snapshot is built under it, the policy
decides with it released (heartbeats and reports fold meanwhile), and under it again the plan is carried out
only if the inputs it was decided on still hold; if not, the policy decides again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace

from pearlctl.daemon.policy_view import PolicyInputs, batch_ready, summary, work_from_progress
from pearlctl.daemon.transitions import (
    BorrowDetail,
    Executor,
    PlanKind,
    ReturnDetail,
    TransitionDetail,
    detail_for,
    switch_plan,
)
from pearlctl.planner import correct, plan
from pearlctl.planner import profile as profiles
from pearlctl.planner.budget import RETURN_SLACK_S
from pearlctl.planner.model import GpuSlot, MoveKind, Plan, Role, Snapshot
from pearlctl.planner.predict import predict
from pearlctl.policies import PolicyError, load_policy
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.rows import Transition
from pearlctl.state.schema import ROLLOUT_PROGRESS, TRAINER_REPORT
from pearlctl.state.store import Store
from pearlctl.vocabulary import SERVING_ROLES, PoolKind

__all__ = ["Borrowing", "PolicyError", "load_policy"]

log = logging.getLogger("pearlctl.daemon")

REDECIDE_S = 5.0  # with unchanged inputs, the policy decides again at least this often (see the module doc)
# A decision made off the lock is carried out when, under the lock again, its inputs are unchanged and it is at
# most this old (a plan's deadlines carry the slack RETURN_SLACK_S, far above this); else the policy decides
# again, at most DECIDE_TRIES times off the lock, then under it.
DECIDED_FRESH_S = 0.5
DECIDE_TRIES = 2


def _no_mark(phase: str) -> None:
    pass


@dataclass(frozen=True)
class _Pending:
    """What a tick carries out once decided: lent GPUs due back (``why``), or the policy's decision on
    ``snapshot`` (whose ``inputs`` say whether it still holds)."""

    at: float  # when it was read
    settings: dict
    lent: list[dict]
    why: str | None
    deadline: float | None  # the lent GPUs' earliest return deadline
    snapshot: Snapshot | None = None
    inputs: tuple | None = None


# a transition per move kind; the variants: a warm borrow wakes a parked worker, a return or a rollout
# GPU's retire parks its worker asleep when workers are kept warm (an elastic GPU's worker stops: its
# allocation may be preempted)
_POOL_MOVES = frozenset({MoveKind.START, MoveKind.WAKE, MoveKind.RETIRE, MoveKind.SWITCH})  # not the trainer's


def transitions_for(
    planned: Plan, gpus: dict[int, dict], *, keep_warm: bool, asleep: Callable[[int | None, str], bool]
) -> list[dict]:
    """The transitions that carry out the plan's moves on rollout and elastic GPUs (its BORROW and RETURN
    moves are the trainer's: ``Borrowing`` runs those as one borrow or return): moves grouped by allocation,
    kind and roles, in the planner's order (capacity freed before it is used). ``gpus``: state rows by id;
    ``asleep(worker id, role)``: whether that worker sleeps parked and serves the role (a switch wakes it)."""
    groups: dict[tuple, list[int]] = {}
    for m in planned.moves:
        if m.kind not in _POOL_MOVES or m.gpu not in gpus:
            continue
        g = gpus[m.gpu]
        groups.setdefault((g.allocation_id, m.kind, str(m.from_role), str(m.to_role), g.pool), []).append(m.gpu)
    out = []
    for (alloc, kind, from_role, to_role, pool), ids in groups.items():
        plan = PlanKind(kind)
        if kind is MoveKind.RETIRE and keep_warm and pool != PoolKind.ELASTIC:
            plan = PlanKind.RETIRE_SLEEP
        elif kind is MoveKind.SWITCH:
            woken = all(asleep(gpus[i].parked_for(to_role), to_role) for i in ids)
            plan = switch_plan(from_role, to_role, woken=woken, keep_warm=keep_warm)
        out.append(
            {
                "kind": kind,
                "plan": plan,
                "gpu_ids": sorted(ids),
                "allocation_id": alloc,
                "from_role": from_role if from_role in SERVING_ROLES else Role.IDLE,
                "to_role": to_role if to_role in SERVING_ROLES else Role.IDLE,
                "why": planned.why,
            }
        )
    return out


def describe_moves(planned: Plan | None, gpus: dict[int, dict]) -> list[dict]:
    """Every move of a plan, for people (``borrow --dry-run``)."""
    out = []
    for m in planned.moves if planned else ():
        g = gpus.get(m.gpu, {})
        out.append(
            {
                "gpu": m.gpu,
                "node": g.node,
                "pool": g.pool,
                "kind": str(m.kind),
                "from": str(m.from_role),
                "to": str(m.to_role),
                "cost_s": round(m.cost_s, 3),
            }
        )
    return out


class Borrowing:
    def __init__(self, store: Store, executor: Executor, run_id: str, *, clock=time.time):
        self.store, self.executor, self.run_id, self.clock = store, executor, run_id, clock
        self.inputs = PolicyInputs(store, run_id)  # what the policy sees
        # the inputs of the last decision the tick carried out, and when it was made (``REDECIDE_S``)
        self._decided: tuple[tuple, float] | None = None
        self.decisions = 0  # the policy's decisions in ticks, and the ticks that skipped one (unchanged inputs)
        self.skipped = 0
        self.redecided = 0  # decisions made off the lock whose inputs changed before they could be carried out

    def decide(self, now: float, settings: dict | None = None):
        """The policy's plan for the run now (None: keep everything as it is). Pure read."""
        settings = settings or self.inputs.settings()
        return load_policy(settings["policy"]).decide(self.inputs.snapshot(now, settings))

    def plan_borrow(self, now: float, settings: dict | None = None, *, planned: Plan | None = None) -> dict | None:
        """What a borrow would do now: GPUs, deadline (None: the policy lends nothing). Pure read.
        ``settings``: borrowing settings to assume (``borrow --dry-run``); default: the run's. ``planned``:
        the policy's plan when the caller has it."""
        settings = settings or self.inputs.settings()
        snapshot = self.inputs.snapshot(now, settings)
        if planned is None:
            planned = load_policy(settings["policy"]).decide(snapshot)
        borrows = [m for m in (planned.moves if planned else ()) if m.kind is MoveKind.BORROW]
        if not borrows:
            return None
        # one borrow at a time, in one role: the policy's (ROLLOUT) or the judge's (REWARD); the rest at a next plan
        to_role = borrows[0].to_role
        lend = [m.gpu for m in borrows if m.to_role == to_role]
        rows = {g.id: g for g in self.inputs.trainer_gpus()}
        chosen = [rows[i] for i in lend if i in rows]
        # warm: a worker of that role sleeps on every chosen GPU (one per GPU, or per tensor-parallel group), all
        # woken (a parked policy worker is no judge: a borrow to the judge starts one)
        parked = {g.parked_for(to_role) for g in chosen}
        warm = bool(parked) and all(self._asleep(w, to_role) for w in parked)
        keep_warm = settings.get("keep_warm", True)
        return {
            "gpu_ids": [g.id for g in chosen],
            "gpus": [(g.node, g.idx) for g in chosen],
            "return_deadline": now + snapshot.trainer.wait_left_s,
            "policy": settings["policy"],
            "to_role": str(to_role),
            "plan": PlanKind.BORROW_WARM if warm else PlanKind.BORROW,
            "rollback": PlanKind.RETURN_SLEEP if keep_warm else PlanKind.RETURN,
            "why": planned.why,
            "predicted_s": [planned.predicted_now_s, planned.predicted_s],
            "view": summary(snapshot),
        }

    def whole_plan(self, now: float, settings: dict | None = None) -> dict:
        """Everything the policy's plan would do now — every move, and the transitions the daemon would run
        for them (``borrow --dry-run``). Pure read."""
        settings = settings or self.inputs.settings()
        planned = self.decide(now, settings)
        rows = {g.id: g for g in self.inputs.gpu_rows()}
        return {
            "why": planned.why if planned else None,
            "predicted_s": [planned.predicted_now_s, planned.predicted_s] if planned else None,
            "moves": describe_moves(planned, rows),
            "transitions": transitions_for(
                planned, rows, keep_warm=settings.get("keep_warm", True), asleep=self._asleep
            )
            if planned
            else [],
        }

    def elastic_wanted(
        self, now: float, *, running: int, low: int, high: int, gpus_per_node: int, settings: dict | None = None
    ) -> tuple[int, str]:
        """How many tasks the elastic pool should hold now, between ``low`` (its launch size, ``nodes``) and
        ``high`` (``max_nodes``), and why. ``running``: its tasks that hold GPUs now.

        During a batch, the policy is asked about a what-if snapshot: the run as it is plus the GPUs of every
        task the pool could still get (IDLE elastic GPUs on nodes of their own). The tasks whose GPUs its plan
        would bring up are wanted; a policy that uses no elastic capacity (static, never) wants none. The
        what-if prices a new task's GPUs like granted ones (a cold start), not the queue wait before Slurm
        grants them: the pending bound (``pending_timeout_s``) caps what a wait can cost. Once the batch ends
        (no work left) the pool goes back to ``low``: capacity held idle between batches is preemptible
        capacity taken from others, and each batch asks again."""
        settings = settings or self.inputs.settings()
        snapshot = self.inputs.snapshot(now, settings)
        if snapshot.work.empty:
            return low, "no rollout work: the batch ended"
        room = max(high - running, 0)
        if room == 0:
            return max(low, min(running, high)), "the pool holds max_nodes tasks"
        extra = tuple(
            GpuSlot(id=-(1 + k * gpus_per_node + i), node=f"elastic+{k}", pool=PoolKind.ELASTIC, role=Role.IDLE)
            for k in range(room)
            for i in range(gpus_per_node)
        )
        what_if = replace(snapshot, gpus=snapshot.gpus + extra)
        planned = load_policy(settings["policy"]).decide(what_if)
        used = {g.node for g in extra for m in (planned.moves if planned else ()) if m.gpu == g.id}
        wanted = max(low, min(high, running + len(used)))
        why = f"policy {settings['policy']}: would bring up {len(used)} more task(s) of GPUs"
        return wanted, why

    def _unpark(self) -> None:
        """Keeping workers warm was turned off: parked workers are no longer desired (their agents stop them)."""
        for g in self.inputs.trainer_gpus():
            if g.parked and not g.borrowed:
                self.store.update_fields(
                    "gpus",
                    g.id,
                    epoch=self.executor.epoch,
                    event="unparked",
                    data={"worker_ids": list(g.parked)},
                    worker_id=None,
                    parked_judge_id=None,
                )

    def _asleep(self, worker_id: int | None, role: str | None = None) -> bool:
        """Whether the worker sleeps (parked), and serves ``role`` when given; False for no worker."""
        if worker_id is None:
            return False
        w = self.store.fleet.worker(worker_id)
        return w.state == "SLEEPING" and (role is None or w.role == role)

    # -- the predictor, checked --------------------------------------------------------------------
    def check_prediction(self) -> None:
        """Watch the current batch's prediction and learn from it when the batch ends (pearlctl.planner.correct).

        A watch starts from a progress report with work left while no transition is open: the completion
        predicted then for the serving GPUs (uncorrected), the report's time, and the GPUs. A change of the
        serving GPUs (a transition opens) drops the watch — a plan's effect is not prediction error — and the
        next stable report starts another. The first report without work ends the batch: measured = its time
        minus the watch's (less its tools' luck when that report carries the batch's tool times,
        ``correct.finish``); when the watch covered enough of the batch (``correct.MIN_COVER``, counted from the
        batch's first report with work), the ratio goes into the run's correction, journaled as
        ``prediction checked``."""
        run = self.store.runs.get(self.run_id)
        doc = run.get("profile")
        report = run.get(ROLLOUT_PROGRESS) or {}
        at = report.get("reported_at")
        if not doc or at is None:
            return
        state = dict(run.get("predictor") or {})
        watch = state.get("watch")
        work = work_from_progress(report)
        if work.empty:
            if watch is not None or state.get("batch_since") is not None:
                tools = report.get("tools")  # stored as the typed body had it (bodies.ToolTimes)
                state, check = correct.finish(state, at, correct.Tools(tools["slowest_s"]) if tools else None)
                self._save_predictor({**state, "watch": None, "batch_since": None}, check)
            return
        if correct.grew(state, work):  # the next batch joined before this one ended: no watch spans both
            state = {**state, "watch": None, "batch_since": None}
            watch = None
        if state.get("batch_since") is None:  # the batch's first report with work
            state["batch_since"] = at
            self._save_predictor(state)
        if self.executor.open_transitions():
            if watch is not None:
                self._save_predictor({**state, "watch": None})
            return
        serving = self.inputs.serving_gpu_ids()
        if watch is not None and watch["gpus"] == serving:
            return
        profile = profiles.from_dict(doc)
        snapshot = self.inputs.snapshot(at)
        workers = self.inputs.serving_workers(profile.gpus_per_worker)
        prediction = predict(work, plan.current_deployment(snapshot), profile)  # uncorrected
        if not (math.isfinite(prediction.seconds) and math.isfinite(prediction.spread)):
            # nothing serves (every worker gone, the run ending): no prediction to check, nor one JSON can store
            if watch is not None:
                self._save_predictor({**state, "watch": None})
            return
        key = correct.shape(work, workers)
        self._save_predictor({**state, "watch": correct.watch(prediction, key, at, serving, work.trajectories)})

    def _save_predictor(self, state: dict, check: correct.Check | None = None) -> None:
        event, data = ("prediction checked", asdict(check)) if check else (None, None)
        self.store.update_fields(
            "runs", self.run_id, epoch=self.executor.epoch, event=event, data=data, predictor=state
        )

    def tick(self, lock: AbstractContextManager | None = None, mark: Callable[[str], None] = _no_mark) -> None:
        """One control-loop pass: advance the open transitions, then — with none open — return lent GPUs that
        are due back, or ask the policy and carry its plan out (see the module doc).

        ``lock`` is the daemon's decision lock. Everything that reads or writes state runs under it; the
        policy's decision does not: it is made on an immutable snapshot with no lock held, so heartbeats and
        reports fold meanwhile. It is carried out only if, under the lock again, the snapshot's inputs are
        unchanged and it is at most ``DECIDED_FRESH_S`` old; otherwise the policy decides again, at most
        ``DECIDE_TRIES`` times off the lock and then once under it, so a tick always ends with a decision
        carried out however busy the run. ``mark(phase)`` is called as each phase ends (a slow tick's log line
        names them)."""
        lock = lock if lock is not None else nullcontext()
        with lock:
            mark("lock wait")
            now = self.clock()
            self._advance(now)
            pending = self._pending(now)
            mark("transitions")
            if pending is None or pending.snapshot is None:  # nothing to do, or lent GPUs due back: no decision
                if pending is not None:
                    self._carry_out(now, pending, None)
                return
        for _ in range(DECIDE_TRIES):
            planned = self._decide(pending)  # no lock held
            mark("decision, unlocked")
            with lock:
                now = self.clock()
                again = self._pending(now)
                if again is None or again.snapshot is None:
                    if again is not None:
                        self._carry_out(now, again, None)
                    return
                if again.inputs == pending.inputs and now - pending.at <= DECIDED_FRESH_S:
                    self._carry_out(now, again, planned)
                    mark("carried out")
                    return
                self.redecided += 1
                pending = again
        with lock:  # its inputs kept changing: decided and carried out under the lock
            now = self.clock()
            pending = self._pending(now)
            if pending is not None:
                self._carry_out(now, pending, self._decide(pending) if pending.snapshot is not None else None)
            mark("decided and carried out under the lock")

    def _decide(self, pending: _Pending) -> Plan | None:
        self.decisions += 1
        return load_policy(pending.settings["policy"]).decide(pending.snapshot)

    def _advance(self, now: float) -> None:
        """Move every open transition as far as it goes (a borrow whose return deadline came is aborted; one
        switch at a time)."""
        try:
            self.check_prediction()
        except Exception:  # advice to the planner: never in the way of the plan or the return guarantee
            log.exception("checking the batch's prediction failed")
        moving = self.executor.open_transitions()
        switching = {t.id for t in moving if t.kind == MoveKind.SWITCH and t.state != T.PLANNED}
        for t in moving:
            if t.kind == MoveKind.SWITCH and t.state == T.PLANNED:
                if self._plan_broke(t):
                    self.executor.abort(t.id, "an earlier switch of its plan did not complete")
                    continue
                if switching:
                    continue  # one switch at a time: the workers not switching keep serving meanwhile
            deadline = TransitionDetail.of(t).return_deadline
            borrowing = t.kind == MoveKind.BORROW and t.state == T.RUNNING
            if borrowing and deadline and now >= deadline - self.inputs.cost(MoveKind.RETURN):
                self.executor.abort(t.id, "return deadline reached during the borrow")
            state = self.executor.advance(t.id)
            if t.kind == MoveKind.RETURN and state == T.DONE:
                self._judge_return(t)
            if t.kind == MoveKind.SWITCH and state in (T.RUNNING, T.ROLLING_BACK):
                switching.add(t.id)
            else:
                switching.discard(t.id)

    def _pending(self, now: float) -> _Pending | None:
        """What the tick has to carry out now, or None: nothing while a transition is open (one plan at a time:
        a new one is made from the state the last one left) or while the policy's answer could not differ from
        the last one carried out (``_decision_due``)."""
        if self.executor.open_transitions():
            return None
        settings = self.inputs.settings()
        if not settings.get("keep_warm", True):
            self._unpark()
        lent = [g for g in self.inputs.trainer_gpus() if g.borrowed]
        why, deadline = None, None
        if lent:
            deadline = min(g.return_deadline or now for g in lent)
            run = self.store.runs.get(self.run_id)
            trainer = run.get(TRAINER_REPORT) or {}
            if settings["policy"] == "never":
                why = "borrowing turned off"
            elif trainer.get("blocked_s") is not None:
                why = "the trainer is waiting for its GPUs"
            elif batch_ready(trainer, run.get(ROLLOUT_PROGRESS) or {}):
                why = "the trainer's batch is complete"
            elif now >= deadline - self.inputs.cost(MoveKind.RETURN):
                why = "return deadline"
        if why:
            return _Pending(now, settings, lent, why, deadline)
        snapshot, inputs = self.inputs._snapshot(now, settings)
        if not self._decision_due(inputs, now, lent):
            self.skipped += 1
            return None
        return _Pending(now, settings, lent, why, deadline, snapshot, inputs)

    def _decision_due(self, inputs: tuple, now: float, lent: list[dict]) -> bool:
        """Whether the tick asks the policy (see the module doc): its inputs changed since the last decision
        carried out, ``REDECIDE_S`` passed since, or a lent GPU's return must start within ``REDECIDE_S``."""
        if self._decided is None:
            return True
        last, at = self._decided
        if now - at >= REDECIDE_S or now < at or inputs != last:
            return True
        if lent:
            deadline = min(g.return_deadline or now for g in lent)
            return now >= deadline - self.inputs.cost(MoveKind.RETURN) - RETURN_SLACK_S - REDECIDE_S
        return False

    def _carry_out(self, now: float, pending: _Pending, planned: Plan | None) -> None:
        """The tick's return of lent GPUs (``pending.why``) and the policy's plan, as transitions; then the
        decision's inputs are remembered (``_decision_due``). A tick that fails in between forgets the last
        decision, so the next one decides again."""
        self._decided = None
        self._transitions_for(now, pending.settings, planned, pending.lent, pending.why, pending.deadline)
        if pending.inputs is not None:
            self._decided = (pending.inputs, now)

    def _transitions_for(
        self, now: float, settings: dict, planned: Plan | None, lent: list[dict], why: str | None, deadline
    ) -> None:
        keep_warm = settings.get("keep_warm", True)
        if lent and planned and any(m.kind is MoveKind.RETURN for m in planned.moves):
            why = f"policy: {planned.why}"
        if why:
            plan = PlanKind.RETURN_SLEEP if keep_warm else PlanKind.RETURN
            detail = ReturnDetail(plan=plan, why=why, return_deadline=deadline)
            roles = {g.role for g in lent}  # what they serve: the policy's role, or the judge's (one borrow's)
            from_role = roles.pop() if len(roles) == 1 else None
            self.executor.plan(MoveKind.RETURN, [g.id for g in lent], detail=detail, from_role=from_role)
            if planned is None:
                return
        if planned is None or planned.empty:
            return
        rows = {g.id: g for g in self.inputs.gpu_rows()}
        for t in transitions_for(planned, rows, keep_warm=keep_warm, asleep=self._asleep):
            detail = detail_for(t["kind"], plan=t["plan"], why=t["why"], policy=settings["policy"], planned_at=now)
            self.executor.plan(t["kind"], t["gpu_ids"], detail=detail, from_role=t["from_role"], to_role=t["to_role"])
        if not lent:
            borrow = self.plan_borrow(now, settings, planned=planned)
            if borrow is not None:
                self.executor.plan(
                    MoveKind.BORROW,
                    borrow["gpu_ids"],
                    to_role=borrow["to_role"],
                    detail=BorrowDetail(
                        plan=borrow["plan"],
                        rollback=borrow["rollback"],
                        policy=borrow["policy"],
                        why=borrow["why"],  # the policy's reason, as its other transitions carry it
                        return_deadline=borrow["return_deadline"],
                        wait_from=borrow["view"]["wait_from"],  # the deadline's wait: the trainer's, or predicted
                    ),
                )

    def _plan_broke(self, t: Transition) -> bool:
        """Whether another switch of ``t``'s plan (planned at the same moment) failed or was rolled back: the
        deployment the plan aimed at will not be reached, and the next plan is made from what is."""
        at = TransitionDetail.of(t).planned_at
        return at is not None and any(
            o.id != t.id and TransitionDetail.of(o).planned_at == at and o.state in (T.FAILED, T.ROLLED_BACK)
            for o in self.store.transitions.all(self.run_id, kind=MoveKind.SWITCH)
        )

    def _judge_return(self, t: Transition) -> None:
        deadline = TransitionDetail.of(t).return_deadline
        if deadline is None:
            return
        finished = self.store.transitions.get(t.id).updated_at
        # the GPUs were back when their agent returned them itself (the daemon was out of reach then)
        agent_returns = [
            float(j["data"]["at"])
            for j in self.store.journal.read(self.run_id)
            if j["event"] == "agent returned lent GPUs itself" and (j["data"] or {}).get("deadline") == deadline
        ]
        finished = min([finished, *agent_returns])
        late = finished - deadline
        self.store.journal_event(
            self.run_id,
            "transitions",
            str(t.id),
            "deadline missed" if late > 0 else "deadline met",
            data={"lateness_s": round(late, 3), **({"by": "agent"} if agent_returns else {})},
            epoch=self.executor.epoch,
        )
