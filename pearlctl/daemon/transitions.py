"""Checkpointed role transitions: a transition is a fixed sequence of idempotent steps, each journaled
INTENT → effect → DONE/FAILED in state (docs/architecture.md). The daemon carries out every move of a policy's plan
(pearlctl.planner.model.MoveKind) as one transition of the same kind:

- borrow (TRAIN → ROLLOUT):  OFFLOAD → START → VERIFY → REGISTER, or OFFLOAD → WAKE → VERIFY → REGISTER
  when a vLLM worker parked asleep on those GPUs can be woken instead of cold-started
- return (ROLLOUT → TRAIN):  DEREGISTER → DRAIN → STOP → RELOAD → VERIFY, or … → SLEEP → … to park the
  worker asleep (its GPU memory released) for the next borrow
- start (IDLE → a serving role, rollout and elastic pools):  START → VERIFY → REGISTER
- wake (IDLE with a parked worker → serving):  WAKE → VERIFY → REGISTER
- retire (serving → IDLE):  DEREGISTER → DRAIN → STOP, or DEREGISTER → DRAIN → SLEEP to park the worker
  (a rollout-pool GPU may serve again soon; an elastic one may be preempted, so its worker stops)
- switch (one serving role → another, e.g. ROLLOUT → PREFILL):  DEREGISTER → DRAIN → STOP → START →
  VERIFY → REGISTER: the worker restarts in its new role (its engine flags differ). Between the policy's model
  and the judge's, the leaving worker parks asleep instead of stopping (… → SLEEP → START → …), and where the
  other model's worker sleeps parked there it wakes (… → SLEEP → WAKE → …): a GPU parks one worker per model

A worker always leaves the router (DEREGISTER) before it drains, so nothing new reaches it; what it still
runs when its drain ends is aborted and continued elsewhere by the router's gateway (pearlctl.router).

The executor never blocks: ``advance`` moves a transition as far as its probes allow and returns; the
daemon calls it every tick. A step's INTENT (with its idempotency key ``<transition>:<seq>:<kind>``) is
durable before its effect is issued. After a daemon crash, ``recover`` probes every step left in
INTENT: a proven effect becomes DONE; an unproven one is issued again only if its effect is idempotent
for its key (every effect here is a desired-state write that agents and the trainer apply once per
key, so no engine ever starts twice); otherwise it is HELD for a person to look at.

A failed step of a transition that brings GPUs up (borrow, start, wake, switch), or a return deadline
reached mid-borrow, rolls back: the compensating plan of ``ROLLBACKS`` runs (seq 100+) — the trainer
always gets its GPUs back, and a rollout GPU that could not come up ends IDLE with nothing running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar, NamedTuple, Protocol

from pearlctl.planner.model import MoveKind
from pearlctl.state.machines import StepState as S
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.rows import Step, Transition
from pearlctl.state.store import Store
from pearlctl.vocabulary import Role, StepKind

log = logging.getLogger("pearlctl.daemon")


class PlanKind(StrEnum):
    """A transition's sequence of steps (``PLANS``): its move kind's, or a variant that parks or wakes a worker
    (stored as ``detail.plan`` and ``detail.rollback``)."""

    BORROW = "borrow"  # cold: a new vLLM process
    BORROW_WARM = "borrow_warm"  # a vLLM parked asleep on these GPUs wakes
    RETURN = "return"  # the vLLM process exits
    RETURN_SLEEP = "return_sleep"  # parked asleep for next time
    START = "start"  # an idle rollout/elastic GPU serves: a new vLLM process
    WAKE = "wake"  # the vLLM parked asleep there serves again
    RETIRE = "retire"  # the worker exits, the GPU is IDLE
    RETIRE_SLEEP = "retire_sleep"  # the worker parks asleep on the IDLE GPU
    SWITCH = "switch"  # restart in a new role
    SWITCH_SLEEP = "switch_sleep"  # to the other model: the leaving worker parks asleep, a new one starts
    SWITCH_WAKE = "switch_wake"  # to the other model: the leaving worker parks asleep, the one parked there wakes


class Outcome(StrEnum):
    """What a step's probe found, and what a walk through a transition's steps ended on."""

    DONE = "done"  # proven
    PENDING = "pending"  # not yet: probed again at the next tick
    FAILED = "failed"  # it cannot happen: the transition rolls back (or fails, with nothing to fall back to)
    HELD = "held"  # (a walk only) a step is HELD: its effect could not be proven, a person looks at it


_K, _P = StepKind, PlanKind
PLANS: dict[PlanKind, tuple[StepKind, ...]] = {
    _P.BORROW: (_K.OFFLOAD, _K.START, _K.VERIFY, _K.REGISTER),
    _P.BORROW_WARM: (_K.OFFLOAD, _K.WAKE, _K.VERIFY, _K.REGISTER),
    _P.RETURN: (_K.DEREGISTER, _K.DRAIN, _K.STOP, _K.RELOAD, _K.VERIFY),
    _P.RETURN_SLEEP: (_K.DEREGISTER, _K.DRAIN, _K.SLEEP, _K.RELOAD, _K.VERIFY),
    _P.START: (_K.START, _K.VERIFY, _K.REGISTER),
    _P.WAKE: (_K.WAKE, _K.VERIFY, _K.REGISTER),
    _P.RETIRE: (_K.DEREGISTER, _K.DRAIN, _K.STOP),
    _P.RETIRE_SLEEP: (_K.DEREGISTER, _K.DRAIN, _K.SLEEP),
    _P.SWITCH: (_K.DEREGISTER, _K.DRAIN, _K.STOP, _K.START, _K.VERIFY, _K.REGISTER),
    _P.SWITCH_SLEEP: (_K.DEREGISTER, _K.DRAIN, _K.SLEEP, _K.START, _K.VERIFY, _K.REGISTER),
    _P.SWITCH_WAKE: (_K.DEREGISTER, _K.DRAIN, _K.SLEEP, _K.WAKE, _K.VERIFY, _K.REGISTER),
}
# What a failed transition of each kind runs to compensate (``detail.rollback`` overrides). Kinds not
# listed (return, retire) have nothing to fall back to: a failure there needs a person.
ROLLBACKS: dict[MoveKind, PlanKind] = {
    MoveKind.BORROW: _P.RETURN,
    MoveKind.START: _P.RETIRE,
    MoveKind.WAKE: _P.RETIRE,
    MoveKind.SWITCH: _P.RETIRE,
}


def switch_plan(from_role: str, to_role: str, *, woken: bool, keep_warm: bool) -> PlanKind:
    """The steps of a switch from ``from_role`` to ``to_role``: between the policy's model and the judge's, the
    leaving worker parks asleep and, where the coming role's worker sleeps parked on every GPU (``woken``), that
    one wakes (with workers not kept warm, a switch with nothing to wake restarts, as between roles of one model)."""
    if Role.REWARD not in (from_role, to_role):
        return PlanKind.SWITCH  # one model, other engine flags: the worker restarts
    if woken:
        return PlanKind.SWITCH_WAKE
    return PlanKind.SWITCH_SLEEP if keep_warm else PlanKind.SWITCH


class Between(NamedTuple):
    """The roles a transition kind moves GPUs from and to; None: the move's own (a switch's target role)."""

    from_role: Role | None
    to_role: Role | None


KIND_ROLES: dict[MoveKind, Between] = {
    MoveKind.BORROW: Between(Role.TRAIN, Role.ROLLOUT),
    MoveKind.RETURN: Between(Role.ROLLOUT, Role.TRAIN),
    MoveKind.START: Between(Role.IDLE, None),
    MoveKind.WAKE: Between(Role.IDLE, None),
    MoveKind.RETIRE: Between(None, Role.IDLE),
    MoveKind.SWITCH: Between(None, None),
}
ROLLBACK_SEQ = 100  # compensating steps of a rolled-back transition start here


@dataclass(frozen=True, kw_only=True)
class TransitionDetail:
    """A transition's ``detail`` column, typed: what it carries besides its kind, GPUs and roles. What every kind
    may carry is here; a kind that carries more has its own model (``DETAILS``: a borrow, a return). Stored as a
    JSON object of the fields set (``to_json``); read back with ``of``, which picks the kind's model and ignores
    keys it does not know."""

    plan: PlanKind | None = None  # the steps it runs (default: its kind's)
    rollback: PlanKind | None = None  # what a failure runs to compensate (default: ROLLBACKS[kind])
    why: str | None = None  # the reason it was planned
    policy: str | None = None  # the policy whose plan it carries out
    planned_at: float | None = None  # a plan's transitions share it (its switches run one at a time)
    by: str | None = None  # "operator": asked for through `pearlctl move`
    # only the trainer's GPUs moving (a borrow, a return of lent GPUs) have a deadline: when the trainer needs them
    return_deadline: ClassVar[float | None] = None

    @classmethod
    def of(cls, transition: Transition) -> TransitionDetail:
        """The detail of ``transition`` as its kind's model."""
        model = DETAILS.get(MoveKind(transition.kind), TransitionDetail)
        doc = transition.detail or {}
        known = {f.name for f in fields(model)}
        kept = {k: v for k, v in doc.items() if k in known and v is not None}
        for k in ("plan", "rollback"):
            if k in kept:
                kept[k] = PlanKind(kept[k])
        return model(**kept)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class ReturnDetail(TransitionDetail):
    """A return: the trainer's deadline for the GPUs it gets back."""

    return_deadline: float | None = None


