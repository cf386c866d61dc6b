"""What each transition step does and how it is proven, in terms of state the agents and the trainer
act on. ``STEPS`` is the catalogue: one row per ``StepKind`` naming its effect and its probe (the
executor never branches on a step's kind). Every effect is a desired-state write, idempotent for its
step key:

| step | effect | proven when |
|---|---|---|
| OFFLOAD | the trainer is asked to release (command id = step key) | the trainer acked it ok |
| START | the GPUs take role ROLLOUT (borrowed, with a deadline): the agent starts vLLM | the agent reports it |
| VERIFY (borrow) | — | the worker is READY (health checked by its agent) |
| REGISTER | the worker becomes routable | recorded |
| DEREGISTER | the worker stops being routable: rollout clients send it nothing new | recorded |
| DRAIN | the GPUs go back to role TRAIN: the agent drains the worker, then stops it | the worker drains or is gone |
| STOP | — | the worker is STOPPED (or FAILED/LOST: it is gone either way) |
| WAKE (not START) | the GPUs serve rollout again: the agent wakes the worker parked there | it is READY |
| SLEEP (not STOP) | DRAIN parked the worker: the agent drains it and puts it to sleep | it SLEEPS (or is gone) |
| RELOAD | the trainer is asked to reclaim (command id = step key) | the trainer acked it ok |
| VERIFY (return) | — | the trainer reports itself not released |

Trainer commands are not stored separately: the pending one is the OFFLOAD/RELOAD step still in
INTENT, so a restarted daemon asks again under the same id and the hook answers a repeat with its
first answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearlctl.daemon.transitions import DONE, FAILED, PENDING, PLANS
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import StepState as S
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store
from pearlctl.vocabulary import StepKind

GONE_WORKER = (W.STOPPED, W.FAILED, W.LOST)


class DaemonEffects:
    def __init__(self, store: Store, run_id: str, epoch: int | None):
        self.store, self.run_id, self.epoch = store, run_id, epoch

    # -- helpers ----------------------------------------------------------------------------------
    def _gpus(self, t: dict) -> list[dict]:
        ids = set(t["gpu_ids"])
        return [g for g in self.store.gpus(self.run_id) if g["id"] in ids]

    def _workers_on(self, t: dict, role: str = "ROLLOUT") -> list[dict]:
        places = {(g["allocation_id"], g["idx"]) for g in self._gpus(t)}
        out = []
        for w in self.store.workers(self.run_id):
            if w["role"] == role and any((w["allocation_id"], i) in places for i in (w.get("gpu_idx") or [])):
                out.append(w)
        return out

    def _live_worker(self, t: dict) -> dict | None:
        live = [w for w in self._workers_on(t) if w["state"] not in GONE_WORKER]
        return live[0] if live else None

    def _proven_gone(self, w: dict) -> bool:
        """Stopped or failed as its agent reported — or LOST with its allocation ended. A worker LOST only
        because its agent went quiet for a moment (a daemon restart, a slow host) may still run: a
        STOP or SLEEP is not proven by that."""
        if w["state"] in (W.STOPPED, W.FAILED):
            return True
        return w["state"] == W.LOST and self.store.get("allocations", w["allocation_id"])["state"] in (A.ENDED, A.LOST)

    def _ack(self, key: str) -> dict | None:
        for t in self.store.transitions(self.run_id):
            for s in self.store.steps(t["id"]):
                if s["idempotency_key"] == key:
                    return (s.get("detail") or {}).get("ack")
        return None

    # -- effects --------------------------------------------------------------------------------
    def _lend(self, t: dict, key: str) -> None:
        """START / WAKE: the GPUs serve rollout now: their agent starts a vLLM worker, or wakes the one
        parked there; the return deadline goes down to the agent with the desired worker."""
        deadline = (t.get("detail") or {}).get("return_deadline")
        for g in self._gpus(t):
            self.store.update_fields(
                "gpus", g["id"], epoch=self.epoch, role="ROLLOUT", borrowed=1, return_deadline=deadline, worker_id=None
            )

    def _route(self, t: dict, key: str) -> None:
        """REGISTER / DEREGISTER: the worker takes new requests, or stops taking them."""
        routable = int(key.endswith(":" + StepKind.REGISTER))
        for w in self._workers_on(t):
            self.store.update_fields("workers", w["id"], epoch=self.epoch, routable=routable)

    def _give_back(self, t: dict, key: str) -> None:
        """DRAIN: back to the trainer; with a SLEEP next, the worker stays parked on the GPUs (desired: asleep)."""
        parked = self._live_worker(t) if StepKind.SLEEP in self._current_plan(t) else None
        for g in self._gpus(t):
            self.store.update_fields(
                "gpus",
                g["id"],
                epoch=self.epoch,
                role="TRAIN",
                borrowed=0,
                return_deadline=None,
                worker_id=parked["id"] if parked else None,
            )

    @staticmethod
    def _nothing(t: dict, key: str) -> None:
        """OFFLOAD / RELOAD: the command is the step's INTENT itself (see pending_trainer_command); the
        probes of STOP, SLEEP and VERIFY wait for what an earlier step set in motion."""

    @staticmethod
    def _current_plan(t: dict) -> tuple[str, ...]:
        detail = t.get("detail") or {}
        if t["state"] == T.ROLLING_BACK:
            return PLANS[detail.get("rollback", "return")]
        return PLANS[detail.get("plan", t["kind"])]

    # -- probes ---------------------------------------------------------------------------------
    def _trainer_acked(self, t: dict, key: str) -> str:
        ack = self._ack(key)
        if ack is None:
            return PENDING
        return DONE if ack.get("ok") else FAILED

    def _woken(self, t: dict, key: str) -> str:
        w = self._live_worker(t)
        if w is None:
            return FAILED  # the parked worker is gone: nothing to wake (the borrow rolls back)
        return DONE if w["state"] == W.READY else PENDING

    def _asleep(self, t: dict, key: str) -> str:
        workers = self._workers_on(t)
        return DONE if all(w["state"] == W.SLEEPING or self._proven_gone(w) for w in workers) else PENDING

    def _started(self, t: dict, key: str) -> str:
        if self._live_worker(t) is not None:
            return DONE
        return FAILED if any(w["state"] == W.FAILED for w in self._workers_on(t)) else PENDING

    def _verified(self, t: dict, key: str) -> str:
        if t["kind"] == "borrow" and t["state"] == T.RUNNING:  # the worker serves
            w = self._live_worker(t)
            if w is None:
                return FAILED if any(x["state"] == W.FAILED for x in self._workers_on(t)) else PENDING
            return DONE if w["state"] == W.READY else PENDING
        trainer = self.store.get_run(self.run_id).get("trainer") or {}  # a return's: the trainer has its GPUs
        return DONE if trainer and not trainer.get("released") else PENDING

    def _routed(self, t: dict, key: str) -> str:
        if key.endswith(":" + StepKind.REGISTER):
            live = [w for w in self._workers_on(t) if w["state"] not in GONE_WORKER]
            return DONE if all(w["routable"] for w in live) else PENDING
        return DONE if not any(w["routable"] for w in self._workers_on(t)) else PENDING

    def _drained(self, t: dict, key: str) -> str:
        busy = (W.READY, W.STARTING)
        return DONE if all(w["state"] not in busy for w in self._workers_on(t)) else PENDING

    def _stopped(self, t: dict, key: str) -> str:
        return DONE if all(self._proven_gone(w) for w in self._workers_on(t)) else PENDING

    # -- the Effects protocol: one table --------------------------------------------------------
    def do(self, kind: str, t: dict, key: str) -> None:
        getattr(self, STEPS[StepKind(kind)].do)(t, key)

    def probe(self, kind: str, t: dict, key: str) -> str:
        return getattr(self, STEPS[StepKind(kind)].probe)(t, key)


@dataclass(frozen=True)
class Step:
    """One step kind: its effect and its proof (methods of DaemonEffects), and both in words."""

    do: str
    probe: str
    effect: str
    proven: str


STEPS: dict[StepKind, Step] = {
    StepKind.OFFLOAD: Step("_nothing", "_trainer_acked", "the trainer is asked to release (id: the key)", "acked ok"),
    StepKind.START: Step("_lend", "_started", "the GPUs take role ROLLOUT, lent with a deadline", "a worker runs"),
    StepKind.WAKE: Step("_lend", "_woken", "as START; the agent wakes the parked worker", "it is READY"),
    StepKind.VERIFY: Step(
        "_nothing", "_verified", "—", "borrow: the worker is READY; return: the trainer is not released"
    ),
    StepKind.REGISTER: Step("_route", "_routed", "the worker becomes routable", "recorded"),
    StepKind.DEREGISTER: Step("_route", "_routed", "the worker stops being routable", "recorded"),
    StepKind.DRAIN: Step("_give_back", "_drained", "the GPUs go back to role TRAIN", "the worker drains or is gone"),
    StepKind.STOP: Step("_nothing", "_stopped", "—", "the worker is STOPPED (or proven gone)"),
    StepKind.SLEEP: Step("_nothing", "_asleep", "— (DRAIN parked the worker)", "it SLEEPS (or is gone)"),
    StepKind.RELOAD: Step("_nothing", "_trainer_acked", "the trainer is asked to reclaim (id: the key)", "acked ok"),
}


def pending_trainer_command(store: Store, run_id: str) -> dict:
    """The trainer command the current step of an open transition asks for, or no command."""
    for t in store.transitions(run_id):
        if t["state"] not in (T.RUNNING, T.ROLLING_BACK):
            continue
        for s in sorted(store.steps(t["id"]), key=lambda s: s["seq"]):
            trainer_step = s["kind"] in (StepKind.OFFLOAD, StepKind.RELOAD)
            if s["state"] == S.INTENT and trainer_step and not (s.get("detail") or {}).get("ack"):
                return {
                    "command": "release" if s["kind"] == StepKind.OFFLOAD else "reclaim",
                    "command_id": s["idempotency_key"],
                }
    return {"command": None}


def record_trainer_ack(store: Store, run_id: str, command_id: str, result: dict, epoch: int | None) -> bool:
    for t in store.transitions(run_id):
        for s in store.steps(t["id"]):
            if s["idempotency_key"] == command_id:
                detail = dict(s.get("detail") or {}, ack=result)
                store.update_fields(
                    "steps", s["id"], epoch=epoch, event="trainer ack", data={"ok": result.get("ok")}, detail=detail
                )
                return True
    return False
