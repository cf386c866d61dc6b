"""The desired workers of each allocation: what its agent should run, derived from state alone — per role among
its live GPUs, a trainer of all of them and vLLM workers of the engine profile's size; workers parked asleep on
trainer or IDLE GPUs; and for a lent GPU, the return deadline its agent returns it by on its own.

``Desired`` computes them for one allocation (an agent's heartbeat answer, pearlctl.daemon.agents) or for all
of them in one pass, and publishes them to the held long polls when state changed (``notify``); it writes
nothing. ``desired_hash`` is the digest an agent sends back to be held until its desired workers change.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from pearlctl.config.spec import judge_model
from pearlctl.daemon.shared import Side
from pearlctl.planner.model import MoveKind
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.schema import TRAINER_REPORT
from pearlctl.vocabulary import ENGINE_FOR_ROLE, GENERATION_ROLES, Engine, PoolKind, Role


def desired_hash(desired: list[dict]) -> str:
    """The digest of an allocation's desired workers (as dicts), which its agent sends back to be held by."""
    return hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:16]


def tensor_parallel_groups(idx: list[int], gpus_per_worker: int | None) -> list[list[int]]:
    """The vLLM workers one role's GPUs of an allocation form: consecutive groups of ``gpus_per_worker`` in
    index order, as many whole ones as there are (the planner's count, pearlctl.planner.choose.worker_groups:
    every GPU set it hands a role yields that many workers); GPUs left over serve nothing. ``None``: one worker
    of all of them."""
    ordered = sorted(idx)
    if gpus_per_worker is None:
        return [ordered]
    whole = len(ordered) - len(ordered) % gpus_per_worker
    return [ordered[k : k + gpus_per_worker] for k in range(0, whole, gpus_per_worker)]


@dataclass(frozen=True)
class DesiredWorker:
    key: str  # stable per allocation: "<role>-<first gpu>"
    role: str
    engine: str
    gpus: tuple[int, ...]
    state: str  # "RUNNING" | "SLEEPING" | "STOPPED"

    weights: dict | None = None  # vLLM workers: the trainer's latest export to serve {version, path}
    # vLLM workers of a role whose model is not their pool's (``foreign_engine``): the model and engine args to
    # serve instead of the agent's own (a judge on a rollout GPU, the policy on a reward pool's GPU)
    model: str | None = None
    engine_args: dict | None = None
    # a worker on lent trainer GPUs: when the trainer needs them back, and when the return must start so
    # that it is back in time; the agent returns them itself if the daemon is unreachable by return_by
    return_deadline: float | None = None
    return_by: float | None = None

    def as_dict(self) -> dict:
        doc = {
            "weights": self.weights,
            "key": self.key,
            "role": self.role,
            "engine": self.engine,
            "gpus": list(self.gpus),
            "state": self.state,
        }
        if self.return_deadline is not None:
            doc.update(return_deadline=self.return_deadline, return_by=self.return_by)
        if self.model is not None:
            doc.update(model=self.model, engine_args=self.engine_args or {})
        return doc


def foreign_engine(spec: dict, pool: str, role: str) -> tuple[str, dict] | None:
    """The model and engine args a vLLM worker of ``role`` on a GPU of ``pool`` serves when they are not that pool's
    own (its agent's ``PEARL_MODEL`` and ``PEARL_ENGINE_ARGS``, set when the pool was launched): a judge (REWARD)
    off the reward pool serves the reward pool's model (the run's, when it names none) with the reward pool's
    engine args; a policy worker on a reward pool's GPU serves the run's model with the rollout pool's engine args
    (the elastic pool's, without one). None: the pool's own. ``spec``: the run's stored spec (RunSpec.to_dict)."""
    pools = spec.get("pools") or {}
    if role == Role.REWARD and pool != PoolKind.REWARD:
        judge = pools.get(PoolKind.REWARD) or {}
        return judge_model(spec) or str(spec.get("model")), dict(judge.get("engine_args") or {})
    if role in GENERATION_ROLES and pool == PoolKind.REWARD:
        home = pools.get(PoolKind.ROLLOUT) or pools.get(PoolKind.ELASTIC) or {}
        return str(spec.get("model")), dict(home.get("engine_args") or {})
    return None