@dataclass(frozen=True, kw_only=True)
class BorrowDetail(TransitionDetail):
    """A borrow: the deadline by which the lent GPUs must be back, and where the wait it was sized to came from."""

    return_deadline: float | None = None
    wait_from: str | None = None  # "trainer report" | "prediction"


# The detail model of each transition kind that carries more than ``TransitionDetail``.
DETAILS: dict[MoveKind, type[TransitionDetail]] = {MoveKind.BORROW: BorrowDetail, MoveKind.RETURN: ReturnDetail}


def detail_for(kind: MoveKind, **fields: Any) -> TransitionDetail:
    """A detail of ``kind``'s model, for a caller that plans transitions of any kind."""
    return DETAILS.get(MoveKind(kind), TransitionDetail)(**fields)


class Effects(Protocol):
    """The seam between the executor and the world. ``do`` must be idempotent for ``key``."""

    def do(self, kind: StepKind, transition: Transition, key: str) -> None: ...

    def probe(self, kind: StepKind, transition: Transition, key: str) -> Outcome: ...  # DONE | PENDING | FAILED


def current_plan(t: Transition) -> tuple[StepKind, ...]:
    """The steps a transition runs now: its plan (``detail.plan``, default its kind), or while it rolls back
    its compensation (``detail.rollback``, default ``ROLLBACKS[kind]``)."""
    detail = TransitionDetail.of(t)
    if t.state == T.ROLLING_BACK:
        return PLANS[detail.rollback or ROLLBACKS.get(MoveKind(t.kind), PlanKind.RETURN)]
    return PLANS[detail.plan or PlanKind(t.kind)]


