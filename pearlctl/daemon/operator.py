"""The operator's side of the controller: what a person (the CLI) asks of a running daemon — borrowing under a
policy, an immediate return, a move of rollout or elastic GPUs, a measured profile.
"""

from __future__ import annotations

from pearlctl.api import bodies
from pearlctl.daemon.borrowing import PolicyError, load_policy
from pearlctl.daemon.policy_view import has_judge
from pearlctl.daemon.shared import ControlError, Side
from pearlctl.daemon.transitions import PlanKind, detail_for, switch_plan
from pearlctl.planner import profile as profiles
from pearlctl.planner.model import MoveKind
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.rows import Gpu
from pearlctl.vocabulary import SERVING_ROLES, PoolKind, Role


class Operator(Side):
    """`pearlctl borrow`, `return`, `move` and `profile --import`, through the control API."""

    def borrow(self, body: bodies.Borrow) -> dict:
        """Turn borrowing on under a policy (``dry_run``: only say what it would do now)."""
        policy = body.policy
        try:
            module = load_policy(policy)
        except PolicyError as exc:
            raise ControlError(str(exc)) from None
        if getattr(module, "NEEDS_PROFILE", False) and not self.store.runs.get(self.run_id).get("profile"):
            raise ControlError(
                f"policy {policy} predicts rollout time with the run's engine profile, and run {self.run_id} has "
                "none: measure one with `pearlctl profile RUN` (a serving worker) or import a file with "
                "`pearlctl profile RUN --import FILE`"
            )
        with self.lock:
            settings = {"policy": policy, "max_gpus": body.gpus, "keep_warm": body.keep_warm}
            if body.dry_run:
                now = self.clock()
                plan = self.borrowing.plan_borrow(now, settings)
                view = self.borrowing.inputs.view(now, settings)
                whole = self.borrowing.whole_plan(now, settings)
                return {
                    "epoch": self.epoch,
                    "dry_run": True,
                    "settings": settings,
                    "plan": plan,
                    "whole_plan": whole,
                    "view": view,
                }
            self.store.update_fields(
                "runs",
                self.run_id,
                epoch=self.epoch,
                event="borrowing set",
                data=settings,
                borrow=settings,
                policy=policy,
            )
            return {"epoch": self.epoch, "settings": settings}

    def give_back(self, body: bodies.ReturnNow) -> dict:
        """Stop borrowing; lent GPUs go back (``now``: abort a borrow that is still starting).

        Their vLLM workers stop, unless ``keep_warm``: then they are parked asleep for a later borrow."""
        with self.lock:
            settings = {"policy": "never", "max_gpus": None, "keep_warm": body.keep_warm}
            self.store.update_fields(
                "runs",
                self.run_id,
                epoch=self.epoch,
                event="return requested",
                data={"now": body.now, "keep_warm": body.keep_warm},
                borrow=settings,
                policy="never",
            )
            aborted = []
            if body.now:
                for t in self.borrowing.executor.open_transitions():
                    if t.kind == MoveKind.BORROW:
                        self.borrowing.executor.abort(t.id, "pearlctl return --now")
                        aborted.append(t.id)
            lent = [g.id for g in self.store.fleet.gpus(self.run_id) if g.borrowed]
            return {"epoch": self.epoch, "aborted": aborted, "lent_gpus": lent}

    def move(self, body: bodies.Move) -> dict:
        """An operator's move (``pearlctl move``): start, wake, retire or switch named rollout, elastic or reward
        GPUs, carried out as a journaled transition exactly like a policy's move (a switch to or from REWARD shifts
        a GPU between the policy and the run's judge: pearlctl.daemon.desired.foreign_engine). The GPUs of a worker move
        together (naming one names its worker's others). Refused, naming what is wrong, while another
        transition is open, for trainer GPUs (those move with borrow and return), for GPUs that are not UP,
        that span allocations or roles, or whose role does not fit the move. A policy that is on plans again
        once this transition ends and may undo it; with borrowing off (policy never) the move stays."""
        with self.lock:
            executor = self.borrowing.executor
            busy = executor.open_transitions()
            if busy:
                t = busy[0]
                raise ControlError(
                    f"transition {t.id} ({t.kind}, {t.state}) is still moving GPUs {list(t.gpu_ids)}: "
                    "one plan at a time; move again once it ends (`pearlctl status`)",
                    409,
                )
            chosen = self._moved_gpus(body.gpus)
            role, names = chosen[0].role, ", ".join(f"{g.node}:{g.idx}" for g in chosen)
            serving = role in SERVING_ROLES
            target = str(body.role or Role.ROLLOUT)
            if (
                target == Role.REWARD
                and body.kind != MoveKind.RETIRE
                and not has_judge(self.store.runs.get(self.run_id))
            ):
                raise ControlError(
                    f"run {self.run_id} has no judge: a GPU serves REWARD with the reward pool's model; add "
                    "[pools.reward] with its model to the run spec",
                    422,
                )
            if body.kind in (MoveKind.START, MoveKind.WAKE):
                if serving:
                    raise ControlError(
                        f"GPUs {names} serve {role}: start and wake bring up IDLE GPUs (retire or switch)"
                    )
                if body.kind == MoveKind.WAKE and not self._woken(chosen, target):
                    raise ControlError(f"no {target} worker is parked asleep on GPUs {names}: start one instead")
                if body.kind == MoveKind.START and any(g.parked_for(target) is not None for g in chosen):
                    raise ControlError(f"a {target} worker is parked on GPUs {names}: wake it instead")
                from_role, to_role, plan = Role.IDLE, target, PlanKind(body.kind)
            elif not serving:
                raise ControlError(f"GPUs {names} are {role}: nothing serves there to {body.kind} (start or wake)")
            elif body.kind == MoveKind.RETIRE:
                plan = PlanKind.RETIRE_SLEEP if body.keep_warm else PlanKind.RETIRE
                from_role, to_role = role, Role.IDLE
            elif target == role:
                raise ControlError(f"GPUs {names} already serve {role}: a switch needs another role")
            else:  # between the policy and the judge, the leaving worker parks (keep_warm) or the parked one wakes
                woken = self._woken(chosen, target)
                from_role, to_role = role, target
                plan = switch_plan(role, target, woken=woken, keep_warm=body.keep_warm)
            ids = sorted(g.id for g in chosen)
            tid = executor.plan(
                body.kind,
                ids,
                detail=detail_for(body.kind, plan=plan, why="operator move (pearlctl move)", by="operator"),
                from_role=str(from_role),
                to_role=str(to_role),
            )
            self.wake.set()
            policy = (self.store.runs.get(self.run_id).get("borrow") or {}).get("policy") or "never"
            return {
                "epoch": self.epoch,
                "transition_id": tid,
                "plan": plan,
                "gpu_ids": ids,
                "gpus": [f"{g.node}:{g.idx}" for g in chosen],
                "from_role": str(from_role),
                "to_role": str(to_role),
                "policy": policy,
            }

    def _moved_gpus(self, refs: list[bodies.GpuRef | bodies.GpuId]) -> list[Gpu]:
        """The GPUs an operator's move names (``refs``, in their order), each UP, then the other GPUs of their
        workers (a worker moves whole). Refused unless they are all one allocation's, in one role."""
        rows = self.store.fleet.gpus(self.run_id)
        chosen: list[Gpu] = []
        for ref in refs:
            g = self._named_gpu(rows, ref)
            if g.state != G.UP:
                raise ControlError(f"GPU {g.node}:{g.idx} (id {g.id}) is {g.state}: only UP GPUs move")
            if g not in chosen:
                chosen.append(g)
        workers = {w for g in chosen for w in g.parked}
        chosen += [g for g in rows if workers & set(g.parked) and g not in chosen]  # a worker moves whole
        if len({g.allocation_id for g in chosen}) > 1 or len({g.role for g in chosen}) > 1:
            named = ", ".join(f"{g.node}:{g.idx} ({g.role}, allocation {g.allocation_id})" for g in chosen)
            raise ControlError(f"one move is one allocation's GPUs in one role; these differ: {named}")
        return chosen

    def _woken(self, gpus: list, role: str) -> bool:
        """Whether a worker that serves ``role`` sleeps parked on every one of ``gpus`` (a move there wakes it)."""
        workers = [self.store.fleet.worker(w) for g in gpus if (w := g.parked_for(role)) is not None]
        return len(workers) == len(gpus) and all(w.state == W.SLEEPING and w.role == role for w in workers)

    def _named_gpu(self, rows: list[dict], ref: bodies.GpuRef | bodies.GpuId) -> dict:
        """The rollout or elastic GPU ``ref`` names: by id, or by ``node:index`` (a trainer GPU only if that is
        all the name fits: the local backend gives every task the first GPUs of its one node, so a name may
        fit several GPUs, and then only ids tell them apart)."""
        if isinstance(ref, bodies.GpuId):
            found, name = [g for g in rows if g.id == ref.id], f"id {ref.id}"
        else:
            found, name = [g for g in rows if (g.node, g.idx) == (ref.node, ref.index)], f"{ref.node}:{ref.index}"
        if not found:
            known = ", ".join(f"{g.node}:{g.idx} (id {g.id})" for g in rows) or "none yet"
            raise ControlError(f"run {self.run_id} has no GPU {name} (its GPUs: {known})", 404)
        movable = [g for g in found if g.pool != PoolKind.TRAINER]
        if not movable:
            raise ControlError(
                f"GPU {name} is a trainer GPU: those are lent and taken back with `pearlctl borrow` and "
                "`pearlctl return`"
            )
        if len(movable) > 1:
            which = ", ".join(f"id {g.id} ({g.pool}, allocation {g.allocation_id})" for g in movable)
            raise ControlError(f"GPU {name} fits several GPUs: {which}; name one by its id (`pearlctl status`)")
        return movable[0]

    def set_profile(self, body: bodies.ProfileBody) -> dict:
        """Store the run's engine profile (``pearlctl profile``): the planner predicts with it; or, ``judge``, its
        judge's (``pearlctl profile --judge``: the judge's own engine costs are planned from it)."""
        try:
            profile = profiles.from_dict(body.profile, where="the profile sent")
        except profiles.ProfileError as exc:
            raise ControlError(str(exc), 422) from None
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a field of the wrong shape
            raise ControlError(f"the profile sent is malformed: {type(exc).__name__}: {exc}", 422) from None
        if body.judge and not has_judge(self.store.runs.get(self.run_id)):
            raise ControlError(f"run {self.run_id} has no judge ([pools.reward]): no judge's profile to store", 422)
        with self.lock:
            doc = profiles.to_dict(profile)
            column, event = ("judge_profile", "judge profile stored") if body.judge else ("profile", "profile stored")
            self.store.update_fields(
                "runs", self.run_id, epoch=self.epoch, event=event, data={"name": profile.name}, **{column: doc}
            )
            return {"epoch": self.epoch, "profile": doc, "judge": body.judge}
