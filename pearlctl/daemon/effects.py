"""What each transition step does and how it is proven, in terms of state the agents and the trainer
act on. ``STEPS`` is the catalogue: one row per ``StepKind`` naming its effect and its probe (the
executor never branches on a step's kind). Every effect is a desired-state write, idempotent for its
step key:

| step | effect | proven when |
|---|---|---|
| OFFLOAD | the trainer is asked to release (command id = step key) | the trainer acked it ok |
| START | the GPUs take the serving role (trainer GPUs: lent, with a deadline): the agent starts vLLM | it runs |
| VERIFY (GPUs come up) | — | the worker in the new role is READY and serves the trainer's latest weights |
| REGISTER | the worker becomes routable | recorded, and the run's router lists it |
| DEREGISTER | the worker stops being routable: nothing new reaches it | recorded; the router no longer lists it |
| DRAIN | the GPUs leave their role (trainer: TRAIN; others: IDLE): the agent drains the worker | drained or gone |
| STOP | — | the worker is STOPPED (or FAILED/LOST: it is gone either way) |
| WAKE (not START) | the GPUs serve again: the agent wakes the worker parked there | it is READY |
| SLEEP (not STOP) | DRAIN parked the worker: the agent drains it and puts it to sleep | it SLEEPS (or is gone) |
| RELOAD | the trainer is asked to reclaim (command id = step key) | the trainer acked it ok |
| VERIFY (GPUs go back to TRAIN) | — | the trainer reports itself not released |

VERIFY waits for the latest weights so that nothing off-policy is ever routed: a worker woken (or started)
with older weights reloads them on its agent's next heartbeat, before REGISTER.

Trainer commands are not stored separately: the pending one is the OFFLOAD/RELOAD step still in
INTENT, so a restarted daemon asks again under the same id and the hook answers a repeat with its
first answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pearlctl.daemon.transitions import Outcome, TransitionDetail, current_plan
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import StepState as S
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.rows import Transition, Worker, parked_column
from pearlctl.state.schema import TRAINER_REPORT
from pearlctl.state.store import Store
from pearlctl.vocabulary import GENERATION_ROLES, SERVING_ROLES, Engine, PoolKind, Role, StepKind

GONE_WORKER = (W.STOPPED, W.FAILED, W.LOST)
# the journal row of a step's write of a GPU's role (with the fields written): a GPU's roles over time are read
# from these rows (pearlctl.ops.timeline)
ROLE_SET = "role set"


class DaemonEffects:
    """``router``: what the run's router routes to now (worker URLs), or None when the run has no router
    (REGISTER and DEREGISTER are then proven by state alone); ``router_may_route``: that, and what a membership
    change in flight (or one that failed) may have it route to — DEREGISTER's proof (default: ``router``);
    ``router_wake``: tells the router's keeper that state's routable set changed (it syncs now, not at its next
    tick)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        epoch: int | None,
        *,
        router: Callable[[], set[str] | None] | None = None,
        router_may_route: Callable[[], set[str] | None] | None = None,
        router_wake: Callable[[], None] = lambda: None,
    ):
        self.store, self.run_id, self.epoch = store, run_id, epoch
        self.router = router or (lambda: None)
        self.router_may_route = router_may_route or self.router
        self.router_wake = router_wake

    # -- helpers ----------------------------------------------------------------------------------
    def _gpus(self, t: Transition) -> list[dict]:
        ids = set(t.gpu_ids)
        return [g for g in self.store.fleet.gpus(self.run_id) if g.id in ids]

    def _workers_on(self, t: Transition, role: str | None = None) -> list[dict]:
        """The vLLM workers on the transition's GPUs (``role``: only those serving it)."""
        places = {(g.allocation_id, g.idx) for g in self._gpus(t)}
        out = []
        for w in self.store.fleet.workers(self.run_id):
            if w.engine != Engine.VLLM or (role is not None and w.role != role):
                continue
            if any((w.allocation_id, i) in places for i in (w.gpu_idx or [])):
                out.append(w)
        return out

    def _serving(self, t: Transition) -> tuple[list[dict], bool]:
        """The live workers in the transition's serving role on its GPUs, and whether they cover every one of
        them. A transition of many GPUs has a worker per GPU (or per tensor-parallel group), and its agents
        start or wake them at different times: a step that brings GPUs up is proven for all of them, never
        for the first one up — REGISTER routes the workers there are when it runs."""
        workers = self._workers_on(t, self._serving_role(t))
        live = [w for w in workers if w.state not in GONE_WORKER]
        covered = {(w.allocation_id, i) for w in live for i in (w.gpu_idx or [])}
        return live, all((g.allocation_id, g.idx) in covered for g in self._gpus(t))

    @staticmethod
    def _serving_role(t: Transition) -> str:
        """The role the transition's GPUs serve in when it brings them up (a borrow: ROLLOUT)."""
        return t.to_role if t.to_role in SERVING_ROLES else Role.ROLLOUT

    def _proven_gone(self, w: dict) -> bool:
        """Stopped or failed as its agent reported — or LOST with its allocation ended. A worker LOST only
        because its agent went quiet for a moment (a daemon restart, a slow host) may still run: a
        STOP or SLEEP is not proven by that."""
        if w.state in (W.STOPPED, W.FAILED):
            return True
        return w.state == W.LOST and self.store.fleet.allocation(w.allocation_id).state in (A.ENDED, A.LOST)

    def _ack(self, key: str) -> dict | None:
        step = self.store.transitions.step_by_key(self.run_id, key)
        return (step.detail or {}).get("ack") if step else None

    # -- effects --------------------------------------------------------------------------------
    def _serve(self, t: Transition, key: str) -> None:
        """START / WAKE: the GPUs serve in the transition's role now: their agent starts a vLLM worker, or
        wakes the one parked there. Lent trainer GPUs carry their return deadline down to the agent."""
        deadline = TransitionDetail.of(t).return_deadline
        role = self._serving_role(t)
        for g in self._gpus(t):
            lent = g.pool == PoolKind.TRAINER
            self.store.update_fields(
                "gpus",
                g.id,
                epoch=self.epoch,
                event=ROLE_SET,
                data={"step": key},
                role=role,
                borrowed=int(lent),
                return_deadline=deadline if lent else None,
                # the role's model's parked worker serves (WAKE), or a new one does; the other model's stays parked
                **{parked_column(role): None},
            )

    def _register(self, t: Transition, key: str) -> None:
        """REGISTER: the live workers in the transition's serving role take new requests."""
        workers = [w for w in self._workers_on(t, self._serving_role(t)) if w.state not in GONE_WORKER]
        self._set_routable(workers, 1)

    def _deregister(self, t: Transition, key: str) -> None:
        """DEREGISTER: the workers on the transition's GPUs stop taking new requests."""
        self._set_routable(self._workers_on(t), 0)

    def _set_routable(self, workers: list[dict], routable: int) -> None:
        for w in workers:
            if w.routable != routable:
                self.store.update_fields("workers", w.id, epoch=self.epoch, routable=routable)
        self.router_wake()

    def _leave(self, t: Transition, key: str) -> None:
        """DRAIN: the GPUs leave their serving role — trainer GPUs back to TRAIN, others IDLE; with a SLEEP
        next, the leaving worker stays parked on the GPUs (desired: asleep) in its model's place. A worker of the
        other model parked there stays parked (one GPU holds a parked policy worker and a parked judge)."""
        parked: dict[tuple[int, int], Worker] = {}  # (allocation, GPU index) -> the leaving worker, parked there
        if StepKind.SLEEP in current_plan(t):
            kept = {w for g in self._gpus(t) for w in g.parked}
            for w in self._workers_on(t):
                if w.state not in GONE_WORKER and w.id not in kept:
                    parked.update({(w.allocation_id, i): w for i in w.gpu_idx or []})
        for g in self._gpus(t):
            leaving = parked.get((g.allocation_id, g.idx))
            self.store.update_fields(
                "gpus",
                g.id,
                epoch=self.epoch,
                event=ROLE_SET,
                data={"step": key},
                role=Role.TRAIN if g.pool == PoolKind.TRAINER else Role.IDLE,
                borrowed=0,
                return_deadline=None,
                **({parked_column(leaving.role): leaving.id} if leaving is not None else {}),
            )

    def _nothing(self, t: Transition, key: str) -> None:
        """OFFLOAD / RELOAD: the command is the step's INTENT itself (see pending_trainer_command); the
        probes of STOP, SLEEP and VERIFY wait for what an earlier step set in motion."""

    # -- probes ---------------------------------------------------------------------------------
    def _trainer_acked(self, t: Transition, key: str) -> Outcome:
        ack = self._ack(key)
        if ack is None:
            return Outcome.PENDING
        return Outcome.DONE if ack.get("ok") else Outcome.FAILED

    def _none_up(self, t: Transition) -> Outcome:
        """No live worker on the GPUs brought up: FAILED where one failed there, else still PENDING."""
        failed = any(w.state == W.FAILED for w in self._workers_on(t, self._serving_role(t)))
        return Outcome.FAILED if failed else Outcome.PENDING

    def _woken(self, t: Transition, key: str) -> Outcome:
        live, covered = self._serving(t)
        if not live:
            return Outcome.FAILED  # the parked worker is gone: nothing to wake (the borrow rolls back)
        # GPUs with no parked worker get a new one (the agent starts what desired state lacks): READY too
        return _proven(covered and all(w.state == W.READY for w in live))

    def _asleep(self, t: Transition, key: str) -> Outcome:
        workers = self._workers_on(t)
        return _proven(all(w.state == W.SLEEPING or self._proven_gone(w) for w in workers))

    def _started(self, t: Transition, key: str) -> Outcome:
        """READY on every GPU (a worker still starting, or missing, is awaited; a failed one restarts): so the
        step's journaled time is the cold start, the running estimate of ``start_s`` the planner prices a start
        with (pearlctl.planner.profile.STEP_COSTS)."""
        live, covered = self._serving(t)
        if not live:
            return self._none_up(t)
        return _proven(covered and all(w.state == W.READY for w in live))

    def _verified(self, t: Transition, key: str) -> Outcome:
        if StepKind.RELOAD in current_plan(t):  # GPUs back to the trainer: it has them again
            trainer = self.store.runs.get(self.run_id).get(TRAINER_REPORT) or {}
            return _proven(bool(trainer) and not trainer.get("released"))
        live, covered = self._serving(t)  # GPUs brought up: a worker serves on every one
        if not live:
            return self._none_up(t)
        if not covered or any(w.state != W.READY for w in live):
            return Outcome.PENDING
        # ... the trainer's latest weights: a worker woken (or started) with older ones reloads them before
        # REGISTER routes anything to it (the agent does on its next heartbeat; a reload that never succeeds
        # fails the step by its timeout, and the transition rolls back)
        trainer = self.store.runs.get(self.run_id).get(TRAINER_REPORT) or {}
        latest = trainer.get("weight_version") if trainer.get("weights_path") else None
        policy = [w for w in live if w.role in GENERATION_ROLES]  # a judge keeps its own model
        return _proven(latest is None or all(w.weight_version == str(latest) for w in policy))

    def _registered(self, t: Transition, key: str) -> Outcome:
        """Recorded in state, and — where the run has a router — carried out by it: the router routes to every
        live worker in the serving role."""
        routed = self.router()
        live = [w for w in self._workers_on(t, self._serving_role(t)) if w.state not in GONE_WORKER]
        if not all(w.routable for w in live):
            return Outcome.PENDING
        return _proven(routed is None or all(w.url in routed for w in live if w.url))

    def _deregistered(self, t: Transition, key: str) -> Outcome:
        """Recorded in state, and — where the run has a router — carried out by it: the router no longer routes
        to the workers (so a worker drains only once nothing new can reach it)."""
        routed = self.router_may_route()
        workers = self._workers_on(t)
        if any(w.routable for w in workers):
            return Outcome.PENDING
        return _proven(routed is None or not any(w.url in routed for w in workers if w.url))

    def _drained(self, t: Transition, key: str) -> Outcome:
        busy = (W.READY, W.STARTING)
        return _proven(all(w.state not in busy for w in self._workers_on(t)))

    def _stopped(self, t: Transition, key: str) -> Outcome:
        kept = {w for g in self._gpus(t) for w in g.parked}  # the other model's parked worker stays
        return _proven(all(self._proven_gone(w) for w in self._workers_on(t) if w.id not in kept))

    # -- the Effects protocol: one table --------------------------------------------------------
    def do(self, kind: StepKind, t: dict, key: str) -> None:
        STEPS[kind].do(self, t, key)

    def probe(self, kind: StepKind, t: dict, key: str) -> Outcome:
        return STEPS[kind].probe(self, t, key)