def step_key(transition_id: int, seq: int, kind: StepKind) -> str:
    return f"{transition_id}:{seq}:{kind}"


class Executor:
    def __init__(
        self, store: Store, effects: Effects, *, run_id: str, epoch: int, step_timeout_s: float = 120.0, clock=time.time
    ):
        self.store, self.effects, self.run_id, self.epoch = store, effects, run_id, epoch
        self.step_timeout_s, self.clock = step_timeout_s, clock
        self.issued: set[str] = set()  # keys whose effect this process issued (empty after a restart)
        # fault injection for the crash tests: called at every step boundary with (point, step key)
        self.fault: Callable[[str, str], None] = lambda point, key: None

    # -- planning ---------------------------------------------------------------------------------
    def plan(
        self,
        kind: MoveKind,
        gpu_ids: list[int],
        *,
        detail: TransitionDetail | None = None,
        from_role: Role | None = None,
        to_role: Role | None = None,
    ) -> int:
        """Record a PLANNED transition of ``kind`` for ``gpu_ids``; the roles default to the kind's
        (``KIND_ROLES``: a switch names both, a retire its from-role, a start/wake its to-role)."""
        kind = MoveKind(kind)
        default_from, default_to = KIND_ROLES[kind]
        from_role, to_role = from_role or default_from, to_role or default_to
        if from_role is None or to_role is None:
            raise ValueError(f"a {kind} transition needs from_role and to_role")
        model = DETAILS.get(kind, TransitionDetail)
        if detail is not None and type(detail) is not model:
            raise TypeError(f"a {kind} transition's detail is a {model.__name__}, not a {type(detail).__name__}")
        with self.store.atomic():  # the transition and its detail land together: a plan is never half written
            tid = self.store.transitions.add(
                run_id=self.run_id, kind=kind, from_role=from_role, to_role=to_role, gpu_ids=gpu_ids, epoch=self.epoch
            )
            if detail is not None and detail.to_json():
                self.store.update_fields("transitions", tid, epoch=self.epoch, detail=detail.to_json())
        return tid

    def open_transitions(self) -> list[Transition]:
        return self.store.transitions.open(self.run_id)

    # -- moving -----------------------------------------------------------------------------------
    def _set(self, t: Transition, to: str, event: str, data: dict | None = None) -> Transition:
        self.store.set_state("transitions", t.id, expect=t.state, to=to, epoch=self.epoch, event=event, data=data)
        return self.store.transitions.get(t.id)

    def _steps_for(self, t: Transition) -> list[tuple[int, StepKind]]:
        """The transition's plan (``detail.plan``, default its kind); a rollback runs ``detail.rollback``."""
        if t.state == T.ROLLING_BACK:
            return [(ROLLBACK_SEQ + i, k) for i, k in enumerate(current_plan(t))]
        return list(enumerate(current_plan(t)))

    def abort(self, tid: int, why: str) -> None:
        """Stop a running transition that can compensate and roll it back (a borrow's deadline reached,
        operator `return --now`); a PLANNED one is dropped."""
        t = self.store.transitions.get(tid)
        if t.state == T.RUNNING and t.kind in ROLLBACKS:
            for step in self.store.transitions.steps(tid):  # an effect still pending is superseded, not awaited
                if step.state == S.INTENT:
                    self._finish(step, S.FAILED, f"aborted: {why}")
            self._set(t, T.ROLLING_BACK, "rollback", {"why": why})
        elif t.state == T.PLANNED:
            self._set(t, T.ROLLED_BACK, "dropped", {"why": why})

    def advance(self, tid: int) -> str:
        """Move one transition as far as its probes allow. Returns its state."""
        t = self.store.transitions.get(tid)
        if t.state == T.PLANNED:
            t = self._set(t, T.RUNNING, "started")
        while t.state in (T.RUNNING, T.ROLLING_BACK):
            outcome = self._walk(t)
            if outcome is Outcome.PENDING:
                break
            if outcome is Outcome.DONE:
                t = self._set(t, T.DONE if t.state == T.RUNNING else T.ROLLED_BACK, "completed", self._cost(t))
            elif outcome is Outcome.HELD:
                t = self._set(t, T.FAILED, "held: a step's effect could not be proven")
            elif t.state == T.RUNNING and t.kind in ROLLBACKS:
                t = self._set(t, T.ROLLING_BACK, "rollback", {"why": "a step failed"})  # GPUs go back
            else:
                t = self._set(t, T.FAILED, "failed")  # a failed return or rollback needs a person
        return t.state

    def _cost(self, t: Transition) -> dict:
        """What a transition that ends cost, for its journal row: the seconds from its first step's intent to now,
        and each step's (intent to DONE or FAILED; a step still open counts to now)."""
        now = self.clock()
        steps = sorted(self.store.transitions.steps(t.id), key=lambda s: s.seq)
        spans = {}
        for s in steps:
            detail = s.detail or {}
            started = detail.get("started_at")
            if isinstance(started, int | float):
                spans[f"{s.seq}:{s.kind}"] = round(float(detail.get("finished_at", now)) - started, 3)
        first = min((s.detail or {}).get("started_at", now) for s in steps) if steps else now
        return {"seconds": round(now - first, 3), "steps": spans}

    def _walk(self, t: Transition) -> Outcome:
        """Go through the steps in order; stop at the first that is not DONE."""
        existing = {s.seq: s for s in self.store.transitions.steps(t.id)}
        for seq, kind in self._steps_for(t):
            step = existing.get(seq) or self._intend(t, seq, kind)
            if step.state == S.DONE:
                continue
            if step.state == S.HELD:
                return Outcome.HELD
            if step.state == S.FAILED:
                return Outcome.FAILED
            key = step.idempotency_key
            if key not in self.issued:  # after a restart: effects are idempotent per key, so issue again
                self._issue(kind, t, key, again=True)
            result = Outcome(self.effects.probe(kind, t, key))
            if result is Outcome.DONE:
                self._finish(step, S.DONE, "done")
                self.fault("after_done", key)
                continue
            started = (step.detail or {}).get("started_at", self.clock())
            if result is Outcome.FAILED or self.clock() - started > self.step_timeout_s:
                self._finish(step, S.FAILED, "probe failed" if result is Outcome.FAILED else "no effect in time")
                return Outcome.FAILED
            return Outcome.PENDING
        return Outcome.DONE

    def _intend(self, t: Transition, seq: int, kind: StepKind) -> Step:
        """Write the step's INTENT durably, then issue its effect."""
        key = step_key(t.id, seq, kind)
        self.fault("before_intent", key)
        sid = self.store.transitions.add_step(
            transition_id=t.id,
            seq=seq,
            kind=kind,
            idempotency_key=key,
            detail={"started_at": self.clock()},
            epoch=self.epoch,
        )
        self.fault("after_intent", key)
        self._issue(kind, t, key)
        self.fault("after_effect", key)
        return self.store.transitions.step(sid)

    def _issue(self, kind: StepKind, t: Transition, key: str, *, again: bool = False) -> None:
        self.effects.do(kind, t, key)
        self.issued.add(key)
        if again:
            self.store.journal_event(
                self.run_id, "steps", key, "effect re-issued after restart", data={"kind": kind}, epoch=self.epoch
            )

    def _finish(self, step: Step, to: str, why: str) -> None:
        detail = dict(step.detail or {}, finished_at=self.clock(), why=why)
        self.store.set_state("steps", step.id, expect=step.state, to=to, epoch=self.epoch, event=why, detail=detail)