class Desired(Side):
    """The desired workers of the run's allocations, and their publication to the agents' held long polls."""

    def __init__(self, shared) -> None:
        super().__init__(shared)
        self._notified: tuple[int, int] | None = None  # the store's generation when long polls were last woken

    def of(self, alloc_id: int) -> list[DesiredWorker]:
        """The allocation's workers: per role among its live GPUs, a trainer of all of them, and vLLM workers of
        the run's ``gpus_per_worker`` each (``tensor_parallel_groups``); none while the allocation is not RUNNING.

        A borrowed GPU serves ROLLOUT but still belongs to its trainer: the TRAIN worker keeps running
        (offloaded) across a borrow, so its key and GPU set do not change and it is never restarted. A vLLM
        worker parked on trainer GPUs after a return, on IDLE rollout GPUs after a retire, or on a GPU that
        shifted to the other model (the policy's or the judge's) is desired asleep, ready to be woken by the next
        borrow, wake or shift back. IDLE GPUs run nothing else.
        """
        alloc = self.store.fleet.allocation(alloc_id)
        gpus = self.store.fleet.gpus(self.run_id, allocation_id=alloc_id)
        return self._from_rows(alloc, gpus, *self._serving(), lambda wid: self.store.fleet.worker(wid))

    def all(self) -> dict[int, list[DesiredWorker]]:
        """``of`` every allocation of the run, from one read of its GPUs and workers."""
        by_alloc: dict[int, list[dict]] = collections.defaultdict(list)
        for g in self.store.fleet.gpus(self.run_id):
            by_alloc[g.allocation_id].append(g)
        workers = {w.id: w for w in self.store.fleet.workers(self.run_id)}
        weights, gpw, spec = self._serving()
        return {
            a.id: self._from_rows(a, by_alloc.get(a.id, []), weights, gpw, spec, workers.__getitem__)
            for a in self.store.fleet.allocations(self.run_id)
        }

    def _serving(self) -> tuple[dict | None, int | None, dict]:
        """From one read of the run: the trainer's latest weight export that vLLM workers should serve
        ({version, path}), their tensor-parallel size, the engine profile's ``gpus_per_worker`` (the worker
        the planner plans with, pearlctl.planner.choose; None without a profile: one worker per role per
        allocation, vLLM's tensor parallelism over all of them), and the run's spec (``foreign_engine``)."""
        run = self.store.runs.get(self.run_id)
        trainer = run.get(TRAINER_REPORT) or {}
        weights = None
        if trainer.get("weight_version") is not None and trainer.get("weights_path"):
            weights = {"version": str(trainer["weight_version"]), "path": trainer["weights_path"]}
        profile = run.get("profile")
        return weights, (int(profile.get("gpus_per_worker") or 1) if profile else None), run.get("spec") or {}

    def _from_rows(
        self,
        alloc: dict,
        gpus: list[dict],
        weights: dict | None,
        gpus_per_worker: int | None,
        spec: dict,
        worker: Callable[[int], dict],
    ) -> list[DesiredWorker]:
        if alloc.state not in (A.RUNNING,):
            return []
        by_role: dict[str, list[int]] = {}
        parked: dict[int, list[int]] = {}  # worker id -> GPUs where a returned vLLM worker sleeps
        deadlines: dict[str, float] = {}  # role -> the earliest return deadline of its lent GPUs
        for g in gpus:
            if g.state == G.UP:
                by_role.setdefault(g.role, []).append(g.idx)
                # lent: serving another role (a TRAIN GPU is its trainer's whatever its flag says: its agent
                # must never be handed a trainer's GPUs twice, nor a deadline to stop the trainer by)
                if g.borrowed and g.role != Role.TRAIN:
                    by_role.setdefault(Role.TRAIN, []).append(g.idx)
                    if g.return_deadline is not None:
                        deadlines[g.role] = min(deadlines.get(g.role, g.return_deadline), g.return_deadline)
                for wid in g.parked:  # a policy worker and a judge may sleep here, beside what the GPU serves
                    parked.setdefault(wid, []).append(g.idx)
        out = []
        return_s = self.borrowing.inputs.cost(MoveKind.RETURN) if deadlines and self.borrowing is not None else 0.0
        for role, idx in sorted(by_role.items()):
            if role == Role.IDLE:
                continue
            engine = ENGINE_FOR_ROLE[Role(role)]
            deadline = deadlines.get(role)
            model, engine_args = foreign_engine(spec, alloc.pool, role) or (None, None)
            groups = [sorted(idx)] if engine != Engine.VLLM else tensor_parallel_groups(idx, gpus_per_worker)
            out.extend(
                DesiredWorker(
                    f"{role.lower()}-{group[0]}",
                    role,
                    engine,
                    tuple(group),
                    "RUNNING",
                    weights if role in GENERATION_ROLES else None,  # a judge keeps its own model
                    return_deadline=deadline,
                    return_by=None if deadline is None else round(deadline - return_s, 3),
                    model=model,
                    engine_args=engine_args,
                )
                for group in groups
            )
        serving = {d.key for d in out}
        for wid, idx in sorted(parked.items()):
            w = worker(wid)
            # a parked worker that died is simply gone; one the GPU's role now serves is awake (never twice)
            if w.state not in (W.STOPPED, W.FAILED, W.LOST) and w.worker_key not in serving:
                model, engine_args = foreign_engine(spec, alloc.pool, w.role) or (None, None)
                out.append(
                    DesiredWorker(
                        w.worker_key,
                        w.role,
                        w.engine,
                        tuple(sorted(idx)),
                        "SLEEPING",
                        model=model,
                        engine_args=engine_args,
                    )
                )
        return out

    def notify(self) -> None:
        """Desired state may have changed: if state changed since the last call (``Store.generation``), every
        allocation's desired workers are computed in one pass and published to the held long polls, which
        answer those whose allocation's desired workers changed (pearlctl.daemon.longpoll)."""
        with self.lock:
            generation = self.store.generation()
            if generation == self._notified:
                return
            self._notified = generation
            desired = {a: [w.as_dict() for w in ws] for a, ws in self.all().items()}
            self.long_polls.publish({a: (d, desired_hash(d)) for a, d in desired.items()})