def _proven(held: bool) -> Outcome:
    return Outcome.DONE if held else Outcome.PENDING


@dataclass(frozen=True)
class StepAction:
    """One step kind: its effect and its proof (functions of DaemonEffects, the transition and the step's key),
    and both in words."""

    do: Callable[[DaemonEffects, Transition, str], None]
    probe: Callable[[DaemonEffects, Transition, str], Outcome]
    effect: str
    proven: str


_E = DaemonEffects
STEPS: dict[StepKind, StepAction] = {
    StepKind.OFFLOAD: StepAction(
        _E._nothing, _E._trainer_acked, "the trainer is asked to release (id: the key)", "acked ok"
    ),
    StepKind.START: StepAction(
        _E._serve, _E._started, "the GPUs take the serving role (trainer GPUs: lent, with a deadline)", "it is READY"
    ),
    StepKind.WAKE: StepAction(_E._serve, _E._woken, "as START; the agent wakes the parked worker", "it is READY"),
    StepKind.VERIFY: StepAction(
        _E._nothing, _E._verified, "—", "GPUs brought up: the worker is READY; back to TRAIN: the trainer has them"
    ),
    StepKind.REGISTER: StepAction(
        _E._register, _E._registered, "the worker becomes routable", "recorded; the router lists it"
    ),
    StepKind.DEREGISTER: StepAction(
        _E._deregister, _E._deregistered, "the worker stops being routable", "recorded; the router no longer lists it"
    ),
    StepKind.DRAIN: StepAction(
        _E._leave, _E._drained, "the GPUs leave their role (trainer: TRAIN; others: IDLE)", "drained or gone"
    ),
    StepKind.STOP: StepAction(_E._nothing, _E._stopped, "—", "the worker is STOPPED (or proven gone)"),
    StepKind.SLEEP: StepAction(_E._nothing, _E._asleep, "— (DRAIN parked the worker)", "it SLEEPS (or is gone)"),
    StepKind.RELOAD: StepAction(
        _E._nothing, _E._trainer_acked, "the trainer is asked to reclaim (id: the key)", "acked ok"
    ),
}


def pending_trainer_command(store: Store, run_id: str) -> dict:
    """The trainer command the current step of an open transition asks for, or no command."""
    for t in store.transitions.all(run_id, states=(T.RUNNING, T.ROLLING_BACK)):
        for s in sorted(store.transitions.steps(t.id), key=lambda s: s.seq):
            trainer_step = s.kind in (StepKind.OFFLOAD, StepKind.RELOAD)
            if s.state == S.INTENT and trainer_step and not (s.detail or {}).get("ack"):
                return {
                    "command": "release" if s.kind == StepKind.OFFLOAD else "reclaim",
                    "command_id": s.idempotency_key,
                }
    return {"command": None}


def record_trainer_ack(store: Store, run_id: str, command_id: str, result: dict, epoch: int | None) -> bool:
    s = store.transitions.step_by_key(run_id, command_id)
    if s is None:
        return False
    detail = dict(s.detail or {}, ack=result)
    ack = {"ok": result.get("ok")}
    store.update_fields("steps", s.id, epoch=epoch, event="trainer ack", data=ack, detail=detail)
    return True
